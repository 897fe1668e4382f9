"""Sharding a batch for sequence parallelism: a pure function from the global batch to this rank's tensors and a
frozen :class:`BatchPlan` (docs/design.md §3, §5). The plan carries the layout the batch was sharded with; the
attention of every layer uses that layout instead of rebuilding it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_fpdt.sequence.documents import DocumentBoundaries, document_starts_mask, has_position_resets
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.loss import IGNORE_INDEX, ignore_document_ends, shift_labels

_SHARDED_BY_NAME = ("input_ids", "labels", "shift_labels", "position_ids", "document_ids")
"""Keys :func:`shard_batch` builds itself; every other ``(B, S, ...)`` tensor is sharded as it is."""


@dataclass(frozen=True)
class BatchPlan:
    """What the sharding of one batch decided, for the attention, the loss and the metrics of its step."""

    layout: SequenceLayout
    """The layout the batch was sharded with (chunks included): the one every attention layer uses."""
    batch_size: int
    seq_len: int
    """Global tokens per sequence before padding."""
    documents: Optional[DocumentBoundaries]
    """Packed documents of the global batch, padded like it; ``None``: one document per sequence."""
    position_ids: Tensor
    """Global positions of this rank's tokens ``(B, S/P)``."""
    valid_tokens: Tensor
    """This rank's tokens with a target (a device tensor: reading it would stall the step)."""
    targetless: Tensor
    """Whether no token of the global batch has a target (a device flag, read with the loss check)."""
    token_mask: Optional[Tensor] = None
    """``(B, S/P)``: which of this rank's tokens are the batch's own (``False`` for the padding added here and the
    right padding an ``attention_mask`` drops); ``None`` when nothing is padded."""

    @property
    def padded_len(self) -> int:
        return self.layout.padded_length(self.seq_len)

    @property
    def attention_length(self) -> Optional[float]:
        """``Σ L_d² / S`` of the packed documents (what FLOP counts use for ``S``); ``None``: one per sequence."""
        return self.documents.attention_length() if self.documents is not None else None


def check_batch(batch: Any) -> None:
    """``ValueError`` unless ``batch`` is a mapping with an ``input_ids`` tensor of shape ``(B, S)``."""
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), Tensor):
        raise ValueError(
            "the fpdt strategy shards batches by their 'input_ids' (B, S): return a dict with an 'input_ids' "
            f"tensor from the dataloader (got {type(batch).__name__}"
            f"{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''})"
        )
    if batch["input_ids"].dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence), got shape {tuple(batch['input_ids'].shape)}")


def packed_documents(
    document_ids: Optional[Tensor], position_ids: Tensor, shape: torch.Size
) -> tuple[Optional[DocumentBoundaries], Optional[Tensor]]:
    """The documents of a packed global batch and the ``(B, S)`` mask of their starts; ``(None, None)`` for a batch
    of one document per sequence. From ``document_ids`` when the batch has them, else from ``position_ids`` that
    restart at 0 (one host synchronisation per packed batch, for the start offsets)."""
    if document_ids is not None:
        if not isinstance(document_ids, Tensor) or tuple(document_ids.shape) != tuple(shape):
            raise ValueError(
                f"batch['document_ids'] must be a tensor shaped like input_ids {tuple(shape)} (one document id per "
                f"token), got {tuple(document_ids.shape) if isinstance(document_ids, Tensor) else type(document_ids)}"
            )
        starts = document_starts_mask(document_ids=document_ids)
    else:
        if position_ids.dim() != 2 or position_ids.shape[1] != shape[1] or position_ids.shape[0] not in (1, shape[0]):
            raise ValueError(
                f"batch['position_ids'] must be shaped like input_ids {tuple(shape)} (or (1, S)), got "
                f"{tuple(position_ids.shape)}"
            )
        if not has_position_resets(position_ids):
            return None, None
        starts = document_starts_mask(position_ids=position_ids.expand(shape[0], -1))
    return DocumentBoundaries.from_starts_mask(starts), starts


def check_labels(batch: Mapping[str, Any]) -> None:
    """``ValueError`` unless ``labels`` and ``shift_labels`` (when given) have one entry per token of ``input_ids``."""
    shape = tuple(batch["input_ids"].shape)
    for key in ("labels", "shift_labels"):
        labels = batch.get(key)
        if labels is not None and (not isinstance(labels, Tensor) or tuple(labels.shape) != shape):
            got = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(
                f"batch['{key}'] has shape {got} but input_ids has {shape}: sequences of {shape[1]} tokens need "
                f"{shape[1]} labels each (one per token, {IGNORE_INDEX} where no target counts; the strategy shifts "
                f"them)"
            )


