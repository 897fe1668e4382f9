"""Failures end every rank quickly and say why: a dead or hung rank is named, a NaN loss stops training."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from tests.dist.training import LitLM, TokenDataset, trainer_kwargs

ROOT = Path(__file__).resolve().parents[2]


def _launch(mode: str, watched: int = 0) -> tuple[subprocess.CompletedProcess, float, subprocess.Popen]:
    """Start both ranks; wait for rank ``watched`` and return its output, the seconds it took and the other rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.dist.failing_run", mode], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    start = time.time()
    out, _ = procs[watched].communicate(timeout=240)
    elapsed = time.time() - start
    return subprocess.CompletedProcess(procs[watched].args, procs[watched].returncode, out), elapsed, procs[1 - watched]


@pytest.mark.parametrize("mode,named", [
    ("die", "rank 1 stopped responding"),
    ("hang", "rank 1 is not in the collective the others wait in; it is at"),
])
def test_dead_or_hung_rank_is_named_and_others_exit(mode, named):
    """Rank 1 dies (or hangs outside a collective) at step 1: rank 0 exits non-zero within the collective timeout
    (15 s) plus the diagnosis, with a message naming rank 1."""
    result, elapsed, other = _launch(mode)
    other.kill()
    other.communicate()
    assert result.returncode != 0
    assert named in result.stdout, result.stdout[-3000:]
    assert elapsed < 120


def test_frozen_rank_is_named_and_the_job_ends():
    """Rank 1 freezes (SIGSTOP) at step 1, with the default collective timeout (30 minutes): rank 0 names it from its
    stopped heartbeat (timeout 3 s here), ends it and exits non-zero, long before the collective would time out."""
    result, elapsed, frozen = _launch("freeze")
    try:
        assert frozen.wait(timeout=10) is not None, "the frozen rank was left stopped"
    finally:
        frozen.kill()
        frozen.communicate()
    assert result.returncode != 0
    assert "fpdt: rank 1 stopped responding" in result.stdout and "froze" in result.stdout, result.stdout[-3000:]
    assert elapsed < 90


def test_death_of_rank_zero_is_named_by_the_others():
    """Rank 0, which hosts the rendezvous store, dies at step 1: rank 1 says that rank 0 stopped responding and
    exits non-zero, instead of printing only gloo's connection error."""
    result, elapsed, dead = _launch("die0", watched=1)
    dead.communicate()
    assert result.returncode != 0
    assert "rank 0 stopped responding" in result.stdout, result.stdout[-3000:]
    assert elapsed < 90


class NaNLM(LitLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        # one data-parallel group only: all ranks must still stop together
        return loss * float("nan") if self.global_step == 1 and dist.get_rank() == 0 else loss


def nonfinite_stops_everyone() -> None:
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=1, data_parallel_size=2), devices=2,
                        max_steps=4, **trainer_kwargs())
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan on rank 0\)|non-finite loss \(.* at global step 1"):
        trainer.fit(NaNLM("llama", seed=0, lr=0.1), DataLoader(TokenDataset(16, 16, seed=0), batch_size=2))
    assert trainer.global_step == 1


def test_nonfinite_loss_stops_every_rank_with_the_step(dist_pool):
    """A NaN loss on one data-parallel group stops both groups at global step 1, naming the step."""
    dist_pool(2).run(nonfinite_stops_everyone)
    torch.manual_seed(0)


class InfInWindowLM(LitLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        # the first of the two micro-batches of global step 1, on one rank only
        return loss * float("inf") if self.global_step == 1 and batch_idx == 2 and dist.get_rank() == 0 else loss


class Weights(L.Callback):
    """Every rank's shards of the weights the optimizer steps, as global step 1 starts (``before``) and where fit
    ends (``after``); read from the optimizer, which holds the sharded parameters whether or not FSDP2 has the module
    gathered at that moment."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2:
            self.before = self._read(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self.after = self._read(trainer)

    @staticmethod
    def _read(trainer):
        params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
        return {i: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for i, p in enumerate(params)}


def nonfinite_in_window_changes_nothing() -> int:
    weights = Weights()
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=1, data_parallel_size=2), devices=2,
                        max_steps=4, accumulate_grad_batches=2, callbacks=[weights], **trainer_kwargs())
    with pytest.raises(FloatingPointError, match=r"non-finite loss \((inf on rank 0|on another rank than 1)\) "
                                                 r"at global step 1"):
        trainer.fit(InfInWindowLM("llama", seed=0, lr=0.1), DataLoader(TokenDataset(16, 16, seed=0), batch_size=2))
    assert trainer.global_step == 1
    for name, before in weights.before.items():
        assert torch.equal(weights.after[name], before), f"parameter {name} changed in the step of the infinite loss"
    return len(weights.before)


def test_nonfinite_loss_early_in_a_window_stops_before_the_optimizer_step(dist_pool):
    """An infinite loss in the first micro-batch of global step 1's accumulation window (one rank) stops both ranks at
    that step, before the optimizer changes any weight; the rank whose own loss is finite says the other had it."""
    assert all(count > 0 for count in dist_pool(2).run(nonfinite_in_window_changes_nothing))
    torch.manual_seed(0)


class BrokenEverywhereLM(LitLM):
    def training_step(self, batch, batch_idx):
        if self.global_step == 1:  # the same mistake on every rank (its message differs only in a number)
            raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied (32x{16 + dist.get_rank()})")
        return super().training_step(batch, batch_idx)


def every_rank_fails_alike() -> list[str]:
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=4,
                            **trainer_kwargs())
        with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
            trainer.fit(BrokenEverywhereLM("llama", seed=0, lr=0.1),
                        DataLoader(TokenDataset(16, 16, seed=0), batch_size=2))
    finally:
        logger.removeHandler(handler)
    return [line for line in lines if line.startswith("fpdt:") and "failed" in line]


def test_every_rank_failing_alike_is_one_line(dist_pool):
    """Every rank raises the same error at step 1: rank 0 logs one line saying all ranks failed alike, rank 1 logs
    nothing more, and no rank is named as hanging outside the collective."""
    rank0, rank1 = dist_pool(2).run(every_rank_fails_alike)
    assert len(rank0) == 1 and "every rank (2 of 2) failed alike (RuntimeError: mat1 and mat2" in rank0[0], rank0
    assert rank1 == []
