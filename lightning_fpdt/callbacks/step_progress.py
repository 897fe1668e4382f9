"""StepProgress: where a long optimizer step is, shown while it runs (the progress bar, else the log).

A step of a million tokens can take minutes. Once a step has run ``after_seconds``, a background thread shows every
``refresh_seconds`` what rank 0 already knows, without synchronising anything: the phase and the block (a forward
pre-hook on each transformer block records ``forward, block i of L``; a hook on the block's output gradient records
``backward, block i``; a block run again inside the backward, by checkpointing, shows as ``recompute``), the global
tokens of the step's batches so far, the time spent, and an estimate of what is left: from the previous step's
duration or, for the first step, from the planner's estimate of the strategy's memory plan (at this GPU's measured
rates where it was calibrated, else at an H100's: a rough figure, said so). The hooks store two Python ints;
nothing waits on a device.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_fpdt.integrations.discovery import planned_model
from lightning_fpdt.memory.surgery import find_blocks
from lightning_fpdt.planner.search import step_estimate

log = logging.getLogger("lightning_fpdt")


@dataclass
class StepPosition:
    """What the hooks record of the running step (plain Python values, written by the training thread)."""

    step: int = 0
    """The optimizer step running (``trainer.global_step`` at its first batch)."""
    started: float = 0.0
    """``time.monotonic()`` at its first batch."""
    phase: str = "data"
    """``"forward"``, ``"backward"`` or ``"recompute"`` (a checkpointed block's forward run again in the backward)."""
    block: int = -1
    """Index of the block the phase is in (``-1``: before the first)."""
    tokens: int = 0
    """Global tokens of the step's batches so far (counted once per sequence-parallel group)."""
    running: bool = False


def describe(position: StepPosition, num_blocks: int, now: float, expected: Optional[float],
             expected_from: str) -> str:
    """``"step 12: backward, block 3 of 32, 1,048,576 tokens, 41 s; ~19 s left (previous step 60 s)"``."""
    elapsed = now - position.started
    where = "starting" if position.block < 0 else f"{position.phase}, block {position.block + 1} of {num_blocks}"
    text = f"step {position.step}: {where}, {position.tokens:,} tokens, {elapsed:.0f} s"
    if expected is not None:
        left = expected - elapsed
        text += (f"; ~{left:.0f} s left" if left >= 0 else f"; {-left:.0f} s over") + f" ({expected_from} " \
            f"{expected:.0f} s)"
    return text


class StepProgress(pl.Callback):
    """Shows where a long optimizer step is while it runs: forward or backward, block ``i`` of ``L``, tokens so far,
    and an estimate of the step's end (the previous step's duration; for the first, the planner's estimate where
    the strategy has a memory plan). On a terminal in the training progress bar (TQDM's postfix, or after Rich's
    description), else in the log every ``log_every_seconds``: the ``lightning_fpdt`` logger where logging is
    configured for it, else Lightning's, which prints by default (to a redirected log file too). Rank 0 only; no
    synchronisation in the step.

    Args:
        after_seconds: show nothing for steps shorter than this.
        refresh_seconds: how often the shown text is renewed.
        log_every_seconds: without a progress bar, at most one log line per this many seconds.
        layer_classes: class names of the transformer blocks; ``None``: the largest ``ModuleList`` (as the strategy).
    """

    def __init__(self, *, after_seconds: float = 5.0, refresh_seconds: float = 1.0, log_every_seconds: float = 30.0,
                 layer_classes: Optional[list[str]] = None) -> None:
        super().__init__()
        if after_seconds < 0 or refresh_seconds <= 0 or log_every_seconds <= 0:
            raise ValueError(f"StepProgress: need after_seconds ({after_seconds}) >= 0, refresh_seconds "
                             f"({refresh_seconds}) > 0 and log_every_seconds ({log_every_seconds}) > 0")
        self.after_seconds, self.refresh_seconds, self.log_every_seconds = after_seconds, refresh_seconds, \
            log_every_seconds
        self.layer_classes = layer_classes
        self.position = StepPosition()
        self.num_blocks = 0
        self.previous_seconds: Optional[float] = None
        """The last completed step's duration."""
        self.planned_seconds: Optional[float] = None
        self.planned_rates = "at an H100's rates"
        """Which rates the planner's estimate was made at (its built-in table's, or this GPU's measured ones)."""
        """The planner's estimate for the first step (``None`` where nothing planned)."""
        self._handles: list[RemovableHandle] = []
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._trainer: Optional[pl.Trainer] = None
        self._last_log = 0.0

    # ---- hooks on the blocks (the training thread) ------------------------------------------------------------------
    def install(self, module: Any) -> None:
        """Put the hooks on the blocks of ``module``'s network."""
        self.remove()
        blocks = find_blocks(planned_model(module), self.layer_classes)
        self.num_blocks = len(blocks)
        for index, block in enumerate(blocks):
            self._handles.append(block.register_forward_pre_hook(self._forward_hook(index)))
            self._handles.append(block.register_forward_hook(self._output_hook(index)))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _forward_hook(self, index: int) -> Any:
        def hook(module: Any, args: Any) -> None:
            if not module.training:
                return  # an evaluation between steps (validation, LongContextEval): not the step's forward
            p = self.position
            p.phase, p.block = ("recompute" if p.phase in ("backward", "recompute") else "forward"), index
        return hook

    def _output_hook(self, index: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            first = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(first, Tensor) and first.requires_grad:
                def reached(grad: Tensor) -> None:
                    self.position.phase, self.position.block = "backward", index
                first.register_hook(reached)
        return hook

    # ---- Lightning hooks ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._trainer = trainer
        self.install(pl_module)
        plan = getattr(trainer.strategy, "memory_plan", None)
        self.planned_seconds = sum(seconds for _, seconds in step_estimate(plan)) if plan is not None else None
        if plan is not None and plan.rates.calibrated:
            self.planned_rates = "at this GPU's measured rates"
        self.previous_seconds = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._show_loop, name="fpdt-step-progress", daemon=True)
        self._thread.start()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if not trainer.is_global_zero:
            return
        p = self.position
        if not p.running:
            self.position = p = StepPosition(step=trainer.global_step, started=time.monotonic(), running=True)
        p.phase, p.block = "forward", -1
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if isinstance(ids, Tensor):  # the strategy's shard: this rank's part of the group's sequences
            p.tokens += ids.numel() * int(getattr(trainer.strategy, "sequence_parallel_size", 1))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        p = self.position
        if trainer.is_global_zero and p.running and trainer.global_step != p.step:  # the optimizer stepped
            self.previous_seconds = time.monotonic() - p.started
            p.running = False
            clear_rich_bar(trainer.progress_bar_callback)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.refresh_seconds)
            self._thread = None
        self.remove()

    # ---- the display thread ---------------------------------------------------------------------------------------
    def text(self, now: Optional[float] = None) -> Optional[str]:
        """What is shown now, or ``None`` for a step shorter than ``after_seconds`` (or none running)."""
        p, now = self.position, time.monotonic() if now is None else now
        if not p.running or now - p.started < self.after_seconds:
            return None
        if self.previous_seconds is not None:
            return describe(p, self.num_blocks, now, self.previous_seconds, "previous step")
        return describe(p, self.num_blocks, now, self.planned_seconds, f"planner's estimate {self.planned_rates}")

    def _show_loop(self) -> None:
        while not self._stop.wait(self.refresh_seconds):
            text = self.text()
            if text is not None:
                self._show(text)

    def _show(self, text: str) -> None:
        bar = self._trainer.progress_bar_callback if self._trainer is not None else None
        on_terminal = isinstance(bar, TQDMProgressBar) and not bar.is_disabled and sys.stdout.isatty()
        if on_terminal and bar._train_progress_bar is not None:
            bar.train_progress_bar.set_postfix_str(text, refresh=True)
            return
        if show_in_rich_bar(bar, text):
            return
        now = time.monotonic()
        if now - self._last_log >= self.log_every_seconds:
            self._last_log = now
            if log.isEnabledFor(logging.INFO) and has_handler(log):
                log.info(text)  # where the user's logging configuration sends it
            else:
                rank_zero_info(text)  # Lightning's logger, which prints by default (to a log file too)


