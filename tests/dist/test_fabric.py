"""``Fabric(strategy="fpdt")`` on N gloo processes against one process without it (docs/fabric.md): a user's own
loop, the loss and every gradient of a step, the parameters after it, frozen parameters, the checkpoint round trip,
the registry name, a user's mistake, and examples/fabric_loop.py run as a user runs it."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, DistributedSampler

import lightning_fpdt  # noqa: F401  (registers "fpdt" with Fabric)
from lightning_fpdt import ActivationOffload, FPDTFabricStrategy, TiledLoss, TiledMLP
from lightning_fpdt.integrations.attributes import TILED_MLP
from tests.dist.test_multinode import _env
from tests.dist.training import TokenDataset, build_model, make_optimizer, model_loss, reference_batch

# fp32: the parallel run sums the same products in another order (the blockwise softmax merge, the gradient sums
# split across ranks and all-to-alls, FSDP2's reduce-scatter), ~1e-7 relative per op; after one step of a 2-layer
# model losses, gradients and parameters stay within ~1e-6 of one process. 2e-5 absolute / 1e-4 relative leaves
# margin and still catches a lost label, a wrong position or a mis-weighted rank (each moves the loss by > 1e-2).
TOL = dict(rtol=1e-4, atol=2e-5)
SEED, LR = 1234, 0.5


def _fabric(strategy: object) -> Fabric:
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=dist.get_world_size())
    fabric.launch()  # the processes exist already (the pool's): this sets up the strategy's environment
    return fabric


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _reference_step(kind: str, tuning: str | None, dataset: TokenDataset, dp: int, batch_size: int,
                    accumulate: int):
    """One process, one SGD step over the first ``accumulate`` batches of every data-parallel group (the batches
    Fabric's sampler gives each group): each group's losses, the gradients of their mean, the parameters after the
    step."""
    model = build_model(kind, SEED, tuning)
    optimizer = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad], LR)
    losses: list[list[float]] = []
    for d in range(dp):
        sampler = DistributedSampler(dataset, num_replicas=dp, rank=d, shuffle=True, seed=0)
        losses.append([])
        for batch in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
            loss = model_loss(kind, model, reference_batch(kind, batch))
            losses[d].append(loss.item())
            (loss / (dp * accumulate)).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return losses, grads, {name: p.detach().clone() for name, p in model.named_parameters()}


def fabric_step(kind: str, sp: int, dp: int, chunks: int, seq_len: int, tuning: str | None = None,
                by_name: bool = False, memory: bool = False, accumulate: int = 1, ring: int = 1,
                data_seed: int = 0) -> None:
    """One step of a plain Fabric loop under the fpdt strategy equals one process's: the loss on every rank of a
    sequence group, every gradient and their norm (``fabric.clip_gradients``), every parameter after the step; frozen
    parameters get no gradient and stay.
    ``memory``: with the memory callbacks' transforms (checkpointed blocks, inputs offloaded, tiled MLP and loss);
    ``accumulate``: batches per step, the ones before the last without FSDP2's gradient reduce-scatter."""
    batch_size = 2
    callbacks = [ActivationOffload(), TiledMLP(num_tiles=3), TiledLoss(num_tiles=3)] if memory else []
    strategy = "fpdt" if by_name else FPDTFabricStrategy(sequence_parallel_size=sp, data_parallel_size=dp,
                                                         chunks=chunks, memory_callbacks=callbacks)
    fabric = _fabric(strategy)
    assert isinstance(fabric.strategy, FPDTFabricStrategy)
    dataset = TokenDataset(num_samples=dp * batch_size * accumulate, seq_len=seq_len, seed=data_seed)
    initial = build_model(kind, SEED, tuning)
    model = build_model(kind, SEED, tuning)
    optimizer = make_optimizer("sgd", [p for p in model.parameters() if p.requires_grad], LR)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch_size, shuffle=True))
    assert (fabric.strategy.sequence_parallel_size, fabric.strategy.data_parallel_size) == (sp, dp)
    assert fabric.strategy.ring_size == ring
    assert any(getattr(m, TILED_MLP, False) for m in model.modules()) == memory  # the transforms ran, or none

    # the user's loop, as one process writes it
    losses = []
    for index, batch in enumerate(loader):
        assert batch["input_ids"].shape[1] == fabric.strategy.batch_plan.padded_len // sp  # this rank's share
        with fabric.no_backward_sync(model, enabled=index < accumulate - 1):
            loss = model_loss(kind, model, batch)
            if kind == "plain":  # a loss computed from local logits: the sequence's token mean
                loss = fabric.strategy.reduce_loss(loss)
            fabric.backward(loss / accumulate)
        losses.append(loss.item())
    grads = {name: _full(p.grad) for name, p in model.module.named_parameters() if p.grad is not None}
    norm = _full(fabric.clip_gradients(model, optimizer, max_norm=1e9))  # the whole model's norm, nothing clipped
    optimizer.step()
    optimizer.zero_grad()

    ref_losses, ref_grads, ref_params = _reference_step(kind, tuning, dataset, dp, batch_size, accumulate)
    dp_rank = fabric.strategy.device_mesh["data_parallel"].get_local_rank()
    case = f"{kind} dp={dp} sp={sp} chunks={chunks} S={seq_len} tuning={tuning} accumulate={accumulate}"
    torch.testing.assert_close(losses, ref_losses[dp_rank], **TOL, msg=lambda m: f"{case} losses: {m}")
    ref_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    torch.testing.assert_close(norm, ref_norm, **TOL, msg=lambda m: f"{case} gradient norm: {m}")
    assert set(grads) == set(ref_grads), f"{case}: gradients of {sorted(set(grads) ^ set(ref_grads))} differ in kind"
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, **TOL, msg=lambda m: f"{case} gradient of {name}: {m}")
    start = dict(initial.named_parameters())
    for name, param in model.module.named_parameters():
        got = _full(param)
        torch.testing.assert_close(got, ref_params[name], **TOL, msg=lambda m: f"{case} {name}: {m}")
        if start[name].requires_grad:
            assert not torch.equal(got, start[name].detach()), f"{case}: {name} requires grad but did not move"
        else:
            assert torch.equal(got, start[name].detach()), f"{case}: {name} is frozen but changed"