def global_targets(batch: Mapping[str, Any], document_starts: Optional[Tensor]) -> Tensor:
    """Per-token targets of the global batch: ``shift_labels`` as given, else ``labels`` (or the input ids) shifted;
    the last token of every packed document predicts nothing (run alone it has no next token)."""
    check_labels(batch)
    if "shift_labels" in batch:
        targets = batch["shift_labels"]
    else:
        targets = shift_labels(batch.get("labels", batch["input_ids"]))
    return targets if document_starts is None else ignore_document_ends(targets, document_starts)


def shard_batch(
    batch: Mapping[str, Any], *, layout: SequenceLayout, pad_token_id: int = 0, pad_to_multiple: bool = True
) -> tuple[dict[str, Any], BatchPlan]:
    """This rank's part of a global batch ``{"input_ids": (B, S), ...}`` under ``layout``, and the batch's plan.

    The sequence is right-padded to a multiple of ``layout.num_pieces`` (``pad_token_id``, targets -100, positions
    continued; ``pad_to_multiple=False`` raises instead). The result holds ``input_ids``, the global ``position_ids``
    of the local tokens, ``labels`` = ``shift_labels`` (already shifted on the global sequence), ``document_ids``
    when given, and every other ``(B, S, ...)`` tensor sharded alike; other values pass unchanged. An
    ``attention_mask`` that right-pads is dropped, its padding without targets (:func:`right_padding`); other zeros
    are refused (the attention is causal over the whole sequence).
    """
    check_batch(batch)
    input_ids = batch["input_ids"]
    batch_size, seq_len = input_ids.shape
    padded = layout.padded_length(seq_len)
    if padded != seq_len and not pad_to_multiple:
        layout.check_divisible(seq_len)
    real = right_padding(batch.get("attention_mask"), input_ids.shape)
    position_ids = batch.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch_size, -1)
    documents, document_starts = packed_documents(batch.get("document_ids"), position_ids, input_ids.shape)
    if real is not None and "labels" not in batch and "shift_labels" not in batch:
        batch = {**batch, "labels": input_ids.masked_fill(~real, IGNORE_INDEX)}  # the padding is no target
    targets = global_targets(batch, document_starts)
    if real is not None:
        check_padding_targets(targets, real)

    sharded: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _SHARDED_BY_NAME or key == "attention_mask":
            continue
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == (batch_size, seq_len):
            sharded[key] = layout.shard(layout.pad(value, dim=1, value=0), dim=1)  # any other per-token tensor
        else:
            sharded[key] = value
    sharded["input_ids"] = layout.shard(layout.pad(input_ids, dim=1, value=pad_token_id))
    local_targets = layout.shard(layout.pad(targets, dim=1, value=IGNORE_INDEX))
    sharded["labels"] = sharded["shift_labels"] = local_targets
    sharded["position_ids"] = layout.shard(layout.pad_position_ids(position_ids))
    if "document_ids" in batch:
        document_ids = batch["document_ids"]
        pad_document = (document_ids[:, -1:] + 1).expand(-1, padded - seq_len)  # the padding is a document
        sharded["document_ids"] = layout.shard(torch.cat([document_ids, pad_document], dim=1))
    plan = BatchPlan(
        layout=layout, batch_size=batch_size, seq_len=seq_len,
        documents=documents.padded(padded) if documents is not None else None,
        position_ids=sharded["position_ids"], valid_tokens=(local_targets != IGNORE_INDEX).sum(),
        targetless=(targets == IGNORE_INDEX).all(),
        token_mask=own_tokens(layout, real, batch_size=batch_size, seq_len=seq_len, device=input_ids.device),
    )
    return sharded, plan


