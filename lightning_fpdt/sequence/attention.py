"""The attention models call, and the one place an algorithm is chosen (docs/design.md §4, docs/ring.md).

:func:`plan_attention` is the dispatch: from the group (and the batch's layout) it validates the call for FPDT's
chunk pipeline (:mod:`lightning_fpdt.sequence.fpdt`; one chunk is Ulysses) or for the Ulysses × ring hybrid
(:mod:`lightning_fpdt.sequence.ring`), and returns that algorithm's plan; a plan runs itself (``plan.apply``: the
attention with its backward; ``plan.forward``: the forward alone, for a checkpoint's first pass). Every caller goes
through it: :func:`fpdt_attention`, :func:`ring_attention`, ``ulysses_attention``, and :class:`FPDTAttention`, which
binds it to a group and options for a whole model and receives the per-batch layout from the strategy
(:meth:`FPDTAttention.begin_batch`); each attention layer calls that through a :class:`LayerAttention` handle, which
under activation checkpointing keeps the first forward's output and chunks for the recompute, so the attention never
runs twice.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.offload.host_stash import ChunkStash, StashFactory
from lightning_fpdt.sequence import fpdt, ring
from lightning_fpdt.sequence.blocks import FirstPass, in_backward
from lightning_fpdt.sequence.documents import DocumentBoundaries
from lightning_fpdt.sequence.kernels import check_backend_name
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.options import check_positive_int
from lightning_fpdt.sequence.ring_rules import check_ring

SequenceGroup = Union[dist.ProcessGroup, tuple[dist.ProcessGroup, dist.ProcessGroup], None]
"""A process group (FPDT over it), a ``(ulysses_group, ring_group)`` pair (the hybrid) or ``None`` (the default
group, or one process)."""

Plan = Union[fpdt.FPDTPlan, ring.RingPlan]
"""One validated call of one algorithm: ``plan.apply(q, k, v, stashes, save, first_pass)`` runs it with its
backward, ``plan.forward(q, k, v, stash, save_for_backward)`` its forward alone."""


def ring_size_of(group: SequenceGroup) -> int:
    """``R``: ranks of the group's ring; 1 for one process group (or ``None``)."""
    return ring.split_groups(group)[3] if isinstance(group, tuple) else 1


def plan_attention(
    query: Tensor, key: Tensor, value: Tensor, *, causal: bool, scale: Optional[float], group: SequenceGroup,
    num_chunks: int, backend: str, documents: Optional[DocumentBoundaries] = None,
    layout: Optional[SequenceLayout] = None,
) -> Plan:
    """The one dispatch: the plan of the algorithm that runs this call.

    - ``group`` a ``(ulysses_group, ring_group)`` pair whose ring has ``R > 1`` ranks: the Ulysses × ring hybrid,
      after the ring's rules (:data:`~lightning_fpdt.sequence.ring_rules.RING_RULES`) refuse what it does not compose
      with (packed documents here; chunks in its layout);
    - otherwise FPDT's chunk pipeline over the group (over the Ulysses group of a pair with ``R = 1``); ``u = 1`` is
      Ulysses.

    ``layout``: the batch's layout (the strategy builds it once per batch; its chunks then win); ``None``: built from
    the group and ``num_chunks``."""
    ring_size = ring_size_of(group)
    if ring_size > 1:
        check_ring(ring_size, documents=documents)
        return ring.make_ring_plan(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                                   backend=backend, layout=layout)
    if isinstance(group, tuple):
        group = group[0]
    return fpdt.make_plan(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                          backend=backend, documents=documents, layout=layout)


def attend(query: Tensor, key: Tensor, value: Tensor, plan: Plan, stashes: StashFactory,
           first_pass: Optional[FirstPass] = None) -> Tensor:
    """Run ``plan`` with its backward; what the backward needs is kept when autograd will ask for it."""
    # decided here: inside Function.forward grad mode is always off
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    if first_pass is not None and not needs_grad:
        # a recompute whose q, k, v need no gradient (frozen projections on a frozen input): no backward will read
        # the first pass's chunks, which go now; its output is the value
        first_pass.stash.clear()
        return first_pass.out
    return plan.apply(query, key, value, stashes, needs_grad or first_pass is not None, first_pass)


