from types import SimpleNamespace

import pytest
import torch
import transformers
from torch import nn

from lightning_fpdt.flops import ModelGeometry, flops_per_step, flops_per_token, peak_flops
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM


def odd_hf_config() -> transformers.LlamaConfig:
    # head_dim (10) is set explicitly so that num_heads * head_dim (60) != hidden_size (48).
    return transformers.LlamaConfig(
        vocab_size=1000, hidden_size=48, intermediate_size=100, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=10, tie_word_embeddings=True,
    )


# Hand-derived counts. Per layer: attention h·(H·hd) + 2·h·(Hkv·hd) + (H·hd)·h, MLP 3·h·I, norms 2·h;
# then N = L·per_layer + h (final norm) + h·V (lm_head).
# causal = 6N + 6·L·S·(H·hd); megatron = 8N + 16·L·S·(H·hd).
GEOMETRY_CASES = [
    pytest.param(
        lambda: ModelGeometry.from_config(LlamaConfig.from_name("tiny")),
        128,
        # h=64, H=4, Hkv=2, hd=16, I=128, L=2, V=256:
        # attention 64·64 + 2·64·32 + 64·64 = 12288; MLP 3·64·128 = 24576; per layer 12288 + 24576 + 128 = 36992
        # N = 2·36992 + 64 + 64·256 = 73984 + 64 + 16384 = 90432
        90_432,
        # 6·90432 + 6·2·128·64 = 542592 + 98304
        640_896,
        # 8·90432 + 16·2·128·64 = 723456 + 262144
        985_600,
        id="tiny",
    ),
    pytest.param(
        lambda: ModelGeometry.from_config(LlamaConfig.from_name("llama3-8b")),
        8192,
        # h=4096, H=32, Hkv=8, hd=128, I=14336, L=32, V=128256:
        # attention 4096·4096 + 2·4096·1024 + 4096·4096 = 41943040; MLP 3·4096·14336 = 176160768
        # per layer 41943040 + 176160768 + 8192 = 218112000
        # N = 32·218112000 + 4096 + 4096·128256 = 6979584000 + 4096 + 525336576 = 7504924672
        # (= Llama-3-8B's published 8,030,261,248 minus the 525,336,576 embedding parameters)
        7_504_924_672,
        # 6·7504924672 + 6·32·8192·4096 = 45029548032 + 6442450944
        51_471_998_976,
        # 8·7504924672 + 16·32·8192·4096 = 60039397376 + 17179869184
        77_219_266_560,
        id="llama3-8b",
    ),
    pytest.param(
        lambda: ModelGeometry.from_config(odd_hf_config()),
        1000,
        # h=48, H=6, Hkv=2, hd=10 (d_attn = 60), I=100, L=3, V=1000, tied:
        # attention 48·60 + 2·48·20 + 60·48 = 2880 + 1920 + 2880 = 7680; MLP 3·48·100 = 14400
        # per layer 7680 + 14400 + 96 = 22176; N = 3·22176 + 48 + 48·1000 = 66528 + 48 + 48000 = 114576
        114_576,
        # 6·114576 + 6·3·1000·60 = 687456 + 1080000
        1_767_456,
        # 8·114576 + 16·3·1000·60 = 916608 + 2880000
        3_796_608,
        id="hf-odd",
    ),
]


@pytest.mark.parametrize("make_geometry, seq_len, n_nonembedding, causal, megatron", GEOMETRY_CASES)
def test_flops_per_token_matches_hand_derived_counts(make_geometry, seq_len, n_nonembedding, causal, megatron):
    """N, and FLOPs per token in both conventions, equal the counts derived by hand in the comments."""
    geometry = make_geometry()
    assert geometry.nonembedding_parameters == n_nonembedding
    assert flops_per_token(geometry, seq_len) == causal
    assert flops_per_token(geometry, seq_len, convention="causal") == causal
    assert flops_per_token(geometry, seq_len, convention="megatron") == megatron


def test_flops_per_step_is_tokens_times_flops_per_token():
    """flops_per_step multiplies the per-token count by the number of tokens."""
    geometry = ModelGeometry.from_config(LlamaConfig.from_name("llama3-8b"))
    # Two sequences of 8192 tokens on each of 4 data-parallel groups: 65536 tokens · 51471998976.
    assert flops_per_step(geometry, 8192, 65536) == 3_373_268_924_891_136
    assert flops_per_step(geometry, 8192, 65536, convention="megatron") == 65536 * 77_219_266_560


