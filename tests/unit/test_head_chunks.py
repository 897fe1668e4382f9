"""Head-group chunking in one process: equal to the whole-layer attention, attention run once per
group, no full-width activation kept for the backward, misconfigurations named (integrations/head_groups.py)."""

from __future__ import annotations

import copy

import pytest
import torch

import lightning_fpdt.sequence.fpdt as fpdt_module
from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.integrations import (
    HeadGroupedAttention,
    SequenceParallelContext,
    install,
    install_head_groups,
    install_hf_model,
    install_reference_llama,
)
from lightning_fpdt.memory import find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM
from lightning_fpdt.offload.host_stash import HostBufferPool
from lightning_fpdt.sequence import FPDTAttention, check_head_groups
from lightning_fpdt.sequence.planning import AttentionGeometry, grouped_geometry
from tests.live_bytes import LiveBytes

# fp64 throughout: grouping changes only the summation order of the output projection (G partial products instead
# of one) and of the input gradient (G contributions), ~1e-16 relative each; 1e-10 catches any wrong head, row or
# column (those are O(1) errors) with a wide margin.
TOL = dict(rtol=1e-10, atol=1e-10)
VOCAB = 64


def _reference_llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    # H·D = 64 differs from hidden = 48, so a slice along the wrong dimension cannot go unnoticed
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_layers=2, num_heads=8,
                         num_kv_heads=4, head_dim=8, **overrides)
    return LlamaForCausalLM(config).double()


def _hf_model(family: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    sizes = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=8, max_position_embeddings=256, attn_implementation="sdpa")
    if family == "llama":
        config = transformers.LlamaConfig(**sizes, attention_bias=True)  # biases on q, k, v and o
        cls = transformers.LlamaForCausalLM
    elif family == "qwen2":
        config = transformers.Qwen2Config(**sizes)  # q, k, v biases, none on o
        cls = transformers.Qwen2ForCausalLM
    elif family == "qwen3":
        config = transformers.Qwen3Config(**sizes)  # q/k RMSNorm over the head dim
        cls = transformers.Qwen3ForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**sizes, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise ValueError(family)
    model = cls(config).double()
    # random norm weights and biases (their inits are ones / zeros, which would hide a wrong slice)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def _logits_and_grads(model, input_ids: torch.Tensor, weight: torch.Tensor, steps: int = 1):
    """Logits and every parameter's gradient of a random linear function of them (fresh inputs, no loss shift)."""
    model.zero_grad(set_to_none=True)
    for _ in range(steps):
        logits = model(input_ids=input_ids)
        logits = logits if isinstance(logits, torch.Tensor) else logits.logits
        (logits * weight).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _inputs(seed: int, seq_len: int = 12, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq_len), generator=gen)
    weight = torch.randn(batch, seq_len, VOCAB, generator=gen, dtype=torch.float64)
    return ids, weight


def _compare(reference, grouped, ids, weight, steps: int = 1):
    ref_logits, ref_grads = _logits_and_grads(reference, ids, weight, steps)
    logits, grads = _logits_and_grads(grouped, ids, weight, steps)
    torch.testing.assert_close(logits, ref_logits, **TOL)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("head_chunks", [2, 4])
@pytest.mark.parametrize("num_chunks,offload", [(1, False), (2, True)])
def test_reference_llama_groups_equal_plain_attention(head_chunks, num_chunks, offload):
    """Reference Llama, G = 2, 4 (8 query / 4 kv heads): logits and every parameter gradient equal SDPA's."""
    reference = _reference_llama(seed=head_chunks)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=num_chunks, backend="math", offload=offload, head_chunks=head_chunks)
    install_reference_llama(grouped, SequenceParallelContext(group=None, attention=attention))
    assert all(isinstance(layer.self_attn._fpdt_attention, HeadGroupedAttention) for layer in grouped.model.layers)
    _compare(reference, grouped, *_inputs(seed=num_chunks))
    assert attention.kernel_calls == head_chunks * 2  # once per group and layer: the backward replays


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("head_chunks", [2, 4])
def test_hf_families_groups_equal_sdpa_attention(family, head_chunks):
    """HF Llama (all biases), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral: grouped = SDPA attention."""
    reference = _hf_model(family, seed=head_chunks)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=2, backend="math", offload=head_chunks == 4, head_chunks=head_chunks)
    install_hf_model(grouped, SequenceParallelContext(group=None, attention=attention))
    _compare(reference, grouped, *_inputs(seed=7))
    # the weights are still the modules' own parameters: same names, same shapes
    shapes = [(n, p.shape) for n, p in reference.named_parameters()]
    assert [(n, p.shape) for n, p in grouped.named_parameters()] == shapes