def run_steps(cases: list[dict]) -> None:
    for case in cases:
        fabric_step(**case)


def test_fabric_parity_two_processes(dist_pool):
    """1×2: the reference Llama with padding (by the registry name, the options' defaults), a Hugging Face Llama (its
    own loss), a plain SDPA module whose loop computes the loss from local logits (chunks 2), frozen embeddings, the
    memory callbacks' transforms."""
    seed = int(torch.randint(0, 2**31 - 1, ()))  # fresh random inputs each run
    dist_pool(2).run(run_steps, cases=[
        dict(kind="llama", sp=2, dp=1, chunks=1, seq_len=15, by_name=True, data_seed=seed),
        dict(kind="hf", sp=2, dp=1, chunks=1, seq_len=16, data_seed=seed + 1),
        dict(kind="plain", sp=2, dp=1, chunks=2, seq_len=16, data_seed=seed + 2),
        dict(kind="llama", sp=2, dp=1, chunks=2, seq_len=16, tuning="embeddings", data_seed=seed + 3),
        dict(kind="hf", sp=2, dp=1, chunks=2, seq_len=16, memory=True, data_seed=seed + 4),
    ])


def test_fabric_parity_four_processes(dist_pool):
    """1×4 (kv heads replicated, chunks 2) and 2×2 (data parallel: the groups sample apart, the ranks of a group
    alike), the reference and a Hugging Face Llama; gradient accumulation over 2 batches, with padding."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    dist_pool(4).run(run_steps, cases=[
        dict(kind="llama", sp=4, dp=1, chunks=2, seq_len=24, data_seed=seed),
        dict(kind="hf", sp=2, dp=2, chunks=2, seq_len=16, data_seed=seed + 1),
        dict(kind="llama", sp=2, dp=2, chunks=1, seq_len=15, accumulate=2, data_seed=seed + 2),
    ])


def test_fabric_parity_ring(dist_pool):
    """1×4 with 2 query heads: a Ulysses × ring mesh (ring_size "auto" chosen from the model's heads at setup)."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    dist_pool(4).run(run_steps, cases=[dict(kind="llama-2heads", sp=4, dp=1, chunks=1, seq_len=16, ring=2,
                                               data_seed=seed)])


