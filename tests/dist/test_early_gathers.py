"""The step's first all-gathers started before its forward: the forward reads the same parameters as without them,
and a gather no forward took is dropped before the sharded parameters change, so no forward reads it
(strategy/parallelize.py, ``EarlyGathers``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_fpdt.strategy.parallelize import EarlyGathers


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def sharded_net() -> tuple[Net, Net]:
    torch.manual_seed(0)
    net = Net()
    reference = Net()
    reference.load_state_dict(net.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, reference


def gathered_forward_reads_the_parameters() -> None:
    net, reference = sharded_net()
    gathers = EarlyGathers(net, ["Block"])
    assert gathers.units == [net, net.layers[0]]  # the root (embeddings), then the first block
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    gathers.start()  # before the first forward: FSDP2 has no streams yet, nothing starts
    net(ids).sum().backward()
    gathers.ready = True
    for step in range(2):
        with torch.no_grad():  # an optimizer step's worth of change to every shard, and to the reference
            for (name, p), q in zip(net.named_parameters(), reference.parameters()):
                p.to_local().add_(0.1 * (step + 1))
                q.add_(0.1 * (step + 1))
        gathers.start()
        out = net(ids)
        # the same arithmetic on gathered copies of the same values: exactly equal
        torch.testing.assert_close(out, reference(ids), rtol=0, atol=0)
        out.sum().backward()
        net.zero_grad()


def a_gather_no_forward_took_is_dropped() -> None:
    net, reference = sharded_net()
    gathers = EarlyGathers(net, ["Block"])
    ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(3))
    net(ids).sum().backward()
    gathers.ready = True
    gathers.start()  # a batch whose step did not run
    gathers.drop()  # as before a checkpoint's load
    with torch.no_grad():  # the load
        for p, q in zip(net.parameters(), reference.parameters()):
            p.to_local().mul_(-1.0)
            q.mul_(-1.0)
    torch.testing.assert_close(net(ids), reference(ids), rtol=0, atol=0)


def test_a_forward_after_early_gathers_reads_the_current_parameters(dist_pool):
    """1×2 FSDP2 units: gathers started before each forward, after the shards changed, give the reference's output."""
    dist_pool(2).run(gathered_forward_reads_the_parameters)


def test_a_dropped_gather_leaves_the_next_forward_the_changed_parameters(dist_pool):
    """A gather started for a step that did not run, dropped, then the shards changed: the forward reads the change."""
    dist_pool(2).run(a_gather_no_forward_took_is_dropped)