def fpdt_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    group: SequenceGroup = None,
    num_chunks: int = 1,
    backend: str = "auto",
    stashes: Optional[StashFactory] = None,
    documents: Optional[DocumentBoundaries] = None,
) -> Tensor:
    """Exact causal attention of a sequence-sharded batch over the sequence-parallel ``group``.

    Args:
        query: ``(B, S/P, H, D)``, this rank's tokens in :class:`SequenceLayout` order, RoPE applied.
        key, value: ``(B, S/P, Hkv, D)``.
        causal: must be ``True``: FPDT's schedule is the causal one.
        scale: softmax scale, ``D ** -0.5`` by default.
        group: the sequence-parallel process group (``None``: the default group, or one process), or a
            ``(ulysses_group, ring_group)`` pair: the Ulysses × ring hybrid (:func:`ring_attention`) for more ranks
            than heads.
        num_chunks: FPDT chunks per rank ``u``; ``1`` is Ulysses.
        backend: block kernel, one of ``"auto"``, ``"math"``, ``"flash"``, ``"cudnn"``.
        stashes: where chunks wait for the backward (:class:`StashFactory`; default: device memory).
        documents: packed documents of the *global* (padded) sequences (:class:`DocumentBoundaries`): a token
            attends only to earlier tokens of its own document; ``None``: one document per sequence.

    Returns:
        ``(B, S/P, H, D)``, this rank's tokens of the attention output.
    """
    plan = plan_attention(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                          backend=backend, documents=documents)
    return attend(query, key, value, plan, stashes or StashFactory())


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    scale: Optional[float] = None,
    group: ring.SequenceGroups,
    num_chunks: int = 1,
    backend: str = "auto",
    stashes: Optional[StashFactory] = None,
    layout: Optional[SequenceLayout] = None,
) -> Tensor:
    """Exact causal attention of a sequence-sharded batch over a 2-D ``(ulysses_group, ring_group)``.

    Args:
        query: ``(B, S/P, H, D)``, this rank's tokens in :class:`SequenceLayout` order with ``ring_size = R``
            (``P = U·R``, ring-major ranks), RoPE applied.
        key, value: ``(B, S/P, Hkv, D)``.
        causal: must be ``True``.
        scale: softmax scale, ``D ** -0.5`` by default.
        group: ``(ulysses_group, ring_group)`` (``new_sequence_groups``, or the strategy's mesh axes).
        num_chunks: FPDT chunks; only ``1`` composes with ``R > 1`` so far. With ``R = 1`` this is
            FPDT's chunk pipeline over the Ulysses group.
        backend: block kernel, as for FPDT.
        stashes: where the shares wait for the backward (:class:`StashFactory`; default: device memory; with
            ``offload=True`` pinned host memory).
        layout: the batch's :class:`SequenceLayout`; ``None``: built from the groups.

    Returns:
        ``(B, S/P, H, D)``, this rank's tokens of the attention output.
    """
    ring.split_groups(group)  # a pair, or a ValueError naming new_sequence_groups
    plan = plan_attention(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                          backend=backend, layout=layout)
    return attend(query, key, value, plan, stashes or StashFactory())


class FPDTAttention:
    """:func:`fpdt_attention` bound to a group and options: what a strategy installs in a model.

    One instance serves a whole model (it owns the host buffer pool and the copy streams); each attention layer
    calls it through its own :meth:`for_layer` handle. Under activation checkpointing (``recording`` is set while a
    checkpoint runs a block's first, no-grad forward) a layer computes attention once, keeps its output and chunks,
    and the recompute in backward gets them back instead of running attention again.
    """

    def __init__(
        self,
        *,
        group: SequenceGroup = None,
        num_chunks: int = 1,
        backend: str = "auto",
        offload: bool = False,
        offload_dq: bool = False,
        head_chunks: int = 1,
    ) -> None:
        check_backend_name(backend)
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        check_positive_int("head_chunks", head_chunks)
        self.group = group
        self._num_chunks = num_chunks
        self.head_chunks = head_chunks
        """Head groups G: the layers the strategy installs run projection, attention and output projection per group
        of ``H/G`` query heads (``lightning_fpdt.integrations.head_groups``); 1 is one group of all heads."""
        self.backend = backend
        self.stashes = StashFactory(offload=offload, offload_dq=offload_dq)
        self.layout: Optional[SequenceLayout] = None
        """The current batch's layout, from the strategy's batch plan; ``None``: built from the group per call."""
        self.recording = False
        """Set by a checkpoint around a block's first forward: keep what the recompute will need."""
        self.regenerating = False
        """Set by a checkpoint around a forward run again in the backward to regenerate block inputs (partial
        residency): a layer whose first pass was recorded returns that output without consuming it (its own
        recompute replays it later); one that recorded nothing computes the attention, keeping nothing."""
        self.kernel_calls = 0
        """Attention computations run (a recompute served from the first forward does not count)."""
        self.documents: Optional[DocumentBoundaries] = None
        """Packed documents of the current batch (set per batch by the strategy); ``None``: plain causal."""

    @property
    def num_chunks(self) -> int:
        """FPDT chunks per rank: the batch layout's, else the constructor's."""
        return self.layout.num_chunks if self.layout is not None else self._num_chunks

    @property
    def offload(self) -> bool:
        return self.stashes.offload

    @offload.setter
    def offload(self, value: bool) -> None:
        self.stashes.offload = value

    def begin_batch(self, layout: SequenceLayout, *, documents: Optional[DocumentBoundaries], offload: bool,
                    offload_dq: bool) -> None:
        """What every layer's attention uses for the coming batch: the layout the batch was sharded with (chunks
        included), its packed documents (padded like it) and where the chunks wait for the backward."""
        self.layout = layout
        self.documents = documents
        self.stashes.offload = offload
        self.stashes.offload_dq = offload_dq

    @property
    def ring_size(self) -> int:
        """``R``: ranks of the group's ring (1: FPDT over one group)."""
        return ring_size_of(self.group)

    def plan(self, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: Optional[float]) -> Plan:
        """The plan of this call (:func:`plan_attention`) with the batch's layout and documents."""
        return plan_attention(query, key, value, causal=causal, scale=scale, group=self.group,
                              num_chunks=self.num_chunks, backend=self.backend, documents=self.documents,
                              layout=self.layout)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True,
                 scale: Optional[float] = None) -> Tensor:
        self.kernel_calls += 1
        return attend(query, key, value, self.plan(query, key, value, causal, scale), self.stashes)

    def for_layer(self) -> "LayerAttention":
        return LayerAttention(self)

    def __repr__(self) -> str:
        return (f"FPDTAttention(num_chunks={self.num_chunks}, backend={self.backend!r}, offload={self.offload}, "
                f"head_chunks={self.head_chunks})")


