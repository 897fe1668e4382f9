"""What a checkpoint of the fpdt strategy holds beyond Lightning's, and what resuming from one needs
(docs/checkpoints.md):

- every rank's random states (torch, CUDA, Python, NumPy), so a resumed run draws what the uninterrupted one would;
- a completeness check: a distributed checkpoint folder whose save was interrupted is refused;
- checksums of every file of a distributed checkpoint, recorded when it is saved and verified when it is loaded: a
  damaged or truncated file is refused by name (PyTorch's distributed checkpoint format keeps none of its own);
- :class:`ResumableLoader`: a training dataloader that resumes mid-epoch where the checkpoint left off. Lightning
  restores the state of dataloaders that have ``state_dict``/``load_state_dict`` and otherwise replays the
  interrupted epoch from its first batch; this one skips, at the index level (no sample is loaded), the batches the
  checkpointed run had already trained on in that epoch, read from the restored loop progress.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader

from lightning_fpdt.lightning_private import _METADATA_FILENAME

RNG_KEY = "fpdt_rng_states"
"""The checkpoint key of the list of every rank's random states."""


def rng_states() -> dict[str, Any]:
    """This process's random states (numpy's key array as a tensor: checkpoints load with ``weights_only=True``,
    which refuses numpy objects)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def gather_rng_states(checkpoint: dict[str, Any], world_size: int) -> None:
    """Put every rank's random states (dropout, sampling) into ``checkpoint``: a resumed run draws what the
    uninterrupted one would. Collective."""
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(states, rng_states())
    checkpoint[RNG_KEY] = states


def restored_rng_state(checkpoint: dict[str, Any], world_size: int, rank: int) -> Optional[dict[str, Any]]:
    """This rank's random states out of a loaded ``checkpoint`` (removed from it), or ``None`` when it holds none,
    or those of another number of ranks (then random streams start afresh, with a warning)."""
    states = checkpoint.pop(RNG_KEY, None)
    if states is None:
        return None
    if len(states) != world_size:
        rank_zero_warn(
            f"fpdt: the checkpoint holds the random states of {len(states)} ranks and this run has {world_size}; "
            f"random streams start afresh (parameters and optimizer states are restored)"
        )
        return None
    return states[rank]


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    kind, key, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def check_checkpoint_complete(path: Path) -> None:
    """A distributed checkpoint is complete only when both its DCP index (``.metadata``, written by the coordinator
    after every rank's shard) and Lightning's ``meta.pt`` (written by rank 0 after that) exist; a save interrupted by a
    dying rank leaves a folder without them, which must never be resumed from as if it were whole."""
    if not path.is_dir():
        if not path.exists():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        return  # a single-file checkpoint: torch.load checks it
    missing = [name for name in (".metadata", _METADATA_FILENAME) if not (path / name).is_file()]
    if missing:
        raise ValueError(
            f"checkpoint folder {path} is incomplete (missing {', '.join(missing)}): a save was interrupted, e.g. by a "
            f"rank that died; resume from an earlier checkpoint"
        )


class _SkipFirst:
    """A batch sampler that drops its first ``skip`` batches once."""

    def __init__(self, batch_sampler: Any, skip: int) -> None:
        self.batch_sampler = batch_sampler
        self.sampler = getattr(batch_sampler, "sampler", None)
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


class ResumableLoader:
    """Wraps a map-style ``DataLoader``; ``completed_batches()`` says how many batches of the restored epoch to skip."""

    def __init__(self, loader: Any, completed_batches: Callable[[], int]) -> None:
        self.loader = loader
        self._completed_batches = completed_batches
        self._restoring = False

    # Lightning reaches the sampler through these to call set_epoch
    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def batch_sampler(self) -> Any:
        return self.loader.batch_sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def state_dict(self) -> dict[str, Any]:
        return {"resumable": True}  # the position itself is the loop progress Lightning saves

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restoring = bool(state.get("resumable"))

    def __iter__(self) -> Iterator[Any]:
        if not self._restoring:
            return iter(self.loader)
        self._restoring = False
        skip = self._completed_batches()
        if skip <= 0 or self.loader.batch_sampler is None:
            return iter(self.loader)
        loader = self.loader
        skipping = DataLoader(
            loader.dataset, batch_sampler=_SkipFirst(loader.batch_sampler, skip), num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
            persistent_workers=False,
        )
        return iter(skipping)


CHECKSUMS_FILENAME = "fpdt_checksums.json"
"""The file of a distributed checkpoint folder that records each other file's size and checksums."""
CHECKSUM_CHUNK = 64 * 2**20
"""Bytes per CRC-32: a file's chunks are read and checksummed in parallel threads."""


def checkpoint_files(path: Path) -> list[str]:
    """The files of a checkpoint folder that checksums cover, in the same order on every rank."""
    return sorted(f.name for f in path.iterdir() if f.is_file() and f.name != CHECKSUMS_FILENAME)


def file_checksums(path: Path, threads: int = 0) -> dict[str, Any]:
    """``{"size": bytes, "crc32": [one per chunk of CHECKSUM_CHUNK bytes]}`` of one file (the chunks in parallel)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        def chunk_crc(index: int) -> str:
            return f"{zlib.crc32(os.pread(fd, CHECKSUM_CHUNK, index * CHECKSUM_CHUNK)):08x}"

        with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:  # zlib releases the GIL
            crcs = list(pool.map(chunk_crc, range(max(1, -(-size // CHECKSUM_CHUNK)))))
    finally:
        os.close(fd)
    return {"size": size, "crc32": crcs}


def record_checksums(path: Path, rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """The checksums of this rank's share of the folder's files (every ``world_size``-th, from ``rank``)."""
    return {name: file_checksums(path / name) for name in checkpoint_files(path)[rank::world_size]}


def write_checksums(path: Path, records: dict[str, dict[str, Any]]) -> None:
    """Write the folder's checksums file, complete or not at all (a rename)."""
    partial = path / f".{CHECKSUMS_FILENAME}.partial"
    partial.write_text(json.dumps({"chunk_bytes": CHECKSUM_CHUNK, "files": records}, indent=1, sort_keys=True))
    partial.replace(path / CHECKSUMS_FILENAME)


def damaged_files(path: Path, rank: int, world_size: int) -> Optional[list[str]]:
    """What is wrong with this rank's share of the folder's files against the recorded checksums (files missing,
    truncated or changed; rank 0 also reports files the save did not write); ``None`` when the folder records no
    checksums."""
    recorded_file = path / CHECKSUMS_FILENAME
    if not recorded_file.is_file():
        return None
    try:
        recorded = json.loads(recorded_file.read_text())["files"]
    except (ValueError, KeyError) as error:
        return [f"{CHECKSUMS_FILENAME} (unreadable: {error})"]
    names = sorted(recorded)
    problems = [f"{name} (extra file, not written by the save)" for name in checkpoint_files(path)
                if name not in recorded and rank == 0]
    for name in names[rank::world_size]:
        file = path / name
        if not file.is_file():
            problems.append(f"{name} (missing)")
        elif file.stat().st_size != recorded[name]["size"]:
            problems.append(f"{name} ({file.stat().st_size} bytes, {recorded[name]['size']} when saved: truncated "
                            f"or overwritten)")
        elif file_checksums(file)["crc32"] != recorded[name]["crc32"]:
            problems.append(f"{name} (its contents changed since the save: the checksum differs)")
    return problems


def save_checksums(path: Path, rank: int, world_size: int) -> None:
    """Record the checksums of a distributed checkpoint folder just saved, every rank hashing its share of the files.
    Collective."""
    _barrier()  # rank 0 writes Lightning's metadata file after the others' shards: list the files only now
    records = record_checksums(path, rank, world_size)
    gathered: list[Any] = [None] * world_size
    _all_gather(gathered, records)
    if rank == 0:
        write_checksums(path, {name: entry for share in gathered for name, entry in share.items()})
    _barrier()


def verify_checksums(path: Path, rank: int, world_size: int) -> None:
    """Refuse a distributed checkpoint folder whose files differ from what the save recorded, naming them; every
    rank verifies its share. A folder without checksums loads with a warning (nothing to verify it against).
    Collective."""
    if not path.is_dir():
        return
    problems = damaged_files(path, rank, world_size)
    gathered: list[Any] = [None] * world_size
    _all_gather(gathered, problems)
    if all(share is None for share in gathered):
        rank_zero_warn(f"fpdt: checkpoint {path} records no checksums ({CHECKSUMS_FILENAME}): its files cannot be "
                       f"verified before loading")
        return
    damaged = [problem for share in gathered for problem in share or []]
    if damaged:
        raise ValueError(
            f"checkpoint {path} is damaged: {'; '.join(damaged)}. Loading it would train on other weights than the "
            f"ones saved: resume from an earlier checkpoint"
        )


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _all_gather(out: list[Any], value: Any) -> None:
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(out, value)
    else:
        out[0] = value


def resumable_loader(dataloader: Any, trainer: Any) -> Any:
    """A training ``DataLoader`` wrapped in :class:`ResumableLoader`; anything else as it is."""
    if trainer is None or not trainer.training or not isinstance(dataloader, DataLoader):
        return dataloader
    progress = trainer.fit_loop.epoch_loop.batch_progress
    # `processed`: batches whose training step finished (a checkpoint written in on_train_batch_end has not counted
    # its batch as `completed` yet; after the loop's restart reset both are equal)
    return ResumableLoader(dataloader, completed_batches=lambda: progress.current.processed)
