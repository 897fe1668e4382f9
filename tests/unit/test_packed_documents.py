"""Packed documents: boundaries from ids or position resets, block segmentation and skipping (kernel calls
counted), the reference Llama on a packed batch, and every misuse a ValueError naming the fix."""

import pytest
import torch

from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM, sdpa_attention
from lightning_fpdt.offload.host_stash import ChunkStash
from lightning_fpdt.sequence import FPDTAttention, fpdt_attention
from lightning_fpdt.sequence import fpdt as fpdt_module
from lightning_fpdt.sequence.documents import (
    BlockPlan,
    DocumentBoundaries,
    Segment,
    document_ids_from_positions,
    document_starts_mask,
)
from lightning_fpdt.sequence.kernels import MathKernel
from lightning_fpdt.strategy.batch import packed_documents
from tests.reference import documents_separately


def test_boundaries_from_ids_and_positions_agree():
    """document_ids and position resets give the same starts; padding is a document of its own."""
    document_ids = torch.tensor([[0, 0, 1, 1, 1, 4, 5], [2, 2, 2, 2, 2, 2, 2]])
    positions = torch.tensor([[7, 8, 0, 1, 2, 0, 0], [3, 4, 5, 6, 7, 8, 9]])  # a document begun earlier continues
    from_ids = DocumentBoundaries.from_document_ids(document_ids)
    assert from_ids == DocumentBoundaries.from_position_ids(positions)
    assert from_ids.starts == ((0, 2, 5, 6), (0,)) and from_ids.seq_len == 7
    padded = from_ids.padded(8)
    assert padded.starts == ((0, 2, 5, 6, 7), (0, 7)) and padded.seq_len == 8
    assert padded.document_ids().tolist() == [[0, 0, 1, 1, 1, 2, 3, 4], [0] * 7 + [1]]
    assert document_ids_from_positions(positions).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0] * 7]


def test_block_plans_skip_plain_and_segments():
    """A block is skipped without a shared document, one call inside one document, one per document otherwise;
    equal consecutive batch items share their calls."""
    documents = DocumentBoundaries(((0, 5, 6, 13), (0, 5, 6, 13), (0,)), 16)
    # below the diagonal: q [8, 12) is inside document [6, 13), kv [0, 4) inside [0, 5): nothing for items 0, 1
    assert documents.block_plans((8, 12), (0, 4)) == [BlockPlan(2, 3, (Segment(0, 4, 0, 4, causal=False),))]
    # diagonal: three documents meet in [4, 8) for items 0 and 1
    diagonal = [Segment(0, 1, 0, 1, True), Segment(1, 2, 1, 2, True), Segment(2, 4, 2, 4, True)]
    assert documents.block_plans((4, 8), (4, 8)) == [BlockPlan(0, 2, tuple(diagonal)),
                                                      BlockPlan(2, 3, (Segment(0, 4, 0, 4, True),))]
    # q row 12 (the end of [6, 13)) reads keys [6, 8) of kv chunk [4, 8); rows 13.. belong to a later document
    assert documents.block_plans((12, 16), (4, 8))[0] == BlockPlan(0, 2, (Segment(0, 1, 2, 4, causal=False),))


class CountingKernel(MathKernel):
    """The math kernel, recording every call as (direction, causal, q rows, keys)."""

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def forward(self, q, k, v, *, causal, scale):
        self.calls.append(("fwd", causal, q.shape[2], k.shape[2]))
        return super().forward(q, k, v, causal=causal, scale=scale)

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        self.calls.append(("bwd", causal, q.shape[2], k.shape[2]))
        return super().backward(dout, q, k, v, out, lse, causal=causal, scale=scale)


def _count_calls(monkeypatch, documents, seq_len=16, num_chunks=4, stash_gets: list | None = None) -> list:
    calls = []
    monkeypatch.setattr(fpdt_module, "make_kernel", lambda *args: CountingKernel(calls))
    if stash_gets is not None:
        get = ChunkStash.get
        monkeypatch.setattr(ChunkStash, "get", lambda self, key: stash_gets.append(key) or get(self, key))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, 2, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    out = fpdt_attention(q, k, v, num_chunks=num_chunks, backend="math", documents=documents)
    out.backward(torch.randn(out.shape, generator=gen, dtype=torch.float64))
    if documents is not None:  # the calls computed the right thing
        ref = documents_separately(q.detach(), k.detach(), v.detach(), [list(documents.starts[0])])
        torch.testing.assert_close(out.detach(), ref, rtol=1e-10, atol=1e-10)  # fp64: summation order only
    return calls


