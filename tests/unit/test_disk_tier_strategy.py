"""FPDTStrategy(offload_dir=...): the disk tier's setup checks, the host budgets the plan gives the stash pools, and a
training run whose block inputs spill to disk training exactly as the run that keeps them in host memory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from collections import namedtuple

import lightning as L
import pytest
import torch

from lightning_fpdt import ActivationOffload, FPDTStrategy
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.models.module import LlamaLM
from lightning_fpdt.planner import plan_memory
from lightning_fpdt.sequence import FPDTAttention
from lightning_fpdt.strategy import budget

GIB = 2**30
TINY = dict(vocab_size=96, num_layers=3)


def test_offload_dir_must_be_a_path():
    """offload_dir takes a path or None; anything else is refused naming the type."""
    with pytest.raises(ValueError, match="offload_dir must be a directory path .* got int 3"):
        FPDTStrategy(offload_dir=3)
    assert FPDTStrategy(offload_dir=None).offload_dir is None


def test_setup_refuses_a_directory_that_cannot_be_made(tmp_path):
    """At setup a directory that cannot be created is a ValueError naming it; a good one gets this rank's directory,
    removed with its files when the fit ends."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    memory = budget.MemoryBudget(check=True, offload_dir=str(blocker / "spill"))
    with pytest.raises(ValueError, match=f"offload_dir '{blocker}/spill' does not exist and cannot be created"):
        memory.open_disk(rank=0, local_rank=0, pin_memory=False)
    memory = budget.MemoryBudget(check=True, offload_dir=str(tmp_path / "spill"))
    memory.open_disk(rank=5, local_rank=1, pin_memory=False)
    assert memory.disk.path.endswith("-rank5") and os.path.isdir(memory.disk.path)
    assert memory.disk_free_bytes() > 0
    memory.close()
    assert os.listdir(tmp_path / "spill") == [] and memory.disk_free_bytes() is None


def test_unusable_directory_is_a_warning_where_nothing_plans(tmp_path):
    """Where nothing plans the run (no GPU: nothing spills), an offload_dir that cannot be used warns that the option
    has no effect instead of refusing the run; where a plan may use it, it is refused."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    memory = budget.MemoryBudget(check=True, offload_dir=str(blocker / "spill"))
    with pytest.warns(UserWarning, match=rf"offload_dir has no effect in this run .* '{blocker}/spill' does not exist"):
        memory.open_disk(rank=0, local_rank=0, pin_memory=False, planned=False)
    assert memory.disk is None and memory.disk_free_bytes() is None
    with pytest.raises(ValueError, match=f"offload_dir '{blocker}/spill' does not exist and cannot be created"):
        memory.open_disk(rank=0, local_rank=0, pin_memory=False, planned=True)


def test_stale_directories_are_named_at_setup_not_removed(tmp_path):
    """A directory a crashed process of this host left is named at setup (path, pid, bytes), on a host's first rank
    only, and left in place."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    stale = tmp_path / f"fpdt-{socket.gethostname()}-{dead}-rank0"
    stale.mkdir()
    (stale / "7.bin").write_bytes(b"\0" * 4096)
    memory = budget.MemoryBudget(check=True, offload_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=rf"{stale} \(pid {dead}, 4,096 bytes\).*left as they are"):
        memory.open_disk(rank=0, local_rank=0, pin_memory=False)
    memory.close()
    other = budget.MemoryBudget(check=True, offload_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.open_disk(rank=1, local_rank=1, pin_memory=False)  # not the host's first rank: silent
    other.close()
    assert (stale / "7.bin").exists()


def _tight_plan(**overrides):
    """Llama-3.2-3B geometry, 524,288 tokens, one H200, a 60 GiB host: the plan spills block inputs to a 60 GiB
    disk."""
    options = dict(geometry="llama3-3b", seq_len=1 << 19, num_gpus=1, gpu_memory_gib=131, activation_offload=True,
                   tiled_mlp=True, tiled_loss=True, chunks="auto", offload="auto", offload_dq="auto",
                   head_chunks="auto", recompute_attention="auto", reload_input="auto", prefetch="auto",
                   host_memory_gib=60, disk_memory_gib=60)
    return plan_memory(**{**options, **overrides})


def _bound(memory, callback):
    """``memory`` bound to a one-process run with ``callback`` and an offloading attention."""
    memory.bind(budget.RunFacts(model=None, device=torch.device("cpu"), world_size=1, local_processes=1,
                                sequence_parallel_size=1, ring_size=1, precision="32-true", callbacks=[callback]))
    memory.attach(attention=FPDTAttention(offload=True))
    return memory


def test_plan_gives_the_pools_their_host_budgets(tmp_path):
    """The block inputs' pool may hold what the plan keeps in host memory for them, (L - k)·A, and spills the rest;
    the attention's pool, when the plan offloads it, its planned bytes and the host's room the plan leaves. A new
    length updates the same tiers."""
    plan = _tight_plan()
    assert plan.fits and plan.options.disk_inputs > 0
    callback = ActivationOffload()
    memory = _bound(budget.MemoryBudget(check=True, offload_dir=str(tmp_path)), callback)
    memory.open_disk(rank=0, local_rank=0, pin_memory=False)
    memory.configure_disk(plan)
    tier = callback.stashes.disk
    assert tier.files is memory.disk
    assert tier.host_budget_bytes == plan.component("checkpointed block inputs").host_bytes
    attention = memory.attention.stashes
    assert plan.options.offload is False and attention.disk is None  # its chunks stay on the GPU
    offloaded = _tight_plan(offload=True, recompute_attention=True, host_memory_gib=70)
    memory.configure_disk(offloaded)
    spare = offloaded.host_memory_bytes - offloaded.host_resident_bytes_per_node
    assert attention.disk.host_budget_bytes == offloaded.component("attention stash").host_bytes + spare
    assert callback.stashes.disk is tier and tier.host_budget_bytes == \
        offloaded.component("checkpointed block inputs").host_bytes
    memory.configure_disk(None)  # nothing planned: nothing spills
    assert tier.host_budget_bytes == sys.maxsize
    memory.close()


def test_too_little_space_is_refused_with_the_bytes(tmp_path, monkeypatch):
    """A directory whose file system has less free space than the plan puts there is refused when the length is
    planned, naming the directory, the bytes needed and the bytes free."""
    plan = _tight_plan()
    memory = budget.MemoryBudget(check=True, offload_dir=str(tmp_path))
    memory.open_disk(rank=0, local_rank=0, pin_memory=False)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(100 * GIB, 99 * GIB, GIB))
    needed = plan.disk_bytes_per_node
    with pytest.raises(ValueError, match=rf"offload_dir '{tmp_path}' is too small: the plan's "
                                         rf"{plan.options.disk_inputs} block inputs per GPU x 1 GPUs of this host "
                                         rf"needs {needed:,} bytes .* which has 1,073,741,824 bytes \(1.00 GiB\) free"):
        _bound(memory, ActivationOffload()).configure_disk(plan)
    monkeypatch.undo()
    memory.close()


