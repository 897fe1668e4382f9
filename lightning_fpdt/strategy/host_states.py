"""What a run's model and optimizers hold in host memory, as the memory budget counts it: FSDP2's host-resident
parameter shards page-locked each exactly its size, the bytes of optimizer states and gradients already on the host,
and the parameters that train (only they have gradients and states)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from lightning_fpdt.offload.host_memory import HostAllocator


def host_state_bytes(optimizers: Sequence[Any], model: torch.nn.Module) -> int:
    """Bytes of optimizer states and gradients already in host memory (resident now, counted by the plan too)."""
    seen: set[int] = set()
    total = 0

    def count(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()

    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                count(value)
    for parameter in model.parameters():
        count(parameter.grad)
    return total


def register_host_states(model: torch.nn.Module, *, pin: bool) -> HostAllocator:
    """Page-lock FSDP2's host-resident parameter shards, each exactly its size (FSDP2's own pinning goes through the
    caching host allocator, which rounds every shard up to a power of two; ``parallelize.py`` turns it off)."""
    allocator = HostAllocator(pin=pin)
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if local.device.type == "cpu":
            allocator.register(local.detach())
    return allocator


def trainable_parameters(model: torch.nn.Module) -> Optional[int]:
    """The parameters of ``model`` that train (LoRA's adapters, what is not frozen), counted whole (a sharded
    parameter's global size); ``None`` when every one trains."""
    parameters = list(model.parameters())
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    return None if trainable == sum(p.numel() for p in parameters) else trainable
