"""MFUMonitor: per optimizer step throughput, model TFLOP/s and MFU, to the loggers and the progress bar."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_fpdt.flops import CONVENTIONS, ModelGeometry, flops_per_step, peak_flops
from lightning_fpdt.lightning_private import batches_that_stepped
from lightning_fpdt.offload.host_memory import resident_bytes

_GIB = 2**30
@dataclass(frozen=True)
class StepRecord:
    """What one optimizer step did and how long it took (all micro-batches of gradient accumulation)."""

    tokens: int
    """Global tokens of the step, counted once per sequence-parallel group, summed over micro-batches."""
    flops: int
    """Global model FLOPs of the step in the monitor's convention."""
    step_time_s: float
    """Wall time from the start of the first micro-batch to the end of the optimizer step."""


class MFUMonitor(pl.Callback):
    """Logs tokens/s, model TFLOP/s per device and MFU of every optimizer step, plus step time and memory.

    Metrics (to every attached logger, at ``log_every_n_steps`` optimizer steps, independently of the
    Trainer's ``log_every_n_steps``; tokens/s and MFU also to the progress bar):

    - ``perf/step_time_s``: from the start of the first micro-batch to the end of the optimizer step (the
      data loading between steps is not included). On CUDA the device is synchronised at these two points
      only.
    - ``perf/tokens_per_sec``, ``perf/tokens_per_sec_per_device``: global tokens, each counted once (the
      ranks of a sequence-parallel group share one sample).
    - ``perf/tflops_per_device``: model FLOPs (``lightning_fpdt.flops``, in the chosen convention) per
      second and device, in TFLOP/s.
    - ``perf/mfu_<convention>``: model FLOPs / (step time · world size · peak FLOP/s), e.g. ``perf/mfu_causal``.
      Not logged when the peak is unknown.
    - ``perf/peak_gpu_mem_gib``: ``torch.cuda.max_memory_allocated`` of the step (the peak statistics are reset
      at every step start); CUDA only.
    - ``perf/host_mem_gib``: resident memory of this process (Linux).

    Uneven head splits: every rank counts the whole step's model FLOPs (each query head once) over the world size, so
    14 heads on 4 ranks (4, 4, 3 and 3 heads' attention) give per-device figures that sum to the model's FLOPs.

    The values are this rank's; logged by rank 0's loggers. At the end of training one line sums up the
    median of the steps after the first (a warm-up step).

    Args:
        convention: ``"causal"`` (causal attention, no recompute: the FLOPs the maths needs) or ``"megatron"``
            (non-causal attention and recompute counted, to set beside Megatron-LM / ALST figures); see
            ``lightning_fpdt.flops.flops_per_token``.
        peak_flops: Peak FLOP/s of one device. ``None``: looked up in ``lightning_fpdt.flops.PEAK_FLOPS`` from
            the CUDA device name and the Trainer's precision (dense figures).
        log_every_n_steps: Log every this many optimizer steps.
        geometry: The model sizes. ``None``: read from the first ``.config`` found on the LightningModule or
            its submodules when fit starts (after ``configure_model``).
        prog_bar: Show tokens/s and MFU in the progress bar.
    """

    def __init__(
        self,
        *,
        convention: Literal["causal", "megatron"] = "causal",
        peak_flops: Optional[float] = None,
        log_every_n_steps: int = 1,
        geometry: Optional[ModelGeometry] = None,
        prog_bar: bool = True,
    ) -> None:
        super().__init__()
        if convention not in CONVENTIONS:
            raise ValueError(f"MFUMonitor(convention={convention!r}): choose one of {list(CONVENTIONS)}")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"MFUMonitor(peak_flops={peak_flops}) must be positive FLOP/s (e.g. 989e12), or None")
        if log_every_n_steps < 1:
            raise ValueError(f"MFUMonitor(log_every_n_steps={log_every_n_steps}) must be at least 1")
        self.convention = convention
        self.peak_flops = peak_flops
        self.log_every_n_steps = log_every_n_steps
        self.geometry = geometry
        self.prog_bar = prog_bar
        self.step_records: list[StepRecord] = []  # one per optimizer step of the last fit
        # Resolved when fit starts: the arguments, else read from the model / looked up in the table.
        self._geometry: Optional[ModelGeometry] = None
        self._peak: Optional[float] = None
        self._open_step: Optional[_OpenStep] = None

    @property
    def last_step_tokens(self) -> Optional[int]:
        """Global tokens of the last completed optimizer step; ``None`` before the first."""
        return self.step_records[-1].tokens if self.step_records else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not in `setup`: under FSDP2-style strategies the model is built in `configure_model`, which runs later.
        self._geometry = self.geometry or ModelGeometry.from_model(pl_module)
        self._peak = self.peak_flops if self.peak_flops is not None else _lookup_peak(trainer)
        if self._peak is None:
            rank_zero_warn(
                f"MFUMonitor: no peak FLOP/s known for {_device_name(trainer)} at precision {trainer.precision!r}; "
                "logging tokens/s and TFLOP/s but not MFU. Pass MFUMonitor(peak_flops=...) (dense FLOP/s per device)."
            )
        self.step_records = []
        self._open_step = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._open_step is None:
            device = trainer.strategy.root_device
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the previous step's kernels must not count towards this one
                torch.cuda.reset_peak_memory_stats(device)
            self._open_step = _OpenStep(start=time.perf_counter(), global_step=trainer.global_step)
        tokens, seq_len = _count_global_tokens(trainer.strategy, trainer.world_size, batch)
        self._open_step.tokens += tokens
        # Per micro-batch: the attention FLOPs per token depend on its sequence length, and on its documents when
        # the strategy found packed ones (each token attends only within its own)
        attention_len = getattr(trainer.strategy, "last_batch_attention_length", None)
        self._open_step.flops += flops_per_step(self._geometry, seq_len, tokens, self.convention,
                                                attention_len=attention_len)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = self._open_step
        if step is None or trainer.global_step == step.global_step:
            return  # accumulating gradients: the optimizer step is still to come
        device = trainer.strategy.root_device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record = StepRecord(tokens=step.tokens, flops=step.flops, step_time_s=time.perf_counter() - step.start)
        self.step_records.append(record)
        self._open_step = None
        if trainer.global_step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module, record)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = self.step_records[1:] or self.step_records  # the first step warms up (allocator, kernels)
        if not steps:
            return
        world_size = trainer.world_size
        step_time = statistics.median(r.step_time_s for r in steps)
        tokens_per_sec = statistics.median(r.tokens / r.step_time_s for r in steps)
        tflops = statistics.median(r.flops / r.step_time_s / world_size / 1e12 for r in steps)
        summary = (
            f"MFUMonitor: median of {len(steps)} steps: step time {step_time:.3f} s, "
            f"{tokens_per_sec:,.0f} tokens/s ({tokens_per_sec / world_size:,.0f} per device), "
            f"{tflops:.4g} TFLOP/s per device"
        )
        if self._peak is not None:
            mfu = statistics.median(r.flops / (r.step_time_s * world_size * self._peak) for r in steps)
            summary += f", MFU {100 * mfu:.3g}% of {self._peak / 1e12:g} TFLOP/s"
        rank_zero_info(f"{summary} (FLOP convention {self.convention!r}, {world_size} devices)")

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, record: StepRecord) -> None:
        world_size, seconds = trainer.world_size, record.step_time_s
        metrics = {
            "perf/step_time_s": seconds,
            "perf/tokens_per_sec": record.tokens / seconds,
            "perf/tokens_per_sec_per_device": record.tokens / seconds / world_size,
            "perf/tflops_per_device": record.flops / seconds / world_size / 1e12,
        }
        mfu_name = f"perf/mfu_{self.convention}"
        if self._peak is not None:
            metrics[mfu_name] = record.flops / (seconds * world_size * self._peak)
        device = trainer.strategy.root_device
        if device.type == "cuda":
            metrics["perf/peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated(device) / _GIB
        host_bytes = resident_bytes()
        if host_bytes is not None:
            metrics["perf/host_mem_gib"] = host_bytes / _GIB

        # Straight to the loggers, as Lightning's LearningRateMonitor does: `self.log(..., logger=True)` would
        # only reach them at the Trainer's own `log_every_n_steps`. The step is the one Lightning gives the
        # losses logged in this batch, so the curves line up.
        logger_step = batches_that_stepped(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=logger_step)
        # Also into trainer.callback_metrics (so other callbacks can monitor them); tokens/s and MFU in the bar.
        in_bar = {name: metrics[name] for name in ("perf/tokens_per_sec", mfu_name) if name in metrics}
        rest = {name: value for name, value in metrics.items() if name not in in_bar}
        pl_module.log_dict(in_bar, on_step=True, on_epoch=False, prog_bar=self.prog_bar, logger=False)
        pl_module.log_dict(rest, on_step=True, on_epoch=False, prog_bar=False, logger=False)


@dataclass
class _OpenStep:
    """An optimizer step whose first micro-batch has started."""

    start: float
    global_step: int
    tokens: int = 0
    flops: int = 0


def _count_global_tokens(strategy: Any, world_size: int, batch: Any) -> tuple[int, int]:
    """``(global tokens, global sequence length)`` of one micro-batch.

    Under the FPDT strategy the ranks of a sequence-parallel group hold shards of the same sequences, so
    the global count is ``batch · seq_len · data_parallel_size`` from the strategy's record of the unsharded
    batch (padding excluded). Under any other strategy every rank is assumed to hold a batch of the same
    shape: the token ids' numel times the world size.
    """
    batch_geometry = getattr(strategy, "last_batch_geometry", None)
    if batch_geometry is not None:
        batch_size, seq_len, _padded_seq_len = batch_geometry
        return batch_size * seq_len * strategy.data_parallel_size, seq_len
    token_ids = _find_token_ids(batch)
    if token_ids is None or token_ids.dim() == 0:
        raise ValueError(
            f"MFUMonitor could not find the token ids in the batch ({type(batch).__name__}): it reads "
            "batch['input_ids'] or the first tensor in the batch, shaped (..., seq_len)"
        )
    return token_ids.numel() * world_size, token_ids.shape[-1]


def _find_token_ids(batch: Any) -> Optional[Tensor]:
    """``batch["input_ids"]`` if the batch is a mapping that has it, else the first tensor, depth first."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, Mapping):
        if isinstance(batch.get("input_ids"), Tensor):
            return batch["input_ids"]
        items = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        items = list(batch)
    else:
        return None
    for item in items:
        found = _find_token_ids(item)
        if found is not None:
            return found
    return None


def _lookup_peak(trainer: pl.Trainer) -> Optional[float]:
    device = trainer.strategy.root_device
    dtype = _matmul_dtype(str(trainer.precision))
    if device.type != "cuda" or dtype is None:
        return None
    return peak_flops(torch.cuda.get_device_name(device), dtype)


def _matmul_dtype(precision: str) -> Optional[str]:
    """The dtype the matmuls of a Lightning precision setting run in: "bf16-mixed" -> "bf16"."""
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    if precision.startswith("32"):
        # "high"/"medium" let fp32 matmuls run on the TF32 tensor cores.
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return None  # "64-true", "transformer-engine", ...: no table entry


def _device_name(trainer: pl.Trainer) -> str:
    device = trainer.strategy.root_device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)