def _fit(offload_dir, monkeypatch, tmp_path, frozen_embeddings=False):
    """Two steps of a 3-layer model on CPU under strategy="fpdt" with ActivationOffload, planned (as on a GPU) to
    keep one block input in host memory; returns the parameters and the strategy."""
    config = LlamaConfig.from_name("tiny", **TINY)

    def planned(strategy, seq_len, batch_size):
        return plan_memory(geometry=config, seq_len=seq_len, batch_size=batch_size, num_gpus=1, chunks=2,
                           offload=True, offload_dq=False, activation_offload=True, tiled_mlp=False, tiled_loss=False,
                           precision="32-true", gpu_memory_gib=80, disk_memory_gib=1, disk_inputs=2)

    monkeypatch.setattr(budget, "plan_for", planned)
    torch.manual_seed(0)
    module = LlamaLM("tiny", config_overrides=TINY)
    module.model.model.embed_tokens.requires_grad_(not frozen_embeddings)
    data = RetrievalDataModule(seq_len=96, vocab_size=96, num_train=16, batch_size=2)
    strategy = FPDTStrategy(offload_dir=offload_dir, attention_backend="math", heartbeat_timeout=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="32-true", max_steps=2,
                        callbacks=[ActivationOffload(prefetch=1, reload_input=False, recompute_attention=False)],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    return {n: p.detach().clone() for n, p in module.named_parameters()}, strategy


def test_training_with_block_inputs_on_disk_is_exact(tmp_path, monkeypatch):
    """A run whose plan puts two of three block inputs on disk trains to the same parameters, bit for bit (fp32, the
    same arithmetic on the same values), as the run that keeps them in host memory; its files are gone when the fit
    ends."""
    in_memory, _ = _fit(None, monkeypatch, tmp_path)
    on_disk, strategy = _fit(str(tmp_path / "spill"), monkeypatch, tmp_path)
    assert strategy.memory.disk.peak_bytes_on_disk >= 2 * 2 * 96 * LlamaConfig.from_name("tiny").hidden_size * 4
    assert os.listdir(tmp_path / "spill") == []
    for name, value in in_memory.items():
        assert torch.equal(value, on_disk[name]), name


def test_frozen_embeddings_with_block_inputs_on_disk(tmp_path, monkeypatch):
    """Frozen embeddings (no block input requires grad) with two of three block inputs on disk: the same parameters as
    with every input in host memory, bit for bit, and every block parameter trained (the embeddings did not)."""
    torch.manual_seed(0)
    initial = {n: p.detach().clone() for n, p in LlamaLM("tiny", config_overrides=TINY).named_parameters()}
    in_memory, _ = _fit(None, monkeypatch, tmp_path, frozen_embeddings=True)
    on_disk, strategy = _fit(str(tmp_path / "spill"), monkeypatch, tmp_path, frozen_embeddings=True)
    assert strategy.memory.disk.peak_bytes_on_disk > 0
    for name, value in in_memory.items():
        assert torch.equal(value, on_disk[name]), name
        assert torch.equal(value.full_tensor(), initial[name]) == ("embed_tokens" in name), name
