"""LlamaLM(meta_init=True) builds nothing but shapes; the strategy's materialisation uses the model's own init."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fpdt.models.llama import LlamaConfig, RMSNorm
from lightning_fpdt.models.module import LlamaLM
from lightning_fpdt.strategy.materialize import materialize


def test_meta_init_builds_llama3_8b_on_meta():
    """meta_init leaves every parameter of an 8B model on the meta device (no 32 GB fp32 copy, no init)."""
    module = LlamaLM("llama3-8b", meta_init=True)
    params = list(module.model.parameters())
    assert params and all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == LlamaConfig.from_name("llama3-8b").num_parameters()
    assert module.hparams.meta_init is True  # saved with the checkpoint's hyperparameters


def test_meta_init_warns_that_seed_has_no_effect():
    """A seed other than the default warns under meta_init: the strategy initialises from the global RNG."""
    with pytest.warns(UserWarning, match=r"seed \(5\) has no effect with meta_init=True.*seed_everything\(5\)"):
        LlamaLM("tiny", meta_init=True, seed=5)


@pytest.mark.parametrize("tied", [False, True])
def test_materialize_uses_the_model_init(tied):
    """Materialising uses the model's reset_parameters (N(0, 0.02), norms 1, re-tied), not nn.Linear's Kaiming init,
    draws per rank on the CPU, and leaves the global RNG where it was."""
    torch.manual_seed(0)
    state = torch.get_rng_state()
    weights = []
    for rank in (0, 1):
        module = LlamaLM("tiny", meta_init=True, tie_word_embeddings=tied)
        materialize(module, torch.device("cpu"), rank=rank)
        model = module.model
        assert not any(p.is_meta for p in model.parameters())
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in model.modules() if isinstance(m, RMSNorm))
        gate = model.model.layers[0].mlp.gate_proj.weight  # 8192 draws: sample std within 1% of 0.02 (see
        assert abs(gate.std().item() - 0.02) < 0.002  # test_llama); Kaiming's would be 1/sqrt(3 * 64) = 0.072
        weights.append(gate.detach().clone())
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(weights[0], weights[1])  # ranks seeded alike draw different shards


class PlainModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))


def test_materialize_without_model_init_resets_each_submodule():
    """A model without reset_parameters of its own gets each submodule's (Lightning's materialisation)."""
    module = PlainModule()
    materialize(module, torch.device("cpu"), rank=0)
    linear, norm = module.model
    assert not any(p.is_meta for p in module.parameters())
    assert linear.weight.abs().max() <= 64**-0.5  # Kaiming uniform: bound 1/sqrt(fan_in)
    assert linear.weight.std() > 0.03  # 1/sqrt(3 * 64) = 0.072: drawn, not left empty
    assert torch.equal(norm.weight, torch.ones(64)) and torch.equal(norm.bias, torch.zeros(64))
