"""Which language models a LightningModule holds: every one the strategy puts on the sequence-parallel path.

A LightningModule may hold more than the model it trains: a value head, a probe, a frozen reference model (DPO), a
teacher. Each language model among its modules, wherever it sits and however many there are, gets the fpdt attention,
its family's checks, the sequence's loss and the memory transforms; what is not a language model (a head) stays as it
is and runs on the tokens of its rank. A module is a language model when it is a Hugging Face ``PreTrainedModel`` or
the reference Llama, or an adapter wrapper (peft's ``PeftModel``) of one; the search does not descend into a model it
found. A module holding none of them is one plain network (nanoGPT style, blocks calling
``F.scaled_dot_product_attention``): :func:`~lightning_fpdt.memory.surgery.find_model`'s.

One of them is *planned* (:func:`planned_model`): the first that has trainable parameters, else the first. The memory
planner plans its geometry and counts the others' parameters beside it (:func:`other_parameters`).
"""

from __future__ import annotations

from torch import nn

from lightning_fpdt.integrations.huggingface import is_hf_model, train_mode_for_fit
from lightning_fpdt.integrations.install import can_tile_loss
from lightning_fpdt.integrations.reference_llama import is_reference_llama
from lightning_fpdt.memory.surgery import base_model, find_model


def is_language_model(module: nn.Module) -> bool:
    """A Hugging Face ``PreTrainedModel`` or the reference Llama."""
    return is_reference_llama(module) or is_hf_model(module)


def language_models(module: nn.Module) -> list[nn.Module]:
    """Every language model in ``module``'s tree, outermost first in module order (an adapter wrapper stands for the
    network it wraps, which holds the adapters); none found: ``[find_model(module)]``, the one plain network."""
    found: list[nn.Module] = []

    def visit(node: nn.Module) -> None:
        wrapped = base_model(node)
        if wrapped is not None and is_language_model(wrapped):
            found.append(wrapped)
            return
        if is_language_model(node):
            found.append(node)
            return
        for child in node.children():
            visit(child)

    visit(module)
    unique = list({id(model): model for model in found}.values())  # a model reached twice (a shared module) once
    return unique or [find_model(module)]


def trains(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` requires a gradient."""
    return any(p.requires_grad for p in model.parameters())


def planned_model(module: nn.Module) -> nn.Module:
    """The model the memory planner plans (its config, its blocks): the first language model that trains, else the
    first one (:func:`language_models`)."""
    models = language_models(module)
    return next((model for model in models if trains(model)), models[0])


def other_parameters(module: nn.Module) -> tuple[int, int]:
    """``(all, trainable)``: the parameters of ``module`` outside :func:`planned_model` (a frozen reference model, a
    value head), each shared tensor once; the planner counts their weights, and the trainable ones' gradients and
    optimizer states."""
    planned = {id(p) for p in planned_model(module).parameters()}
    others = {id(p): p for p in module.parameters() if id(p) not in planned}.values()
    return sum(p.numel() for p in others), sum(p.numel() for p in others if p.requires_grad)


def train_modes_for_fit(module: nn.Module) -> list[str]:
    """Put each Hugging Face model of ``module`` that trains and is in eval mode (as ``from_pretrained`` returns it)
    in training mode for ``fit`` (:func:`~lightning_fpdt.integrations.huggingface.train_mode_for_fit`); a frozen one (a
    reference model) stays as it is, its dropout off. Returns the class names of the models it switched."""
    return [type(model).__name__ for model in language_models(module) if trains(model) and train_mode_for_fit(model)]


def transform_targets(slot: str, models: list[nn.Module]) -> list[nn.Module]:
    """The models a memory transform of ``slot`` changes: the tiled MLP every model (a frozen model's forward gains
    the same tiles); the tiled loss each causal LM (none: the first model, whose refusal names the way out);
    checkpointing the models that train (a frozen model's forward records no graph, nothing to recompute; none: the
    first)."""
    if slot == "tiled_loss":
        return [model for model in models if can_tile_loss(model)] or models[:1]
    if slot == "activation_checkpointing":
        return [model for model in models if trains(model)] or models[:1]
    return list(models)