def test_evaluation_without_grad_keeps_nothing():
    """Under no_grad (validation) the groups compute and keep nothing for a backward; logits equal SDPA's."""
    reference = _hf_model("qwen3", seed=11)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=2, backend="math", offload=True, head_chunks=4)
    install_hf_model(grouped, SequenceParallelContext(group=None, attention=attention))
    ids, _ = _inputs(seed=12)
    with torch.no_grad():
        torch.testing.assert_close(grouped(input_ids=ids).logits, reference(input_ids=ids).logits, **TOL)
    layers = [m._fpdt_attention for m in grouped.modules() if isinstance(getattr(m, "_fpdt_attention", None),
                                                                          HeadGroupedAttention)]
    assert len(layers) == 2 and not any(handle.recorded for layer in layers for handle in layer.handles)


@pytest.mark.parametrize("offload", [False, True])
def test_activation_offload_runs_each_group_once(offload):
    """Under ActivationOffload (block recompute) each group's attention runs once per step; gradients exact."""
    reference = _reference_llama(seed=3)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=2, backend="math", offload=offload, head_chunks=2)
    install_reference_llama(grouped, SequenceParallelContext(group=None, attention=attention))
    callback = ActivationOffload(offload=offload)
    callback.fpdt_transform(grouped, find_blocks(grouped))
    assert callback._owner.attentions == [attention]  # found through the grouped layers
    _compare(reference, grouped, *_inputs(seed=4), steps=2)
    assert attention.kernel_calls == 2 * 2 * 2  # groups x layers x steps


def test_recompute_attention_runs_each_group_twice():
    """ActivationOffload(recompute_attention=True): each group's attention runs again in the recompute (its first
    forward keeps nothing), as for whole layers; gradients exact."""
    reference = _reference_llama(seed=14)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=2, backend="math", offload=True, head_chunks=4)
    install_reference_llama(grouped, SequenceParallelContext(group=None, attention=attention))
    ActivationOffload(recompute_attention=True).fpdt_transform(grouped, find_blocks(grouped))
    _compare(reference, grouped, *_inputs(seed=15))
    assert attention.kernel_calls == 2 * 4 * 2  # twice x groups x layers


def test_packed_documents_through_head_groups():
    """Packed documents (the strategy's boundaries on the shared attention) mask every group: grouped logits and
    gradients equal the single-process model given the document ids."""
    from lightning_fpdt.sequence.documents import DocumentBoundaries

    reference = _reference_llama(seed=16)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=2, backend="math", head_chunks=2)
    install_reference_llama(grouped, SequenceParallelContext(group=None, attention=attention))
    ids, weight = _inputs(seed=17)
    document_ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [0] * 12])
    attention.documents = DocumentBoundaries.from_document_ids(document_ids)
    positions = torch.arange(12).expand(2, 12)
    results = []
    for model in (reference, grouped):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions, document_ids=document_ids)
        (logits * weight).sum().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], **TOL)
    for name, ref in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], ref, **TOL, msg=lambda m: f"{name}: {m}")
    attention.documents = None  # local ids without the global boundaries are refused, as for whole layers
    with pytest.raises(ValueError, match="the model passes document_ids to its attention"):
        grouped(input_ids=ids, position_ids=positions, document_ids=document_ids)