def show_in_rich_bar(bar: Any, text: str) -> bool:
    """Show ``text`` after the training task's description of a ``RichProgressBar`` that draws on a terminal (it
    refreshes itself); returns whether it did. Lightning sets the description again at each epoch's start, and
    :func:`clear_rich_bar` restores it at each step's end."""
    if not isinstance(bar, RichProgressBar) or bar.is_disabled or bar.progress is None:
        return False
    task_id = bar.train_progress_bar_id
    if task_id is None or not bar.progress.console.is_terminal:
        return False
    task = bar.progress.tasks[task_id]
    base = task.fields.setdefault(RICH_BASE, task.description)
    bar.progress.update(task_id, description=f"{base} · {text}")
    bar.progress.refresh()  # now: the bar's own refresh may come after the step
    return True


def clear_rich_bar(bar: Any) -> None:
    """The training task's description as Lightning set it (:func:`show_in_rich_bar`)."""
    if not isinstance(bar, RichProgressBar) or bar.progress is None or bar.train_progress_bar_id is None:
        return
    task = bar.progress.tasks[bar.train_progress_bar_id]
    base = task.fields.pop(RICH_BASE, None)
    if base is not None:
        bar.progress.update(bar.train_progress_bar_id, description=base)


RICH_BASE = "fpdt_description"
"""The field of a Rich training task that keeps its description while :func:`show_in_rich_bar` extends it."""


def has_handler(logger: logging.Logger) -> bool:
    """Whether a record of ``logger`` reaches a handler (its own, or an ancestor's it propagates to): otherwise Python
    prints only warnings and errors."""
    current: Optional[logging.Logger] = logger
    while current is not None:
        if current.handlers:
            return True
        current = current.parent if current.propagate else None
    return False
