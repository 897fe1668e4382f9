"""GradientCheck: a run in which a parameter that requires grad never gets a gradient stops with an error.

A parameter can be left out of the training without any error: nothing in the loss depends on it (a module the forward
skips), a wrapper cut the graph above it, or its gradient is zero wherever it flows. Such a run trains less than it
should and ends quietly. This callback looks at every parameter that requires grad after each of the first optimizer
steps: once each has had a non-zero gradient on some rank, it stops looking; a parameter that still has not after
``steps`` steps stops the run on every rank with an error naming it.

It reads the gradients the step leaves behind, after the step (so an optimizer that steps during the backward is not
hindered): one pass over the gradients and one small collective per step, for the first few steps only. The fpdt
strategy adds one to every fit, and so do the memory callbacks under another strategy, unless the trainer has one.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor

from lightning_fpdt.flops import is_count

NO_GRADIENT, ZERO_GRADIENT, TRAINED = 0, 1, 2
"""What a parameter's gradients have been so far: none at all, only zeros, non-zero somewhere."""
SHOWN = 12
"""Parameter names an error lists before it counts the rest."""


class GradientCheck(Callback):
    """Stops a fit in which a parameter that requires grad gets no non-zero gradient in the first ``steps`` steps.

    Args:
        steps: optimizer steps within which every parameter that requires grad must have had a non-zero gradient on
            some rank. More than one: a LoRA adapter's ``A`` matrix gets zero gradients until its ``B`` (initialised
            to zero) has stepped once, and a mixture of experts may route no token to an expert for a step or two.
            ``0`` turns the check off.
        allow: names (``fnmatch`` patterns over ``named_parameters()`` of the LightningModule, e.g.
            ``"model.pooler.*"``) of parameters that may go without gradients.
    """

    def __init__(self, steps: int = 3, allow: Optional[list[str]] = None) -> None:
        if not is_count(steps, least=0):
            raise ValueError(f"GradientCheck(steps={steps!r}): give a number of optimizer steps >= 0 (0: no check)")
        self.steps = steps
        self.allow = list(allow or [])
        self._names: list[str] = []
        self._seen: Optional[Tensor] = None  # per parameter: NO_GRADIENT, ZERO_GRADIENT or TRAINED so far
        self._checked = 0
        self._last_step: Optional[int] = None

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._names = [name for name, p in pl_module.named_parameters()
                       if p.requires_grad and not any(fnmatch.fnmatchcase(name, pattern) for pattern in self.allow)]
        self._seen = torch.zeros(len(self._names), dtype=torch.int32)
        self._checked = 0
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", *args: Any) -> None:
        if self._done() or trainer.global_step == self._last_step:
            return  # checked all it had to, or within an accumulation window
        self._last_step = trainer.global_step
        self._checked += 1
        params = dict(pl_module.named_parameters())
        found = gradient_states([params[name].grad for name in self._names], device=trainer.strategy.root_device)
        self._seen = torch.maximum(self._seen, found)
        if not self._done() and self._checked >= self.steps:
            message = untrained_message(self._names, self._seen, self._checked, total=len(self._names))
            self._names = []  # one error, and nothing more to check
            raise RuntimeError(message)

    def _done(self) -> bool:
        return self.steps == 0 or self._seen is None or bool((self._seen == TRAINED).all())


def gradient_states(grads: Sequence[Optional[Tensor]], device: torch.device) -> Tensor:
    """Per gradient: ``NO_GRADIENT`` (``None``), ``ZERO_GRADIENT`` or ``TRAINED`` (a non-zero element), the most any
    rank of the default process group has (one collective when there are several). Sharded (DTensor) gradients are
    read as this rank's shard."""
    states = torch.full((len(grads),), NO_GRADIENT, dtype=torch.int32)
    by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
    for i, grad in enumerate(grads):
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            by_device.setdefault(local.device, []).append((i, local))
    for entries in by_device.values():  # one read back per device
        nonzero = torch.stack([local.ne(0).any() for _, local in entries]).cpu()
        for (i, _), flag in zip(entries, nonzero.tolist()):
            states[i] = TRAINED if flag else ZERO_GRADIENT
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        reduced = states.to(device)
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
        states = reduced.cpu()
    return states


def untrained_message(names: Sequence[str], seen: Tensor, steps: int, total: int) -> str:
    """The error for the parameters of ``names`` that ``seen`` does not mark ``TRAINED`` after ``steps`` steps."""
    none = [name for name, state in zip(names, seen.tolist()) if state == NO_GRADIENT]
    zero = [name for name, state in zip(names, seen.tolist()) if state == ZERO_GRADIENT]
    parts = [f"{len(none) + len(zero)} of the {total} parameters that require grad did not train in the first "
             f"{steps} optimizer step{'s' if steps > 1 else ''} (on any rank):"]
    if none:
        parts.append(f"No gradient at all for {len(none)}: {_listed(none)}. Nothing in the loss reached them: a "
                     f"module the forward does not call, or a wrapper that cut the graph above them (a checkpoint "
                     f"whose output does not require grad when its input does not, e.g. under frozen embeddings).")
    if zero:
        parts.append(f"Only zero gradients for {len(zero)}: {_listed(zero)}. Their outputs do not change the loss: "
                     f"masked out, multiplied by zero, or replaced (a KV cache filled twice by a recomputed forward "
                     f"leaves the keys' and values' projections without gradient).")
    parts.append("Freeze what should not train (requires_grad_(False)); to let named parameters go without "
                 "gradients, add lightning_fpdt.GradientCheck(allow=['<name pattern>', ...]) to the trainer's "
                 "callbacks (GradientCheck(steps=0) turns the check off).")
    return " ".join(parts)


def _listed(names: Sequence[str]) -> str:
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def add_gradient_check(trainer: "pl.Trainer") -> None:
    """Give ``trainer`` a :class:`GradientCheck` unless it has one (the user's, with its options, wins)."""
    if not any(isinstance(callback, GradientCheck) for callback in trainer.callbacks):
        trainer.callbacks.append(GradientCheck())
