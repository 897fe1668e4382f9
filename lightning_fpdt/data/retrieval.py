"""A synthetic long-context key–value retrieval task, generated on the fly (docs/design.md §2 ``data/``).

A sample is ``seq_len`` tokens::

    BOS  p1 p2 … pn  f f f … f  QUERY  q1 a1  q2 a2 … qm am
         \\_ pairs _/  \\_ filler _/        \\_ queries + answers _/

- the context: ``num_pairs`` key–value pairs at the start of the sequence, distinct keys, random values;
- filler: random tokens from their own range (never a key, value or pair token);
- the query section at the very end: ``num_queries`` of the context's keys, each followed by its value.

Labels are ``-100`` everywhere except at the answers ``a1 … am`` (the strategy shifts them on the global
sequence, so the position of ``q_j`` is trained to predict ``a_j``). The pairs sit at the start and the queries at
the end: under sequence parallelism they live on different ranks, so the task is learnt only if attention crosses
the shards. A model that cannot see the context guesses: chance accuracy is ``1 / num_values``.

``pair_format`` chooses how a pair is written:

- ``"one_token"`` (default): one token per pair, its id encoding (key, value); the query is the key's own token.
  Answering is a single attention hop (query key -> the pair token holding it), which a 2-layer model learns in a
  few hundred steps: what the CPU demo needs.
- ``"two_tokens"``: the classic ``k v`` pairs (associative recall). Answering needs an induction head (a
  previous-token head composed with a matching head), which tiny models take thousands of steps to form.

Every sample is a pure function of ``(seed, split, index)`` (numpy's ``SeedSequence``), so any rank, worker or
rerun regenerates it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.data.base import LongContextDataModule
from lightning_fpdt.sequence.loss import IGNORE_INDEX

PairFormat = Literal["one_token", "two_tokens"]
SPLITS = ("train", "val", "test")


@dataclass(frozen=True, kw_only=True)
class RetrievalTask:
    """The geometry and vocabulary of the retrieval task; ``sample(index)`` builds one sequence.

    Token ids: ``0`` pad, ``1`` BOS, ``2`` QUERY, then the keys, the values, the pair tokens (``"one_token"``
    only: one per (key, value)), and the filler tokens up to ``vocab_size`` (pad when none are left).
    """

    seq_len: int
    """Tokens per sample."""
    vocab_size: int
    """Token ids ``0 … vocab_size-1``; must hold the specials, keys, values and pair tokens."""
    num_keys: int = 8
    """Distinct key tokens."""
    num_values: int = 8
    """Distinct value tokens; chance accuracy is ``1 / num_values``."""
    num_pairs: int = 8
    """Key–value pairs in each context (distinct keys, so at most ``num_keys``)."""
    num_queries: int = 8
    """Keys asked at the end (distinct, among the context's); each answer is one scored token."""
    pair_format: PairFormat = "one_token"
    """``"one_token"``: a pair is one token; ``"two_tokens"``: ``key value``. See the module docstring."""
    seed: int = 0
    """Seed of the generator; a sample is a function of ``(seed, split, index)``."""

    PAD = 0
    BOS = 1
    QUERY = 2
    NUM_SPECIAL = 3

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "num_pairs", "num_queries"):
            if getattr(self, name) < 1:
                raise ValueError(f"RetrievalTask.{name} ({getattr(self, name)}) must be at least 1")
        if self.pair_format not in ("one_token", "two_tokens"):
            raise ValueError(f"RetrievalTask.pair_format must be 'one_token' or 'two_tokens', got {self.pair_format!r}")
        if self.num_pairs > self.num_keys:
            raise ValueError(
                f"RetrievalTask.num_pairs ({self.num_pairs}) > num_keys ({self.num_keys}): the keys of a context are "
                "distinct; raise num_keys or lower num_pairs"
            )
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"RetrievalTask.num_queries ({self.num_queries}) > num_pairs ({self.num_pairs}): each query asks a "
                "distinct key of the context"
            )
        if self.vocab_size < self.filler_start:
            raise ValueError(
                f"RetrievalTask.vocab_size ({self.vocab_size}) is too small: {self.NUM_SPECIAL} specials + "
                f"{self.num_keys} keys + {self.num_values} values"
                + (f" + {self.num_keys * self.num_values} pair tokens" if self.pair_format == "one_token" else "")
                + f" = {self.filler_start}; use vocab_size >= {self.filler_start} (more leaves ids for filler)"
            )
        if self.seq_len < self.min_seq_len:
            raise ValueError(
                f"RetrievalTask.seq_len ({self.seq_len}) < {self.min_seq_len}, the length of BOS + {self.num_pairs} "
                f"pairs + QUERY + {self.num_queries} query/answer pairs; raise seq_len or lower num_pairs/num_queries"
            )

    # ---- vocabulary ---------------------------------------------------------------------------------------------
    @property
    def key_start(self) -> int:
        return self.NUM_SPECIAL

    @property
    def value_start(self) -> int:
        return self.key_start + self.num_keys

    @property
    def pair_start(self) -> int:
        return self.value_start + self.num_values

    @property
    def filler_start(self) -> int:
        pairs = self.num_keys * self.num_values if self.pair_format == "one_token" else 0
        return self.pair_start + pairs

    @property
    def chance_accuracy(self) -> float:
        """Accuracy of a model that cannot see the context: a uniform guess among the values."""
        return 1.0 / self.num_values

    # ---- geometry -----------------------------------------------------------------------------------------------
    @property
    def context_len(self) -> int:
        """BOS and the pairs: the head that a crop to a shorter length keeps."""
        return 1 + self.num_pairs * (1 if self.pair_format == "one_token" else 2)

    @property
    def query_len(self) -> int:
        """QUERY and the query/answer pairs: the tail that a crop keeps."""
        return 1 + 2 * self.num_queries

    @property
    def min_seq_len(self) -> int:
        return self.context_len + self.query_len

    def answer_positions(self, seq_len: Optional[int] = None) -> Tensor:
        """Positions of the answer tokens in a sample of ``seq_len`` (default: the task's) tokens."""
        seq_len = self.seq_len if seq_len is None else seq_len
        return torch.arange(seq_len - 2 * self.num_queries + 1, seq_len, 2)

    # ---- samples ------------------------------------------------------------------------------------------------
    def sample(self, index: int, split: str = "train") -> dict[str, Tensor]:
        """``{"input_ids": (S,), "labels": (S,)}`` (int64), the same for the same ``(seed, split, index)``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = np.random.default_rng([self.seed, SPLITS.index(split), index])
        keys = rng.choice(self.num_keys, size=self.num_pairs, replace=False)
        values = rng.integers(0, self.num_values, size=self.num_pairs)
        asked = rng.choice(self.num_pairs, size=self.num_queries, replace=False)
        filler_len = self.seq_len - self.min_seq_len
        if self.filler_start < self.vocab_size:
            filler = rng.integers(self.filler_start, self.vocab_size, size=filler_len)
        else:
            filler = np.full(filler_len, self.PAD)

        if self.pair_format == "one_token":
            context = self.pair_start + keys * self.num_values + values
        else:
            context = np.stack([self.key_start + keys, self.value_start + values], axis=1).reshape(-1)
        queries = np.stack([self.key_start + keys[asked], self.value_start + values[asked]], axis=1).reshape(-1)
        input_ids = np.concatenate([[self.BOS], context, filler, [self.QUERY], queries]).astype(np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[-2 * self.num_queries + 1 :: 2] = queries[1::2]  # the answers only
        return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}

    def crop(self, batch: dict[str, Tensor], seq_len: int) -> dict[str, Tensor]:
        """Shorten ``(B, S)`` samples to ``seq_len`` by dropping filler: the context and the queries are kept, so the
        cropped sample is a valid (shorter) instance of the task."""
        full = batch["input_ids"].shape[1]
        if seq_len >= full:
            return batch
        if seq_len < self.min_seq_len:
            raise ValueError(
                f"cannot crop retrieval samples to {seq_len} tokens: they need at least {self.min_seq_len} "
                f"(context {self.context_len} + queries {self.query_len})"
            )
        head, tail = seq_len - self.query_len, self.query_len
        return {
            key: torch.cat([value[:, :head], value[:, full - tail :]], dim=1)
            if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == full
            else value
            for key, value in batch.items()
        }


class RetrievalDataset(Dataset):
    """``num_samples`` samples of a :class:`RetrievalTask` for one split, generated when read."""

    def __init__(self, task: RetrievalTask, num_samples: int, split: str = "train") -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples ({num_samples}) must be at least 1")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.task, self.num_samples, self.split = task, num_samples, split

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        return self.task.sample(index, self.split)


class RetrievalDataModule(LongContextDataModule):
    """Key–value retrieval over long contexts (see :class:`RetrievalTask`), generated on the fly.

    Train, validation and test samples come from separate streams of the same seed. Under the fpdt strategy
    Lightning's ``DistributedSampler`` is keyed on the data-parallel rank, so the ranks of a sequence-parallel group
    read the same samples. Chance accuracy: :attr:`chance_accuracy`.

    Args:
        seq_len: tokens per sample (the largest; a ``SequenceLengthCurriculum`` crops filler out of them).
        vocab_size: token ids; must hold 3 specials + keys + values (+ keys × values pair tokens for "one_token").
        num_train: training samples per epoch.
        num_val: validation (and test) samples.
        batch_size: samples per batch and data-parallel group.
        seed: seed of the task; samples are a function of (seed, split, index).
        num_keys: distinct keys.
        num_values: distinct values (chance accuracy 1 / num_values).
        num_pairs: key–value pairs per context.
        num_queries: keys asked at the end of each sample (scored tokens per sample).
        pair_format: ``"one_token"`` (one token per pair; learnt fast) or ``"two_tokens"`` (``key value``).
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        seq_len: int = 256,
        vocab_size: int = 96,
        num_train: int = 100_000,
        num_val: int = 256,
        batch_size: int = 32,
        seed: int = 0,
        *,
        num_keys: int = 8,
        num_values: int = 8,
        num_pairs: int = 8,
        num_queries: int = 8,
        pair_format: PairFormat = "one_token",
        num_workers: int = 0,
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers)
        self.save_hyperparameters()
        self.task = RetrievalTask(
            seq_len=seq_len, vocab_size=vocab_size, num_keys=num_keys, num_values=num_values, num_pairs=num_pairs,
            num_queries=num_queries, pair_format=pair_format, seed=seed,
        )
        self.num_train, self.num_val = num_train, num_val

    @property
    def chance_accuracy(self) -> float:
        return self.task.chance_accuracy

    @property
    def min_seq_len(self) -> int:
        return self.task.min_seq_len

    def crop_batch(self, batch: dict[str, Tensor], seq_len: int) -> dict[str, Tensor]:
        return self.task.crop(batch, seq_len)

    def train_dataloader(self) -> DataLoader:
        return self._loader(RetrievalDataset(self.task, self.num_train, "train"), shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(RetrievalDataset(self.task, self.num_val, "val"), shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(RetrievalDataset(self.task, self.num_val, "test"), shuffle=False)
