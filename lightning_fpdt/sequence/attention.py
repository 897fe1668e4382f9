"""The attention models call: :func:`fpdt_attention` and the handles a strategy installs (docs/design.md §4).

:func:`fpdt_attention` takes the sequence-parallel group as one process group (FPDT's chunk pipeline,
:mod:`lightning_fpdt.sequence.fpdt`) or as a ``(ulysses_group, ring_group)`` pair (the Ulysses × ring hybrid,
:mod:`lightning_fpdt.sequence.ring`). :class:`FPDTAttention` binds it to a group and options for a whole model, and
receives the per-batch layout from the strategy (:meth:`FPDTAttention.begin_batch`) instead of rebuilding it;
each attention layer calls it through a :class:`LayerAttention` handle, which under activation checkpointing keeps
the first forward's output and chunks for the recompute, so the attention never runs twice.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_fpdt.sequence import fpdt, ring
from lightning_fpdt.sequence.blocks import FirstPass, in_backward
from lightning_fpdt.sequence.documents import DocumentBoundaries
from lightning_fpdt.sequence.host_stash import ChunkStash, StashFactory
from lightning_fpdt.sequence.kernels import check_backend_name
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.options import check_positive_int

SequenceGroup = Union[dist.ProcessGroup, tuple[dist.ProcessGroup, dist.ProcessGroup], None]
"""A process group (FPDT over it), a ``(ulysses_group, ring_group)`` pair (the hybrid) or ``None`` (the default
group, or one process)."""

Plan = Union[fpdt.FPDTPlan, ring.RingPlan]


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
            ``(ulysses_group, ring_group)`` pair: the Ulysses × ring hybrid (:func:`~lightning_fpdt.sequence.ring.
            ring_attention`) for more ranks than heads.
        num_chunks: FPDT chunks per rank ``u``; ``1`` is Ulysses.
        backend: block kernel, one of ``"auto"``, ``"math"``, ``"flash"``, ``"cudnn"``.
        stashes: where chunks wait for the backward (:class:`StashFactory`; default: device memory).
        documents: packed documents of the *global* (padded) sequences (:class:`DocumentBoundaries`): a token
            attends only to earlier tokens of its own document; ``None``: one document per sequence.

    Returns:
        ``(B, S/P, H, D)``, this rank's tokens of the attention output.
    """
    if isinstance(group, tuple):
        _refuse_ring_documents(documents)
        return ring.ring_attention(query, key, value, causal=causal, scale=scale, group=group, num_chunks=num_chunks,
                                   backend=backend, stashes=stashes)
    return fpdt.fpdt_chunk_attention(query, key, value, causal=causal, scale=scale, group=group,
                                     num_chunks=num_chunks, backend=backend, stashes=stashes, documents=documents)


def _refuse_ring_documents(documents: Optional[DocumentBoundaries]) -> None:
    if documents is not None:
        raise ValueError("packed documents are not supported with ring_size > 1 yet: use ring_size=1")


def _run(query: Tensor, key: Tensor, value: Tensor, plan: Plan, stashes: StashFactory, save: bool,
         first_pass: Optional[FirstPass] = None) -> Tensor:
    """The autograd function of ``plan``: FPDT's, or the ring hybrid's."""
    run = fpdt.run_plan if isinstance(plan, fpdt.FPDTPlan) else ring.run_ring_plan
    return run(query, key, value, plan, stashes, save, first_pass)


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

    def plan(self, query: Tensor, key: Tensor, value: Tensor, causal: bool, scale: Optional[float]) -> Plan:
        """FPDT's plan, or the ring hybrid's for a ``(ulysses_group, ring_group)`` pair."""
        if isinstance(self.group, tuple):
            _refuse_ring_documents(self.documents)
            return ring.make_ring_plan(query, key, value, causal=causal, scale=scale, group=self.group,
                                       num_chunks=self.num_chunks, backend=self.backend, layout=self.layout)
        return fpdt.make_plan(query, key, value, causal=causal, scale=scale, group=self.group,
                              num_chunks=self.num_chunks, backend=self.backend, documents=self.documents,
                              layout=self.layout)

    def __call__(self, query: Tensor, key: Tensor, value: Tensor, *, causal: bool = True,
                 scale: Optional[float] = None) -> Tensor:
        self.kernel_calls += 1
        save = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
        return _run(query, key, value, self.plan(query, key, value, causal, scale), self.stashes, save)

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
        forward = fpdt.fpdt_forward if isinstance(plan, fpdt.FPDTPlan) else ring.hybrid_forward
        out = forward(query, key, value, plan, stash, save_for_backward=True)
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
        return _run(query, key, value, first_pass.plan, self.shared.stashes, True, first_pass)

    def discard(self) -> None:
        """Drop what a first pass kept (its graph was discarded without a backward)."""
        if self._first_pass is not None:
            self._first_pass.stash.clear()
            self._kept_out.clear()
        self._first_pass = self._kept_out = None

    def __repr__(self) -> str:
        return f"LayerAttention({self.shared!r})"