def test_torch_checkpoint_does_not_recompute_grouped_attention():
    """Under torch's own non-reentrant checkpoint the recompute sums the kept outputs: no attention runs again."""
    reference = _reference_llama(seed=5)
    grouped = copy.deepcopy(reference)
    attention = FPDTAttention(num_chunks=2, backend="math", head_chunks=4)
    install_reference_llama(grouped, SequenceParallelContext(group=None, attention=attention))
    for block in grouped.model.layers:
        forward = block.forward
        block.forward = lambda *a, __f=forward, **k: torch.utils.checkpoint.checkpoint(
            __f, *a, use_reentrant=False, **k)
    _compare(reference, grouped, *_inputs(seed=6))
    assert attention.kernel_calls == 4 * 2


def test_no_full_width_activation_is_kept_or_attended(monkeypatch):
    """G = 4: the FPDT attention sees H/G query heads, and nothing (B, S, H·D)-sized is saved for the backward."""
    seen_heads = []
    original = fpdt_module.fpdt_forward

    def recording_forward(q, k, v, *args, **kwargs):
        seen_heads.append((q.shape[2], k.shape[2]))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(fpdt_module, "fpdt_forward", recording_forward)
    ids, _ = _inputs(seed=8, seq_len=16)
    widest = {}
    for head_chunks in (1, 4):
        model = _reference_llama(seed=9)
        install_reference_llama(model, SequenceParallelContext(
            group=None, attention=FPDTAttention(num_chunks=2, backend="math", offload=True, head_chunks=head_chunks)))
        saved = []
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t):
            if t.dtype == torch.float64 and t.untyped_storage().data_ptr() not in weights:  # activations only
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            hidden = model.model(ids, torch.arange(16).expand(2, 16))  # (B, S, hidden): the decoder stack alone
        hidden.sum().backward()
        widest[head_chunks] = max(saved)
    assert set(seen_heads) == {(8, 4), (2, 1)}  # whole layer (G = 1) and one group of 8/4 query and 4/4 kv heads
    b, s, hidden, width = 2, 16, 48, 8 * 8
    assert widest[1] == b * s * width  # ungrouped: the attention output, saved by o_proj
    assert widest[4] == b * s * hidden  # grouped: the layer input and the MLP's hidden-sized activations only


