"""What the project's data modules share: batch size, loaders, and following a sequence-length schedule."""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
from torch import Tensor
from torch.utils.data import DataLoader, Dataset


class LongContextDataModule(L.LightningDataModule):
    """Base of the data modules that yield ``{"input_ids": (B, S), "labels": (B, S), ...}`` batches.

    It follows a length schedule (:meth:`set_length_schedule`; the ``SequenceLengthCurriculum`` callback hands it
    one at setup): just before a training batch is moved to the device (and sharded by the strategy), it asks the
    schedule for the length of the current optimizer step and shortens the batch with :meth:`crop_batch`. Samples
    are always read at ``seq_len``, so what a sample contains never depends on the step (the data stays a pure
    function of the sample index, for any sampler and any number of workers), and the cut happens in the step that
    uses the batch (Lightning prefetches the next batch one step ahead, so a dataset reading a shared length would lag
    by a step).
    Validation and test batches keep the full ``seq_len``.

    Subclasses implement the loaders (``self._loader(dataset, shuffle=...)`` builds one) and may override
    :meth:`crop_batch` and :attr:`min_seq_len`.
    """

    def __init__(self, *, seq_len: int, batch_size: int, num_workers: int = 0) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"seq_len ({seq_len}) must be at least 2 (one input and one target)")
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be at least 1")
        if num_workers < 0:
            raise ValueError(f"num_workers ({num_workers}) must be >= 0")
        self.seq_len, self.batch_size, self.num_workers = seq_len, batch_size, num_workers
        self._length_schedule: Optional[Callable[[int], int]] = None

    def set_length_schedule(self, schedule: Optional[Callable[[int], int]]) -> None:
        """Crop training batches to ``schedule(optimizer_step)`` tokens from now on; ``None``: full length."""
        self._length_schedule = schedule

    @property
    def min_seq_len(self) -> int:
        """The shortest length :meth:`crop_batch` can produce."""
        return 2

    def crop_batch(self, batch: dict[str, Any], seq_len: int) -> dict[str, Any]:
        """The batch cut to its first ``seq_len`` tokens: every ``(B, S, ...)`` tensor is sliced on dim 1."""
        full = batch["input_ids"].shape[1]
        per_token = [key for key, value in batch.items() if isinstance(value, Tensor) and value.dim() >= 2
                     and value.shape[1] == full]
        return {key: value[:, :seq_len] if key in per_token else value for key, value in batch.items()}

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        seq_len = self._scheduled_seq_len()
        if seq_len is not None and isinstance(batch, dict) and seq_len < batch["input_ids"].shape[1]:
            batch = self.crop_batch(batch, seq_len)
        return batch

    def _scheduled_seq_len(self) -> Optional[int]:
        trainer = self.trainer
        if self._length_schedule is None or trainer is None or not trainer.training:
            return None
        return self._length_schedule(trainer.global_step)

    def _loader(self, dataset: Dataset, *, shuffle: bool) -> DataLoader:
        # under a distributed strategy Lightning swaps in a DistributedSampler (shuffle kept) keyed on the
        # strategy's data-parallel rank, so every rank of a sequence-parallel group reads the same samples
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
