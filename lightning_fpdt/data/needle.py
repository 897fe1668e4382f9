"""Needle probes for long-context evaluation: a fact placed at a chosen depth of filler, asked at the end.

A probe sample is ``length`` tokens::

    [BOS]  f f f … f  NEEDLE  f f … f  QUESTION  ANSWER
           \\_ depth·F _/        \\_ (1 − depth)·F _/

with ``F`` filler tokens in all: depth 0 puts the needle at the start of the filler, depth 1 right before the
question. Labels are ``-100`` except at the answer tokens (the trainer shifts them on the global sequence, as the
project's data modules do), so a teacher-forced forward scores the answer: its log-probability (the sum over its
tokens) and whether every one of its tokens is the argmax (exact match). No generation.

Two needles:

- :class:`KeyValueNeedle`: a key–value pair of a :class:`~lightning_fpdt.data.retrieval.RetrievalTask` (the demo's
  vocabulary), asked as ``QUERY key`` and answered by the value: the task the demo trains, one pair at any depth.
- :class:`PasskeyNeedle`: ``"The pass key is 12345. Remember it. 12345 is the pass key."``, asked as ``"What is the
  pass key? The pass key is"`` and answered by the digits; from a tokenizer's encoding of that text, or from raw
  token ids (a model without a tokenizer).

Each sample is a pure function of ``(seed, length, depth, index)``: every rank builds the same probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import numpy as np
import torch
from torch import Tensor

from lightning_fpdt.data.retrieval import RetrievalTask
from lightning_fpdt.sequence.loss import IGNORE_INDEX

PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
"""The filler sentence of the passkey test, repeated (used with a tokenizer when no filler tokens are given)."""


class Needle(Protocol):
    """What a probe asks: ``draw(rng)`` gives the needle, the question and the answer as token ids."""

    chance: float
    """Exact-match rate of a model that cannot see the needle and guesses among the possible answers."""

    def draw(self, rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]: ...


@dataclass(frozen=True)
class KeyValueNeedle:
    """One key–value pair of ``task`` (in its ``pair_format``), asked as ``QUERY key``, answered by the value."""

    task: RetrievalTask

    @property
    def chance(self) -> float:
        return self.task.chance_accuracy

    @property
    def filler_range(self) -> tuple[int, int]:
        """The task's own filler ids ``[low, high)`` (never a key, a value or a pair)."""
        return self.task.filler_start, self.task.vocab_size

    def draw(self, rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]:
        t = self.task
        key, value = int(rng.integers(t.num_keys)), int(rng.integers(t.num_values))
        if t.pair_format == "one_token":
            needle = [t.pair_start + key * t.num_values + value]
        else:
            needle = [t.key_start + key, t.value_start + value]
        return needle, [t.QUERY, t.key_start + key], [t.value_start + value]


