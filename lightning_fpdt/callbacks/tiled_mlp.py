"""``TiledMLP``: the MLP of every block runs over sequence tiles, only its input kept for backward (DESIGN.md §6).

At long context the MLP's intermediate activations are the largest buffers of a block: for Llama-3-8B each token
holds three 14336-wide vectors (gate, up and their product) against a 4096-wide input, so 256K local tokens need
~21 GiB in bf16. Here the forward runs tile by tile under ``no_grad`` and saves only the input; the backward
recomputes one tile at a time with grad enabled, so one tile's intermediates exist at any moment (ALST's TiledMLP,
FPDT's chunked FFN). The cost is one more MLP forward per step.

Three layers: :func:`tiled_mlp_forward` / :func:`tiled_mlp_backward` hold the tile loops,
:class:`TiledMLPFunction` only handles ``ctx``, and :func:`tiled_mlp` is the public call. :func:`apply_tiled_mlp`
switches the MLPs of a model in place; :class:`TiledMLP` is the Lightning callback that declares it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any, Callable, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.dropout import _DropoutNd

AUTO_TILE_BYTES = 256 * 2**20
"""``num_tiles="auto"``: one tile's intermediate activations (``tokens × intermediate × 3 × dtype bytes``) stay
under this."""
INTERMEDIATE_BUFFERS = 3
"""Buffers of ``intermediate_size`` width per token in a gated MLP: gate, up, and act(gate) · up."""
_TILED = "_fpdt_tiled_mlp"
VALUE_UNUSED_IN_RECOMPUTE = "_fpdt_mlp_value_unused_in_recompute"
"""Set on an MLP by ActivationOffload: an object whose ``recomputing`` is true while the block's checkpoint
recomputes it, in a block where nothing reads the MLP's output value then (it only feeds the residual add)."""


# ---- shared by the tiled callbacks --------------------------------------------------------------------------------
def check_num_tiles(num_tiles: Union[Literal["auto"], int], owner: str) -> None:
    """``ValueError`` unless ``num_tiles`` is ``"auto"`` or a positive int."""
    if num_tiles == "auto":
        return
    if isinstance(num_tiles, bool) or not isinstance(num_tiles, int) or num_tiles < 1:
        raise ValueError(f"{owner}(num_tiles={num_tiles!r}): give 'auto' or a positive int (1 = untiled)")


