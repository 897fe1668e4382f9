"""The registry of Hugging Face families (lightning_fpdt.integrations.families), its refusals, the tiny-model table
the end-to-end tests run over, the README's table, multimodal configs, and the bench's non-Llama geometries."""

from __future__ import annotations

import pytest
import torch
import transformers

from lightning_fpdt.integrations import SequenceParallelContext, install_hf_model, supports_head_groups
from lightning_fpdt.integrations.families import FAMILIES, REFUSED, check_model, family_of
from lightning_fpdt.planner.geometry import resolve_geometry
from lightning_fpdt.sequence import FPDTAttention
from tests.families import MINI_MODELS, README, build, readme_block, readme_table


def _context() -> SequenceParallelContext:
    return SequenceParallelContext(group=None, attention=FPDTAttention())


def test_every_family_has_a_tiny_model():
    """The end-to-end table has one row per registered family, and nothing else."""
    assert list(MINI_MODELS) == list(FAMILIES)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_family_names_the_classes_of_its_model(model_type):
    """Each family's attention, block, norm and MLP classes are those its tiny model is built of."""
    torch.manual_seed(0)
    family = FAMILIES[model_type]
    model = build(model_type)
    classes = {type(m).__name__ for m in model.modules()}
    assert type(model).__name__ == family.causal_lm and family_of(model) is family
    assert {family.attention, family.decoder_layer, family.norm} <= classes
    assert set(family.mlp_classes) & classes
    if family.router:
        assert family.router.module in classes
    assert supports_head_groups(model) == family.separate_projections


def test_readme_table_is_the_families_table():
    """The README's table of families is exactly what tests/families.py renders (python3 -m tests.families)."""
    assert readme_block(README.read_text()) == readme_table()
    row = next(line for line in README.read_text().splitlines() if line.startswith("| Hugging Face families ("))
    assert row.startswith(f"| Hugging Face families ({', '.join(f.name for f in FAMILIES.values())}),")


@pytest.mark.parametrize("config, match", [
    (lambda: transformers.MistralConfig(sliding_window=4096), "sliding_window=4096.*set sliding_window=None"),
    (lambda: transformers.MixtralConfig(sliding_window=64), "sliding_window=64.*set sliding_window=None"),
    (lambda: transformers.Phi3Config(sliding_window=2047), "sliding_window=2047.*set sliding_window=None"),
    (lambda: transformers.Qwen3Config(use_sliding_window=True, sliding_window=8), "set use_sliding_window=False"),
    (lambda: transformers.Gemma2Config(), "soft-caps its attention logits.*without the fpdt strategy"),
    (lambda: transformers.DeepseekV3Config(), "multi-head latent attention.*without the fpdt strategy"),
    (lambda: transformers.LlamaConfig(attn_logit_softcapping=30.0), "attn_logit_softcapping=30.0"),
])
def test_what_a_family_cannot_do_is_refused_at_setup(config, match):
    """Sliding windows that are on, soft-capping and MLA raise a ValueError naming the alternative, from the config
    alone (no model is built: install checks before it changes anything)."""
    model = torch.nn.Module()
    model.config = config()
    with pytest.raises(ValueError, match=match):
        check_model(model)


def test_refused_families_are_not_registered():
    """A model_type is either a family or refused, never both."""
    assert not set(REFUSED) & set(FAMILIES)


def test_unknown_model_type_runs_the_generic_way():
    """An unregistered family (OLMo) keeps the generic install: the fpdt attention in every causal module."""
    model = transformers.OlmoForCausalLM(transformers.OlmoConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    assert family_of(model) is None
    install_hf_model(model, _context())
    assert all(hasattr(m, "_fpdt_attention") for m in model.modules() if hasattr(m, "is_causal"))


def test_multimodal_config_is_read_through_its_text_config():
    """A config whose sizes sit in a text sub-config: the family and the planner's geometry come from it."""
    text = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)

    class Multimodal:
        model_type = "multimodal"

        def get_text_config(self):
            return text

    model = torch.nn.Module()
    model.config = Multimodal()
    assert family_of(model) is FAMILIES["qwen3"]
    geometry = resolve_geometry(Multimodal())
    assert (geometry.num_layers, geometry.hidden_size, geometry.head_dim) == (3, 64, 16)
    assert resolve_geometry({"model_type": "x", "text_config": text.to_dict()}).num_kv_heads == 2


