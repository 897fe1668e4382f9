"""RMSNorm, RoPE and the SwiGLU product of every model the package runs (the reference Llama's, a Hugging Face
family's), computed over token tiles and saving almost nothing for backward.

At long context their plain autograd forms are among the largest buffers of a layer: RMSNorm keeps an fp32 copy of
its input (``S/P × hidden × 4`` bytes: 16 GiB at 1M tokens of Llama-3-8B) and RoPE makes three or four fp32
temporaries of q's size while it runs. Here both run tile by tile over the tokens, with fp32 math inside a tile only:

| op | saved for backward | transient |
|---|---|---|
| :func:`rms_norm` | its input, the weight, ``rstd`` (fp32, per token) | a tile's fp32 buffers: 2 forward, 3 backward |
| :func:`rotary` | nothing but ``position_ids`` | a tile's two fp32 buffers (x, its rotate-half), angle tables |

The norm's input is a tensor the graph holds anyway (the block input or the residual stream), and its backward adds a
bf16 buffer of a tile to the three fp32 ones; RoPE is a rotation, and its backward is the rotation by the opposite
angle.

The results equal the plain forms' (same fp32 math per token); only the summation order of the norm weight's
gradient differs (per tile, then over tiles, in fp32).

On a GPU each pass of each op runs instead as one fused kernel (:data:`FUSED_OPS`): the same formulas, compiled by
``torch.compile`` into a kernel that reads the inputs once and writes the outputs once, with the fp32 math in
registers, so no fp32 buffer of any size is made and the same tensors are saved for backward. The tiled forms make a
dozen or more kernels per pass, each a trip through device memory; the fused ones are several times faster (measured
by ``bench/elementwise.py``). :func:`swiglu` (``silu(gate) · up``, the gated MLP's product) is the third op: fused,
it saves ``gate`` and ``up`` and recomputes the SiLU in backward.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

TILE_BYTES = 256 * 2**20
"""One tile's fp32 buffer (tokens × width × 4 bytes) stays under this."""


class FusedOps:
    """Whether :func:`rms_norm`, :func:`rotary`, :func:`swiglu` and the tiled loss's tiles
    (``lightning_fpdt.memory.tiled_loss``) run as fused kernels.

    ``enabled``: ``"auto"`` fuses on CUDA devices (fp16, bf16, fp32), ``True`` wherever the tensors are (the CPU
    too: the tests), ``False`` never (the tiled forms and eager SwiGLU). The fpdt strategy sets it from its
    ``fused_ops`` option. Where a fused kernel cannot be compiled, the ops fall back to the eager forms for the rest of
    the process, with one warning.
    """

    def __init__(self) -> None:
        self.enabled: Union[bool, Literal["auto"]] = "auto"
        self.failed: Optional[str] = None
        """Why compiling failed (the ops then stay eager); ``None``: it did not."""

    def applies(self, x: Tensor) -> bool:
        if self.failed is not None or self.enabled is False or x.dtype == torch.float64:
            return False  # fp64: the references of the tests, computed exactly as the tiled forms
        return self.enabled is True or (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32))

    def run(self, fn: Callable[..., Any], eager: Callable[[], Any], *args: Any, staged: bool = False) -> Any:
        """``fn(*args)`` compiled (``staged``: ``fn`` calls compiled stages itself, each its own kernel); ``eager()``
        where compiling fails (and from then on)."""
        try:
            return fn(*args) if staged else _compiled(fn)(*args)
        except torch.OutOfMemoryError:
            raise  # the memory, not the compiler: the eager forms would need more
        except Exception as error:  # noqa: BLE001 - any compiler failure: the eager forms compute the same
            if self.failed is None:
                self.failed = f"{type(error).__name__}: {error}"
                warnings.warn(f"lightning_fpdt: the fused RMSNorm/RoPE/SwiGLU/loss kernels could not be compiled "
                              f"({self.failed.splitlines()[0][:300]}); these ops run eager from now on", stacklevel=2)
            return eager()