def test_packed_documents_count_attention_within_documents():
    """Packed documents: the attention term uses Σ L_d² / S instead of S (each token attends only within its
    document); the dense term is unchanged; the window must lie in (0, S]."""
    from lightning_fpdt.sequence.documents import DocumentBoundaries

    sizes = dict(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32, intermediate_size=512,
                 vocab_size=1000)
    geometry = ModelGeometry(**sizes)
    # two sequences of 1000 tokens: documents 100 + 900, and 500 + 500 → (100² + 900² + 2·500²) / 2000 = 660
    documents = DocumentBoundaries(((0, 100), (0, 500)), 1000)
    assert documents.attention_length() == 660.0
    assert DocumentBoundaries(((0,),), 1000).attention_length() == 1000.0  # one document: S
    dense = 6 * geometry.nonembedding_parameters
    assert flops_per_token(geometry, 1000, attention_len=660.0) == dense + 6 * 4 * 660 * 8 * 32
    assert flops_per_step(geometry, 1000, 2000, "megatron", attention_len=660.0) == 2000 * (
        8 * geometry.nonembedding_parameters + 16 * 4 * 660 * 8 * 32)
    assert flops_per_token(geometry, 1000, attention_len=1000) == flops_per_token(geometry, 1000)
    for bad in (0, 1001):
        with pytest.raises(ValueError, match=r"attention_len \(%d\) must be in \(0, seq_len = 1000\]" % bad):
            flops_per_token(geometry, 1000, attention_len=bad)


def test_gqa_does_not_change_attention_flops():
    """With fewer kv heads only N shrinks: the attention term depends on the query heads alone."""
    sizes = dict(num_layers=4, hidden_size=256, num_heads=8, head_dim=32, intermediate_size=512, vocab_size=1000)
    full, grouped = ModelGeometry(num_kv_heads=8, **sizes), ModelGeometry(num_kv_heads=2, **sizes)
    assert grouped.nonembedding_parameters < full.nonembedding_parameters
    for geometry in (full, grouped):
        attention = flops_per_token(geometry, 4096) - 6 * geometry.nonembedding_parameters
        assert attention == 6 * 4 * 4096 * 8 * 32