def tile_bounds(num_tokens: int, num_tiles: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of ``num_tiles`` contiguous tiles covering ``num_tokens`` (``tensor_split`` sizes:
    the first ``num_tokens % num_tiles`` tiles one longer); fewer tiles when there are fewer tokens, one if none."""
    num_tiles = max(1, min(num_tiles, num_tokens))
    base, longer = divmod(num_tokens, num_tiles)
    bounds, start = [], 0
    for i in range(num_tiles):
        end = start + base + (1 if i < longer else 0)
        bounds.append((start, end))
        start = end
    return bounds


def transform_without_fpdt(callback: Any, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
    """Apply ``callback.fpdt_transform`` to the network in ``pl_module`` when the strategy is not ``"fpdt"`` (which
    applies it itself, in its fixed order before FSDP2)."""
    from lightning_fpdt.strategy.fpdt import FPDTStrategy  # lazily: the strategy module imports the callbacks' users
    from lightning_fpdt.strategy.parallelize import find_blocks, find_model

    if isinstance(trainer.strategy, FPDTStrategy):
        return
    model = find_model(pl_module)
    if not any(True for _ in model.parameters()):
        raise ValueError(
            f"{type(callback).__name__} transforms the model at setup when the strategy is not 'fpdt', but "
            f"{type(pl_module).__name__} has no parameters yet (built in configure_model?): build the model in "
            f"__init__, or train with strategy='fpdt', which applies the transform after configure_model"
        )
    callback.fpdt_transform(model, find_blocks(model))


# ---- the tile loops -------------------------------------------------------------------------------------------------
def auto_mlp_tiles(num_tokens: int, intermediate_size: int, element_size: int) -> int:
    """Tiles such that one tile's ``tokens × intermediate_size × 3`` activations stay under 256 MiB; at least 1."""
    tile_bytes = num_tokens * intermediate_size * INTERMEDIATE_BUFFERS * element_size
    return max(1, math.ceil(tile_bytes / AUTO_TILE_BYTES))


def _as_input(tile: Tensor, rank: int) -> Tensor:
    # the MLP sees a tile with the rank of its usual input: (n, hidden) -> (1, ..., n, hidden)
    return tile.view((1,) * (rank - 2) + tuple(tile.shape)) if rank > 2 else tile


def tiled_mlp_forward(fn: Callable[[Tensor], Tensor], x: Tensor, num_tiles: int) -> Tensor:
    """``fn`` over token tiles of ``x (..., S, hidden)``; returns ``(..., S, out)``. Runs under the caller's grad
    mode (``no_grad`` inside :class:`TiledMLPFunction`)."""
    x_flat = x.reshape(-1, x.shape[-1])  # (N, hidden), N = all tokens of the local shard
    out: Optional[Tensor] = None
    for start, end in tile_bounds(x_flat.shape[0], num_tiles):
        y = fn(_as_input(x_flat[start:end], x.dim()))
        y = y.reshape(end - start, -1)  # (n, out)
        if out is None:
            out = y.new_empty((x_flat.shape[0], y.shape[-1]))  # filled in place: no second copy as with cat
        out[start:end] = y
    assert out is not None
    return out.view(*x.shape[:-1], out.shape[-1])


def tiled_mlp_backward(
    fn: Callable[[Tensor], Tensor], x: Tensor, grad_out: Tensor, num_tiles: int, *, input_needs_grad: bool,
    params: Sequence[Tensor] = (),
) -> Optional[Tensor]:
    """Recompute ``fn`` one tile at a time and backpropagate that tile's output gradient through it.

    The gradients of ``params`` (the trainable parameters ``fn`` uses) are summed over the tiles in fp32 (at least)
    and added to their ``.grad`` once at the end, where FSDP2 reads them in its post-backward: summed tile by tile in
    a bf16 ``.grad`` they would be rounded once per tile (84 tiles for Llama-3-8B at 256K tokens), where the untiled
    MLP's single matmul rounds once. Gradients of parameters not in ``params`` accumulate as autograd does. The
    input gradient is returned.
    """
    x_flat = x.detach().reshape(-1, x.shape[-1])  # (N, hidden)
    grad_flat = grad_out.reshape(x_flat.shape[0], -1)  # (N, out)
    grad_x = torch.empty_like(x_flat) if input_needs_grad else None
    params = [p for p in params if p.requires_grad]
    sums: list[Optional[Tensor]] = [None] * len(params)  # fp32 sums over the tiles, allocated at first use
    for start, end in tile_bounds(x_flat.shape[0], num_tiles):
        x_tile = x_flat[start:end].detach().requires_grad_(input_needs_grad)  # (n, hidden), a leaf of this tile
        with torch.enable_grad():
            y = fn(_as_input(x_tile, x.dim()))
        inputs = ([x_tile] if input_needs_grad else []) + params
        grads = torch.autograd.grad(y, inputs, grad_flat[start:end].view_as(y), allow_unused=True)
        if grad_x is not None:
            grad_x[start:end] = grads[0]
        for i, grad in enumerate(grads[1:] if input_needs_grad else grads):
            if grad is not None:
                acc = torch.promote_types(grad.dtype, torch.float32)
                sums[i] = grad.to(acc) if sums[i] is None else sums[i].add_(grad)
    for param, total in zip(params, sums):
        if total is not None:
            total = total.to(param.dtype)
            param.grad = total if param.grad is None else param.grad.add_(total)
    return grad_x.view_as(x) if grad_x is not None else None


class TiledMLPFunction(torch.autograd.Function):
    """An MLP over sequence tiles that keeps only its input for backward.

    ============  ==================  ============================  ==================================================
    tensor        shape               sharded dim                   saved for backward?
    ============  ==================  ============================  ==================================================
    ``x``         ``(B, S/P, h)``     sequence (the local shard)    saved: the only activation kept; each tile's
                                                                    intermediates are recomputed in backward
    tile          ``(1, n, h)``       a slice of the local tokens   no: lives during one tile's forward or backward
    intermediate  ``(1, n, I) × 3``   —                             no: the memory this removes (``n`` of ``S/P``)
    ``out``       ``(B, S/P, h)``     sequence                      no
    ``params``    module parameters   —                             no: inputs so the output requires grad when only
                                                                    they do; their gradients are summed over the
                                                                    recomputed tiles in fp32 and added to ``.grad``
                                                                    once (``None`` returned here)
    ============  ==================  ============================  ==================================================

    The MLP must act on each token separately and deterministically (no dropout: a recomputed tile would draw a
    different mask). Autocast state is recorded in forward and restored for the recomputation. With
    ``compute_value=False`` (a block checkpoint's recompute in which nothing reads the output, see
    ``ActivationOffload``) the forward returns zeros (one zero broadcast to ``x``'s shape) and computes nothing: the
    backward recomputes the tiles anyway.
    """

    @staticmethod
    def forward(
        ctx: Any, fn: Callable[[Tensor], Tensor], num_tiles: int, compute_value: bool, x: Tensor, *params: Tensor
    ) -> Tensor:
        ctx.fn, ctx.num_tiles, ctx.params = fn, num_tiles, params
        device_type = x.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(x)
        if not compute_value:
            # a checkpoint's recompute where nothing reads this value: only the graph matters, and the backward
            # recomputes every tile itself (an MLP maps hidden to hidden). One zero broadcast to x's shape: no
            # hidden-sized buffer (the residual add that reads it makes its own output)
            return x.new_zeros(()).expand_as(x)
        return tiled_mlp_forward(fn, x, num_tiles)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        (x,) = ctx.saved_tensors
        device_type, enabled, dtype = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):  # the backward thread has its own state
            grad_x = tiled_mlp_backward(ctx.fn, x, grad_out, ctx.num_tiles, input_needs_grad=ctx.needs_input_grad[3],
                                        params=ctx.params)
        return (None, None, None, grad_x) + (None,) * len(ctx.params)