def save_and_load(folder: str) -> None:
    """``fabric.save`` then ``fabric.load`` into a model of other weights restores the model, the optimizer and the
    random states exactly; a shard changed after the save is refused by name."""
    fabric = _fabric(FPDTFabricStrategy(sequence_parallel_size=2, data_parallel_size=1, chunks=2))
    dataset = TokenDataset(num_samples=2, seq_len=16, seed=3)
    model = build_model("llama", SEED)
    optimizer = make_optimizer("adamw", model.parameters(), 1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=2))
    fabric.backward(model_loss("llama", model, next(iter(loader))))
    optimizer.step()
    path = Path(folder) / "step-1"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    drawn = torch.rand(4)  # what the loop draws after the save


    other = build_model("llama", SEED + 1)
    other_optimizer = make_optimizer("adamw", other.parameters(), 1e-2)
    other, other_optimizer = fabric.setup(other, other_optimizer)
    state = {"model": other, "optimizer": other_optimizer, "step": 0}
    remainder = fabric.load(path, state)
    assert state["step"] == 1 and remainder == {}  # the random states are the strategy's, not left to the loop
    assert torch.equal(torch.rand(4), drawn), "random states not restored"
    for (name, saved), (_, loaded) in zip(model.module.named_parameters(), other.module.named_parameters()):
        assert torch.equal(_full(saved), _full(loaded)), f"{name} not restored"
    for saved, loaded in zip(optimizer.state.values(), other_optimizer.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(_full(saved[key]), _full(loaded[key])), f"optimizer {key} not restored"

    fabric.barrier()
    if fabric.global_rank == 0:
        shard = next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    fabric.barrier()
    with pytest.raises(ValueError, match="damaged"):
        fabric.load(path, {"model": other, "optimizer": other_optimizer})


def test_fabric_checkpoint_round_trip(dist_pool, tmp_path):
    """The model and optimizer state through fabric.save/fabric.load (a distributed checkpoint with checksums)."""
    dist_pool(2).run(save_and_load, folder=str(tmp_path))


def sizes_that_do_not_divide() -> str:
    with pytest.raises(ValueError) as error:
        _fabric(FPDTFabricStrategy(sequence_parallel_size=3, data_parallel_size=1))
    return str(error.value)


def test_fabric_sizes_that_do_not_divide(dist_pool):
    """sequence_parallel_size × data_parallel_size that is not the world size is a ValueError naming the sizes, on
    every rank (none waits in a collective)."""
    messages = dist_pool(2).run(sizes_that_do_not_divide)
    assert all("3" in m and "2" in m for m in messages), messages


def meta_model_with_auto_sizes() -> list[float]:
    """A model made on the meta device, the sizes left "auto": the mesh is built at setup from the model's heads, the
    model allocated shard by shard, and the optimizer made before setup steps every shard."""
    fabric = _fabric("fpdt")
    with fabric.init_module(empty_init=True):
        model = build_model("llama", SEED)
    assert all(p.is_meta for p in model.parameters())
    optimizer = make_optimizer("adamw", model.parameters(), 1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    assert fabric.strategy.sequence_parallel_size == dist.get_world_size()
    loader = fabric.setup_dataloaders(DataLoader(TokenDataset(num_samples=2, seq_len=16, seed=5), batch_size=2))
    loss = model_loss("llama", model, next(iter(loader)))
    fabric.backward(loss)
    optimizer.step()
    assert not any(p.is_meta for p in model.parameters())
    assert len(optimizer.state) == len(list(model.parameters())), "a parameter the optimizer did not step"
    return [loss.item()]


def test_fabric_meta_model_and_auto_sizes(dist_pool):
    """A meta-device model under Fabric(strategy="fpdt") with every size "auto" trains, its loss equal on every
    rank of the sequence group."""
    losses = dist_pool(2).run(meta_model_with_auto_sizes)
    assert losses[0] == losses[1], losses


def planned_lengths(seed: int) -> list[str]:
    """The memory planner under Fabric, its plans made as on a GPU (this host has none): each new length is planned
    before its first forward, "auto" chunks and ActivationOffload's "auto" kept inputs take the plan's choice, the
    loss equals one process's, and a length whose plan fits nothing is refused on every rank."""
    from lightning_fpdt.planner import plan_memory
    from lightning_fpdt.strategy import budget

    def planned(memory, seq_len, batch_size, gpu_gib=80.0):
        return plan_memory(geometry=memory.facts.network.config, seq_len=seq_len, batch_size=batch_size, num_gpus=2,
                           chunks=2 if seq_len == 16 else 1, offload=False, offload_dq=False,
                           activation_offload=True, tiled_mlp=False, tiled_loss=False, precision="32-true",
                           keep_inputs=1, gpu_memory_gib=gpu_gib if seq_len < 64 else 1e-6)

    real = budget.plan_for
    budget.plan_for = planned
    try:
        callback = ActivationOffload()
        fabric = _fabric(FPDTFabricStrategy(memory_callbacks=[callback]))
        model = build_model("llama", SEED)
        model, optimizer = fabric.setup(model, make_optimizer("sgd", model.parameters(), LR))
        said = []
        for seq_len in (16, 32):
            dataset = TokenDataset(num_samples=2, seq_len=seq_len, seed=seed + seq_len)
            batch = next(iter(fabric.setup_dataloaders(DataLoader(dataset, batch_size=2))))
            plan = fabric.strategy.memory_plan
            assert plan is not None and plan.seq_len == seq_len and plan.options.keep_inputs == 1
            assert fabric.strategy.resolved_options(seq_len, 2).chunks == plan.options.chunks
            assert callback.resolved("keep_inputs") == 1  # "auto" took the plan's choice
            loss = model_loss("llama", model, batch)
            reference = build_model("llama", SEED)
            full = next(iter(DataLoader(dataset, batch_size=2)))
            expected = model_loss("llama", reference, reference_batch("llama", full))
            torch.testing.assert_close(loss.detach(), expected.detach(), **TOL)
            said.append(plan.options.describe())
        dataset = TokenDataset(num_samples=2, seq_len=64, seed=seed)
        with pytest.raises(ValueError, match="does not fit the GPU memory"):
            next(iter(fabric.setup_dataloaders(DataLoader(dataset, batch_size=2))))
        return said
    finally:
        budget.plan_for = real


def test_fabric_plans_each_length(dist_pool):
    """Fabric(strategy="fpdt") plans each new length with the memory planner, as the Trainer does."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    said = dist_pool(2).run(planned_lengths, seed=seed)
    assert said[0] == said[1] and "chunks=2" in said[0][0] and "chunks=1" in said[0][1], said


ROOT = Path(__file__).resolve().parents[2]


def test_fabric_example_trains_and_saves(tmp_path):
    """examples/fabric_loop.py on 2 CPU processes (3 steps) exits 0, prints its losses once, and saves a whole
    checkpoint of the model, the optimizer and the step."""
    checkpoint = tmp_path / "fabric-copy"
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "fabric_loop.py"), "--steps", "3", "--seq-len", "16",
                           "--checkpoint", str(checkpoint)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the example failed ({proc.returncode}):\n{output[-6000:]}"
    # rank 0 alone prints (fabric.print): the first and the last step, each rank holding half of the 16 tokens
    losses = re.findall(r"step +(\d+)  loss (\S+)  \(this rank holds 8 of 16 tokens\)", proc.stdout)
    assert [step for step, _ in losses] == ["0", "2"] and all(math.isfinite(float(v)) for _, v in losses), output
    assert proc.stdout.count(f"saved {checkpoint}") == 1, output

    from torch.distributed.checkpoint import FileSystemReader

    from lightning_fpdt.strategy.checkpoint import check_checkpoint_complete, damaged_files

    check_checkpoint_complete(checkpoint)
    assert damaged_files(checkpoint, rank=0, world_size=1) == []  # the checksums the save recorded
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    assert "model.model.embed_tokens.weight" in saved and any(k.startswith("optimizer.state.") for k in saved)
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["step"] == 3
