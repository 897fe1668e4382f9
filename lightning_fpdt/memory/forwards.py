"""The one way lightning_fpdt replaces a module's ``forward``.

Every replacement keeps the forward it replaces as ``__wrapped__`` (the convention of ``functools.wraps``), so the
original can always be reached, and is marked as made here, so a test can tell the package's replacements from
anything else on a module (``lightning_fpdt.integrations.attributes`` lists the modules whose forward is replaced).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from torch import nn

REPLACED_FORWARD = "_fpdt_replaced_forward"
"""Set (True) on every forward :func:`replace_forward` installed."""

F = TypeVar("F", bound=Callable[..., Any])


def replace_forward(module: nn.Module, forward: F) -> F:
    """``module.forward = forward`` (on the instance, never the class), with ``forward.__wrapped__`` the forward it
    replaces; returns ``forward``. ``forward`` is a function, a ``functools.partial`` or a callable object: anything
    that takes attributes (not a bound method)."""
    forward.__wrapped__ = module.forward  # type: ignore[attr-defined]
    setattr(forward, REPLACED_FORWARD, True)
    module.forward = forward
    return forward


def replaced_forwards(model: nn.Module) -> dict[str, Callable[..., Any]]:
    """``{module name: forward}`` of the modules of ``model`` whose forward was replaced on the instance."""
    return {name: module.__dict__["forward"] for name, module in model.named_modules() if "forward" in module.__dict__}
