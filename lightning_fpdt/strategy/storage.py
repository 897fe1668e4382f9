"""Where checkpoints go, checked before training rather than at the first save (docs/checkpoints.md).

At setup every rank checks each folder a checkpoint will be written to (each ``ModelCheckpoint``'s ``dirpath``, and
the Trainer's ``default_root_dir`` where a preemption saves): that it exists or can be made, that a file can be
written there, and that it has room for about one checkpoint; all ranks refuse together, naming every factor. The
size of a checkpoint is counted the way the memory planner counts the states (``planner.geometry``): every
parameter's master weight and its optimizer states. A save that runs out of space later (another job filled the
disk) is named as such, instead of as the writer's ``unexpected pos 704 vs 598``.
"""

from __future__ import annotations

import errno
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_fpdt.planner.geometry import OPTIMIZER_STATES, PRECISIONS

ASSUMED_STATES = 2
"""Optimizer states per parameter assumed for an optimizer the planner does not list (as Adam keeps)."""
SHORT_WRITE = re.compile(r"unexpected pos|iostream error|file write failed|No space left", re.IGNORECASE)
"""How torch's file writers report a write that came up short, without an errno."""


@dataclass(frozen=True)
class CheckpointSize:
    """About how many bytes one checkpoint of the run takes, and why."""

    bytes: int
    """Master weights and optimizer states of every parameter (all shards together)."""
    reason: str
    """The factors, for messages: ``"1,234 parameters × 4 bytes × (1 weight + 2 AdamW states)"``."""


def checkpoint_size(model: nn.Module, precision: str, optimizers: list[Any]) -> CheckpointSize:
    """One checkpoint's size: every parameter (full sizes, sharded or not) in the precision's master bytes, once for
    the weight and once per optimizer state."""
    parameters = sum(p.numel() for p in model.parameters())
    master = PRECISIONS.get(precision, PRECISIONS["32-true"])["master"]
    states, names = 0, []
    for optimizer in optimizers:
        name = type(optimizer).__name__
        count = OPTIMIZER_STATES.get(name.lower(), ASSUMED_STATES)
        states += count
        names.append(f"{count} {name} state{'s' * (count != 1)}")
    kept = " + ".join(["1 weight", *names])
    reason = f"{parameters:,} parameters × {master} bytes × ({kept})"
    return CheckpointSize(parameters * master * (1 + states), reason)


def checkpoint_folders(trainer: Any, *, preemption: bool) -> list[Path]:
    """The local folders checkpoints of this fit go to: each ``ModelCheckpoint``'s ``dirpath`` (resolved at its
    setup) and, when preemption saves, the Trainer's ``default_root_dir``."""
    paths = [getattr(callback, "dirpath", None) for callback in trainer.checkpoint_callbacks]
    if preemption:
        paths.append(trainer.default_root_dir)
    folders: list[Path] = []
    for path in paths:
        if path is None or "://" in str(path):
            continue  # not resolved, or a remote filesystem: nothing to check locally
        folder = Path(path).expanduser().absolute()
        if folder not in folders:
            folders.append(folder)
    return folders


def folder_problem(folder: Path, size: CheckpointSize) -> Optional[str]:
    """What keeps ``folder`` from holding one checkpoint of ``size``, or ``None``. Makes the folder if it is missing."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{folder} cannot be made ({error.strerror or error})"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".fpdt-write-check-"):
            pass
    except OSError as error:
        return f"{folder} is not writable ({error.strerror or error})"
    free = shutil.disk_usage(folder).free
    if free < size.bytes:
        return f"{folder} has {_gib(free)} free and one checkpoint needs about {_gib(size.bytes)} ({size.reason})"
    return None


def check_checkpoint_folders(folders: list[Path], size: CheckpointSize, *, rank: int, world_size: int) -> None:
    """Refuse the run, on every rank together, when a checkpoint folder cannot take a checkpoint on some rank.
    Collective when ``world_size > 1``."""
    problems = [problem for folder in folders if (problem := folder_problem(folder, size)) is not None]
    gathered: list[Any] = [problems]
    if world_size > 1 and torch.distributed.is_initialized():
        gathered = [None] * world_size
        torch.distributed.all_gather_object(gathered, problems)
    by_problem: dict[str, list[int]] = {}
    for r, share in enumerate(gathered):
        for problem in share:
            by_problem.setdefault(problem, []).append(r)
    if not by_problem:
        return
    lines = [problem + ("" if len(ranks) == world_size else f" (on ranks {ranks})") for problem, ranks in
             by_problem.items()]
    raise ValueError(
        "checkpoints of this run could not be saved: " + "; ".join(lines) + ". Fix the folder, or save elsewhere: "
        "ModelCheckpoint(dirpath=...) for the periodic checkpoints, the Trainer's default_root_dir for the one a "
        "preemption saves (FPDTStrategy(preemption=False) saves none)"
    )


def check_at_setup(strategy: Any, trainer: Any, *, preemption: bool) -> CheckpointSize:
    """The checkpoint size of the fit ``strategy`` has set up, after refusing folders that cannot hold one."""
    size = checkpoint_size(strategy.model, strategy.precision_plugin.precision, strategy.optimizers)
    check_checkpoint_folders(checkpoint_folders(trainer, preemption=preemption), size, rank=strategy.global_rank,
                             world_size=strategy.world_size)
    return size


@contextmanager
def space_named(path: Path, size: Optional[CheckpointSize]) -> Iterator[None]:
    """Let a save into ``path`` that ran out of space fail with an ``OSError(ENOSPC)`` that says so, whatever
    torch's writer reported; any other failure passes unchanged."""
    try:
        yield
    except BaseException as error:  # noqa: BLE001 - DCP reports a failed save as a BaseException
        out_of_space = out_of_space_error(error, path, size)
        if out_of_space is None:
            raise
        raise out_of_space from error


def out_of_space_error(error: BaseException, path: Path, size: Optional[CheckpointSize]) -> Optional[OSError]:
    """The ``OSError(ENOSPC)`` naming the folder, its free space and a checkpoint's size, when ``error`` (or one it
    wraps, on any rank of a distributed save) is a lack of space: an ``ENOSPC``, or a writer's short write on a
    device with less room than a checkpoint."""
    causes = list(_causes(error))
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in causes)
    short_write = any(isinstance(e, RuntimeError) and SHORT_WRITE.search(str(e)) for e in causes)
    if not (enospc or short_write):
        return None
    folder = next((p for p in (path, *path.parents) if p.is_dir()), path.parent)
    try:
        free: Optional[int] = shutil.disk_usage(folder).free
    except OSError:
        free = None
    needed = size.bytes if size is not None else 0
    if not enospc and (free is None or free >= max(needed, 2**20)):
        return None  # a short write on a device with room: some other failure
    need = f"; one checkpoint needs about {_gib(size.bytes)} ({size.reason})" if size is not None else ""
    left = f"{_gib(free)} free now" if free is not None else "its free space unreadable"
    return OSError(
        errno.ENOSPC,
        f"No space left on the device of {folder} while saving the checkpoint {path}: {left}{need}. "
        f"This checkpoint is incomplete and resuming from it is refused; free space there, keep fewer checkpoints "
        f"(ModelCheckpoint's save_top_k) or save them elsewhere",
    )


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, what it was raised from, and each rank's failure a distributed checkpoint collected."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()
                        if isinstance(f[0] if isinstance(f, tuple) else f, BaseException)]


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**28 else f"{size / 2**20:.1f} MiB"
