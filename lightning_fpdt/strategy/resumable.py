"""A training dataloader that resumes mid-epoch where the checkpoint left off (data position, DESIGN.md §5).

Lightning restores the state of dataloaders that have ``state_dict``/``load_state_dict`` and otherwise replays the
interrupted epoch from its first batch. The strategy wraps each training dataloader in :class:`ResumableLoader`:
after a restore it skips, at the index level (no sample is loaded), the batches the checkpointed run had already
trained on in that epoch — read from the restored loop progress, which counts completed batches, not the batches
Lightning's fetcher had prefetched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, Callable


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
        from torch.utils.data import DataLoader

        loader = self.loader
        skipping = DataLoader(
            loader.dataset, batch_sampler=_SkipFirst(loader.batch_sampler, skip), num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory, worker_init_fn=loader.worker_init_fn,
            persistent_workers=False,
        )
        return iter(skipping)
