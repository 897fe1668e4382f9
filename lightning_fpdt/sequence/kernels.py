"""Block attention kernels: ``(out, lse)`` forward and a backward that takes the *final* ``out, lse``.

FPDT computes attention block by block (one q chunk against one kv chunk) and merges the partial results with their
log-sum-exp. The backward of a block, fed the merged output and log-sum-exp of its q rows, yields exactly that block's
share of the full-attention gradients (``P = exp(S − lse_final)`` is the block's slice of the global softmax), so the
blockwise gradients sum to the exact ones. The CUDA flash and cuDNN ops obey it too: two kv blocks computed apart,
merged by log-sum-exp, each block's backward fed the merged ``(out, lse)``, match full attention to bf16 precision
(relative error 2.4e-3 on an H100, torch 2.11; tests/gpu/test_kernels_cuda.py checks it).

All kernels take ``q (B, h, Sq, D)``, ``k, v (B, hkv, Sk, D)`` with ``h % hkv == 0`` and return ``out (B, h, Sq, D)``
in q's dtype and ``lse (B, h, Sq)`` in the accumulation dtype (fp32, or fp64 for fp64 inputs). ``causal`` blocks are
square (the diagonal blocks of the chunk schedule).
"""

from __future__ import annotations

from typing import Literal, Optional, get_args

import torch
from torch import Tensor

AttentionBackend = Literal["auto", "math", "flash", "cudnn"]
"""The block attention kernels: ``"auto"`` picks cuDNN, else flash, else the math kernel."""
BACKENDS: tuple[str, ...] = get_args(AttentionBackend)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, fp64 for fp64: the dtype partial outputs, LSEs and gradients are summed in."""
    return torch.promote_types(dtype, torch.float32)


def _expand_kv(x: Tensor, groups: int) -> Tensor:
    # (B, hkv, S, D) -> (B, hkv·groups, S, D): query head h reads kv head h // groups
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv_grad(g: Tensor, groups: int) -> Tensor:
    # (B, hkv·groups, S, D) -> (B, hkv, S, D): the kv head's gradient is the sum over the query heads that read it
    return g if groups == 1 else g.unflatten(1, (-1, groups)).sum(2)


class BlockKernel:
    """One attention block: ``forward`` returns ``(out, lse)``; ``backward`` takes the final ``out, lse``."""

    name = "base"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        return self._forward(q, _expand_kv(k, groups), _expand_kv(v, groups), causal, scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = self._backward(
            dout, q, _expand_kv(k, groups), _expand_kv(v, groups), out, lse, causal, scale
        )
        return dq, _reduce_kv_grad(dk, groups), _reduce_kv_grad(dv, groups)

    def _forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class MathKernel(BlockKernel):
    """Pure torch, any dtype and device; fp64 for the test references. Materialises the ``Sq × Sk`` scores."""

    name = "math"

    @staticmethod
    def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
        acc = accumulation_dtype(q.dtype)
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, h, Sq, Sk)
        if causal:
            sq, sk = scores.shape[-2:]
            assert sq == sk, "causal blocks are the square diagonal blocks of the schedule"
            mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        return scores

    def _forward(self, q, k, v, causal, scale):
        scores = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(scores, dim=-1)  # (B, h, Sq)
        probs = torch.exp(scores - lse.unsqueeze(-1))
        out = torch.matmul(probs, v.to(probs.dtype))
        return out.to(q.dtype), lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        scores = self._scores(q, k, causal, scale)
        acc = scores.dtype
        probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))  # this block's slice of the global softmax
        dout_acc = dout.to(acc)
        dv = torch.matmul(probs.transpose(-1, -2), dout_acc)
        dprobs = torch.matmul(dout_acc, v.to(acc).transpose(-1, -2))
        delta = (dout_acc * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O) of the *final* output
        dscores = probs * (dprobs - delta)
        dq = torch.matmul(dscores, k.to(acc)) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashKernel(BlockKernel):
    """PyTorch's own flash attention ops (``aten::_scaled_dot_product_flash_attention[_for_cpu]``)."""

    name = "flash"

    def __init__(self) -> None:
        self._aux: Optional[tuple] = None  # CUDA op's (cum_seq_q, cum_seq_k, philox_seed, philox_offset)

    def _forward(self, q, k, v, causal, scale):
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
            return out, lse
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        # without dropout the rng state and cumulative lengths are placeholders; backward still asks for them
        self._aux = (res[2], res[3], res[6], res[7])
        return res[0], res[1]

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        lse = lse.to(accumulation_dtype(q.dtype)).contiguous()  # the op wants fp32 (fp64 for fp64 on CPU)
        if q.device.type == "cpu":
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=scale
            )
        if self._aux is None:
            raise RuntimeError("FlashKernel.backward called before any forward on this device")
        cum_q, cum_k, seed, offset = self._aux
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale
        )