def _attention_peaks(head_chunks: int, seq_len: int) -> tuple[int, int, list]:
    """Peak live bytes (above what exists before) of the GPU test's attention module in bf16: of its forward, and
    of forward + backward, and what was alive at the latter; the input is the norm's output (a leaf), the stash
    offloaded as there."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_layers=1, num_heads=16,
                         num_kv_heads=8, head_dim=64)
    layer = LlamaDecoderLayer(config).to(torch.bfloat16)
    attention = FPDTAttention(num_chunks=8, offload=True, head_chunks=head_chunks)
    if head_chunks > 1:
        install_head_groups(layer.self_attn, attention)
    else:
        layer.self_attn.attention_fn = attention.for_layer()
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(1, seq_len, 1024, dtype=torch.bfloat16, generator=gen)
    grad_out = torch.randn(1, seq_len, 1024, dtype=torch.bfloat16, generator=gen)
    position_ids = torch.arange(seq_len).unsqueeze(0)
    with torch.no_grad():
        h = layer.input_layernorm(x).requires_grad_()
    tracker = LiveBytes()
    acquire = HostBufferPool.acquire

    def host_buffer(pool, *args):  # pinned host memory on a GPU: not in its device count
        with tracker.untracked():
            return acquire(pool, *args)

    with pytest.MonkeyPatch.context() as patch, tracker:
        patch.setattr(HostBufferPool, "acquire", host_buffer)
        y = layer.self_attn(h, position_ids)
        forward = tracker.peak
        y.backward(grad_out)
    assert attention.kernel_calls == head_chunks
    return forward, tracker.peak, tracker.at_peak


def test_groups_lower_the_attention_peaks():
    """G = 4 vs G = 1, bf16 at the GPU test's geometry (live bytes on the CPU): the attention module's forward holds
    a quarter of G = 1's per-head buffers, and its forward peak and forward + backward peak each drop by at least
    the full-width q/k/v/out."""
    seq_len, hidden, head_dim = 2048, 1024, 64
    peaks = {head_chunks: _attention_peaks(head_chunks, seq_len)[:2] for head_chunks in (1, 4)}
    # tests/gpu/test_head_chunks_cuda.py at 1/32 of its length (the same single RoPE tile; every term below is per
    # token, so the bounds hold at any length: the CPU's bf16 attention makes 2K tokens the affordable one). In MiB
    # at 8K tokens (a quarter of each at the 2K run): q/k/v/out =
    # 8K × (16 + 2·8 + 16) × 64 × 2 B = 48. Forward: G = 1 peaks in RoPE of q on q, k, v, the rotated q (48), RoPE's
    # two fp32 tile buffers of q (64: q and its rotate-half) and its per-token tables (angles, cos, sin: 6): 118;
    # G = 4 on a quarter of the per-head ones (28), the same per-token tables (6) and the hidden-sized sum of the
    # group outputs (16): 50. Forward + backward: G = 1 peaks in RoPE's backward of dq (the output 16, dq and its
    # rotation 32, dv and the rotated dk 16, two fp32 buffers of dq 64, the tables, dWo): 152; G = 4 in RoPE's
    # backward of a group's dq: 76 (see test_group_backward_keeps_two_hidden_sized_buffers). The CPU flash kernel,
    # like cuDNN's, keeps no scores. (With RoPE's four fp32 copies: 180 / 198 for G = 1, 64 / 90 for G = 4.)
    qkv_out = seq_len * (16 + 2 * 8 + 16) * head_dim * 2
    group_sum, rope_tables = seq_len * hidden * 2, 3 * seq_len * head_dim * 4  # per token: not split by G
    mib = {g: [p / 2**20 for p in peak] for g, peak in peaks.items()}
    assert peaks[4][0] <= peaks[1][0] / 4 + group_sum + rope_tables, mib
    assert min(one - four for one, four in zip(peaks[1], peaks[4])) >= qkv_out, mib


def test_group_backward_keeps_two_hidden_sized_buffers():
    """G = 4, bf16: the group backward holds two hidden-sized buffers, the output and the running dx (the output
    projection is differentiated by hand, the projections' dx added into dx in place), and peaks below their sum
    with one group's RoPE backward."""
    seq_len, hidden, head_dim, heads, kv_heads, groups = 2048, 1024, 64, 16, 8, 4
    _, peak, alive = _attention_peaks(groups, seq_len)
    # In MiB at 8K tokens (a quarter of each at the 2K run: every term is per token). The peak is in RoPE's backward
    # of a group's dq (4 query heads, 2 kv heads), on
    # - two hidden-sized buffers, 8K × 1024 × 2 B = 16 each: the module's output (the caller holds it) and the one
    #   running dx: 32. (Before: seven at the peak, in the group's dx sum: also the output projection redone to be
    #   differentiated, the three projections' dx products and autograd's two out-of-place sums of them: 124.5.)
    # - RoPE's two fp32 tile buffers of the group's dq (dq and its rotate-half), 2 × 8K × 4 × 64 × 4 B = 16, and its
    #   per-token fp32 tables (angles, cos, sin), 3 × 8K × 64 × 4 B = 6: 22 (fused/ops.py, one tile at this length);
    # - the group's bf16 dout, dq and its rotation (8K × 4 × 64 × 2 B = 4 each), the rotated dk and dv (2 each): 16.
    #   The recomputed projections and the replayed output are gone by then (asked for as gradient edges);
    # - the q, k, v, o weight gradients, (2 · 1024 + 2 · 512) × 1024 × 2 B: 6.
    # 76 in all, and 128 bytes of RoPE's inverse frequencies: the bound is asserted to the KiB (the count is exact).
    # (90 while RoPE held four fp32 copies.)
    tokens_bytes = seq_len * head_dim * 2  # one head of the local sequence in bf16
    group_q, group_kv = heads // groups * tokens_bytes, kv_heads // groups * tokens_bytes
    two_hidden = 2 * seq_len * hidden * 2
    rope = 2 * 2 * group_q + 3 * seq_len * head_dim * 4  # two fp32 buffers of dq (twice its bf16 bytes), tables
    group_grads = 3 * group_q + 2 * group_kv  # dout, dq, rotated dq; rotated dk, dv
    weight_grads = (2 * heads + 2 * kv_heads) * head_dim * hidden * 2
    hidden_sized = [a for a in alive if a.nbytes == seq_len * hidden * 2]
    report = [(a.nbytes / 2**20, a.op, a.shape, a.site) for a in alive]
    assert len(hidden_sized) == 2, report
    assert peak <= two_hidden + rope + group_grads + weight_grads + 2**10, (peak / 2**20, report)


def test_head_group_validation_names_the_fix():
    """G must divide Hkv and leave at least P query heads per group (split over P, unevenly if need be); messages
    list valid values."""
    assert check_head_groups(32, 8, 4, 2) == 1
    assert check_head_groups(32, 8, 8, 4) == 4  # one kv head per group, replicated over 4 ranks
    with pytest.raises(ValueError,
                       match=r"head_chunks \(3\) must divide num_kv_heads \(8\).*head_chunks in \[1, 2, 4, 8\]"):
        check_head_groups(32, 8, 3, 1)
    with pytest.raises(ValueError, match=r"32\) / head_chunks \(8\) = 4 query heads per group is fewer than "
                                         r"sequence_parallel_size \(8\).*head_chunks in \[1, 2, 4\]"):
        check_head_groups(32, 8, 8, 8)
    # each group's 6 query and 2 kv heads split unevenly over 3 ranks (2 q heads each, straddling the kv heads)
    assert check_head_groups(12, 4, 2, 3) == 1
    with pytest.raises(ValueError, match="head_chunks must be a positive int, got 0"):
        FPDTAttention(head_chunks=0)
    model = _reference_llama(seed=0)
    with pytest.raises(ValueError, match=r"head_chunks \(8\) must divide num_kv_heads \(4\)"):
        install_reference_llama(model, SequenceParallelContext(group=None, attention=FPDTAttention(head_chunks=8)))


def test_hf_grouped_forward_refuses_what_it_cannot_compute():
    """A mask, a sliding window (Mistral's config) and attention dropout in training are refused by name."""
    import transformers

    model = _hf_model("mistral", seed=13)
    install_hf_model(model, SequenceParallelContext(group=None, attention=FPDTAttention(head_chunks=2)))
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 4, 48, dtype=torch.float64)
    cos_sin = model.model.rotary_emb(x, torch.arange(4).unsqueeze(0))
    with pytest.raises(ValueError, match="takes no attention mask"):
        attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=torch.zeros(1, 1, 4, 4))
    attn.config.sliding_window = 4096
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        attn(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)
    attn.config.sliding_window = None
    attn.attention_dropout = 0.1
    with pytest.raises(ValueError, match=r"attention dropout \(0.1\) is not supported"):
        attn.train()(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)
    assert isinstance(attn, transformers.models.mistral.modeling_mistral.MistralAttention)


