import math

import pytest
import torch
import torch.nn.functional as F

from lightning_fpdt.models.llama import (
    NAMED_CONFIGS,
    LlamaAttention,
    LlamaConfig,
    LlamaForCausalLM,
    RMSNorm,
    apply_rotary,
    sdpa_attention,
)

# fp64 comparisons of the same math done in two orders agree to ~1e-12; 1e-10 leaves headroom.
FP64_TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


def tiny_model(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig.from_name("tiny", **overrides)).double()


def random_tokens(config: LlamaConfig, batch: int = 2, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, seq))


def test_loss_matches_shifted_cross_entropy():
    """labels are shifted left by one and the loss is the mean CE over the S-1 predicted tokens."""
    model = tiny_model()
    input_ids = random_tokens(model.config)
    labels = random_tokens(model.config)
    logits = model(input_ids)
    assert logits.shape == (2, 12, model.config.vocab_size)
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(model(input_ids, labels=labels), expected, **FP64_TOL)


def test_default_position_ids_are_arange():
    """position_ids default to arange(S) on every row."""
    model = tiny_model()
    input_ids = random_tokens(model.config)
    position_ids = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(model(input_ids), model(input_ids, position_ids=position_ids), **FP64_TOL)


def test_shift_labels_and_pre_shifted_labels_match_labels():
    """shift_labels, and labels with labels_are_shifted=True, are used as targets without shifting."""
    model = tiny_model()
    input_ids = random_tokens(model.config)
    labels = random_tokens(model.config)
    labels[0, 3] = -100
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    expected = model(input_ids, labels=labels)
    torch.testing.assert_close(model(input_ids, shift_labels=shifted), expected, **FP64_TOL)
    model.labels_are_shifted = True
    torch.testing.assert_close(model(input_ids, labels=shifted), expected, **FP64_TOL)


def test_all_ignored_targets_give_zero_loss_and_zero_grads():
    """A shard whose targets are all -100 returns exactly 0.0 and zero gradients, never NaN."""
    model = tiny_model()
    input_ids = random_tokens(model.config)
    loss = model(input_ids, shift_labels=torch.full_like(input_ids, -100))
    assert loss.item() == 0.0
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.all(param.grad == 0), name


def test_ignored_kwargs_warn():
    """Keyword arguments the model does not use (e.g. attention_mask) are named in a warning."""
    model = tiny_model()
    input_ids = random_tokens(model.config)
    with pytest.warns(UserWarning, match="attention_mask"):
        model(input_ids, attention_mask=torch.ones_like(input_ids))


def test_rope_preserves_norms():
    """RoPE is a rotation: per-head vector norms are unchanged, at arbitrary global positions."""
    x = torch.randn(2, 6, 3, 16, dtype=torch.float64)
    position_ids = torch.randint(0, 100_000, (2, 6))
    rotated = apply_rotary(x, position_ids, 500000.0)
    assert rotated.dtype == x.dtype
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), **FP64_TOL)


def test_rope_dot_product_depends_only_on_position_difference():
    """q·k after RoPE is unchanged when both positions shift by the same constant."""
    q = torch.randn(1, 5, 2, 16, dtype=torch.float64)
    k = torch.randn(1, 5, 2, 16, dtype=torch.float64)
    q_pos = torch.tensor([[0, 3, 7, 8, 20]])
    k_pos = torch.tensor([[1, 1, 4, 9, 15]])
    shift = 1000

    def dots(offset: int) -> torch.Tensor:
        q_rot = apply_rotary(q, q_pos + offset, 10000.0)
        k_rot = apply_rotary(k, k_pos + offset, 10000.0)
        return (q_rot * k_rot).sum(-1)

    before, after = dots(0), dots(shift)
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)
    # Guard against a no-op RoPE: the dot product must actually depend on the positions.
    assert not torch.allclose(before, (q * k).sum(-1))


