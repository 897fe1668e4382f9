"""Tiled MLP: the MLP of every block runs over sequence tiles, only its input kept for backward (docs/design.md §6).

At long context the MLP's intermediate activations are the largest buffers of a block: for Llama-3-8B each token
holds three 14336-wide vectors (gate, up and their product) against a 4096-wide input, so 256K local tokens need
~21 GiB in bf16. Here the forward runs tile by tile under ``no_grad`` and saves only the input; the backward
recomputes one tile at a time with grad enabled, so one tile's intermediates exist at any moment. The cost is one
more MLP forward per step. With several tiles the weight and bias gradients of the MLP's ``nn.Linear`` layers are
summed over the tiles in fp32 inside the matmul that makes them (:class:`LinearGradients`), with no pass per tile that
adds a rounded product to the sum; one tile runs plain autograd.

Three layers: :func:`tiled_mlp_forward` / :func:`tiled_mlp_backward` hold the tile loops, :class:`TiledMLPFunction`
only handles ``ctx``, and :func:`tiled_mlp` is the public call. :func:`apply_tiled_mlp` switches the MLPs of a model
in place (the ``TiledMLP`` callback declares it).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.nn.modules.dropout import _DropoutNd

from lightning_fpdt.memory.block_offload import in_plain_block, mlp_value_unused
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.memory.surgery import find_mlps
from lightning_fpdt.memory.tiling import accumulates_in_place, auto_mlp_tiles, check_num_tiles, tile_bounds

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


def _add_product(total: Optional[Tensor], a: Tensor, b: Tensor, acc: torch.dtype) -> Tensor:
    """``total + a @ b`` summed in ``acc`` (fp32 at least), written into ``total`` (a new buffer when ``None``)."""
    if a.dtype != acc and accumulates_in_place(a.device, a.dtype, acc):
        # cuBLAS adds the low-precision product to the fp32 buffer in its epilogue: no rounded product, no add pass
        return torch.mm(a, b, out_dtype=acc) if total is None else torch.addmm(total, a, b, out_dtype=acc, out=total)
    if a.dtype != acc and a.is_cuda:
        # no out_dtype in this torch (2.7): the product in the operands' dtype, as autograd makes it, then one add;
        # an upcast fp32 matmul would be several times slower
        product = a @ b
        return product.to(acc) if total is None else total.add_(product)
    a, b = a.to(acc), b.to(acc)  # fp32/fp64 operands, or the CPU: one matmul in acc
    return a @ b if total is None else total.addmm_(a, b)


def _outside_paths(root: Node, through: dict[int, set[int]]) -> bool:
    """Whether the graph under ``root`` reaches a leaf ``through`` names (by id) on a path that avoids the nodes
    ``through[id(leaf)]`` (by id): a use of the leaf whose gradient those nodes' output gradients do not give."""
    parents: dict[int, list[Node]] = {id(root): []}
    accumulators: dict[int, Node] = {}  # id(leaf) -> its AccumulateGrad node
    stack = [root]
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if id(child) not in parents:
                parents[id(child)] = []
                stack.append(child)
                variable = getattr(child, "variable", None)  # AccumulateGrad nodes name their leaf
                if variable is not None and id(variable) in through:
                    accumulators[id(variable)] = child
            parents[id(child)].append(node)
    for key, accumulator in accumulators.items():
        blocked, seen, up = through[key], {id(accumulator)}, [accumulator]
        while up:
            node = up.pop()
            if node is root:
                return True
            for parent in parents[id(node)]:
                if id(parent) not in blocked and id(parent) not in seen:
                    seen.add(id(parent))
                    up.append(parent)
    return False


