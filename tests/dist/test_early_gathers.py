"""The step's first all-gathers started before its forward: the forward reads the same parameters as without them,
and a gather no forward took is dropped before the sharded parameters change, so no forward reads it
(strategy/parallelize.py, ``EarlyGathers``; under the Trainer and under Fabric, strategy/run.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTFabricStrategy
from lightning_fpdt.strategy.parallelize import EarlyGathers
from tests.dist.training import TokenDataset, build_model, make_optimizer, model_loss, reference_batch

# fp32, as tests/dist/test_fabric.py: one process and the sharded run sum in other orders (~1e-6 after a few SGD
# steps of the tiny model); a forward that read the parameters of the step before moves the loss by > 1e-2
TOL = dict(rtol=1e-4, atol=2e-5)
SEED, LR = 1234, 0.5


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


def fabric_loop(fetch_ahead: bool, seed: int) -> list[float]:
    """Three SGD steps of a Fabric loop under the fpdt strategy (the reference Llama, each sequence on 2 ranks), each
    step's loss against one process's at that step's parameters. ``fetch_ahead``: the loop shards the next batch,
    which starts its gathers, before the optimizer step changes the shards."""
    fabric = Fabric(strategy=FPDTFabricStrategy(sequence_parallel_size=2, data_parallel_size=1, chunks=2),
                    accelerator="cpu", devices=dist.get_world_size())
    fabric.launch()
    dataset = TokenDataset(num_samples=4, seq_len=16, seed=seed)
    model = build_model("llama", SEED)
    model, optimizer = fabric.setup(model, make_optimizer("sgd", model.parameters(), LR))
    reference = build_model("llama", SEED)
    reference_optimizer = make_optimizer("sgd", reference.parameters(), LR)
    gathers = fabric.strategy.run.early_gathers
    assert gathers is not None and gathers.units, "no early gathers under Fabric"
    batches, whole = iter(fabric.setup_dataloaders(DataLoader(dataset, batch_size=1))), iter(DataLoader(dataset))
    losses, batch = [], next(batches)
    for step in range(3):
        loss = model_loss("llama", model, batch)
        fabric.backward(loss)
        if fetch_ahead:
            batch = next(batches)  # before the step: its gathers hold the shards the step is about to change
        optimizer.step()
        optimizer.zero_grad()
        if not fetch_ahead:
            batch = next(batches)  # after the step: its gathers hold the changed shards, and its forward takes them
        expected = model_loss("llama", reference, reference_batch("llama", next(whole)))
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch.testing.assert_close(loss.detach(), expected.detach(), **TOL, msg=lambda m: f"step {step}: {m}")
        losses.append(loss.item())
    assert gathers.starts >= 2, f"the gathers started early for {gathers.starts} batches"
    return losses


@pytest.mark.parametrize("fetch_ahead", [False, True])
def test_a_fabric_loop_reads_the_current_shards(dist_pool, fetch_ahead):
    """1×2 under Fabric: a batch sharded after the optimizer step starts its gathers and its forward reads the
    stepped shards; one sharded before the step (a loop that fetches ahead) has its gathers dropped by the step."""
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh random inputs each run
    losses = dist_pool(2).run(fabric_loop, fetch_ahead=fetch_ahead, seed=seed)
    assert losses[0] == losses[1], losses