@pytest.mark.parametrize("tied", [False, True])
def test_nonembedding_parameters_match_reference_model(tied):
    """N equals the reference model's parameters minus the embedding table, plus the lm_head when tied."""
    config = LlamaConfig.from_name("tiny", tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    embedding = model.model.embed_tokens.weight.numel()
    lm_head = model.lm_head.weight.numel() if tied else 0  # a tied lm_head is not a separate parameter
    expected = sum(p.numel() for p in model.parameters()) - embedding + lm_head
    assert ModelGeometry.from_config(config).nonembedding_parameters == expected
    assert ModelGeometry.from_model(model).nonembedding_parameters == expected


def test_nonembedding_parameters_match_hf_model():
    """N read from a Hugging Face config equals the HF model's own (tied) parameter count minus the embedding."""
    model = transformers.LlamaForCausalLM(odd_hf_config())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    embedding = model.model.embed_tokens.weight.numel()
    expected = sum(p.numel() for p in model.parameters()) - embedding + model.lm_head.weight.numel()
    assert ModelGeometry.from_model(model).nonembedding_parameters == expected


def test_parameter_override_is_used():
    """num_parameters_nonembedding, when given, replaces the counted N in the dense term."""
    geometry = ModelGeometry(
        num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
        vocab_size=256, num_parameters_nonembedding=1000,
    )
    assert geometry.nonembedding_parameters == 1000
    assert flops_per_token(geometry, 10) == 6 * 1000 + 6 * 2 * 10 * 64


def test_from_config_defaults_head_dim_and_kv_heads():
    """A config without head_dim uses hidden_size // num_heads; one without kv heads has num_heads of them."""
    config = SimpleNamespace(num_hidden_layers=2, hidden_size=96, num_attention_heads=12, intermediate_size=200,
                             vocab_size=500)
    geometry = ModelGeometry.from_config(config)
    assert (geometry.head_dim, geometry.num_kv_heads, geometry.tie_word_embeddings) == (8, 12, False)


def test_from_model_finds_nested_config():
    """from_model searches the submodules of a wrapper (e.g. a LightningModule holding the model)."""
    wrapper = nn.Sequential(nn.Linear(2, 2), LlamaForCausalLM(LlamaConfig.from_name("tiny")))
    assert ModelGeometry.from_model(wrapper) == ModelGeometry.from_config(LlamaConfig.from_name("tiny"))


def test_from_model_without_config_raises():
    """A module tree without a usable .config names the fix; a config lacking sizes is named with what it lacks."""
    with pytest.raises(ValueError, match=r"Could not read the model geometry from Linear.*geometry=ModelGeometry"):
        ModelGeometry.from_model(nn.Linear(2, 2))
    module = nn.Linear(2, 2)
    module.config = SimpleNamespace(hidden_size=8)
    with pytest.raises(ValueError, match=r"lacks \['intermediate_size', 'num_heads', 'num_layers', 'vocab_size'\]"):
        ModelGeometry.from_model(module)


@pytest.mark.parametrize(
    "device_name, dtype, expected",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),  # the SXM part's name
        ("nvidia h100 80gb hbm3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA H100 NVL", "fp16", 835e12),
        ("NVIDIA H200", "bf16", 989e12),
        ("NVIDIA GH200 480GB", "bf16", 989e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
        ("NVIDIA L40S", "bf16", 362e12),
        ("NVIDIA B200", "bf16", 2250e12),
        ("NVIDIA GeForce GTX 1080", "bf16", None),  # unknown device
        ("NVIDIA GB200", "bf16", None),  # a different part: no whole-word match on "b200"
        ("NVIDIA B200", "fp32", None),  # known device, no figure for this dtype
        ("NVIDIA H100 80GB HBM3", torch.float64, None),
    ],
)
def test_peak_flops_table(device_name, dtype, expected):
    """Device names match case-insensitively, specific parts before generic ones; unknowns give None."""
    assert peak_flops(device_name, dtype) == expected


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: ModelGeometry(0, 64, 4, 2, 16, 128, 256), r"num_layers \(0\) must be a positive int"),
        (lambda: ModelGeometry(2, 64, 4, 3, 16, 128, 256), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (lambda: ModelGeometry(2, 64, 4, 2, 16, 128, 256, num_parameters_nonembedding=0),
         r"num_parameters_nonembedding \(0\) must be positive"),
        (lambda: ModelGeometry.from_config(SimpleNamespace(num_layers=2, hidden_size=50, num_heads=4,
                                                           intermediate_size=8, vocab_size=8)),
         r"hidden_size \(50\) is not divisible by num_heads \(4\)"),
        (lambda: flops_per_token(ModelGeometry(2, 64, 4, 2, 16, 128, 256), 128, convention="noncausal"),
         r"Unknown FLOP convention 'noncausal'"),
        (lambda: flops_per_token(ModelGeometry(2, 64, 4, 2, 16, 128, 256), 0), r"seq_len \(0\) must be positive"),
        (lambda: flops_per_step(ModelGeometry(2, 64, 4, 2, 16, 128, 256), 8, -1), r"tokens \(-1\) must be"),
        (lambda: peak_flops("NVIDIA H100", "bfloat16"), r"Unknown dtype 'bfloat16'"),
    ],
)
def test_validation_errors(build, message):
    """Invalid geometry and arguments raise ValueError naming the offending values."""
    with pytest.raises(ValueError, match=message):
        build()


def test_mixture_of_experts_counts_every_expert_for_memory_and_the_routed_ones_for_flops():
    """Mixtral-8x7B: 46.7B parameters held (every expert, the planner's states) and 12.9B active per token less the
    input embedding's 0.13B doing work (two experts and the router, the FLOP count); Qwen-MoE's experts are
    moe_intermediate_size wide."""
    from types import SimpleNamespace

    from lightning_fpdt.planner import total_parameters

    mixtral = ModelGeometry.from_config(SimpleNamespace(
        num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=32000, num_local_experts=8, num_experts_per_tok=2))
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)
    assert 46.6e9 < total_parameters(mixtral) < 46.8e9
    assert 12.7e9 < mixtral.nonembedding_parameters < 12.8e9
    qwen = ModelGeometry.from_config(SimpleNamespace(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
        moe_intermediate_size=32, vocab_size=100, num_experts=4, num_experts_per_tok=2))
    assert (qwen.intermediate_size, qwen.num_experts, qwen.experts_per_token) == (32, 4, 2)
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelGeometry(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=8,
                      vocab_size=10, num_experts=2, experts_per_token=3)