@pytest.mark.parametrize("name, model_type, checks", [
    ("qwen3-4b", "qwen3", dict(hidden_size=2560, intermediate_size=9728, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)),
    ("mixtral-8x7b", "mixtral", dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                     num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                                     vocab_size=32000, sliding_window=None)),
])
def test_bench_builds_other_families_by_named_geometry(name, model_type, checks):
    """bench.peers' qwen3-4b and mixtral-8x7b build their family's config at any depth (not the model), and the
    fpdt-hf system accepts them while the reference-Llama systems refuse them."""
    from bench.peers.cli import validate
    from bench.peers.hf_llama import hf_llama_config, named_depth, named_geometry

    config = hf_llama_config(name, num_layers=2, max_seq_len=131072)
    assert config.model_type == model_type and config.num_hidden_layers == 2
    assert config.max_position_embeddings >= 131072
    assert {k: getattr(config, k) for k in checks} == checks
    assert config.rope_parameters["rope_theta"] == 1e6
    assert named_depth(name) == (36 if name == "qwen3-4b" else 32)
    geometry = named_geometry(name)
    if name == "mixtral-8x7b":  # active parameters: ~12.9B of Mixtral's 46.7B
        assert 12.5e9 < geometry.nonembedding_parameters < 13.2e9
    import argparse
    args = argparse.Namespace(model=name, layers=2, system="fpdt", seq_len=131072, steps=1)
    with pytest.raises(ValueError, match="--system fpdt-hf"):
        validate(args, 1)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_a_router_loss_with_gradient_free_first_forwards_is_refused_at_setup(model_type):
    """output_router_logits with ActivationOffload or TiledMLP (their first forward records no router gradient): a
    ValueError at setup naming both fixes; without the router loss, or without those callbacks, nothing is refused."""
    from lightning_fpdt.integrations import check_router_loss

    torch.manual_seed(0)
    model = build(model_type)
    assert model.config.output_router_logits
    with pytest.raises(ValueError, match="output_router_logits=False.*or train without ActivationOffload and TiledMLP"):
        check_router_loss(model, forward_without_grad=["ActivationOffload", "TiledMLP"])
    check_router_loss(model, forward_without_grad=[])
    model.config.output_router_logits = False
    check_router_loss(model, forward_without_grad=["ActivationOffload"])


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_head_norms_are_read_for_the_families_whose_attention_has_them(model_type):
    """ModelGeometry.head_norms (what the planner counts for per-head q/k norms) is read from the config exactly
    for the families whose attention normalises each head's q and k."""
    torch.manual_seed(0)
    model = build(model_type)
    has = any(isinstance(getattr(m, "q_norm", None), torch.nn.Module) for m in model.modules())
    assert resolve_geometry(model.config).head_norms == has


def test_head_norms_keep_what_the_planner_counts():
    """Beyond a Llama attention of the same sizes, a Qwen3 attention (its norms tiled as the strategy tiles them)
    keeps for its backward the norms' inputs and fp32 rstd: the planner's ``StepSizes.head_norm``, to the byte."""
    from lightning_fpdt.integrations.huggingface import tile_hf_rms_norms
    from lightning_fpdt.planner.plan_options import PlanOptions
    from lightning_fpdt.planner.step_sizes import StepSizes

    tokens = 48

    def kept_for_backward(model_type: str) -> int:
        torch.manual_seed(0)
        model = build(model_type, MINI_MODELS["qwen3"]).to(torch.bfloat16)  # head_dim 8 for both
        tile_hf_rms_norms(model)
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        x = torch.randn(1, tokens, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        rotary = model.model.rotary_emb(x, torch.arange(tokens)[None])
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                kept[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = model.model.layers[0].self_attn(x, position_embeddings=rotary, attention_mask=None)
        out.float().sum().backward()  # the graph the bytes were kept for is a working one
        return sum(kept.values())

    geometry = resolve_geometry(build("qwen3").config)
    options = PlanOptions(sequence_parallel_size=1, data_parallel_size=1, chunks=1, offload=False, offload_dq=False,
                          activation_offload=True, activation_checkpointing=True, tiled_mlp=True, tiled_loss=True,
                          cpu_offload_params=False, precision="bf16-mixed", optimizer="adamw")
    expected = StepSizes(geometry, options, tokens, 1, 1).head_norm
    assert expected == tokens * (4 + 2) * (8 * 2 + 4)
    assert kept_for_backward("qwen3") - kept_for_backward("llama") == expected


def test_a_family_file_says_what_its_geometry_adds():
    """What a family's file declares (per-head q/k norms; the experts by the config fields its router names) is what
    the planner's geometry holds; a model_type no family file names adds nothing."""
    from types import SimpleNamespace

    from lightning_fpdt.integrations.families import family_geometry

    moe = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=256, moe_intermediate_size=32, num_experts=4,
                                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16)
    assert family_geometry(moe) == dict(head_norms=True, num_experts=4, experts_per_token=2, intermediate_size=32)
    geometry = resolve_geometry(moe)
    assert (geometry.head_norms, geometry.num_experts, geometry.experts_per_token, geometry.intermediate_size) == (
        True, 4, 2, 32)
    mixtral = SimpleNamespace(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    assert family_geometry(mixtral) == dict(head_norms=False, num_experts=8, experts_per_token=2)
    assert family_geometry(SimpleNamespace(model_type="llama")) == dict(head_norms=False)
    assert family_geometry(SimpleNamespace(model_type="not-a-family")) == {}
