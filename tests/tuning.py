"""Which parameters train: the fine-tuning patterns every memory callback must train exactly (frozen embeddings, a
frozen block, only the MLPs, LoRA adapters), applied alike to the parallel run and to its one-process reference."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_fpdt.memory.surgery import find_blocks, find_mlps

ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_PROJECTIONS = ["gate_proj", "up_proj", "down_proj"]


def _embeddings(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        return get()
    return next(m for m in model.modules() if isinstance(m, nn.Embedding))


def freeze_embeddings(model: nn.Module, seed: int) -> nn.Module:
    """The input embeddings frozen (the most common freeze): no block's input requires grad."""
    _embeddings(model).weight.requires_grad_(False)
    return model


def freeze_first_block(model: nn.Module, seed: int) -> nn.Module:
    """The first transformer block frozen: the second block's input requires grad only through the embeddings."""
    find_blocks(model)[0].requires_grad_(False)
    return model


def train_mlps_only(model: nn.Module, seed: int) -> nn.Module:
    """Only the MLPs train: attention, norms, embeddings and head are frozen."""
    model.requires_grad_(False)
    for mlp in find_mlps([model]):
        mlp.requires_grad_(True)
    return model


def lora(targets: list[str], *, random_b: bool = True, dropout: float = 0.0) -> Callable[[nn.Module, int], nn.Module]:
    """peft's LoRA (rank 4) on the ``targets`` projections; everything else frozen. ``random_b``: ``B`` drawn at random
    (every adapter has gradients from the first step) instead of peft's zeros (``A`` then gets zero gradients until
    ``B`` has stepped once)."""

    def apply(model: nn.Module, seed: int) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed + 1)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
                            init_lora_weights=not random_b)
        return get_peft_model(model, config)

    return apply


TUNINGS: dict[str, Callable[[nn.Module, int], nn.Module]] = {
    "embeddings": freeze_embeddings,
    "first-block": freeze_first_block,
    "mlps": train_mlps_only,
    "lora-attention": lora(ATTENTION_PROJECTIONS),
    "lora-mlp": lora(MLP_PROJECTIONS),
    "lora-default": lora(ATTENTION_PROJECTIONS, random_b=False),
    "lora-dropout": lora(ATTENTION_PROJECTIONS, dropout=0.2),
}
"""``name -> tune(model, seed)``, which returns the model to train (peft wraps it)."""


def tune(model: nn.Module, tuning: str, seed: int) -> nn.Module:
    return TUNINGS[tuning](model, seed)
