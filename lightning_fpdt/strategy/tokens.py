"""Token ids checked against the model's vocabulary before they reach the embedding (docs/design.md §5.9).

An id outside the embedding's rows fails inside the first forward as a bare ``IndexError: index out of range in
self`` on the CPU, and as a device-side assert that takes the CUDA context down on a GPU; neither names the id, where
it is, or the vocabulary. Here each batch costs one min/max of its ids (and of its labels), read before the batch
moves to the device, and the error says all of it. The vocabulary is read once at setup: the rows of the model's
input embedding, else its ``config.vocab_size``. At setup too, a token file's recorded ids are compared with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_fpdt.integrations.discovery import language_models
from lightning_fpdt.sequence.loss import IGNORE_INDEX


@dataclass(frozen=True)
class Vocabulary:
    """The token ids a model accepts, and where that number was read."""

    size: int
    """Ids ``0 … size-1`` are valid."""
    source: str
    """Where ``size`` comes from, for messages (``"the rows of Qwen3ForCausalLM's input embedding"``)."""


def model_vocabulary(model: nn.Module) -> Optional[Vocabulary]:
    """The vocabulary every language model inside ``model`` accepts (``integrations/discovery.py``; a policy beside
    a reference model: the smaller of theirs): a network's input embedding rows (``get_input_embeddings()``, as
    Hugging Face models have), else its ``config.vocab_size``; ``None`` when none says (then nothing is checked)."""
    found = [v for v in map(network_vocabulary, language_models(model)) if v is not None]
    return min(found, key=lambda v: v.size) if found else None


def network_vocabulary(network: nn.Module) -> Optional[Vocabulary]:
    """One network's vocabulary (:func:`model_vocabulary`)."""
    name = type(network).__name__
    get_embeddings = getattr(network, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    if isinstance(embedding, nn.Embedding):
        return Vocabulary(embedding.num_embeddings, f"the rows of {name}'s input embedding")
    size = getattr(getattr(network, "config", None), "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return Vocabulary(size, f"{name}'s config.vocab_size")
    return None


def check_token_ids(batch: Any, vocabulary: Optional[Vocabulary]) -> None:
    """Refuse a batch whose ``input_ids`` are not integers, or whose ids (or labels other than -100) fall outside
    ``vocabulary``, with a ``ValueError`` naming the first such id and its place. One min/max per tensor; a batch
    without ``input_ids`` is left to the strategy's batch check."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        return
    ids = batch["input_ids"]
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(
            f"input_ids must be integer token ids, got dtype {ids.dtype}: return them as torch.long from the dataset "
            f"(a float tensor of ids usually comes from building it with torch.tensor(list_of_floats) or from a "
            f"collate function that stacks them with other fields)"
        )
    if vocabulary is None or ids.numel() == 0:
        return
    _check_range(ids, "input_ids", "token id", vocabulary, ignore=None)
    labels = batch.get("labels")
    if isinstance(labels, Tensor) and labels.numel() and not labels.is_floating_point():
        _check_range(labels, "labels", "label", vocabulary, ignore=IGNORE_INDEX)


def _check_range(values: Tensor, key: str, what: str, vocabulary: Vocabulary, *, ignore: Optional[int]) -> None:
    checked = values if ignore is None else values.masked_fill(values == ignore, 0)
    low, high = (int(v) for v in torch.aminmax(checked))
    if low >= 0 and high < vocabulary.size:
        return
    bad = (checked < 0) | (checked >= vocabulary.size)
    place = tuple(int(i) for i in bad.nonzero()[0])
    value = int(values[place])
    where = f"batch row {place[0]}, token {place[1]} of {values.shape[1]}" if values.dim() == 2 else f"index {place}"
    allowed = f"0 … {vocabulary.size - 1}" + ("" if ignore is None else f", or {ignore} for no target")
    raise ValueError(
        f"batch[{key!r}] holds {what} {value} at {where} (ids in this batch span {low} … {high}); the model's "
        f"vocabulary has {vocabulary.size:,} ids ({allowed}), from {vocabulary.source}. The data were tokenized "
        f"for another vocabulary: tokenize with the model's own tokenizer, or grow the model's embeddings to the "
        f"tokenizer's size (model.resize_token_embeddings(len(tokenizer)) for a Hugging Face model)"
    )


def check_pad_token(pad_token_id: int, vocabulary: Optional[Vocabulary]) -> None:
    """The strategy's padding id must be a token of the model too."""
    if vocabulary is not None and not 0 <= pad_token_id < vocabulary.size:
        raise ValueError(
            f"FPDTStrategy(pad_token_id={pad_token_id}) is outside the model's vocabulary of {vocabulary.size:,} ids "
            f"(from {vocabulary.source}): pass the tokenizer's pad (or EOS) id"
        )


def check_data_vocabulary(datamodule: Any, vocabulary: Optional[Vocabulary]) -> None:
    """Compare the token files a data module reads (``token_files()``: name, largest id, recorded vocabulary and
    tokenizer of each) with the model's vocabulary: an id the file holds that the model lacks is refused now, not at
    the batch that holds it; a file that records only its tokenizer's size is refused when that exceeds the model's
    vocabulary and does not record its largest id."""
    describe = getattr(datamodule, "token_files", None)
    if vocabulary is None or not callable(describe):
        return
    for name, largest, recorded, tokenizer in describe():
        written_with = f"written with the tokenizer {tokenizer!r}, " if tokenizer else ""
        if largest is not None and largest >= vocabulary.size:
            raise ValueError(
                f"token file {name} ({written_with}vocabulary {recorded:,}) holds token ids up to {largest:,}, and "
                f"the model's vocabulary has {vocabulary.size:,} ids (from {vocabulary.source}): tokenize the corpus "
                f"with the model's own tokenizer, or train a model of that vocabulary"
            )
        if largest is None and recorded > vocabulary.size:
            raise ValueError(
                f"token file {name} was {written_with}a vocabulary of {recorded:,} ids, and the model's has "
                f"{vocabulary.size:,} (from {vocabulary.source}): ids past {vocabulary.size - 1} would index past its "
                f"embedding. Tokenize the corpus with the model's own tokenizer"
            )
