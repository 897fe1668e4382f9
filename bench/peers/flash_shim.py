"""flash-attn's two private kernels, as DeepSpeed's FPDT layer calls them, on PyTorch's own FlashAttention-2.

``deepspeed.sequence.fpdt_layer`` (DeepSpeed 0.19.8) imports ``_flash_attn_forward`` and ``_flash_attn_backward``
from ``flash_attn.flash_attn_interface`` and picks its call signature by ``flash_attn.__version__``. :func:`install`
registers a ``flash_attn`` package in ``sys.modules`` that claims version 2.7.4, so DeepSpeed takes its flash-attn
>= 2.7.0 calls, whose signatures the two functions here follow:

    _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                        alibi_slopes, return_softmax) -> (out, softmax_lse, S_dmask, rng_state)
    _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None)
        -> softmax_d, with dq, dk, dv written in place

On CUDA they run ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` (the FlashAttention-2
kernels behind SDPA's flash backend, grouped-query attention included); elsewhere an fp32 reference of the same
contract, for the CPU tests. What neither computes (dropout, softcap, ALiBi, the attention probabilities) raises a
``ValueError``; DeepSpeed's FPDT layer asks for none of them. ``softmax_d`` (the row sums of ``dout * out``) is
returned as ``None``: computing it would cost a ``(B, S, H, D)`` fp32 temporary, and DeepSpeed discards it.

Tensors, flash-attn's layout (batch 1 in DeepSpeed's calls):

| name | shape | note |
|---|---|---|
| q, dout, out, dq | (B, Sq, H, D) | |
| k, v, dk, dv | (B, Sk, Hkv, D) | ``H % Hkv == 0`` (grouped-query attention) |
| softmax_lse | (B, H, Sq) fp32 | log-sum-exp of each query row's scaled scores |
"""

from __future__ import annotations

import sys
import types
from typing import Any, Optional

import torch
from torch import Tensor

FLASH_ATTN_VERSION = "2.7.4"
"""The version the registered ``flash_attn`` claims: DeepSpeed 0.19.8 calls the >= 2.7.0 signatures for it."""


def _check_supported(dropout_p: float, softcap: float, alibi_slopes: Optional[Tensor]) -> None:
    if dropout_p or softcap or alibi_slopes is not None:
        raise ValueError(
            f"the flash_attn stand-in computes exact attention only: dropout_p ({dropout_p}), softcap ({softcap}) and "
            f"alibi_slopes ({'given' if alibi_slopes is not None else None}) must be 0, 0 and None"
        )


def _window(size: int) -> Optional[int]:
    """flash-attn's ``-1`` (no window) is PyTorch's ``None``."""
    return None if size is None or size < 0 else size


def _reference_scores(q: Tensor, k: Tensor, softmax_scale: float, causal: bool) -> Tensor:
    """fp32 scaled scores ``(B, H, Sq, Sk)``, causal as flash-attn aligns it (to the bottom right when Sq != Sk)."""
    groups = q.shape[2] // k.shape[2]
    k = k.float().repeat_interleave(groups, dim=2)  # (B, Sk, Hkv, D) -> (B, Sk, H, D)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * softmax_scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


def _reference_forward(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor]:
    scores = _reference_scores(q, k, softmax_scale, causal)
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    groups = q.shape[2] // k.shape[2]
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float().repeat_interleave(groups, dim=2))
    return out.to(q.dtype), lse


def _reference_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        softmax_scale: float, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """FlashAttention-2's backward in fp32 from the saved ``lse``: ``dS = P * (dP - rowsum(dO * O))``."""
    groups = q.shape[2] // k.shape[2]
    probs = torch.exp(_reference_scores(q, k, softmax_scale, causal) - lse[..., None])  # (B, H, Sq, Sk)
    v_heads = v.float().repeat_interleave(groups, dim=2)
    d_probs = torch.einsum("bqhd,bkhd->bhqk", dout.float(), v_heads)
    row = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (B, H, Sq)
    d_scores = probs * (d_probs - row[..., None]) * softmax_scale
    dq = torch.einsum("bhqk,bkhd->bqhd", d_scores, k.float().repeat_interleave(groups, dim=2))
    dk = torch.einsum("bhqk,bqhd->bkhd", d_scores, q.float())
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout.float())
    # the H query heads' contributions add up onto each of the Hkv key/value heads
    b, sk, hkv, d = k.shape
    return dq, dk.reshape(b, sk, hkv, groups, d).sum(3), dv.reshape(b, sk, hkv, groups, d).sum(3)


