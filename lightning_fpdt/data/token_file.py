"""Token files: a flat memory-mapped array of token ids with document boundaries, packed into fixed-length samples.

On disk, for ``--out corpus.bin``:

- ``corpus.bin``: the token ids of every document back to back, raw ``uint16`` (vocabularies up to 65,536) or
  ``uint32``, read with ``numpy.memmap`` (nothing is loaded until a sample is read);
- ``corpus.idx.npy``: ``int64`` document offsets, ``num_documents + 1`` of them (document ``d`` is
  ``tokens[offsets[d]:offsets[d + 1]]``);
- ``corpus.json``: dtype, counts, vocabulary size, the largest id written, EOS id and the tokenizer's name.

``python -m lightning_fpdt.data.tokenize_files`` writes them from text files; :func:`write_token_file` from any
iterable of token-id lists.

Packing: the documents form one stream, cut into consecutive windows of ``seq_len`` tokens (the remainder is
dropped), so a sample can hold the end of one document and the start of the next.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt.data.base import LongContextDataModule
from lightning_fpdt.sequence.loss import IGNORE_INDEX

PathLike = Union[str, Path]


def _paths(path: PathLike) -> tuple[Path, Path, Path]:
    tokens = Path(path)
    stem = tokens.with_suffix("") if tokens.suffix == ".bin" else tokens
    return tokens, stem.with_name(stem.name + ".idx.npy"), stem.with_name(stem.name + ".json")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids ``0 … vocab_size-1``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size ({vocab_size}) must be positive")
    if vocab_size <= 2**16:
        return np.dtype(np.uint16)
    if vocab_size <= 2**32:
        return np.dtype(np.uint32)
    raise ValueError(f"vocab_size ({vocab_size}) does not fit uint32 token ids")


def write_token_file(
    path: PathLike,
    documents: Iterable[Sequence[int]],
    *,
    vocab_size: int,
    eos_token_id: Optional[int] = None,
    tokenizer: Optional[str] = None,
) -> "TokenFile":
    """Write ``documents`` (each a sequence of token ids, EOS included if wanted) as a token file; returns it opened.

    Documents are streamed to disk one at a time; only their offsets are kept in memory.
    """
    tokens_path, index_path, meta_path = _paths(path)
    dtype = token_dtype(vocab_size)
    offsets = [0]
    largest = -1
    tokens_path.parent.mkdir(parents=True, exist_ok=True)
    with open(tokens_path, "wb") as out:
        for document in documents:
            ids = np.asarray(document, dtype=np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(
                    f"document {len(offsets) - 1} has token ids outside [0, {vocab_size}): {ids.min()} … {ids.max()}"
                )
            out.write(ids.astype(dtype).tobytes())
            offsets.append(offsets[-1] + int(ids.size))
            largest = max(largest, int(ids.max())) if ids.size else largest
    np.save(index_path, np.asarray(offsets, dtype=np.int64))
    meta = {
        "format": "lightning_fpdt.token_file/1",
        "dtype": dtype.name,
        "num_tokens": offsets[-1],
        "num_documents": len(offsets) - 1,
        "vocab_size": vocab_size,
        "max_token_id": largest if largest >= 0 else None,
        "eos_token_id": eos_token_id,
        "tokenizer": tokenizer,
    }
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return TokenFile(tokens_path)


class TokenFile:
    """A token file opened for reading: ``tokens`` (memmap), ``offsets`` (document starts + the end), ``meta``."""

    def __init__(self, path: PathLike) -> None:
        tokens_path, index_path, meta_path = _paths(path)
        for needed in (tokens_path, index_path, meta_path):
            if not needed.exists():
                raise FileNotFoundError(
                    f"token file part {needed} is missing; write token files with "
                    "`python -m lightning_fpdt.data.tokenize_files` or lightning_fpdt.data.write_token_file"
                )
        self.path = tokens_path
        self.meta: dict[str, Any] = json.loads(meta_path.read_text())
        self.offsets: np.ndarray = np.load(index_path)
        num_tokens = int(self.offsets[-1])
        if num_tokens != self.meta["num_tokens"]:
            raise ValueError(f"{index_path} ends at {num_tokens} tokens but {meta_path} says {self.meta['num_tokens']}")
        dtype = np.dtype(self.meta["dtype"])
        size = tokens_path.stat().st_size
        if size != num_tokens * dtype.itemsize:
            # a copy or a write cut short (numpy's memmap alone says "mmap length is greater than file size")
            raise ValueError(
                f"{tokens_path} holds {size:,} bytes, but its index {index_path} and {meta_path} say {num_tokens:,} "
                f"{dtype.name} tokens ({num_tokens * dtype.itemsize:,} bytes): the file is truncated or not the one "
                f"its index was written with; copy it again or write it again with "
                f"`python -m lightning_fpdt.data.tokenize_files`"
            )
        self.tokens: np.ndarray = (
            np.memmap(tokens_path, dtype=dtype, mode="r", shape=(num_tokens,))
            if num_tokens
            else np.zeros(0, dtype=dtype)
        )

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def max_token_id(self) -> Optional[int]:
        """The largest id the file holds (``None``: an empty file, or one written before this was recorded)."""
        largest = self.meta.get("max_token_id")
        return None if largest is None else int(largest)

    def document(self, index: int) -> np.ndarray:
        return np.asarray(self.tokens[self.offsets[index] : self.offsets[index + 1]])


class PackedTokenDataset(Dataset):
    """Consecutive ``seq_len``-token windows of a :class:`TokenFile`'s token stream.

    A sample has ``input_ids`` and ``labels`` (the same ids: the strategy, or the model, shifts them) and, when
    asked for, the per-document fields that let a model keep documents apart:

    - ``reset_position_ids``: ``position_ids`` count from 0 at every document start (a document that began before
      the window continues its count), so RoPE sees each document from its own beginning;
    - ``document_ids``: ``document_ids`` number the documents of the window 0, 1, 2, … (for attention that masks
      across documents).

    With either, the first token of every document gets label ``-100``: predicting it from the previous document's
    last token would train across the boundary.
    """

    def __init__(
        self,
        token_file: Union[TokenFile, PathLike],
        seq_len: int,
        *,
        reset_position_ids: bool = False,
        document_ids: bool = False,
        first_sample: int = 0,
        num_samples: Optional[int] = None,
    ) -> None:
        self.file = token_file if isinstance(token_file, TokenFile) else TokenFile(token_file)
        if seq_len < 2:
            raise ValueError(f"seq_len ({seq_len}) must be at least 2")
        available = self.file.num_tokens // seq_len
        num_samples = available - first_sample if num_samples is None else num_samples
        if first_sample < 0 or num_samples < 1 or first_sample + num_samples > available:
            raise ValueError(
                f"{self.file.path} has {self.file.num_tokens} tokens = {available} samples of {seq_len}; samples "
                f"{first_sample} … {first_sample + num_samples - 1} were asked for"
            )
        self.seq_len, self.first_sample, self.num_samples = seq_len, first_sample, num_samples
        self.reset_position_ids, self.document_ids = reset_position_ids, document_ids

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        start = (self.first_sample + index) * self.seq_len
        ids = torch.from_numpy(self.file.tokens[start : start + self.seq_len].astype(np.int64))
        sample = {"input_ids": ids, "labels": ids.clone()}
        if not (self.reset_position_ids or self.document_ids):
            return sample
        positions = np.arange(start, start + self.seq_len)
        document = np.searchsorted(self.file.offsets, positions, side="right") - 1  # global document of each token
        doc_start = self.file.offsets[document]
        starts_document = torch.from_numpy(positions == doc_start)
        sample["labels"][starts_document] = IGNORE_INDEX
        if self.reset_position_ids:
            sample["position_ids"] = torch.from_numpy(positions - doc_start)
        if self.document_ids:
            sample["document_ids"] = torch.from_numpy(document - document[0])
        return sample


class TokenFileDataModule(LongContextDataModule):
    """Language modelling on token files (see :mod:`lightning_fpdt.data.token_file`), packed to ``seq_len``.

    Args:
        train_path: the training token file (``.bin``).
        seq_len: tokens per sample.
        batch_size: samples per batch and data-parallel group.
        val_path: a validation token file; ``None``: the last ``val_samples`` windows of the training file.
        val_samples: windows of the training file held out for validation when ``val_path`` is not given
            (0: no validation).
        reset_position_ids: emit ``position_ids`` that restart at each document (see :class:`PackedTokenDataset`).
        document_ids: emit ``document_ids`` per token.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        train_path: str,
        seq_len: int = 4096,
        batch_size: int = 1,
        *,
        val_path: Optional[str] = None,
        val_samples: int = 0,
        reset_position_ids: bool = False,
        document_ids: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__(seq_len=seq_len, batch_size=batch_size, num_workers=num_workers)
        self.save_hyperparameters()
        if val_samples < 0:
            raise ValueError(f"val_samples ({val_samples}) must be >= 0")
        self.train_path, self.val_path, self.val_samples = train_path, val_path, val_samples
        self._options = dict(reset_position_ids=reset_position_ids, document_ids=document_ids)
        self.train_set: Optional[PackedTokenDataset] = None
        self.val_set: Optional[PackedTokenDataset] = None

    def setup(self, stage: str) -> None:
        train_file = TokenFile(self.train_path)
        held_out = 0 if self.val_path else self.val_samples
        total = train_file.num_tokens // self.seq_len
        if total - held_out < 1:
            raise ValueError(
                f"{self.train_path} has {total} samples of {self.seq_len} tokens; holding out {held_out} for "
                "validation leaves none to train on"
            )
        self.train_set = PackedTokenDataset(train_file, self.seq_len, num_samples=total - held_out, **self._options)
        if self.val_path:
            self.val_set = PackedTokenDataset(self.val_path, self.seq_len, **self._options)
        elif held_out:
            self.val_set = PackedTokenDataset(train_file, self.seq_len, first_sample=total - held_out, **self._options)

    def token_files(self) -> list[tuple[str, Optional[int], int, Optional[str]]]:
        """``(path, largest id, recorded vocabulary, tokenizer)`` of each token file read: what the fpdt strategy
        compares with the model's vocabulary at setup."""
        paths = [self.train_path] + ([self.val_path] if self.val_path else [])
        files = [TokenFile(path) for path in paths]
        return [(str(f.path), f.max_token_id, f.vocab_size, f.meta.get("tokenizer")) for f in files]

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() first"
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> Union[DataLoader, list]:
        return self._loader(self.val_set, shuffle=False) if self.val_set is not None else []

    def test_dataloader(self) -> Union[DataLoader, list]:
        return self.val_dataloader()