def check_document_ids(shared: FPDTAttention, document_ids: Optional[Tensor]) -> None:
    """A model passing ``document_ids`` (it masks documents single-process) needs the strategy to have found the
    documents of the global batch: the local ids cannot say where a document continues on another rank."""
    if document_ids is not None and shared.documents is None:
        raise ValueError(
            "the model passes document_ids to its attention, but the fpdt strategy found neither 'document_ids' "
            "nor position_ids restarting at 0 in the batch: put them in the dict the dataloader returns (e.g. "
            "PackedTokenDataset(document_ids=True)), so the strategy sees every document of the global sequence"
        )


class LayerAttention:
    """One layer's handle on a shared :class:`FPDTAttention` (see there)."""

    def __init__(self, shared: FPDTAttention) -> None:
        self.shared = shared
        self._first_pass: Optional[FirstPass] = None
        self._kept_out: Optional[ChunkStash] = None  # the first pass's output, on the host when offloading

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True, scale: Optional[float] = None,
                 document_ids: Optional[Tensor] = None) -> Tensor:
        shared = self.shared
        check_document_ids(shared, document_ids)
        if shared.regenerating:
            # the recorded output, as the first forward returned it; the record stays for the layer's recompute
            return self.kept_output() if self._first_pass is not None else shared(query, key, value, causal=causal,
                                                                                  scale=scale)
        if self._first_pass is not None and in_backward():
            return self._replay(query, key, value)
        if not shared.recording:
            return shared(query, key, value, causal=causal, scale=scale)
        # a checkpoint's first forward (no grad)
        return self.record(query, key, value, causal=causal, scale=scale)

    def record(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True,
               scale: Optional[float] = None) -> Tensor:
        """Compute the attention now (no graph) and stash as for a backward, keeping the output: a later call
        inside a backward takes both back instead of computing again. What a checkpoint's first forward does, and
        what each head group of ``lightning_fpdt.integrations.head_groups`` does."""
        shared = self.shared
        self.discard()
        shared.kernel_calls += 1
        plan = shared.plan(query, key, value, causal, scale)
        stash = shared.stashes.chunks(query.device)
        out = plan.forward(query, key, value, stash, save_for_backward=True)
        self._kept_out = shared.stashes.chunks(out.device)  # host memory when offloading
        self._kept_out.put("out", out)
        self._first_pass = FirstPass(plan=plan, stash=stash, out=None)  # out comes back from _kept_out in _replay
        return out

    @property
    def recorded(self) -> bool:
        """A first pass is kept and waits for its replay."""
        return self._first_pass is not None

    def kept_output(self) -> Tensor:
        """The recorded output, resident (a head group's recomputed forward sums its output projection from it);
        the kept copy stays for the replay."""
        if self._first_pass is None:
            raise RuntimeError("kept_output called without a recorded first pass (record first)")
        out = self._kept_out.get("out")
        self._kept_out.release("out")
        return out

    def _replay(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        first_pass, kept = self._first_pass, self._kept_out
        self._first_pass = self._kept_out = None
        first_pass.out = kept.get("out")
        kept.release("out")
        kept.free("out")
        return attend(query, key, value, first_pass.plan, self.shared.stashes, first_pass)

    def discard(self) -> None:
        """Drop what a first pass kept (its graph was discarded without a backward)."""
        if self._first_pass is not None:
            self._first_pass.stash.clear()
            self._kept_out.clear()
        self._first_pass = self._kept_out = None

    def __repr__(self) -> str:
        return f"LayerAttention({self.shared!r})"
