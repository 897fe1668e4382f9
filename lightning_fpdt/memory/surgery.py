"""Finding the parts of a model that the transforms change: the network inside a LightningModule, its transformer
blocks, and its MLPs. By structure and class name only; nothing here knows a model family."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from torch import nn


def has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def find_model(module: nn.Module) -> nn.Module:
    """The network inside a LightningModule: its single child that holds parameters, or the module itself; inside an
    adapter wrapper that names the network it wraps (``get_base_model()``, as peft's ``PeftModel``), that network,
    which holds the adapters in its own modules. The wrapper may be ``module`` itself or that child."""
    wrapped = base_model(module)
    if wrapped is not None:
        return wrapped
    children = [c for c in module.children() if has_parameters(c)]
    model = children[0] if len(children) == 1 else module
    return base_model(model) or model


def base_model(wrapper: nn.Module) -> Optional[nn.Module]:
    """The network an adapter wrapper names (``get_base_model()``); ``None`` for a module that is none."""
    get = getattr(wrapper, "get_base_model", None)
    base = get() if callable(get) else None
    return base if isinstance(base, nn.Module) and base is not wrapper else None


def find_blocks(model: nn.Module, layer_classes: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The transformer blocks: modules of ``layer_classes``, else the members of the largest ``nn.ModuleList``."""
    if layer_classes:
        names = set(layer_classes)
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        if not blocks:
            raise ValueError(f"layer_classes={sorted(names)} matched no module of {type(model).__name__}")
        return blocks
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=len))


def is_gated_mlp(module: nn.Module) -> bool:
    """Llama/Qwen/Mistral-style ``down(act(gate(x)) * up(x))``: submodules ``gate_proj``, ``up_proj``, ``down_proj``."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in ("gate_proj", "up_proj", "down_proj"))


def is_sequential_mlp(module: nn.Module) -> bool:
    """``nn.Sequential(Linear, activation, Linear)`` with a parameter-free activation."""
    return (
        isinstance(module, nn.Sequential)
        and len(module) == 3
        and isinstance(module[0], nn.Linear)
        and isinstance(module[2], nn.Linear)
        and not has_parameters(module[1])
        and module[0].out_features == module[2].in_features
    )


def find_mlps(roots: Sequence[nn.Module], mlp_classes: Optional[Sequence[str]] = None) -> list[nn.Module]:
    """The MLPs inside ``roots``: of ``mlp_classes`` if given, else gated and Linear-act-Linear ones; outermost only."""
    names = set(mlp_classes) if mlp_classes else None
    found: list[nn.Module] = []
    inside: set[int] = set()  # ids of modules within an MLP already found (an MLP is tiled as a whole)
    for root in roots:
        for module in root.modules():
            if id(module) in inside:
                continue
            if names is not None:
                match = type(module).__name__ in names
            else:
                match = is_gated_mlp(module) or is_sequential_mlp(module)
            if match:
                found.append(module)
                inside.update(id(m) for m in module.modules())
    return found