class CudnnKernel(BlockKernel):
    """PyTorch's cuDNN attention ops (CUDA, fp16/bf16): the fastest on an H100 (docs/design.md §4)."""

    name = "cudnn"

    def __init__(self) -> None:
        self._aux: Optional[tuple] = None  # (philox_seed, philox_offset), placeholders without dropout
        # cuDNN refuses a 1 x 1 block ("s_q = s_kv = 1 is not supported", seen on an H100 with torch 2.11): the
        # diagonal segment of a one-token packed document; the math kernel computes it exactly
        self._one_token = MathKernel()

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if q.shape[2] == 1 and k.shape[2] == 1:
            return self._one_token.forward(q, k, v, causal=causal, scale=scale)
        return super().forward(q, k, v, causal=causal, scale=scale)

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.shape[2] == 1 and k.shape[2] == 1:
            return self._one_token.backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        return super().backward(dout, q, k, v, out, lse, causal=causal, scale=scale)

    def _forward(self, q, k, v, causal, scale):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        self._aux = (res[6], res[7])
        lse = res[1]
        return res[0], lse.squeeze(-1) if lse.dim() == 4 else lse

    def _backward(self, dout, q, k, v, out, lse, causal, scale):
        if self._aux is None:
            raise RuntimeError("CudnnKernel.backward called before any forward on this device")
        seed, offset = self._aux
        lse4 = lse.float().unsqueeze(-1).contiguous()  # the op's logsumexp is (B, h, Sq, 1)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse4, seed, offset, None, None, None, q.shape[2], k.shape[2], 0.0, causal,
            scale=scale,
        )


class VarlenFlashKernel:
    """Many segments of one block in one call: ``aten::_flash_attention_forward/_backward`` with cumulative sequence
    lengths (the flash-attention varlen kernel; CUDA, fp16/bf16). Packed documents use it for blocks that hold
    several document segments, which the other kernels would take one call each.

    Tensors are token-major and packed: ``q (Nq, h, D)``, ``k, v (Nk, hkv, D)`` (GQA native), segment ``s`` being
    rows ``cum_q[s] … cum_q[s+1]`` against keys ``cum_k[s] … cum_k[s+1]``; ``lse`` is ``(h, Nq)`` fp32.
    Checked on an H200 (torch 2.11): this layout, and gradients fed the merged ``(out, lse)``, within ~2e-3 relative
    error in bf16 (tests/gpu/test_packed_cuda.py).
    """

    name = "flash-varlen"

    def __init__(self) -> None:
        self._aux: Optional[tuple[Tensor, Tensor]] = None  # (rng_state, unused): placeholders without dropout

    @staticmethod
    def usable(device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, cum_q: Tensor, cum_k: Tensor, max_q: int, max_k: int, *,
        causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor]:
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cum_q, cum_k, max_q, max_k, 0.0, causal, False, scale=scale
        )
        self._aux = (rng_state, unused)
        return out, lse

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cum_q: Tensor, cum_k: Tensor,
        max_q: int, max_k: int, *, causal: bool, scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self._aux is None:
            raise RuntimeError("VarlenFlashKernel.backward called before any forward")
        rng_state, unused = self._aux
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, rng_state, unused,
            scale=scale,
        )

    def __repr__(self) -> str:
        return "VarlenFlashKernel()"


def _cudnn_usable() -> bool:
    return torch.cuda.is_available() and torch.backends.cudnn.is_available() and torch.backends.cudnn.version() >= 90000


def supported_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    """The backends that can run ``dtype`` on ``device``, fastest first."""
    names = []
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda":
        if half and _cudnn_usable():
            names.append("cudnn")
        if half:
            names.append("flash")
    elif device.type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        names.append("flash")
    names.append("math")
    return names


def check_backend_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")


def make_kernel(name: str, device: torch.device, dtype: torch.dtype) -> BlockKernel:
    """The kernel called ``name`` (or the fastest for ``device``/``dtype`` when ``"auto"``)."""
    check_backend_name(name)
    available = supported_backends(device, dtype)
    if name == "auto":
        name = available[0]
    elif name not in available:
        raise ValueError(
            f"attention_backend={name!r} cannot run {dtype} on {device.type}; available there: {available} "
            f"(or 'auto')"
        )
    return {"math": MathKernel, "flash": FlashKernel, "cudnn": CudnnKernel}[name]()