def test_blocks_without_shared_documents_are_skipped(monkeypatch):
    """S = 16, 4 chunks of 4, documents [0,5) [5,6) [6,13) [13,16): the kernel runs exactly the segments listed,
    and the chunks of skipped blocks are never fetched from the stash."""
    stash_gets = []
    calls = _count_calls(monkeypatch, DocumentBoundaries(((0, 5, 6, 13),), 16), stash_gets=stash_gets)
    forward = [c[1:] for c in calls if c[0] == "fwd"]
    assert forward == [
        (True, 4, 4),  # (0, 0): one document, the plain diagonal block
        (False, 1, 4), (True, 1, 1), (True, 1, 1), (True, 2, 2),  # (1, 0): row 4 reads [0, 4); (1, 1): 3 documents
        # (2, 0) skipped: rows [8, 12) are in [6, 13), keys [0, 4) in [0, 5)
        (False, 4, 2), (True, 4, 4),  # (2, 1): keys 6, 7 of the same document; (2, 2): inside one document
        # (3, 0) skipped
        (False, 1, 2), (False, 1, 4), (True, 1, 1), (True, 3, 3),  # (3, 1), (3, 2): row 12 only; (3, 3): 2 docs
    ]
    backward = sorted(c[1:] for c in calls if c[0] == "bwd")
    assert backward == sorted(forward)  # the backward runs the same segments, no more
    # forward: kv chunk j < i fetched for the blocks (1, 0), (2, 1), (3, 1), (3, 2) only
    assert [j for name, j in stash_gets if name == "k"][:4] == [0, 1, 1, 2]
    # backward: per kv chunk j, the q chunks i >= j that read it: j=0: 0, 1; j=1: 1, 2, 3; j=2: 2, 3; j=3: 3
    assert [i for name, i in stash_gets if name == "q"] == [0, 1, 1, 2, 3, 2, 3, 3]


def test_one_document_per_sequence_runs_the_plain_blocks(monkeypatch):
    """Documents that each fill a whole sequence make the plain schedule: u(u+1)/2 whole blocks each way."""
    calls = _count_calls(monkeypatch, DocumentBoundaries(((0,),), 16))
    assert calls == _count_calls(monkeypatch, None)
    assert len(calls) == 2 * 10 and all(c[2:] == (4, 4) for c in calls)


def test_reference_llama_packed_equals_documents_separately():
    """One process: the reference Llama on a packed batch (document_ids, or position resets) gives the
    token-weighted mean of the documents' own losses, and the same gradients."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=32)).double()
    lengths = [5, 1, 7, 3]
    docs = [torch.randint(0, 32, (n,)) for n in lengths]
    ids = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    targets = sum(n - 1 for n in lengths)
    ref = sum(model(doc[None], labels=doc[None]) * (len(doc) - 1) for doc in docs if len(doc) > 1) / targets
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    for packed in ({"document_ids": document_ids}, {"position_ids": positions}):
        loss = model(ids, labels=ids, **packed)  # labels not masked at document starts: the model does it
        grads = torch.autograd.grad(loss, list(model.parameters()))
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)  # fp64: summation order only
        for grad, ref_grad in zip(grads, ref_grads):
            torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_hf_reference_run_masks_restarting_positions_without_the_cache():
    """docs/packing.md's reference run without the strategy: a Hugging Face Llama (SDPA) called with restarting
    position_ids and use_cache=False gives each document the logits it has alone."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).double().eval()
    lengths = [5, 7, 4]
    docs = [torch.randint(0, 32, (n,)) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat(docs)[None], position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=doc[None], use_cache=False).logits[0] for doc in docs])
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)  # fp64: summation order only


