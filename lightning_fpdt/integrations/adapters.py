"""``PeftModel.save_pretrained`` after ``fit`` on a model FSDP2 shards (docs/adapters.md).

peft's own ``save_pretrained`` reads the parameters' local storage, which FSDP2's sharded parameters do not have, so it
fails on a trained model. At the end of every ``fit`` (a point every rank reaches together) the strategy gathers the
adapters' weights, the trainable parameters, whole onto the CPU of each rank and keeps them on the wrapper; the
wrapper's ``save_pretrained`` then writes those when it is given no ``state_dict``. No collective runs when the user
saves, so ``if trainer.is_global_zero: model.save_pretrained(...)`` is safe. Trainable weights beyond
:data:`MAX_KEPT_BYTES` (a wrapper that trains more than adapters), or shards on the host (``cpu_offload_params``), are
not kept: ``save_pretrained`` then raises a ``ValueError`` naming :func:`lightning_fpdt.export.save_adapters`, which
gathers them when called on every rank.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

MAX_KEPT_BYTES = 2**30
"""The most trainable bytes kept on the CPU for ``save_pretrained`` (LoRA's adapters are a few MB to a few hundred)."""
_KEPT = "_fpdt_trained_adapters"
_WRAPPED = "_fpdt_save_pretrained"


def adapter_wrappers(module: nn.Module) -> list[nn.Module]:
    """The adapter wrappers in ``module`` that save themselves: modules with ``get_base_model``, ``save_pretrained``
    and a ``peft_config`` (peft's ``PeftModel``, duck-typed so that peft need not be installed)."""
    return [m for m in module.modules() if callable(getattr(m, "get_base_model", None))
            and callable(getattr(m, "save_pretrained", None)) and hasattr(m, "peft_config")]


def keep_trained_adapters(module: nn.Module) -> None:
    """Collective when a wrapper's parameters are sharded: every rank calls it, at the end of ``fit``. Gathers each
    sharded wrapper's trainable parameters whole onto the CPU and lets its ``save_pretrained`` write them."""
    for wrapper in adapter_wrappers(module):
        if not any(isinstance(p, DTensor) for p in wrapper.parameters()):
            continue  # peft's own save_pretrained reads plain parameters
        trainable = [(name, p) for name, p in wrapper.named_parameters() if p.requires_grad]
        size = sum(p.numel() * p.element_size() for _, p in trainable)
        on_host = any(isinstance(p, DTensor) and p.to_local().device.type != p.device_mesh.device_type
                      for _, p in trainable)  # cpu_offload_params: the shards cannot be gathered where they are
        if size > MAX_KEPT_BYTES:
            kept: Any = (f"the {size / 2**20:,.0f} MiB of trainable weights were not kept after fit (more than "
                         f"{MAX_KEPT_BYTES / 2**30:.0f} GiB)")
        elif on_host:
            kept = "the trainable weights live on the host (cpu_offload_params) and were not gathered after fit"
        else:
            kept = {name: whole_on_cpu(p) for name, p in trainable}
        setattr(wrapper, _KEPT, kept)
        if not hasattr(wrapper, _WRAPPED):
            _wrap_save_pretrained(wrapper)


def whole_on_cpu(value: Tensor) -> Tensor:
    """``value`` whole on the CPU: an FSDP2 shard all-gathered (collective), any other tensor as it is."""
    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()


def _wrap_save_pretrained(wrapper: nn.Module) -> None:
    own = wrapper.save_pretrained

    def save_pretrained(save_directory: Any, *args: Any, state_dict: Optional[dict[str, Tensor]] = None,
                        **kwargs: Any) -> Any:
        if state_dict is None:
            kept = getattr(wrapper, _KEPT)
            if not isinstance(kept, dict):
                raise ValueError(
                    f"{type(wrapper).__name__}.save_pretrained cannot read FSDP2's sharded parameters, and {kept}: "
                    "call lightning_fpdt.export.save_adapters(model, directory) on every rank instead (it gathers "
                    "them; rank 0 writes)"
                )
            state_dict = kept
        return own(save_directory, *args, state_dict=state_dict, **kwargs)

    save_pretrained.__doc__ = own.__doc__
    setattr(wrapper, _WRAPPED, own)
    wrapper.save_pretrained = save_pretrained  # an instance attribute: the class and other instances are untouched
