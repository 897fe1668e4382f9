"""The rates of the GPU a run is on, measured once and cached: what makes the step-time model's seconds a prediction
(:mod:`lightning_fpdt.planner.cost`; without a calibration it times steps at the built-in table's rates,
:mod:`lightning_fpdt.planner.rates`).

A calibration measures (:mod:`lightning_fpdt.planner.measure`) on the current CUDA device:

- once: page-locked host <-> device copies alone and beside a GEMM on another stream (the share of a copy the
  compute hides), a memory-bound op's bytes per second, the all-to-all of a process group of 2 or more ranks where one
  is given (keyed by its size), the disk of an ``offload_dir`` where one is given (keyed by the directory);
- per shape, when first needed: the bf16 GEMMs of the model's linear layers (forward and the two backward GEMMs) at
  the rows a plan runs them with (:data:`~lightning_fpdt.planner.rates.GEMM_MAX_ROWS` at most), and the attention
  kernel's blocks, forward and backward, causal and full, at the chunk shapes the search may try
  (:func:`needed_shapes`).

It is bounded: every measurement is a short loop (a warm-up call, a few timed ones), and a calibration stops
measuring shapes once :data:`BUDGET_SECONDS` have passed (the shapes left are measured the next time they are
needed; until then the nearest measured shape stands for them). The results are cached as JSON in
``$XDG_CACHE_HOME/lightning_fpdt/`` (``~/.cache/lightning_fpdt/`` by default), one file per GPU model, torch version and
cuDNN version (:class:`CalibrationKey`): a driver or library update measures again. The strategy calibrates on its
first GPU use where no calibration is cached (``strategy/budget.py``), ``lightning-fpdt calibrate`` on demand, and
``lightning-fpdt plan`` reads the cache.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from lightning_fpdt.planner import measure
from lightning_fpdt.planner.cost import BACKWARD, FORWARD, attention_blocks, attention_gemms, head_gemm, mlp_gemms
from lightning_fpdt.planner.rates import (
    ATTENTION_FLOPS,
    GEMM_MAX_ROWS,
    MATMUL_FLOPS,
    StepRates,
    attention_block_flops,
    attention_key,
    gemm_key,
)
from lightning_fpdt.planner.step_sizes import StepSizes

CACHE_VERSION = 1
"""The cache files' format; a file of another version is measured again."""
BUDGET_SECONDS = 25.0
"""Seconds a calibration measures shapes for at most (the measurements of the machine itself come first: a few calls
of milliseconds each on a GPU), so that a calibration stays under half a minute."""
GEMM_KINDS = FORWARD + BACKWARD
ATTENTION_KINDS = ("forward", "backward")


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration holds for: the GPU model, torch's version and cuDNN's (the attention kernels')."""

    gpu: str
    torch: str
    cudnn: Optional[int]

    def describe(self) -> str:
        return f"{self.gpu}, torch {self.torch}, cuDNN {self.cudnn if self.cudnn is not None else 'none'}"

    def file_name(self) -> str:
        """The cache file's name: the key's fields, every other character an underscore."""
        text = f"{self.gpu}-torch{self.torch}-cudnn{self.cudnn}"
        return "calibration-" + re.sub(r"[^A-Za-z0-9.+-]+", "_", text) + ".json"


def current_key(device: torch.device) -> CalibrationKey:
    """The key of ``device`` (a CUDA device) in this process."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return CalibrationKey(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, cudnn=cudnn)


def cache_directory() -> Path:
    """``$XDG_CACHE_HOME/lightning_fpdt`` (``~/.cache/lightning_fpdt`` where it is not set)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "lightning_fpdt"


@dataclass(frozen=True)
class Shapes:
    """What a plan's step is timed at: GEMMs ``(kind, rows, inner, cols)`` and attention blocks ``(kind, causal,
    batch, heads, kv_heads, tokens, head_dim)``."""

    gemms: frozenset[tuple[str, int, int, int]] = frozenset()
    attention: frozenset[tuple[str, bool, int, int, int, int, int]] = frozenset()

    def __len__(self) -> int:
        return len(self.gemms) + len(self.attention)


def needed_shapes(sizes: Iterable[StepSizes]) -> Shapes:
    """The GEMMs and attention blocks the cost model times the steps of ``sizes`` with (the rows capped as the rates
    look them up)."""
    gemms, blocks = set(), set()
    for s in sizes:
        for gemm in attention_gemms(s) + attention_gemms(s, groups=1) + mlp_gemms(s) + [head_gemm(s)]:
            rows = min(gemm.call_rows, GEMM_MAX_ROWS)
            gemms.update((kind, rows, gemm.inner, gemm.cols) for kind in GEMM_KINDS)
        for groups in {s.G, 1}:
            for count, shape in attention_blocks(s, groups=groups):
                if count:
                    blocks.update((kind, shape["causal"], shape["batch"], shape["heads"], shape["kv_heads"],
                                   shape["tokens"], shape["head_dim"]) for kind in ATTENTION_KINDS)
    return Shapes(frozenset(gemms), frozenset(blocks))


def _gemm_name(shape: tuple[str, int, int, int]) -> str:
    return gemm_key(*shape)


def _attention_name(shape: tuple[str, bool, int, int, int, int, int]) -> str:
    kind, causal, batch, heads, kv_heads, tokens, head_dim = shape
    return attention_key(kind, causal=causal, batch=batch, heads=heads, kv_heads=kv_heads, tokens=tokens,
                         head_dim=head_dim)


class Calibration:
    """The measured rates of one :class:`CalibrationKey`: its cache file's contents (``data``), what is missing for a
    plan (:meth:`missing`), measuring it (:meth:`measure`), and the rates a plan is timed at (:meth:`rates`)."""

    def __init__(self, key: CalibrationKey, data: Optional[dict[str, Any]] = None,
                 path: Optional[Path] = None) -> None:
        self.key = key
        self.path = path
        self.data: dict[str, Any] = data if data is not None else self.empty(key)

    @staticmethod
    def empty(key: CalibrationKey) -> dict[str, Any]:
        return {"version": CACHE_VERSION, "key": dataclasses.asdict(key), "machine": {}, "all_to_all": {}, "disk": {},
                "gemms": {}, "attention": {}, "seconds": 0.0, "measured": None}

    @classmethod
    def load(cls, key: CalibrationKey, directory: Optional[Path] = None) -> "Calibration":
        """The cached calibration of ``key`` (``directory``: instead of :func:`cache_directory`), or an empty one
        (nothing cached, a file of another version or one that cannot be read)."""
        path = (directory or cache_directory()) / key.file_name()
        return cls(key, read_cache(path), path)

    @classmethod
    def of_data(cls, data: dict[str, Any], path: Optional[Path] = None) -> "Calibration":
        """A calibration from its ``data`` (one rank's, shared with the others)."""
        return cls(CalibrationKey(**data["key"]), data, path)

    @property
    def measured(self) -> bool:
        """Whether the machine's own rates (copies, overlap, the memory-bound op) were measured."""
        return bool(self.data["machine"])

    def save(self) -> None:
        """Write the cache file (atomically: another process reads the old file or the new one)."""
        if self.path is None:
            raise RuntimeError("Calibration.save: this calibration has no cache file (made from shared data)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        os.replace(temporary, self.path)

    def missing(self, shapes: Shapes) -> Shapes:
        """The shapes of ``shapes`` not measured yet."""
        return Shapes(frozenset(s for s in shapes.gemms if _gemm_name(s) not in self.data["gemms"]),
                      frozenset(s for s in shapes.attention if _attention_name(s) not in self.data["attention"]))

    def measure(self, device: torch.device, *, shapes: Shapes = Shapes(), group: Any = None,
                offload_dir: Optional[str] = None, clock: Optional[measure.Clock] = None,
                budget_seconds: float = BUDGET_SECONDS, dtype: torch.dtype = torch.bfloat16,
                now: Callable[[], float] = time.monotonic) -> Shapes:
        """Measure on ``device`` what is not measured yet: the machine's rates, the all-to-all of ``group`` (collective:
        every rank of it calls this), the disk of ``offload_dir``, then the missing ``shapes``, GEMMs first, each
        kind's cheapest first, until ``budget_seconds`` have passed (``now``: the clock of that bound). Returns the
        shapes left unmeasured."""
        clock = clock or measure.clock_for(device)
        started = now()
        if not self.measured:
            copies = measure.copy_rates(device, clock=clock)
            self.data["machine"] = {**copies, "copy_overlap": measure.copy_overlap(device, clock=clock),
                                    "elementwise_bytes": measure.elementwise_bytes(device, clock=clock)}
        if group is not None:
            import torch.distributed as dist

            size = str(dist.get_world_size(group))
            if size not in self.data["all_to_all"]:
                self.data["all_to_all"][size] = measure.all_to_all_bytes(group, device, clock=clock)
        if offload_dir is not None and offload_dir not in self.data["disk"]:
            self.data["disk"][offload_dir] = measure.disk_bytes(offload_dir)
        left = self.missing(shapes)
        gemms = sorted(left.gemms, key=lambda s: s[1] * s[2] * s[3])
        blocks = sorted(left.attention, key=lambda s: s[2] * s[3] * s[5] ** 2 * s[6])
        unmeasured_gemms, unmeasured_blocks = set(), set()
        for shape in gemms:
            kind, rows, inner, cols = shape
            if now() - started > budget_seconds or not _fits(lambda: measure.gemm_flops(
                    kind, rows, inner, cols, device=device, dtype=dtype, clock=clock), self.data["gemms"],
                    _gemm_name(shape)):
                unmeasured_gemms.add(shape)
        for shape in blocks:
            kind, causal, batch, heads, kv_heads, tokens, head_dim = shape
            if now() - started > budget_seconds or not _fits(lambda: measure.attention_seconds(
                    kind, causal=causal, batch=batch, heads=heads, kv_heads=kv_heads, tokens=tokens,
                    head_dim=head_dim, device=device, dtype=dtype, clock=clock), self.data["attention"],
                    _attention_name(shape)):
                unmeasured_blocks.add(shape)
        self.data["seconds"] = self.data.get("seconds", 0.0) + now() - started
        self.data["measured"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        return Shapes(frozenset(unmeasured_gemms), frozenset(unmeasured_blocks))

    def rates(self, *, group_size: int = 1) -> StepRates:
        """The rates a plan is timed at: the measured ones, and for a GEMM or attention block whose shape was not
        measured the nearest measured one (:class:`StepRates`), else the median measured rate; the all-to-all of a
        group of ``group_size`` ranks where it was measured."""
        if not self.measured:
            raise ValueError(f"the calibration of {self.key.describe()} has not measured this machine's rates yet: "
                             f"run Calibration.measure (or `lightning-fpdt calibrate`) first")
        machine = self.data["machine"]
        gemms = tuple(sorted(self.data["gemms"].items()))
        attention = tuple(sorted(self.data["attention"].items()))
        attention_rates = [attention_block_flops(kind, causal=causal == "causal", **sizes) / seconds
                           for (kind, causal, sizes), seconds in map(_block_of, attention)]
        return StepRates(
            source=f"calibrated on {self.key.describe()}" + (f", {self.path}" if self.path else ""),
            calibrated=True,
            matmul_flops=statistics.median(rate for _, rate in gemms) if gemms else MATMUL_FLOPS,
            attention_flops=statistics.median(attention_rates) if attention_rates else ATTENTION_FLOPS,
            copy_bytes=min(machine["host_to_device"], machine["device_to_host"]),
            copy_overlap=machine["copy_overlap"], elementwise_bytes=machine["elementwise_bytes"],
            all_to_all_bytes=self.data["all_to_all"].get(str(group_size)) if group_size > 1 else None,
            gemms=gemms, attention=attention,
        )

    def table(self) -> str:
        """The measured rates as a table (``lightning-fpdt calibrate``)."""
        d, machine = self.data, self.data["machine"]
        lines = [f"calibration of {self.key.describe()}" + (f" ({self.path})" if self.path else ""),
                 f"  measured {d.get('measured')}, {d.get('seconds', 0.0):.1f} s of measuring in all", ""]
        if machine:
            lines += [f"  {'host -> device, page-locked':<46} {machine['host_to_device'] / 1e9:>10.1f} GB/s",
                      f"  {'device -> host, page-locked':<46} {machine['device_to_host'] / 1e9:>10.1f} GB/s",
                      f"  {'copies hidden by a GEMM beside them':<46} {100 * machine['copy_overlap']:>10.0f} %",
                      f"  {'memory-bound op (read + written)':<46} {machine['elementwise_bytes'] / 1e9:>10.1f} GB/s"]
        lines += [f"  {f'all-to-all, {size} ranks, per rank':<46} {rate / 1e9:>10.1f} GB/s"
                  for size, rate in sorted(d["all_to_all"].items(), key=lambda item: int(item[0]))]
        lines += [f"  {'disk ' + path:<46} {rate / 1e9:>10.2f} GB/s" for path, rate in sorted(d["disk"].items())]
        if d["gemms"]:
            lines += ["", f"  {'GEMM (kind: rows x inner x cols)':<46} {'TFLOP/s':>10}"]
            lines += [f"  {name:<46} {rate / 1e12:>10.1f}" for name, rate in sorted(d["gemms"].items())]
        if d["attention"]:
            lines += ["", f"  {'attention block (kind:mask:batch,heads,kv,dim:tokens)':<58} {'ms':>9} {'TFLOP/s':>8}"]
            for name, seconds in sorted(d["attention"].items()):
                (kind, causal, sizes), _ = _block_of((name, seconds))
                flops = attention_block_flops(kind, causal=causal == "causal", **sizes)
                lines.append(f"  {name:<58} {1e3 * seconds:>9.2f} {flops / seconds / 1e12:>8.1f}")
        return "\n".join(lines)


def _fits(measurement: Callable[[], float], into: dict[str, float], name: str) -> bool:
    """Run ``measurement`` into ``into[name]``; ``False`` where the device had not the memory for it (the shape is
    then left to the nearest measured one)."""
    try:
        into[name] = measurement()
    except torch.OutOfMemoryError:
        return False
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the measurement's buffers, not the run's
    return True


def _block_of(item: tuple[str, float]) -> tuple[tuple[str, str, dict[str, int]], float]:
    """``((kind, mask, sizes), seconds)`` of a cached attention entry (``sizes``: batch, heads, tokens, head_dim)."""
    key, seconds = item
    kind, mask, shape, tokens = key.split(":")
    batch, rest = shape[1:].split("h")
    heads, rest = rest.split("k")
    _kv_heads, head_dim = rest.split("d")
    return (kind, mask, dict(batch=int(batch), heads=int(heads), tokens=int(tokens[1:]), head_dim=int(head_dim))), \
        seconds


def read_cache(path: Path) -> Optional[dict[str, Any]]:
    """A cache file's contents, or ``None`` where it is absent, unreadable or of another version."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None


def find_cached(gpu: Optional[str] = None, directory: Optional[Path] = None) -> Optional[Calibration]:
    """A cached calibration that measured its machine: of the GPU model ``gpu`` (``None``: this machine's first CUDA
    device; none without one), this torch's and cuDNN's where cached, else the newest of that GPU."""
    directory = directory or cache_directory()
    if gpu is None:
        if not torch.cuda.is_available():
            return None
        exact = Calibration.load(current_key(torch.device("cuda", 0)), directory)
        if exact.measured:
            return exact
        gpu = exact.key.gpu
    found = []
    for path in directory.glob("calibration-*.json"):
        data = read_cache(path)
        if data is not None and data["key"].get("gpu") == gpu and data.get("machine"):
            found.append((data["key"].get("torch") == torch.__version__, path.stat().st_mtime, path, data))
    if not found:
        return None
    *_, path, data = max(found, key=lambda entry: entry[:2])
    return Calibration.of_data(data, path)


def cached_rates(card: Optional[str], *, group_size: int) -> Optional[StepRates]:
    """The rates of ``card``'s cached calibration (``None``: this machine's GPU's), or ``None`` (the built-in table)
    where none is cached."""
    calibration = find_cached(card)
    return None if calibration is None else calibration.rates(group_size=group_size)