def tiled_mlp(
    fn: Callable[[Tensor], Tensor], x: Tensor, *, num_tiles: int, params: Iterable[Tensor] = (),
    compute_value: bool = True,
) -> Tensor:
    """``fn(x)`` computed over ``num_tiles`` token tiles, keeping only ``x`` for backward.

    Args:
        fn: a token-wise function, e.g. an MLP's original ``forward``; its parameters must be usable where this is
            called (under FSDP2: inside the forward of the module that owns them).
        x: ``(..., S, hidden)``.
        num_tiles: tiles over all tokens of ``x`` (capped at the token count).
        params: the trainable parameters ``fn`` uses (so the output requires grad when only they do).
        compute_value: ``False`` returns zeros of ``x``'s shape with the same graph: for a checkpoint's recompute in
            which nothing reads the output (the backward recomputes the tiles anyway); ``fn`` must map ``x``'s width to
            itself.
    """
    if num_tiles < 1:
        raise ValueError(f"tiled_mlp(num_tiles={num_tiles}): give a positive number of tiles")
    return TiledMLPFunction.apply(fn, num_tiles, compute_value, x, *params)


# ---- finding and switching MLPs -----------------------------------------------------------------------------------
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
        and not any(True for _ in module[1].parameters())
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


def _intermediate_size(mlp: nn.Module) -> Optional[int]:
    return max((m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)), default=None)