def right_padding(attention_mask: Any, shape: torch.Size) -> Optional[Tensor]:
    """The tokens an ``attention_mask`` keeps, ``(B, S)`` bool, when it right-pads (each row ones, then zeros);
    ``None`` when it keeps every token (or there is none). Under causal attention no kept token attends to a token
    after it, so dropping a right-padding mask is exact: the kept tokens' outputs are one process's with the mask.
    Zeros anywhere else (left padding, holes) are refused: they hide tokens from the tokens after them."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != tuple(shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask)
        raise ValueError(f"batch['attention_mask'] must be a tensor shaped like input_ids {tuple(shape)}, got {got}")
    kept = attention_mask.bool()
    if bool(kept.all()):
        return None
    if not bool((kept[:, 1:] <= kept[:, :-1]).all()):
        raise ValueError(
            "batch['attention_mask'] has zeros before kept tokens (left padding, or holes): the fpdt attention is "
            "causal over the whole sequence and takes no padding mask, so only right padding (each row ones, then "
            f"zeros) can be dropped exactly: right-pad instead and set the padded labels to {IGNORE_INDEX}"
        )
    return kept


def check_padding_targets(targets: Tensor, kept: Tensor) -> None:
    """``ValueError`` where ``targets`` give a target to the padding a right-padding mask drops
    (:func:`right_padding`): its tokens' outputs differ from one process's with the mask."""
    if bool((targets[~kept] != IGNORE_INDEX).any()):
        raise ValueError(
            f"batch['attention_mask'] has zeros where the labels give targets: a right-padding mask is dropped "
            f"exactly only when its padding has no target, so set the labels to {IGNORE_INDEX} wherever "
            f"attention_mask is 0 (the padded tokens' outputs are the mask's to hide)"
        )


def own_tokens(layout: SequenceLayout, kept: Optional[Tensor], *, batch_size: int, seq_len: int,
               device: torch.device) -> Optional[Tensor]:
    """``(B, S/P)``: which of this rank's tokens are the batch's own, not padding (the strategy's, or the right
    padding an ``attention_mask`` drops); ``None`` when every token is."""
    padded = layout.padded_length(seq_len)
    if padded == seq_len and kept is None:
        return None
    own = (torch.arange(padded, device=device) < seq_len).expand(batch_size, -1)
    if kept is not None:
        own = own & layout.pad(kept, dim=1, value=False)
    return layout.shard(own)


def padding_message(plan: BatchPlan) -> str:
    """What the log says, once per length and padded length, when sequences are padded."""
    layout = plan.layout
    return (
        f"fpdt: padding sequences of {plan.seq_len} tokens to {plan.padded_len} (a multiple of {layout.num_pieces}: "
        f"sequence_parallel_size {layout.sp_size} × chunks {layout.num_chunks}"
        + (" × 2 for the ring's head-tail pieces" if layout.ring_size > 1 else "")
        + f"); padded labels are {IGNORE_INDEX}"
    )


def length_message(seq_len: int, resolved: Any, options: Any, sp_size: int, free_bytes: Optional[int]) -> str:
    """What the log says, once per length, of the options resolved for it (``resolved``) from ``options``."""
    return (f"fpdt: sequences of {seq_len} tokens: chunks={resolved.chunks} ({options.chunks!r}), "
            f"offload={resolved.offload} ({options.offload!r}), sequence_parallel_size={sp_size}"
            + (f", planned for {free_bytes / 2**30:.1f} GiB free" if free_bytes else ""))


class BatchStep:
    """The per-batch step both strategies take before a forward (docs/design.md §5): the batch's length planned
    when it is new, or its plan run on again (before the forward pins host memory); the batch sharded
    (:func:`shard_batch`) with the chunks it runs with; the plan handed whole to the model's installed wrappers in one
    call (``context.begin_batch``). What the log says of batches is said once each: a new length's options, a
    length's padding (through ``log``)."""

    def __init__(self, *, pad_token_id: int, pad_to_multiple: bool, log: Callable[[str], Any]) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple = pad_to_multiple
        self._log = log
        self._lengths: set[tuple[int, Any]] = set()
        self._paddings: set[tuple[int, int]] = set()  # (length, padded length)

    def __call__(self, batch: Mapping[str, Any], *, memory: Any, context: Any, sp_size: int, sp_rank: int,
                 ring_size: int, training: bool = False) -> tuple[dict[str, Any], BatchPlan]:
        """This rank's share of ``batch`` (on its device already) and the batch's plan. ``memory``: the run's
        :class:`~lightning_fpdt.strategy.budget.MemoryBudget`; ``context``: the installed
        :class:`~lightning_fpdt.integrations.SequenceParallelContext`; ``training``: a training batch (a plan trial
        times it)."""
        batch_size, seq_len = batch["input_ids"].shape
        # planned before the forward pins host memory
        options = memory.begin_length(seq_len, batch_size, training=training)
        self.say_length(seq_len, options, memory.options, sp_size, memory.free_bytes)
        layout = SequenceLayout(sp_size, sp_rank, options.chunks, ring_size=ring_size)
        sharded, plan = shard_batch(batch, layout=layout, pad_token_id=self.pad_token_id,
                                    pad_to_multiple=self.pad_to_multiple)
        context.begin_batch(plan, offload=options.offload, offload_dq=options.offload_dq)
        self.say_padding(plan)
        return sharded, plan

    def say_length(self, seq_len: int, resolved: Any, options: Any, sp_size: int, free_bytes: Optional[int]) -> None:
        if (seq_len, resolved) not in self._lengths:
            self._lengths.add((seq_len, resolved))
            self._log(length_message(seq_len, resolved, options, sp_size, free_bytes))

    def say_padding(self, plan: BatchPlan) -> None:
        padding = (plan.seq_len, plan.padded_len)
        if plan.padded_len != plan.seq_len and padding not in self._paddings:
            self._paddings.add(padding)
            self._log(padding_message(plan))