def test_sdpa_attention_document_mask():
    """sdpa_attention(document_ids=...) equals each document through plain causal attention."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 9, 2, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    document_ids = torch.tensor([[0, 0, 0, 1, 2, 2, 2, 2, 2], [0] * 8 + [1]])
    out = sdpa_attention(q, k, v, document_ids=document_ids)
    torch.testing.assert_close(out, documents_separately(q, k, v, [[0, 3, 4], [0, 8]]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("call, match", [
    (lambda: document_starts_mask(document_ids=torch.tensor([[0, 0, 1, 0]])),
     r"non-decreasing .* sequence 0 goes from 1 to 0 at token 3: number the documents"),
    (lambda: document_starts_mask(document_ids=torch.tensor([[0.0, 1.0]])), "document_ids must be an integer tensor"),
    (lambda: document_starts_mask(document_ids=torch.tensor([0, 1])), r"document_ids must be \(batch, sequence\)"),
    (lambda: DocumentBoundaries(((0, 3, 2),), 8), "must ascend strictly from 0"),
    (lambda: DocumentBoundaries(((1,),), 8), "must ascend strictly from 0"),
    (lambda: DocumentBoundaries(((0,),), 8).padded(4), "padded length 4 is shorter"),
    (lambda: packed_documents(torch.zeros(2, 7, dtype=torch.long), None, torch.Size((2, 8))),
     r"document_ids'\] must be a tensor shaped like input_ids \(2, 8\)"),
    (lambda: packed_documents(None, torch.zeros(3, 8, dtype=torch.long), torch.Size((2, 8))),
     r"position_ids'\] must be shaped like input_ids \(2, 8\)"),
    (lambda: fpdt_attention(*(torch.randn(2, 8, 2, 4) for _ in "qkv"), documents=DocumentBoundaries(((0, 3),), 8)),
     r"documents describe 1 sequences of 8 tokens, but the attention got 2 sequences"),
    (lambda: FPDTAttention(backend="math").for_layer()(*(torch.randn(1, 8, 2, 4) for _ in "qkv"),
                                                         document_ids=torch.zeros(1, 8, dtype=torch.long)),
     "passes document_ids to its attention, but the fpdt strategy found neither"),
    (lambda: LlamaForCausalLM(LlamaConfig.from_name("tiny"))(torch.zeros(1, 6, dtype=torch.long),
                                                             document_ids=torch.zeros(1, 5, dtype=torch.long)),
     r"document_ids must be shaped like input_ids \(1, 6\)"),
])
def test_packed_misuse_raises_value_error(call, match):
    """Anything a user can get wrong about packed documents is a ValueError naming the fix."""
    with pytest.raises(ValueError, match=match):
        call()


def test_packed_documents_detection():
    """The strategy masks when the batch has document_ids or position resets, not for plain positions."""
    plain = torch.arange(8).expand(2, 8)
    assert packed_documents(None, plain, torch.Size((2, 8))) == (None, None)
    documents, starts = packed_documents(None, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]), torch.Size((2, 8)))
    assert documents.starts == ((0, 3), (0, 3)) and starts.shape == (2, 8)  # (1, S) positions serve every item
    documents, _ = packed_documents(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [3] * 8]), plain, torch.Size((2, 8)))
    assert documents.starts == ((0, 4), (0,))


class VarlenMath:
    """The varlen kernel's contract (packed ``(N, h, D)`` tokens, cumulative lengths, ``lse (h, N)``) computed by the
    math kernel segment by segment: runs the packed-rows gather/scatter of the CUDA path on CPU in fp64."""

    def __init__(self, calls: list) -> None:
        self.calls, self.math = calls, MathKernel()

    def _segments(self, cum_q, cum_k):
        return zip(cum_q[:-1].tolist(), cum_q[1:].tolist(), cum_k[:-1].tolist(), cum_k[1:].tolist())

    def forward(self, q, k, v, cum_q, cum_k, max_q, max_k, *, causal, scale):
        self.calls.append(("fwd", causal, len(cum_q) - 1))
        outs, lses = [], []
        for qa, qb, ka, kb in self._segments(cum_q, cum_k):
            assert max(qb - qa, 0) <= max_q and kb - ka <= max_k
            o, lse = self.math.forward(*(x[a:b].transpose(0, 1)[None] for x, a, b in ((q, qa, qb), (k, ka, kb),
                                                                                    (v, ka, kb))),
                                     causal=causal, scale=scale)
            outs.append(o[0].transpose(0, 1)), lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, dim=-1)

    def backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, *, causal, scale):
        self.calls.append(("bwd", causal, len(cum_q) - 1))
        grads = [[], [], []]
        for qa, qb, ka, kb in self._segments(cum_q, cum_k):
            seg = [x[a:b].transpose(0, 1)[None] for x, a, b in ((dout, qa, qb), (q, qa, qb), (k, ka, kb),
                                                               (v, ka, kb), (out, qa, qb))]
            for store, g in zip(grads, self.math.backward(*seg, lse[None, :, qa:qb], causal=causal, scale=scale)):
                store.append(g[0].transpose(0, 1))
        return tuple(torch.cat(g) for g in grads)


@pytest.mark.parametrize("num_chunks", [1, 2, 4])
def test_varlen_path_matches_documents_separately(monkeypatch, num_chunks):
    """The CUDA varlen path's packing (gather the segments' tokens of the whole batch, one call per block, scatter
    back, -inf rows merged) is exact: run here with a math stand-in for the flash varlen op, fp64, GQA, B = 2."""
    calls = []
    monkeypatch.setattr(fpdt_module, "varlen_kernel_for", lambda *args: VarlenMath(calls))
    seq_len, starts = 24, [[0, 1, 7, 8, 15, 23], [0, 12]]
    gen = torch.Generator().manual_seed(num_chunks)
    q = torch.randn(2, seq_len, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, seq_len, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    dout = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    documents = DocumentBoundaries(tuple(tuple(row) for row in starts), seq_len)
    out = fpdt_attention(q, k, v, num_chunks=num_chunks, backend="math", documents=documents)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = documents_separately(q, k, v, starts)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)  # fp64: summation order only
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)
    forward_blocks = sum(c[0] == "fwd" for c in calls)
    assert 0 < forward_blocks <= num_chunks * (num_chunks + 1) // 2  # at most one call per block, never per segment
    assert sorted(c for c in calls if c[0] == "bwd") == sorted(("bwd", *c[1:]) for c in calls if c[0] == "fwd")