def _tile(mlp: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
    forward = mlp.forward
    intermediate = _intermediate_size(mlp)

    @functools.wraps(forward)
    def tiled_forward(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        def fn(tile: Tensor) -> Tensor:
            return forward(tile, *args, **kwargs)  # the original forward: no hooks, no second tiling

        tiles = num_tiles
        if tiles == "auto":
            tiles = auto_mlp_tiles(x.numel() // x.shape[-1], intermediate or x.shape[-1], x.element_size())
        recompute = getattr(mlp, VALUE_UNUSED_IN_RECOMPUTE, None)
        skip = recompute is not None and recompute.recomputing and torch.is_grad_enabled()
        return tiled_mlp(fn, x, num_tiles=tiles, params=[p for p in mlp.parameters() if p.requires_grad],
                         compute_value=not skip)

    mlp.forward = tiled_forward
    setattr(mlp, _TILED, True)


def apply_tiled_mlp(
    model: nn.Module,
    *,
    num_tiles: Union[Literal["auto"], int] = "auto",
    mlp_classes: Optional[Sequence[str]] = None,
    blocks: Optional[Sequence[nn.Module]] = None,
) -> nn.Module:
    """Run every MLP of ``model`` (inside ``blocks`` when given) over sequence tiles; in place, idempotent."""
    check_num_tiles(num_tiles, "TiledMLP")
    mlps = find_mlps(list(blocks) if blocks else [model], mlp_classes)
    if not mlps:
        what = f"no module of class {sorted(mlp_classes)}" if mlp_classes else (
            "no gated MLP (gate_proj/up_proj/down_proj) and no nn.Sequential(Linear, activation, Linear)"
        )
        raise ValueError(
            f"TiledMLP found {what} in {type(model).__name__}: name its MLP class, e.g. "
            f"TiledMLP(mlp_classes=['MyMLP']), or drop the callback"
        )
    for mlp in mlps:
        dropout = [m for m in mlp.modules() if isinstance(m, _DropoutNd) and m.p > 0]
        if dropout:
            raise ValueError(
                f"TiledMLP recomputes {type(mlp).__name__} in backward, where its dropout (p={dropout[0].p}) would "
                f"draw a different mask: set the MLP dropout to 0 or leave this MLP out (mlp_classes=[...])"
            )
    for mlp in mlps:
        if not getattr(mlp, _TILED, False):  # fit then validate must not wrap twice
            _tile(mlp, num_tiles)
    return model


class TiledMLP(pl.Callback):
    """Runs the MLP of every transformer block over sequence tiles; only its input is kept for backward.

    The forward computes each tile under ``no_grad``; the backward recomputes one tile at a time and backpropagates
    it, so at most one tile's intermediate activations exist (for Llama-3-8B, 3 × 14336 values per token instead of
    all tokens' — the largest buffers of a block at long context). The price is one extra MLP forward.

    Detected: gated MLPs with ``gate_proj``, ``up_proj``, ``down_proj`` submodules (Hugging Face Llama, Qwen,
    Mistral, the reference Llama) and ``nn.Sequential(Linear, activation, Linear)``; other MLPs by class name. An
    MLP must act on each token separately and hold no dropout.

    With ``strategy="fpdt"`` the strategy applies this in its fixed order (after the attention swap, before the tiled
    loss, activation checkpointing and FSDP2). With any other strategy it is applied in :meth:`setup` to the network
    in the LightningModule (which must then be built in ``__init__``, not ``configure_model``); it works on a single
    device and under DDP.

    Args:
        num_tiles: token tiles per MLP call; ``"auto"``: from each call's input, enough that one tile's
            intermediate activations (tokens × intermediate size × 3 × dtype bytes) stay under 256 MiB.
        mlp_classes: class names of the MLP modules to tile instead of the detected ones.
    """

    fpdt_transform_order = 2
    """Tiled MLP comes after the attention swap and before the tiled loss and checkpointing (DESIGN.md §5)."""

    def __init__(
        self, num_tiles: Union[Literal["auto"], int] = "auto", mlp_classes: Optional[list[str]] = None
    ) -> None:
        super().__init__()
        check_num_tiles(num_tiles, "TiledMLP")
        if mlp_classes is not None and not mlp_classes:
            raise ValueError("TiledMLP(mlp_classes=[]): name at least one class, or pass None to detect MLPs")
        self.num_tiles = num_tiles
        self.mlp_classes = mlp_classes

    def fpdt_transform(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        apply_tiled_mlp(model, num_tiles=self.num_tiles, mlp_classes=self.mlp_classes, blocks=blocks)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        transform_without_fpdt(self, trainer, pl_module)