FUSED_OPS = FusedOps()
"""The process's setting (see :class:`FusedOps`)."""


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    # automatic dynamic shapes: compiled first for the sizes it meets, then again once with the sizes that changed
    # (the token count between sequence lengths, the head count between q and k) left symbolic; the model's widths
    # stay constants, which the kernels' indexing and reductions need to run at memory speed (all sizes symbolic made
    # RoPE several times slower than the bytes it moves). A CPU run (tests) compiles without code generation, which
    # would take minutes on a small machine.
    return torch.compile(fn, dynamic=None, backend="inductor" if torch.cuda.is_available() else "eager")


def _tiles(num_tokens: int, width: int) -> list[tuple[int, int]]:
    step = max(1, TILE_BYTES // (4 * max(width, 1)))
    return [(start, min(start + step, num_tokens)) for start in range(0, num_tokens, step)]


# ---- RMSNorm ---------------------------------------------------------------------------------------------------------
def rms_norm_forward(x: Tensor, weight: Tensor, eps: float, acc: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """``(weight · (x / rms(x)).to(x.dtype), rstd)``; ``rstd`` in ``acc`` (default fp32, fp64 for fp64 inputs; Hugging
    Face's norms compute in fp32 whatever the input), one per token."""
    acc = acc or torch.promote_types(x.dtype, torch.float32)
    flat = x.reshape(-1, x.shape[-1])  # (N, hidden)
    out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    rstd = torch.empty(flat.shape[0], dtype=acc, device=x.device)
    for start, end in _tiles(flat.shape[0], flat.shape[1]):
        x32 = flat[start:end].to(acc, copy=True)  # owned: normalised in place (two fp32 tile buffers at most)
        rstd[start:end] = torch.rsqrt(x32.pow(2).mean(-1) + eps)
        out[start:end] = weight * x32.mul_(rstd[start:end, None]).to(x.dtype)
    return out.view(*x.shape[:-1], x.shape[-1]), rstd


def rms_norm_backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, *, input_grad: bool, weight_grad: bool
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Gradients of :func:`rms_norm_forward`'s output: ``dx = rstd · (g − n · mean(g · n))`` with ``n = x · rstd``
    and ``g = dy · weight``; ``dweight = Σ dy · n`` over the tokens (fp32 sums)."""
    acc = rstd.dtype
    flat, grad = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, x.shape[-1])
    grad_x = torch.empty_like(flat) if input_grad else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if weight_grad else None
    weight_acc = weight.to(acc)
    # At most three fp32 tile buffers at once (the normalised input, dy turned into dx, one temporary), each op in
    # place where the plain expression would allocate: the same arithmetic in the same order, so the same values.
    for start, end in _tiles(flat.shape[0], flat.shape[1]):
        r = rstd[start:end, None]
        normed = torch.empty((end - start, flat.shape[1]), dtype=acc, device=flat.device)
        torch.mul(flat[start:end], r, out=normed)  # the fp32 normalised input, without an fp32 copy of x first
        dy = grad[start:end].to(acc, copy=True)  # owned: turned into dx in place below
        if grad_w is not None:
            if x.dtype == acc:
                grad_w += (dy * normed).sum(0)
            else:  # the forward multiplied the weight by n in x's dtype
                grad_w += normed.to(x.dtype).to(acc).mul_(dy).sum(0)
        if grad_x is not None:
            g = dy.mul_(weight_acc)
            mean = (g * normed).mean(-1, keepdim=True)
            grad_x[start:end] = g.sub_(normed.mul_(mean)).mul_(r)  # r · (g − n · mean(g · n))
    return (grad_x.view_as(x) if grad_x is not None else None,
            grad_w.to(weight.dtype) if grad_w is not None else None)


def _fused_rms_norm_forward(x: Tensor, weight: Tensor, eps: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_forward` as one expression (fused when compiled)."""
    x_acc = x.to(acc)
    rstd = torch.rsqrt(x_acc.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x_acc * rstd).to(x.dtype), rstd.reshape(-1)


def _fused_rms_norm_backward(grad_out: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, input_grad: bool,
                             weight_grad: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`rms_norm_backward` as expressions (fused when compiled)."""
    acc = rstd.dtype
    r = rstd.view(*x.shape[:-1], 1)
    normed = x.to(acc) * r
    dy = grad_out.to(acc)
    grad_w = None
    if weight_grad:  # the forward multiplied the weight by n in x's dtype
        product = dy * (normed if x.dtype == acc else normed.to(x.dtype).to(acc))
        grad_w = product.reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    grad_x = None
    if input_grad:
        g = dy * weight.to(acc)
        grad_x = ((g - normed * (g * normed).mean(-1, keepdim=True)) * r).to(x.dtype)
    return grad_x, grad_w


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm over token tiles.

    | tensor | shape | kept for backward |
    |---|---|---|
    | x (in) | (B, S/P, hidden) | yes: the norm's input, which the graph keeps anyway (block input, residual) |
    | weight | (hidden,) | yes |
    | rstd | (B·S/P,) fp32 | yes: 1/rms per token, so the backward needs no reduction of its own |
    | fp32 normalised input | (n, hidden) per tile | no: recomputed tile by tile in backward |
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, acc: Optional[torch.dtype]) -> Tensor:
        acc = acc or torch.promote_types(x.dtype, torch.float32)
        ctx.fused = FUSED_OPS.applies(x)
        if ctx.fused:
            out, rstd = FUSED_OPS.run(_fused_rms_norm_forward, lambda: rms_norm_forward(x, weight, eps, acc),
                                      x, weight, eps, acc)
        else:
            out, rstd = rms_norm_forward(x, weight, eps, acc)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight, rstd = ctx.saved_tensors
        needs = dict(input_grad=ctx.needs_input_grad[0], weight_grad=ctx.needs_input_grad[1])
        eager = functools.partial(rms_norm_backward, grad_out, x, weight, rstd, **needs)
        if ctx.fused:
            grad_x, grad_w = FUSED_OPS.run(_fused_rms_norm_backward, eager, grad_out.contiguous(), x, weight, rstd,
                                           needs["input_grad"], needs["weight_grad"])
        else:
            grad_x, grad_w = eager()
        return grad_x, grad_w, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, acc: Optional[torch.dtype] = None) -> Tensor:
    """``weight · (x / sqrt(mean(x²) + eps))``, the mean square in fp32 (fp64 for fp64, or ``acc``), over token
    tiles."""
    return RMSNormFunction.apply(x, weight, eps, acc)


# ---- RoPE ------------------------------------------------------------------------------------------------------------
def rotary_forward(x: Tensor, position_ids: Tensor, theta: float, *, inverse: bool = False) -> Tensor:
    """``x (B, S, H, D)`` rotated by the RoPE angles of ``position_ids (B, S)`` (rotate-half convention), over token
    tiles in fp32 (fp64 for fp64); ``inverse`` rotates by the opposite angles (the backward)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    head_dim = x.shape[-1]
    # fp32 at least: bf16 angles are wrong by whole radians at long positions
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device, dtype=acc) / head_dim))  # (D/2,)
    out = torch.empty_like(x)
    seq_len, half = x.shape[1], head_dim // 2
    # two fp32 tile buffers at once (x and its rotate-half), each op in place: x·cos + rotate_half(x)·sin, the same
    # arithmetic in the same order as the plain expression
    for start, end in _tiles(seq_len, x.shape[0] * x.shape[2] * head_dim):
        angles = position_ids[:, start:end].to(acc)[..., None] * inv_freq  # (B, n, D/2)
        angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # (B, n, 1, D), broadcast over heads
        sin = -angles.sin() if inverse else angles.sin()
        x_c = x[:, start:end].to(acc, copy=True)  # owned: turned into the output in place
        rotated = torch.empty_like(x_c)  # rotate_half(x) = (-x2, x1)
        torch.neg(x_c[..., half:], out=rotated[..., :half])
        rotated[..., half:].copy_(x_c[..., :half])
        out[:, start:end] = x_c.mul_(angles.cos()).add_(rotated.mul_(sin))
    return out