@dataclass(frozen=True, kw_only=True)
class PasskeyNeedle:
    """A passkey of ``num_digits`` digits in a sentence: ``prefix digits suffix``, asked by ``question``.

    From raw ids: ``digit_ids`` are the 10 ids of ``"0"`` … ``"9"``; the needle is ``prefix + digits + suffix``, the
    question ``question``, the answer the digits' ids. :meth:`from_tokenizer` builds them from text.
    """

    digit_ids: Sequence[int]
    """The token ids of the digits 0 … 9 (10 distinct ids)."""
    prefix: Sequence[int]
    """Needle tokens before the digits (``"The pass key is"``)."""
    question: Sequence[int]
    """Tokens after the filler, before the answer (``"What is the pass key? The pass key is"``)."""
    suffix: Sequence[int] = ()
    """Needle tokens after the digits (``". Remember it."``)."""
    num_digits: int = 5
    """Digits of the passkey; each is one answer token."""
    answer_prefix: Sequence[int] = field(default=())
    """Answer tokens before the digits (a tokenizer's leading space), scored with them."""

    def __post_init__(self) -> None:
        if len(self.digit_ids) != 10 or len(set(self.digit_ids)) != 10:
            raise ValueError(f"PasskeyNeedle.digit_ids must be the 10 distinct ids of '0' … '9', got "
                             f"{list(self.digit_ids)}")
        if self.num_digits < 1:
            raise ValueError(f"PasskeyNeedle.num_digits ({self.num_digits}) must be at least 1")

    @property
    def chance(self) -> float:
        return 10.0 ** -self.num_digits

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *, num_digits: int = 5) -> "PasskeyNeedle":
        """The passkey sentences encoded by ``tokenizer`` (a Hugging Face tokenizer); each digit must encode as one
        token (true of Llama-3, Qwen, Mistral and most byte-level vocabularies)."""
        def encode(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        digit_ids = []
        for digit in "0123456789":
            ids = encode(digit)
            if len(ids) != 1:
                raise ValueError(f"the tokenizer encodes the digit {digit!r} as {len(ids)} tokens {ids}: the passkey "
                                 f"needs one token per digit; use KeyValueNeedle or PasskeyNeedle(digit_ids=...)")
            digit_ids.append(ids[0])
        space = encode(" 1")  # a leading space may be its own token, or merged into the digit's
        answer_prefix = space[:-1] if len(space) == 2 and space[-1] == digit_ids[1] else []
        return cls(digit_ids=digit_ids, prefix=encode(" The pass key is") + answer_prefix,
                   suffix=encode(". Remember it."), question=encode(" What is the pass key? The pass key is"),
                   num_digits=num_digits, answer_prefix=answer_prefix)

    def draw(self, rng: np.random.Generator) -> tuple[list[int], list[int], list[int]]:
        digits = [int(self.digit_ids[d]) for d in rng.integers(0, 10, size=self.num_digits)]
        needle = [*self.prefix, *digits, *self.suffix]
        return needle, list(self.question), [*self.answer_prefix, *digits]


def check_depths(depths: Sequence[float]) -> None:
    """``ValueError`` unless every depth is in ``[0, 1]`` and there is at least one."""
    if not depths:
        raise ValueError("depths is empty: give at least one depth in [0, 1] (0: the needle first, 1: last)")
    outside = [d for d in depths if not 0.0 <= float(d) <= 1.0]
    if outside:
        raise ValueError(f"depths {outside} are outside [0, 1]: a depth is the needle's place in the filler, 0 at its "
                         f"start and 1 right before the question")


def probe_sample(
    filler: Tensor, needle: Sequence[int], question: Sequence[int], answer: Sequence[int], *, depth: float,
    bos: Optional[int] = None,
) -> dict[str, Tensor]:
    """``{"input_ids": (S,), "labels": (S,)}`` with ``S = [1 +] len(filler)``: the filler's first tokens, the needle
    at ``depth`` of what is left of the filler, the question and the answer at the end; labels the answer only."""
    check_depths([depth])
    fixed = len(needle) + len(question) + len(answer) + (bos is not None)
    room = filler.numel() + (bos is not None) - fixed
    if room < 0:
        raise ValueError(f"a probe of {filler.numel() + (bos is not None)} tokens cannot hold the needle "
                         f"({len(needle)}), the question ({len(question)}) and the answer ({len(answer)}); use longer "
                         f"lengths")
    head = int(round(depth * room))
    pieces = [torch.tensor([bos] if bos is not None else [], dtype=torch.long), filler[:head].long(),
              torch.tensor(list(needle), dtype=torch.long), filler[head:room].long(),
              torch.tensor([*question, *answer], dtype=torch.long)]
    input_ids = torch.cat(pieces)
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[input_ids.numel() - len(answer):] = input_ids[input_ids.numel() - len(answer):]
    return {"input_ids": input_ids, "labels": labels}


def probe_rng(seed: int, length: int, depth_index: int, index: int) -> np.random.Generator:
    """The generator of one probe: a function of ``(seed, length, depth, index)`` only."""
    return np.random.default_rng([seed, length, depth_index, index])


def synthetic_filler(rng: np.random.Generator, length: int, low: int, high: int) -> Tensor:
    """``length`` ids drawn uniformly from ``[low, high)``."""
    return torch.from_numpy(rng.integers(low, high, size=length).astype(np.int64))


def stream_filler(stream: Tensor, length: int, index: int) -> Tensor:
    """Window ``index`` of ``length`` tokens from a token stream (validation text), windows wrapping around it."""
    if stream.numel() < length:
        raise ValueError(f"the filler text has {stream.numel()} tokens, fewer than a probe of {length}: give more "
                         f"validation data, shorter lengths, or filler='synthetic'")
    starts = stream.numel() - length + 1
    start = (index * length) % starts
    return stream[start:start + length]