def flash_attn_forward(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
    window_size_left: int = -1, window_size_right: int = -1, softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None, return_softmax: bool = False,
) -> tuple[Tensor, Tensor, None, Any]:
    """flash-attn 2.7's ``_flash_attn_forward``: ``(out, softmax_lse, None, rng_state)``."""
    _check_supported(dropout_p, softcap, alibi_slopes)
    if return_softmax:
        raise ValueError("the flash_attn stand-in does not return the attention probabilities (return_softmax=True)")
    if q.device.type != "cuda":
        if window_size_left >= 0 or window_size_right >= 0:
            raise ValueError("the CPU reference of the flash_attn stand-in has no sliding window")
        out, lse = _reference_forward(q, k, v, softmax_scale, causal)
        return out, lse, None, None
    out, lse, rng_state, unused, _debug = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=softmax_scale,
        window_size_left=_window(window_size_left), window_size_right=_window(window_size_right),
    )
    return out, lse, None, (rng_state, unused)


def flash_attn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor, dq: Tensor, dk: Tensor,
    dv: Tensor, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False, rng_state: Any = None,
) -> None:
    """flash-attn 2.7's ``_flash_attn_backward``: writes ``dq, dk, dv`` in place; returns ``None`` for
    ``softmax_d`` (see the module's docstring). ``deterministic`` has no effect: PyTorch's kernel is
    deterministic for exact attention."""
    _check_supported(dropout_p, softcap, alibi_slopes)
    if q.device.type != "cuda":
        if window_size_left >= 0 or window_size_right >= 0:
            raise ValueError("the CPU reference of the flash_attn stand-in has no sliding window")
        grads = _reference_backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal)
    else:
        # the random-number state only matters with dropout, which _check_supported refused: DeepSpeed passes
        # rng_state=None, and placeholders of the forward's dtypes stand in
        seed, offset = rng_state if rng_state is not None else (
            torch.zeros(2, dtype=torch.uint64, device=q.device), torch.zeros((), dtype=torch.uint64, device=q.device))
        grads = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, softmax_lse, None, None, q.shape[1], k.shape[1], 0.0, causal, seed,
            offset, scale=softmax_scale, window_size_left=_window(window_size_left),
            window_size_right=_window(window_size_right),
        )
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.copy_(grad)
    return None


def install() -> str:
    """Make ``from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_backward`` find the two
    functions above, unless a real flash-attn is importable. Call it before importing
    ``deepspeed.sequence.fpdt_layer``, which reads the names at import. Returns which kernels DeepSpeed gets:
    ``"torch flash"`` (the stand-in) or ``"flash-attn X.Y.Z"``."""
    installed = sys.modules.get("flash_attn")
    if installed is not None and getattr(installed, "__stand_in__", False):
        return "torch flash"
    try:
        import flash_attn  # noqa: F401 - a real installation wins
        from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward  # noqa: F401

        return f"flash-attn {flash_attn.__version__}"
    except ImportError:
        pass
    package = types.ModuleType("flash_attn")
    package.__version__ = FLASH_ATTN_VERSION
    package.__stand_in__ = True
    package.__path__ = []  # a package, so that the submodule import resolves through sys.modules
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_forward = flash_attn_forward
    interface._flash_attn_backward = flash_attn_backward
    package.flash_attn_interface = interface
    sys.modules["flash_attn"] = package
    sys.modules["flash_attn.flash_attn_interface"] = interface
    if "deepspeed.sequence.fpdt_layer" in sys.modules:
        raise RuntimeError("install() ran after deepspeed.sequence.fpdt_layer was imported, which read the missing "
                           "flash_attn then; call it before that import")
    return "torch flash"
