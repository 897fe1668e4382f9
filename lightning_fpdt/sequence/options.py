"""The attention options of a run, validated once, and the one resolver of their ``"auto"`` values.

:class:`FPDTOptions` is what ``FPDTStrategy(...)``, :func:`lightning_fpdt.planner.plan_memory` and
``lightning-fpdt plan`` take for the attention (chunks, offload, head groups, ring, kernel): all three validate
through it, and all three turn ``"auto"`` into numbers through :meth:`FPDTOptions.resolve`, so a plan and the run it
plans resolve alike. The byte counts the resolver compares live in :mod:`lightning_fpdt.sequence.planning`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional, Union

from lightning_fpdt.flops import is_count
from lightning_fpdt.sequence.kernels import AttentionBackend, check_backend_name
from lightning_fpdt.sequence.planning import (
    MAX_CHUNK_TOKENS,
    AttentionGeometry,
    choose_chunks,
    choose_offload,
    choose_offload_dq,
)
from lightning_fpdt.sequence.ring_rules import RING_RULES, check_ring, ring_refusal

Auto = Literal["auto"]


def check_positive_int(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is a positive int (``True`` is not one)."""
    if not is_count(value):
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_auto_or_positive_int(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is ``"auto"`` or a positive int."""
    if value != "auto" and (not is_count(value)):
        raise ValueError(f"{name} must be 'auto' or a positive int, got {value!r}")


def check_switch(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is ``"auto"``, ``True`` or ``False``."""
    if value not in ("auto", True, False):
        raise ValueError(f"{name} must be 'auto', True or False, got {value!r}")


class ResolvedOptions(NamedTuple):
    """The attention options of one sequence length, every ``"auto"`` decided."""

    chunks: int
    offload: bool
    offload_dq: bool


@dataclass(frozen=True, kw_only=True)
class FPDTOptions:
    """How the attention runs: chunks, host offload, head groups, the ring and the kernel (keyword-only)."""

    chunks: Union[Auto, int] = "auto"
    """FPDT chunks per rank ``u``; ``"auto"``: the fewest whose working set fits a sixteenth of the free GPU memory,
    at most 65,536 global tokens per chunk. ``1`` is plain Ulysses."""
    offload: Union[Auto, bool] = "auto"
    """Keep the attention's chunks in pinned host memory between forward and backward; ``"auto"``: when all layers'
    chunks would take more than a quarter of the free GPU memory (never without a GPU)."""
    offload_dq: Union[Auto, bool] = "auto"
    """Keep the backward's fp32 partial dQ sums in host memory too; ``"auto"``: when the chunks are offloaded and
    those sums would take more than an eighth of the free GPU memory."""
    head_chunks: Union[Auto, int] = 1
    """Head groups ``G``: projections and attention run on ``H/G`` query heads at a time; ``"auto"``: chosen with
    the memory features by the strategy's search (``lightning_fpdt.planner.search``), 1 where nothing plans."""
    ring_size: Union[Auto, int] = "auto"
    """Ring ranks ``R`` of a Ulysses × ring sequence mesh; ``"auto"``: 1 unless the heads need a ring."""
    attention_backend: AttentionBackend = "auto"
    """Block kernel: ``"auto"``, ``"cudnn"``, ``"flash"`` or ``"math"``."""

    def __post_init__(self) -> None:
        check_auto_or_positive_int("chunks", self.chunks)
        check_switch("offload", self.offload)
        check_switch("offload_dq", self.offload_dq)
        check_auto_or_positive_int("head_chunks", self.head_chunks)
        check_auto_or_positive_int("ring_size", self.ring_size)
        check_backend_name(self.attention_backend)
        if isinstance(self.ring_size, int) and self.ring_size > 1:
            self.check_ring(self.ring_size)

    def check_ring(self, ring_size: int) -> None:
        """Options the ring does not compose with yet are refused (:data:`~lightning_fpdt.sequence.ring_rules.
        RING_RULES`), not silently ignored."""
        check_ring(ring_size, chunks=self.chunks, offload_dq=self.offload_dq)

    @property
    def allows_ring(self) -> bool:
        """Whether the options given compose with a ring: where they do not, ``ring_size="auto"`` stays without one
        when the heads allow that."""
        return ring_refusal(2, chunks=self.chunks, offload_dq=self.offload_dq) is None

    @property
    def fixed_head_chunks(self) -> int:
        """``head_chunks`` where nothing plans it: the value given, 1 for ``"auto"``."""
        return 1 if self.head_chunks == "auto" else self.head_chunks

    def resolve(
        self, geometry: Optional[AttentionGeometry], *, batch_size: int, seq_len: int, sp_size: int,
        ring_size: int = 1, free_bytes: Optional[int] = None,
    ) -> ResolvedOptions:
        """Chunks and offload for sequences of ``seq_len`` global tokens: the options as given, ``"auto"`` sized
        from the attention's ``geometry`` (one head group's under ``head_chunks``) and ``free_bytes`` of GPU memory.
        Without a GPU (``free_bytes`` or ``geometry`` ``None``) auto chunks keep at most 65,536 tokens per chunk and
        auto offload is off. With a ring, auto chunks are 1 and auto dQ offload off (not composed with the ring)."""
        planned = free_bytes is not None and geometry is not None
        size = dict(batch_size=batch_size, seq_len=seq_len, sp_size=sp_size)
        chunks = self.chunks
        if chunks == "auto":
            if ring_size > 1:
                chunks = RING_RULES["chunks"].with_ring
            elif planned:
                chunks = choose_chunks(geometry, free_bytes=free_bytes, **size)
            else:
                chunks = max(1, math.ceil(seq_len / MAX_CHUNK_TOKENS))
        offload = self.offload
        if offload == "auto":
            offload = planned and choose_offload(geometry, free_bytes=free_bytes, ring_size=ring_size, **size)
        offload_dq = self.offload_dq
        if offload_dq == "auto":
            offload_dq = (RING_RULES["offload_dq"].with_ring if ring_size > 1 else
                          offload and planned and choose_offload_dq(geometry, free_bytes=free_bytes, **size))
        return ResolvedOptions(chunks=chunks, offload=bool(offload), offload_dq=bool(offload_dq))