class LinearGradients:
    """The gradients of the trainable weights and biases of ``nn.Linear`` layers, summed over the tiles inside the
    matmul that makes them.

    While a tile is recomputed (:meth:`recording`), a forward hook on each layer records every call: its input ``X``
    (a tensor autograd saves anyway) and the gradient edge of its output ``Y``. The tile's ``autograd.grad`` is then
    asked for ``dY`` at those edges instead of the layer's parameter gradients, and :meth:`accumulate` adds
    ``dY^T X`` to the weight's sum and ``Σ dY`` to the bias's, in fp32: the product is never rounded to bf16 and no
    separate pass per tile adds it to the sum (a 14336 × 4096 weight: ~0.23 ms a pass on an H200).

    A tile whose calls do not give the whole gradient of these parameters (:meth:`covers` is false: a weight also
    read outside its layer's forward, a layer called with a keyword input, its parameters swapped during the forward)
    takes autograd's parameter gradients instead, into the same sums.
    """

    def __init__(self, linears: Iterable[nn.Linear], params: Sequence[Tensor]) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self.params = params
        self.layers: list[tuple[nn.Linear, Optional[int], Optional[int]]] = []
        """``(layer, index of its weight in params, of its bias)``, ``None`` for one that is frozen or absent."""
        for layer in linears:
            if type(layer).forward is not nn.Linear.forward:  # a subclass's own forward may not compute X W^T + b
                continue
            weight, bias = index.get(id(layer.weight)), None if layer.bias is None else index.get(id(layer.bias))
            if weight is not None or bias is not None:
                self.layers.append((layer, weight, bias))
        owned = {i for _, weight, bias in self.layers for i in (weight, bias) if i is not None}
        self.others = [i for i in range(len(params)) if i not in owned]
        """Indices of the parameters whose gradients autograd computes in every tile."""
        self.calls: list[tuple[int, Tensor, GradientEdge]] = []  # (layer number, X (..., in), edge of Y (..., out))
        self.complete = True

    def __bool__(self) -> bool:
        return bool(self.layers)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Records the layers' calls during one tile's forward; the hooks exist only inside."""
        self.calls, self.complete = [], True
        # prepend: the output as the layer's forward made it, before any other hook could replace it
        handles = [layer.register_forward_hook(functools.partial(self._record, k), prepend=True)
                   for k, (layer, _, _) in enumerate(self.layers)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, k: int, layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        _, weight, bias = self.layers[k]
        same = (weight is None or layer.weight is self.params[weight]) and (
            bias is None or layer.bias is self.params[bias])
        if not args or not same or not isinstance(output, Tensor) or output.grad_fn is None:
            self.complete = False
            return
        self.calls.append((k, args[0].detach(), get_gradient_edge(output)))

    def covers(self, y: Tensor) -> bool:
        """Whether the recorded calls give the whole gradient of the layers' parameters in ``y``: every path of
        ``y``'s graph to such a parameter runs through the output of one of its layer's calls."""
        if not self.complete or y.grad_fn is None:
            return False
        # a parameter no call recorded keeps an empty set: any path to it is a use outside its layer
        through: dict[int, set[int]] = {
            id(self.params[i]): set() for _, weight, bias in self.layers for i in (weight, bias) if i is not None}
        for k, _, edge in self.calls:
            for i in self.layers[k][1:]:
                if i is not None:
                    through[id(self.params[i])].add(id(edge.node))
        return not _outside_paths(y.grad_fn, through)

    def edges(self) -> list[GradientEdge]:
        return [edge for _, _, edge in self.calls]

    def accumulate(self, sums: list[Optional[Tensor]], output_grads: Sequence[Optional[Tensor]]) -> None:
        """Adds each recorded call's ``dY^T X`` and ``Σ dY`` to ``sums`` (indexed as the parameters); forgets the
        calls, so the next tile's recompute does not find this tile's ``X`` alive."""
        for (k, x, _), dy in zip(self.calls, output_grads):
            if dy is None:  # the output did not reach y: no gradient, as autograd gives none
                continue
            _, weight, bias = self.layers[k]
            dy = dy.reshape(-1, dy.shape[-1])  # (n, out)
            if weight is not None:
                acc = torch.promote_types(self.params[weight].dtype, torch.float32)
                x = x.reshape(-1, x.shape[-1]).to(dy.dtype)  # (n, in), in the dtype of the layer's matmul (autocast)
                # the backward runs under the forward's autocast: the sums' matmuls keep their own dtypes
                with torch.autocast(dy.device.type, enabled=False):
                    sums[weight] = _add_product(sums[weight], dy.t(), x, acc)  # (out, n) @ (n, in)
            if bias is not None:
                bias_grad = dy.sum(0, dtype=torch.promote_types(self.params[bias].dtype, torch.float32))  # (out,)
                sums[bias] = bias_grad if sums[bias] is None else sums[bias].add_(bias_grad)
        self.calls = []


def tiled_mlp_backward(
    fn: Callable[[Tensor], Tensor], x: Tensor, grad_out: Tensor, num_tiles: int, *, input_needs_grad: bool,
    params: Sequence[Tensor] = (), linears: Sequence[nn.Linear] = (),
) -> Optional[Tensor]:
    """Recompute ``fn`` one tile at a time and backpropagate that tile's output gradient through it.

    The gradients of ``params`` (the trainable parameters ``fn`` uses) are summed over the tiles in fp32 (at least;
    with one tile there is nothing to sum) and added to their ``.grad`` once at the end, where FSDP2 reads them in
    its post-backward: summed tile by tile in a bf16 ``.grad`` they would be rounded once per tile (84 tiles for
    Llama-3-8B at 256K tokens), where the untiled MLP's single matmul rounds once. With several tiles, the parameters
    of ``linears`` (the ``nn.Linear`` layers ``fn`` calls) among ``params`` are summed inside their gradient's matmul
    (:class:`LinearGradients`); the others take autograd's gradient of each tile. Gradients of parameters not in
    ``params`` accumulate as autograd does. The input gradient is returned.
    """
    x_flat = x.detach().reshape(-1, x.shape[-1])  # (N, hidden)
    grad_flat = grad_out.reshape(x_flat.shape[0], -1)  # (N, out)
    grad_x = torch.empty_like(x_flat) if input_needs_grad else None
    params = [p for p in params if p.requires_grad]
    sums: list[Optional[Tensor]] = [None] * len(params)  # fp32 sums over the tiles, allocated at first use
    bounds = tile_bounds(x_flat.shape[0], num_tiles)
    # one tile: plain autograd, one product rounded once as in the untiled MLP, nothing to sum
    linear_grads = LinearGradients(linears, params) if len(bounds) > 1 else None
    for start, end in bounds:
        x_tile = x_flat[start:end].detach().requires_grad_(input_needs_grad)  # (n, hidden), a leaf of this tile
        recording = linear_grads.recording() if linear_grads else contextlib.nullcontext()
        with torch.enable_grad(), recording:
            y = fn(_as_input(x_tile, x.dim()))
        by_layers = bool(linear_grads) and linear_grads.covers(y)
        indices = linear_grads.others if by_layers else range(len(params))
        edges = linear_grads.edges() if by_layers else []
        inputs = ([x_tile] if input_needs_grad else []) + [params[i] for i in indices] + edges
        grads = list(torch.autograd.grad(y, inputs, grad_flat[start:end].view_as(y), allow_unused=True))
        if grad_x is not None:
            grad_x[start:end] = grads.pop(0)
        for i, grad in zip(indices, grads):
            if grad is not None and len(bounds) == 1:
                sums[i] = grad  # one product, rounded once as the untiled MLP's: nothing to sum
            elif grad is not None:
                acc = torch.promote_types(grad.dtype, torch.float32)
                sums[i] = grad.to(acc) if sums[i] is None else sums[i].add_(grad)
        if by_layers:
            linear_grads.accumulate(sums, grads[len(indices):])
        del y, grads  # this tile's gradients and outputs do not live through the next tile's recompute
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
    ``X``/``dY``  ``(n, in)``,        a tile's tokens               no: with several tiles, the input and output
                  ``(n, out)``                                      gradient of each call of a layer in ``linears``,
                                                                    one tile's at a time (:class:`LinearGradients`)
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
        ctx: Any, fn: Callable[[Tensor], Tensor], num_tiles: int, compute_value: bool, linears: Sequence[nn.Linear],
        x: Tensor, *params: Tensor,
    ) -> Tensor:
        ctx.fn, ctx.num_tiles, ctx.linears, ctx.params = fn, num_tiles, linears, params
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
            grad_x = tiled_mlp_backward(ctx.fn, x, grad_out, ctx.num_tiles, input_needs_grad=ctx.needs_input_grad[4],
                                        params=ctx.params, linears=ctx.linears)
        return (None, None, None, None, grad_x) + (None,) * len(ctx.params)


def tiled_mlp(
    fn: Callable[[Tensor], Tensor], x: Tensor, *, num_tiles: int, params: Iterable[Tensor] = (),
    linears: Iterable[nn.Linear] = (), compute_value: bool = True,
) -> Tensor:
    """``fn(x)`` computed over ``num_tiles`` token tiles, keeping only ``x`` for backward.

    Args:
        fn: a token-wise function, e.g. an MLP's original ``forward``; its parameters must be usable where this is
            called (under FSDP2: inside the forward of the module that owns them).
        x: ``(..., S, hidden)``.
        num_tiles: tiles over all tokens of ``x`` (capped at the token count).
        params: the trainable parameters ``fn`` uses (so the output requires grad when only they do).
        linears: ``nn.Linear`` layers ``fn`` calls: with several tiles, the gradients of their parameters in
            ``params`` are summed over the tiles in fp32 inside the matmul that makes them, not added to a sum tile
            by tile (the same values; empty: every gradient from autograd, tile by tile).
        compute_value: ``False`` returns zeros of ``x``'s shape with the same graph: for a checkpoint's recompute in
            which nothing reads the output (the backward recomputes the tiles anyway); ``fn`` must map ``x``'s width to
            itself.
    """
    if num_tiles < 1:
        raise ValueError(f"tiled_mlp(num_tiles={num_tiles}): give a positive number of tiles")
    return TiledMLPFunction.apply(fn, num_tiles, compute_value, list(linears), x, *params)


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
        # walked at every call: a LoRA adapter added after this wrapper brings its own layers
        linears = [m for m in self.mlp.modules() if isinstance(m, nn.Linear)]
        return tiled_mlp(fn, x, num_tiles=tiles, params=[p for p in self.mlp.parameters() if p.requires_grad],
                         linears=linears, compute_value=not skip)


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
