"""One rank of a 2-process CPU training run that test_preemption.py stops with real signals.

    python -m tests.dist.preempted_run MODE ROOT_DIR

``train``: trains until a signal stops it (the ranks come from RANK/WORLD_SIZE, or from SLURM's variables when the
test sets those instead); ``stuck``: rank 1 hangs outside any collective from global step 3, after writing
``ROOT_DIR/stuck``. Each rank writes its global step to ``ROOT_DIR/step.<rank>`` after every step, so the test knows
training is under way.
:func:`train_until_stopped` is the same run inside the test's pool of processes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from tests.dist.training import LitLM, TokenDataset, trainer_kwargs

MAX_STEPS = 1000
"""Far more steps than a test lets run: the signal always comes first."""


class DrawingLM(LitLM):
    """AdamW with a step schedule and a random draw per step: every state a resume must restore."""

    def __init__(self) -> None:
        super().__init__("llama", seed=3, lr=0.01)
        self.draws: list[float] = []

    def training_step(self, batch, batch_idx):
        self.draws.append(torch.rand(()).item())  # a random stream, as dropout would use
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.99)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def dataset() -> TokenDataset:
    return TokenDataset(2 * MAX_STEPS, 16, seed=11)  # one epoch holds every step


def fit(root_dir: str, max_steps: int, *, ckpt_path: str | None = None, strategy_kwargs: dict | None = None,
        callbacks: list | None = None, accumulate: int = 1) -> tuple[DrawingLM, L.Trainer]:
    """The run the test interrupts, and (in the test's process pool) its uninterrupted and resumed twins."""
    # seeded as the CLI seeds: Lightning reseeds at setup whenever an earlier seed_everything in the same process (or
    # one the test process passed on) left PL_GLOBAL_SEED set, so every run must leave it set the same
    L.seed_everything(0, verbose=False)
    module = DrawingLM()
    strategy = FPDTStrategy(sequence_parallel_size=2, chunks=2, **(strategy_kwargs or {}))
    trainer = L.Trainer(strategy=strategy, devices=2, max_steps=max_steps, default_root_dir=root_dir,
                        callbacks=callbacks or [], accumulate_grad_batches=accumulate, **trainer_kwargs())
    trainer.fit(module, DataLoader(dataset(), batch_size=2), ckpt_path=ckpt_path)
    return module, trainer


class Progress(Callback):
    def __init__(self, root_dir: str, stuck: bool) -> None:
        self.root_dir, self.stuck = Path(root_dir), stuck

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        (self.root_dir / f"step.{trainer.global_rank}").write_text(str(trainer.global_step))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.stuck and trainer.global_rank == 1 and trainer.global_step >= 3:
            (self.root_dir / "stuck").write_text(str(trainer.global_step))  # past the last step end rank 0 can agree at
            time.sleep(600)  # alive, outside any collective: rank 0 waits in one


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def train_until_stopped(root_dir: str, accumulate: int = 1) -> dict:
    """:func:`main`'s ``train`` run in a process of the test's pool: the status it stopped with (``None`` when it
    trained to the end), when it stopped, and the lines the strategy logged."""
    torch.set_num_threads(1)
    lines = _Lines()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(lines)
    code = None
    try:
        fit(root_dir, MAX_STEPS, callbacks=[Progress(root_dir, stuck=False)], accumulate=accumulate)
    except SystemExit as stop:
        code = stop.code
    finally:
        logger.removeHandler(lines)
    return {"code": code, "stopped_at": time.time(), "log": "\n".join(lines.lines)}


def main(mode: str, root_dir: str) -> None:
    torch.set_num_threads(1)  # the same arithmetic as the test's pool processes, bit for bit
    fit(root_dir, MAX_STEPS, strategy_kwargs=dict(preemption_timeout=5.0) if mode == "stuck" else None,
        callbacks=[Progress(root_dir, stuck=mode == "stuck")])
    print(f"rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID'))}: fit returned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