def test_rope_keeps_low_precision_dtype():
    """apply_rotary computes in fp32 but returns x's dtype."""
    x = torch.randn(1, 4, 2, 8).to(torch.bfloat16)
    out = apply_rotary(x, torch.arange(4)[None], 500000.0)
    assert out.dtype == torch.bfloat16
    # bf16 has 8 mantissa bits; rounding the rotated output costs ~2^-8 relative.
    expected = apply_rotary(x.float(), torch.arange(4)[None], 500000.0)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_attention_matches_explicit_gqa_softmax(causal):
    """sdpa_attention with fewer kv heads equals softmax(QK^T*scale + mask) V with repeated kv heads."""
    b, s, h, h_kv, d = 2, 7, 4, 2, 8
    q = torch.randn(b, s, h, d, dtype=torch.float64)
    k = torch.randn(b, s, h_kv, d, dtype=torch.float64)
    v = torch.randn(b, s, h_kv, d, dtype=torch.float64)
    scale = 0.3
    k_rep = k.repeat_interleave(h // h_kv, dim=2)  # (B, S, H, D): query head i reads kv head i // (H/Hkv)
    v_rep = v.repeat_interleave(h // h_kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) * scale  # (B, H, S, S)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), -math.inf)
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v_rep)  # (B, S, H, D)
    torch.testing.assert_close(sdpa_attention(q, k, v, causal=causal, scale=scale), expected, **FP64_TOL)


def test_replaced_attention_fn_is_called_once_per_layer():
    """Every LlamaAttention routes through its attention_fn attribute, with the documented arguments."""
    model = tiny_model()
    input_ids = random_tokens(model.config)
    expected = model(input_ids)
    calls = []

    def counting_attention(q, k, v, *, causal, scale):
        calls.append((q.shape, k.shape, causal, scale))
        return sdpa_attention(q, k, v, causal=causal, scale=scale)

    for module in model.modules():
        if isinstance(module, LlamaAttention):
            module.attention_fn = counting_attention
    torch.testing.assert_close(model(input_ids), expected, **FP64_TOL)
    cfg = model.config
    q_shape, kv_shape = (2, 12, cfg.num_heads, cfg.head_dim), (2, 12, cfg.num_kv_heads, cfg.head_dim)
    assert calls == [(q_shape, kv_shape, True, cfg.head_dim**-0.5)] * cfg.num_layers


def test_llama3_8b_parameter_count():
    """num_parameters of llama3-8b equals Llama-3-8B's published 8,030,261,248 (counted, not built)."""
    config = LlamaConfig.from_name("llama3-8b")
    assert config.head_dim == 128
    assert config.num_parameters(include_embedding=True) == 8_030_261_248
    assert config.num_parameters(include_embedding=False) == 8_030_261_248 - 128256 * 4096


@pytest.mark.parametrize("tied", [False, True])
def test_num_parameters_matches_module(tied):
    """num_parameters(include_embedding=True) counts exactly the module's parameters, tied or not."""
    model = tiny_model(tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.config.num_parameters(include_embedding=True) == sum(p.numel() for p in model.parameters())


def test_named_configs():
    """from_name builds each named geometry and applies overrides."""
    assert set(NAMED_CONFIGS) == {"tiny", "llama3-1b", "llama3-3b", "llama3-8b"}
    one_b = LlamaConfig.from_name("llama3-1b")
    assert (one_b.head_dim, one_b.num_kv_heads, one_b.tie_word_embeddings) == (64, 8, True)
    three_b = LlamaConfig.from_name("llama3-3b")  # Llama-3.2-3B: 3.21B parameters, the embedding tied
    assert (three_b.num_layers, three_b.hidden_size, three_b.num_heads, three_b.num_kv_heads) == (28, 3072, 24, 8)
    assert three_b.num_parameters() == 3_212_749_824
    assert LlamaConfig.from_name("tiny", num_layers=3).num_layers == 3


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_layers=0), r"num_layers \(0\) must be positive"),
        (dict(num_kv_heads=3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (dict(hidden_size=66), r"hidden_size \(66\) is not divisible by num_heads \(4\)"),
        (dict(head_dim=7), r"head_dim \(7\) must be a positive even number"),
        (dict(rms_norm_eps=0.0), r"rms_norm_eps \(0.0\) must be positive"),
    ],
)
def test_config_validation(overrides, message):
    """Invalid geometry raises ValueError naming the offending values."""
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_name("tiny", **overrides)


def test_unknown_config_name():
    """An unknown name raises ValueError listing the known names."""
    with pytest.raises(ValueError, match=r"Unknown Llama config 'llama9'.*'llama3-8b'.*'tiny'"):
        LlamaConfig.from_name("llama9")


@pytest.mark.parametrize("tied", [False, True])
def test_meta_device_init(tied):
    """After meta build + to_empty, reset_parameters on each submodule gives finite weights, norms at one."""
    config = LlamaConfig.from_name("tiny", tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.isfinite(param).all(), name
    for module in model.modules():
        if isinstance(module, RMSNorm):
            assert torch.all(module.weight == 1)
    # to_empty unties shared Parameters; the top-level reset_parameters ties them again.
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_model_reset_parameters_uses_initializer_range():
    """The model-level init draws Linear/Embedding weights from N(0, initializer_range)."""
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", initializer_range=0.05))
    std = model.model.layers[0].mlp.gate_proj.weight.std().item()
    # 8192 samples: the sample std is within ~1% of 0.05; 10% catches a wrong init scheme.
    assert abs(std - 0.05) < 0.005


def test_bf16_model_takes_loss_in_fp32():
    """A bf16 model returns an fp32 loss close to the fp32 model's."""
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny"))
    input_ids = random_tokens(model.config)
    labels = random_tokens(model.config)
    expected = model(input_ids, labels=labels)
    loss = model.to(torch.bfloat16)(input_ids, labels=labels)
    assert loss.dtype == torch.float32
    # bf16 weights and activations (8 mantissa bits) move a ~5.5 loss by a few 1e-2 at most.
    torch.testing.assert_close(loss, expected, rtol=2e-2, atol=2e-2)