def test_plain_sdpa_module_is_refused_with_head_chunks():
    """A module calling SDPA itself cannot be head-grouped: ValueError naming head_chunks=1."""
    from tests.dist.training import PlainLM

    model = PlainLM()
    with pytest.raises(ValueError, match="calls scaled_dot_product_attention itself: set head_chunks=1"):
        install(model, find_blocks(model), SequenceParallelContext(group=None, attention=FPDTAttention(head_chunks=2)))


def test_grouped_geometry_for_the_planner():
    """The planner sees L·G attention calls of H/G query and Hkv/G kv heads."""
    geometry = AttentionGeometry(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    assert grouped_geometry(geometry, 1) is geometry
    assert grouped_geometry(geometry, 4) == AttentionGeometry(num_layers=128, num_heads=8, num_kv_heads=2, head_dim=128)


# ---- planner, strategy option, command lines -------------------------------------------------------------------------
def _plan(**overrides):
    from lightning_fpdt.flops import ModelGeometry
    from lightning_fpdt.planner import plan_memory

    geometry = ModelGeometry(num_layers=2, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                             intermediate_size=4096, vocab_size=32000)
    options = dict(geometry=geometry, seq_len=65536, num_gpus=1, chunks=2, offload=True, offload_dq=False,
                   activation_offload=True, tiled_mlp=True, tiled_loss=True)
    return plan_memory(**{**options, **overrides})


def test_planner_counts_one_head_group_by_hand():
    """G = 2: the attention forward holds one group's q, k, v, out and working set plus the hidden-sized output sum."""
    whole, grouped = _plan(), _plan(head_chunks=2)
    # N = 65536 local tokens, A = N·1024·2 = 134,217,728; norm = A + N·4 = 134,479,872
    # one group's q, k, v, out: N·(8 + 2·2 + 8)·128·2 / 2 = 167,772,160
    # one group's working set (4 query, 1 kv head, chunks of 32768): 32768·(4 + 4·1)·128·2 + 32768·4·(2·128 + 2)·4
    #   = 67,108,864 + 135,266,304 = 202,375,168
    assert grouped.component("attention forward").gpu_bytes == 134_479_872 + 134_217_728 + 167_772_160 + 202_375_168
    assert grouped.phase_bytes["attention forward"] < whole.phase_bytes["attention forward"]
    assert grouped.phase_bytes["attention backward"] < whole.phase_bytes["attention backward"]
    # the same chunks and kept outputs wait on the host; the backward's dout and out chunks are one group's (half of
    # N·8·128·2 each) instead of a layer's
    assert whole.host_bytes_per_gpu - grouped.host_bytes_per_gpu == 2 * (65536 * 8 * 128 * 2 // 2)
    assert "head_chunks=2" in grouped.options.describe()


def test_planner_and_strategy_refuse_bad_head_chunks(capsys):
    """plan_memory, `lightning-fpdt plan --head-chunks` and FPDTStrategy name the valid values."""
    from lightning_fpdt.planner import main
    from lightning_fpdt.strategy.trainer import FPDTStrategy

    with pytest.raises(ValueError, match=r"head_chunks \(4\) must divide num_kv_heads \(2\)"):
        _plan(head_chunks=4)
    assert main(["--seq-len", "65536", "--head-chunks", "3"]) == 2  # llama3-8b: 8 kv heads
    assert "head_chunks (3) must divide num_kv_heads (8)" in capsys.readouterr().err
    assert main(["--seq-len", "65536", "--gpus", "4", "--head-chunks", "4", "--chunks", "2"]) in (0, 1)
    assert "head_chunks=4" in capsys.readouterr().out
    with pytest.raises(ValueError, match="head_chunks must be .auto. or a positive int, got 0"):
        FPDTStrategy(head_chunks=0)
    with pytest.raises(ValueError, match=r"head_chunks \(2\) is not composed with a ring \(ring_size 2\)"):
        _plan(num_gpus=2, sequence_parallel_size=2, ring_size=2, chunks=1, head_chunks=2)


def test_head_chunks_from_yaml(tmp_path, monkeypatch):
    """trainer.strategy init_args head_chunks reaches the strategy (LightningCLI reads the type hint)."""
    from pathlib import Path

    from lightning_fpdt.cli import FPDTCLI
    from lightning_fpdt.strategy.trainer import FPDTStrategy

    monkeypatch.setattr("sys.argv", ["lightning-fpdt"])
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo_cpu.yaml"
    cli = FPDTCLI(args=["--config", str(config), "--trainer.devices", "1", "--trainer.logger", "false",
                        "--trainer.strategy.init_args.head_chunks", "2"], run=False)
    assert isinstance(cli.trainer.strategy, FPDTStrategy) and cli.trainer.strategy.options.head_chunks == 2


def test_bench_script_runs_on_cpu(tmp_path):
    """bench/head_chunks.py --device cpu --tiny: a row per case and G, one attention call per group and step (the
    checkpointed layer included), and the JSON record."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "head_chunks.py"
    spec = importlib.util.spec_from_file_location("bench_head_chunks", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "head_chunks.json"
    record = bench.main(["--device", "cpu", "--tiny", "--seq-len", "32", "--chunks", "2", "--head-chunks", "1,8",
                         "--repeats", "1", "--out", str(out)])
    rows = {(r["case"], r["head_chunks"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows.keys() == {("attention", 1), ("layer", 1), ("attention", 8), ("layer", 8)}
    assert all(r["status"] == "ok" and r["attention_calls_per_step"] == r["head_chunks"] for r in rows.values())
    assert record["rows"][0]["planner_gib"]["attention forward"] > record["rows"][2]["planner_gib"]["attention forward"]
