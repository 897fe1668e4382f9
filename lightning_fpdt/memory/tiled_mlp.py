"""Tiled MLP: the MLP of every block runs over sequence tiles, only its input kept for backward (docs/design.md §6).

At long context the MLP's intermediate activations are the largest buffers of a block: for Llama-3-8B each token
holds three 14336-wide vectors (gate, up and their product) against a 4096-wide input, so 256K local tokens need
~21 GiB in bf16. Here the forward runs tile by tile under ``no_grad`` and saves only the input; the backward
recomputes one tile at a time with grad enabled, so one tile's intermediates exist at any moment. The cost is one
more MLP forward per step.

Three layers: :func:`tiled_mlp_forward` / :func:`tiled_mlp_backward` hold the tile loops, :class:`TiledMLPFunction`
only handles ``ctx``, and :func:`tiled_mlp` is the public call. :func:`apply_tiled_mlp` switches the MLPs of a model
in place (the ``TiledMLP`` callback declares it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.dropout import _DropoutNd

from lightning_fpdt.memory.block_offload import in_plain_block, mlp_value_unused
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.memory.surgery import find_mlps
from lightning_fpdt.memory.tiling import auto_mlp_tiles, check_num_tiles, tile_bounds

TILED_MLP = "_fpdt_tiled_mlp"
"""Marks an MLP whose forward runs over token tiles (listed with every other attribute the package sets on user
modules in ``lightning_fpdt.integrations.attributes``)."""

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

    The gradients of ``params`` (the trainable parameters ``fn`` uses) are summed over the tiles in fp32 (at least;
    with one tile there is nothing to sum) and added to their ``.grad`` once at the end, where FSDP2 reads them in
    its post-backward: summed tile by tile in a bf16 ``.grad`` they would be rounded once per tile (84 tiles for
    Llama-3-8B at 256K tokens), where the untiled MLP's single matmul rounds once. Gradients of parameters not in ``params`` accumulate as autograd does. The
    input gradient is returned.
    """
    x_flat = x.detach().reshape(-1, x.shape[-1])  # (N, hidden)
    grad_flat = grad_out.reshape(x_flat.shape[0], -1)  # (N, out)
    grad_x = torch.empty_like(x_flat) if input_needs_grad else None
    params = [p for p in params if p.requires_grad]
    sums: list[Optional[Tensor]] = [None] * len(params)  # fp32 sums over the tiles, allocated at first use
    bounds = tile_bounds(x_flat.shape[0], num_tiles)
    for start, end in bounds:
        x_tile = x_flat[start:end].detach().requires_grad_(input_needs_grad)  # (n, hidden), a leaf of this tile
        with torch.enable_grad():
            y = fn(_as_input(x_tile, x.dim()))
        inputs = ([x_tile] if input_needs_grad else []) + params
        grads = torch.autograd.grad(y, inputs, grad_flat[start:end].view_as(y), allow_unused=True)
        if grad_x is not None:
            grad_x[start:end] = grads[0]
        for i, grad in enumerate(grads[1:] if input_needs_grad else grads):
            if grad is not None and len(bounds) == 1:
                sums[i] = grad  # one product, rounded once as the untiled MLP's: nothing to sum
            elif grad is not None:
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
    ``lightning_fpdt.memory.block_offload``) the forward returns zeros (one zero broadcast to ``x``'s shape) and
    computes nothing: the
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


def _intermediate_size(mlp: nn.Module) -> Optional[int]:
    return max((m.out_features for m in mlp.modules() if isinstance(m, nn.Linear)), default=None)


class TiledForward:
    """What replaces an MLP's ``forward``: the original forward over token tiles (:func:`tiled_mlp`)."""

    def __init__(self, mlp: nn.Module, num_tiles: Union[Literal["auto"], int]) -> None:
        self.mlp, self.forward, self.num_tiles = mlp, mlp.forward, num_tiles
        self.intermediate_size = _intermediate_size(mlp)

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if in_plain_block():  # a block that is not checkpointed keeps its activations: nothing to run again
            return self.forward(x, *args, **kwargs)

        def fn(tile: Tensor) -> Tensor:
            return self.forward(tile, *args, **kwargs)  # the original forward: no hooks, no second tiling

        tiles = self.num_tiles
        if tiles == "auto":
            tiles = auto_mlp_tiles(x.numel() // x.shape[-1], self.intermediate_size or x.shape[-1], x.element_size())
        skip = mlp_value_unused(self.mlp) and torch.is_grad_enabled()
        return tiled_mlp(fn, x, num_tiles=tiles, params=[p for p in self.mlp.parameters() if p.requires_grad],
                         compute_value=not skip)


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
        if not getattr(mlp, TILED_MLP, False):  # fit then validate must not wrap twice
            replace_forward(mlp, TiledForward(mlp, num_tiles))
            setattr(mlp, TILED_MLP, True)
    return model
