"""Materialising a model built on the meta device: each rank allocates only its FSDP2 shards and initialises them
(docs/design.md §5)."""

from __future__ import annotations

import warnings
from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_fpdt.integrations.discovery import language_models
from lightning_fpdt.lightning_private import _materialize_distributed_module


def has_meta_parameters(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def materialize(module: nn.Module, device: torch.device, *, rank: int) -> None:
    """Allocate the meta parameters and buffers of ``module`` on ``device`` (FSDP2 DTensors: each rank only its
    shards) and initialise them: each language model with its own ``reset_parameters`` where it has one (the reference
    Llama's N(0, initializer_range) and norms at 1; per submodule, ``nn.Linear`` would give its Kaiming init instead),
    everything else with each submodule's (Lightning's ``_materialize_distributed_module``)."""
    models = language_models(module)
    resets = [model for model in models if callable(getattr(model, "reset_parameters", None))]
    with _distinct_shard_draws(device, rank=rank):
        if not resets:
            _materialize_distributed_module(module, device)
        else:
            module.to_empty(device=device)  # on the root, as Lightning's helper: nothing left on meta
            for model in resets:
                model.reset_parameters()
            _reset_the_rest(module, {id(m) for model in resets for m in model.modules()})
    for model in models:
        model.apply(_retie_weights)


def _reset_the_rest(module: nn.Module, done: set[int]) -> None:
    """Each submodule outside ``done`` that holds parameters or buffers of its own gets its ``reset_parameters`` (a
    head beside the model)."""
    for sub in module.modules():
        holds = any(True for _ in sub.parameters(recurse=False)) or any(True for _ in sub.buffers(recurse=False))
        reset = getattr(sub, "reset_parameters", None)
        if id(sub) not in done and holds and callable(reset):
            reset()


def _retie_weights(module: nn.Module) -> None:
    # materialising meta parameters unties shared ones; models that tie re-tie here
    tie = getattr(module, "tie_weights", None)
    if callable(tie) and getattr(getattr(module, "config", None), "tie_word_embeddings", False):
        tie()


@contextmanager
def _distinct_shard_draws(device: torch.device, *, rank: int) -> Generator[None, None, None]:
    """Random ops on DTensors draw each rank's shard at its own offset of one shared stream on CUDA-like devices, but
    shards in host memory from each rank's CPU generator as it stands (DTensor's ``OffsetBasedRNGTracker`` refuses
    the CPU), so ranks seeded alike would draw equal shards. For those each rank draws from a stream of its own,
    derived from the global RNG, which is left where it was (the flat FSDP2 mesh gives no two ranks the same
    shard)."""
    if device.type != "cpu":
        yield
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # DTensor warns that its random ops may not fully support a CPU mesh: the per-rank stream is the answer
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        torch.manual_seed(int(torch.randint(2**62, ())) + rank)
        yield