def _rotary_table(position_ids: Tensor, theta: float, head_dim: int, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the RoPE angles, ``(B, S, D/2)`` in ``acc`` (fused when compiled): a kernel of its own,
    so the rotation reads one angle per token and frequency instead of computing it again for every head."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=acc) / head_dim))
    angles = position_ids.to(acc)[..., None] * inv_freq  # (B, S, D/2)
    return angles.cos(), angles.sin()


def _fused_rotation(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """:func:`rotary_forward`'s arithmetic given the angle table (fused when compiled)."""
    half = x.shape[-1] // 2
    cos = torch.cat((cos, cos), dim=-1)[:, :, None, :]  # (B, S, 1, D), broadcast over heads
    sin = torch.cat((sin, sin), dim=-1)[:, :, None, :]
    x_acc = x.to(cos.dtype)
    rotated = torch.cat((-x_acc[..., half:], x_acc[..., :half]), dim=-1)  # rotate_half(x)
    return (x_acc * cos + rotated * (-sin if inverse else sin)).to(x.dtype)


def _fused_rotary(x: Tensor, position_ids: Tensor, theta: float, inverse: bool) -> Tensor:
    """:func:`rotary_forward` as two compiled stages: the angle table, then the rotation (compiled as one, the angles
    were computed in the rotation's kernel for every element: sin and cos of fp32 angles dominated its time)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    cos, sin = _compiled(_rotary_table)(position_ids, theta, x.shape[-1], acc)
    return _compiled(_fused_rotation)(x, cos, sin, inverse)


def _rotate(x: Tensor, position_ids: Tensor, theta: float, *, inverse: bool = False) -> Tensor:
    if FUSED_OPS.applies(x):
        return FUSED_OPS.run(_fused_rotary, lambda: rotary_forward(x, position_ids, theta, inverse=inverse),
                             x, position_ids, theta, inverse, staged=True)
    return rotary_forward(x, position_ids, theta, inverse=inverse)


class RotaryFunction(torch.autograd.Function):
    """RoPE over token tiles.

    | tensor | shape | kept for backward |
    |---|---|---|
    | x (in) | (B, S/P, H, D) | no: a rotation's gradient is the opposite rotation of the output's gradient |
    | position_ids | (B, S/P) | yes: the angles are recomputed per tile |
    | fp32 angles, x copy and its rotate-half | (B, n, H, D) per tile | no: two tile buffers while a tile runs |
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, position_ids: Tensor, theta: float) -> Tensor:
        ctx.save_for_backward(position_ids)
        ctx.theta = theta
        return _rotate(x, position_ids, theta)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:
        (position_ids,) = ctx.saved_tensors
        return _rotate(grad_out.contiguous(), position_ids, ctx.theta, inverse=True), None, None


def rotary(x: Tensor, position_ids: Tensor, theta: float) -> Tensor:
    """RoPE of ``x (B, S, H, D)`` at ``position_ids (B, S)`` over token tiles, keeping nothing of ``x``."""
    return RotaryFunction.apply(x, position_ids, theta)


# ---- SwiGLU ----------------------------------------------------------------------------------------------------------
def _fused_swiglu_forward(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) · up`` in fp32, rounded once (fused when compiled)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


def _fused_swiglu_backward(grad_out: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """``d gate = dy · up · σ(g) · (1 + g · (1 − σ(g)))``, ``d up = dy · silu(g)``, in fp32 (fused when compiled)."""
    acc = torch.promote_types(gate.dtype, torch.float32)
    g, u, dy = gate.to(acc), up.to(acc), grad_out.to(acc)
    sig = torch.sigmoid(g)
    return (dy * u * sig * (1 + g * (1 - sig))).to(gate.dtype), (dy * g * sig).to(up.dtype)


class SwiGLUFunction(torch.autograd.Function):
    """The gated MLP's product ``silu(gate) · up``, one fused kernel per pass.

    | tensor | shape | kept for backward |
    |---|---|---|
    | gate, up (in) | (..., intermediate) | yes: the SiLU is recomputed from gate in backward (eager keeps it too) |
    | out | (..., intermediate) | no |
    """

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return FUSED_OPS.run(_fused_swiglu_forward, lambda: _fused_swiglu_forward(gate, up), gate, up)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        return FUSED_OPS.run(_fused_swiglu_backward, lambda: _fused_swiglu_backward(grad_out, gate, up),
                             grad_out, gate, up)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) · up``: one fused kernel per pass where :data:`FUSED_OPS` applies, else eager."""
    if FUSED_OPS.applies(gate):
        return SwiGLUFunction.apply(gate, up)
    return F.silu(gate) * up
