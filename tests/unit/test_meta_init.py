"""LlamaLM(meta_init=True) builds nothing but shapes."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.models.module import LlamaLM


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
