"""Head groups: an attention layer run one group of heads at a time (docs/head_chunks.md).

With ``G`` head groups, group ``g`` projects the layer input onto its ``H/G`` query heads and ``Hkv/G`` kv heads
(the module's own ``q_proj``/``k_proj``/``v_proj`` weights, sliced by rows), applies RoPE (and Qwen3's q/k norms),
runs the FPDT attention on them (sequence-sharded in, head-sharded inside, as for the whole layer) and adds its share
of the output projection, ``out_g @ Wo[:, cols_g]ᵀ``, to the layer output. So the full-width q, k, v and attention
output of the local sequence never exist at once, in the forward or in the backward.

Groups are GQA-aware: query head ``i`` reads kv head ``i // (H/Hkv)``, so the contiguous query heads
``[g·H/G, (g+1)·H/G)`` read exactly the kv heads ``[g·Hkv/G, (g+1)·Hkv/G)``; each kv head is projected and
all-to-all'd once, in its group. ``G`` must therefore divide ``Hkv``, and each group's heads must split over the
``P`` ranks as a whole layer's do (:func:`lightning_fpdt.sequence.sizes.check_head_groups`).

The backward does not keep any group's activations: it recomputes each group's q/k/v projections from the saved layer
input (cheap matmuls; the linear ends, output projection included, are differentiated by hand into one running input
gradient) and replays its attention from the stash of the forward (:class:`LayerAttention`'s ``record``/replay, one
handle per group), so the attention itself is never recomputed, also under ``ActivationOffload`` (whose first,
no-grad forward records every group; its recompute sums the output projection from the kept outputs).

Three layers: the loops (:func:`head_groups_forward`, :func:`head_groups_backward`), a thin ``autograd.Function``,
and :class:`HeadGroupedAttention` with :func:`install_head_groups`, which the reference Llama and the Hugging Face
Llama/Qwen2/Qwen3/Mistral attention modules get. The weights stay the modules' own parameters (sliced in the
forward): checkpoints, FSDP2 sharding and export are unchanged.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call

from lightning_fpdt.integrations.attributes import ATTENTION_HANDLE
from lightning_fpdt.integrations.families.base import module_rope
from lightning_fpdt.memory.forwards import replace_forward
from lightning_fpdt.models.llama import LlamaAttention, apply_rotary
from lightning_fpdt.sequence.all_to_all import group_size
from lightning_fpdt.sequence.attention import FPDTAttention, check_document_ids
from lightning_fpdt.sequence.blocks import check_exact_call, in_backward
from lightning_fpdt.sequence.ring_rules import check_ring
from lightning_fpdt.sequence.sizes import check_head_groups

# ---- one attention module's weights, by role -----------------------------------------------------------------------
Q_ROWS, KV_ROWS, O_COLUMNS, WHOLE = "q", "kv", "o", "whole"
_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@dataclass(frozen=True)
class _Layout:
    """Head counts of one module and its group size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_groups: int

    @property
    def group_heads(self) -> int:
        return self.num_heads // self.num_groups

    @property
    def group_kv_heads(self) -> int:
        return self.num_kv_heads // self.num_groups

    def slice(self, tensor: Tensor, role: str, group: int) -> Tensor:
        """Group ``group``'s part of a weight: rows of q/k/v projections, columns of the output projection."""
        if role == Q_ROWS:
            width = self.group_heads * self.head_dim  # (H·D, hidden) -> (H/G·D, hidden); biases alike
            return tensor.narrow(0, group * width, width)
        if role == KV_ROWS:
            width = self.group_kv_heads * self.head_dim
            return tensor.narrow(0, group * width, width)
        if role == O_COLUMNS:
            width = self.group_heads * self.head_dim  # (hidden, H·D) -> (hidden, H/G·D)
            return tensor.narrow(1, group * width, width)
        return tensor


class _Family:
    """How one kind of attention module projects, normalises and rotates (reads the module; holds no tensors)."""

    def __init__(self, module: nn.Module, rope: Callable[[Tensor, Tensor, Sequence[Tensor]], tuple[Tensor, Tensor]],
                 scale: float) -> None:
        self.rope = rope
        self.scale = scale
        roles = [("q_proj.weight", Q_ROWS), ("q_proj.bias", Q_ROWS), ("k_proj.weight", KV_ROWS),
                 ("k_proj.bias", KV_ROWS), ("v_proj.weight", KV_ROWS), ("v_proj.bias", KV_ROWS),
                 ("o_proj.weight", O_COLUMNS)]
        self.norms = [name for name in ("q_norm", "k_norm") if isinstance(getattr(module, name, None), nn.Module)]
        for norm in self.norms:  # Qwen3: RMSNorm over the head dim, the same weights for every head
            roles += [(f"{norm}.{name}", WHOLE) for name, _ in getattr(module, norm).named_parameters()]
        self.roles = [(name, role) for name, role in roles if operator.attrgetter(name)(module) is not None]

    def parameters(self, module: nn.Module) -> list[Tensor]:
        """Read at call time: under FSDP2 these are the unsharded parameters of the current forward."""
        return [operator.attrgetter(name)(module) for name, _ in self.roles]


# ---- the loops -----------------------------------------------------------------------------------------------------
class HeadGroupedAttention:
    """One attention module run in ``G`` head groups, each with its own :class:`LayerAttention` handle.

    Installed as the module's attention handle (:data:`~lightning_fpdt.integrations.attributes.ATTENTION_HANDLE`) by
    :func:`install_head_groups`; ``ActivationOffload`` and the strategy find the shared :class:`FPDTAttention`
    through ``shared``.
    """

    def __init__(self, shared: FPDTAttention, layout: _Layout, family: _Family) -> None:
        self.shared = shared
        self.layout = layout
        self.family = family
        self.handles = [shared.for_layer() for _ in range(layout.num_groups)]

    def group_params(self, params: Sequence[Tensor], group: int) -> dict[str, Tensor]:
        return {name: self.layout.slice(p, role, group) for (name, role), p in zip(self.family.roles, params)}

    def project(self, module: nn.Module, x: Tensor, aux: Sequence[Tensor], p: dict[str, Tensor]
                ) -> tuple[Tensor, Tensor, Tensor]:
        """Group q, k, v from the layer input: ``(B, S/P, hidden) -> (B, S/P, H/G, D), 2 × (B, S/P, Hkv/G, D)``."""
        return self.rotate(module, *self.linear(x, p), aux, p)

    @staticmethod
    def linear(x: Tensor, p: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The group's q, k, v projections: ``(B, S/P, hidden) -> (B, S/P, H/G·D), 2 × (B, S/P, Hkv/G·D)``."""
        return tuple(F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias")) for name in _PROJECTIONS)

    def rotate(self, module: nn.Module, q: Tensor, k: Tensor, v: Tensor, aux: Sequence[Tensor], p: dict[str, Tensor]
               ) -> tuple[Tensor, Tensor, Tensor]:
        """Projections to attention inputs: split into heads, the q/k norms (Qwen3), RoPE."""
        lay = self.layout
        b, s, _ = q.shape
        q = q.view(b, s, lay.group_heads, lay.head_dim)
        k = k.view(b, s, lay.group_kv_heads, lay.head_dim)
        v = v.view(b, s, lay.group_kv_heads, lay.head_dim)
        normed = {"q_norm": q, "k_norm": k}
        for norm in self.family.norms:  # the module's own norm, run with this call's (leaf) weights
            weights = {name[len(norm) + 1:]: t for name, t in p.items() if name.startswith(norm + ".")}
            normed[norm] = functional_call(getattr(module, norm), weights, (normed[norm],))
        q, k = self.family.rope(normed["q_norm"], normed["k_norm"], aux)
        return q, k, v

    @staticmethod
    def output(out: Tensor, p: dict[str, Tensor], into: Optional[Tensor] = None) -> Tensor:
        """This group's share of the output projection, ``(B, S/P, H/G, D) @ Wo[:, cols_g]ᵀ``, added ``into`` the sum
        of the earlier groups' (in place: only under no grad)."""
        flat = out.flatten(2)  # (B, S/P, H/G·D)
        weight = p["o_proj.weight"]  # (hidden, H/G·D), a column block of Wo
        if into is None:
            return F.linear(flat, weight)
        into.view(-1, into.shape[-1]).addmm_(flat.reshape(-1, flat.shape[-1]), weight.t())
        return into

    @property
    def recorded(self) -> bool:
        return all(handle.recorded for handle in self.handles)

    def __call__(self, module: nn.Module, x: Tensor, aux: Sequence[Tensor]) -> Tensor:
        """The layer's attention output before the output projection's bias: ``(B, S/P, hidden)``."""
        params = self.family.parameters(module)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *aux, *params)):
            return _HeadGroupedFunction.apply(self, module, x, len(aux), *aux, *params)
        # no graph: evaluation, a checkpoint's first forward (which records every group for the recompute), a
        # forward run again to regenerate block inputs (the recorded outputs summed, their records left for the
        # replay), or a recompute of a layer that needs no gradient (frozen, on a frozen input: the records' last use)
        if self.recorded and (self.shared.regenerating or in_backward()):
            y = head_groups_forward(self, module, x, aux, params, mode="kept")
            if not self.shared.regenerating:
                for handle in self.handles:
                    handle.discard()
            return y
        mode = "record" if self.shared.recording else "compute"
        return head_groups_forward(self, module, x, aux, params, mode=mode)

    def __repr__(self) -> str:
        lay = self.layout
        return (f"HeadGroupedAttention({lay.num_groups} groups of {lay.group_heads} query / {lay.group_kv_heads} kv "
                f"heads, {self.shared!r})")


def head_groups_forward(layer: HeadGroupedAttention, module: nn.Module, x: Tensor, aux: Sequence[Tensor],
                        params: Sequence[Tensor], mode: str) -> Tensor:
    """The group loop of the forward, under no grad. ``mode``: ``"record"`` runs each group's attention and keeps it
    for the backward's replay; ``"kept"`` (a checkpoint's recompute, or a forward regenerating block inputs) only sums
    the output projection of the recorded outputs; ``"compute"`` (evaluation) keeps nothing."""
    y = None  # (B, S/P, hidden): the running sum of the groups' output projections
    for group, handle in enumerate(layer.handles):
        p = layer.group_params(params, group)
        if mode == "kept":
            out = handle.kept_output()  # (B, S/P, H/G, D)
        else:
            q, k, v = layer.project(module, x, aux, p)  # (B, S/P, H/G, D), (B, S/P, Hkv/G, D) x 2
            scale = layer.family.scale
            if mode == "record":
                out = handle.record(q, k, v, causal=True, scale=scale)
            else:
                out = layer.shared(q, k, v, causal=True, scale=scale)
            del q, k, v  # freed before the next group projects
        y = layer.output(out, p, into=y)
        del out
    return y


def head_groups_backward(layer: HeadGroupedAttention, module: nn.Module, grad_y: Tensor, x: Tensor,
                         aux: Sequence[Tensor], params: Sequence[Tensor], needs_grad: Sequence[bool]
                         ) -> tuple[Optional[Tensor], list[Optional[Tensor]], list[Optional[Tensor]]]:
    """The group loop of the backward: per group, recompute the q, k, v projections from ``x``, take the attention
    output back from the recorded first pass (its backward runs on the stashed chunks: no attention recompute) and
    backpropagate ``grad_y`` through that group alone. Returns the gradients of ``x``, of the ``aux`` tensors (RoPE
    inputs) and of ``params``; ``needs_grad`` flags ``(x, *aux, *params)``.

    The linear ends are differentiated by hand, so no hidden-sized (B, S/P, hidden) tensor is made per group: the
    output projection is not run again (``d out_g = grad_y @ Wo[:, cols_g]``, ``dWo[:, cols_g] = grad_yᵀ @ out_g``),
    and each projection's input gradient is added into one running ``dx`` by ``addmm_`` (autograd would return each
    as a fresh tensor and sum them out of place). Autograd runs only from the attention output back to the
    projections' outputs (the replay, RoPE, the q/k norms), which are asked for as gradient edges: neither the
    projections nor the attention output are held through it by a reference of this loop. Each ``addmm_`` rounds its
    product and the running sum once, in ``dx``'s dtype (3·G roundings in all; autograd's out-of-place sums rounded
    each product, each of two sums and the running sum: 6·G)."""
    needs_x, needs_aux, needs_params = needs_grad[0], needs_grad[1:1 + len(aux)], needs_grad[1 + len(aux):]
    # a graph root only: the projections' own backward (the linear on x_leaf) never runs, and saves nothing new
    x_leaf = x.detach().requires_grad_()
    aux_leaves = [a.detach().requires_grad_(n) for a, n in zip(aux, needs_aux)]
    names = [name for name, _ in layer.family.roles]
    needs = dict(zip(names, needs_params))
    x_2d = x_leaf.detach().view(-1, x.shape[-1])  # (B·S/P, hidden)
    grad_y_2d = grad_y.view(-1, grad_y.shape[-1])  # (B·S/P, hidden)
    grad_x = torch.zeros_like(x_2d) if needs_x else None  # (B·S/P, hidden): the one running input gradient
    grad_aux: list[Optional[Tensor]] = [None] * len(aux)
    # full-size parameter gradients (weight-sized, small next to activations); each group writes its rows/columns
    grads = {name: torch.zeros_like(p) if needs[name] else None for name, p in zip(names, params)}
    # the q/k norms' weights: leaves of each group's graph (shared by all groups, so their gradients are summed)
    norm_names = [name for name, role in layer.family.roles if role == WHOLE]
    for group, handle in enumerate(layer.handles):
        p = {name: t.detach() for name, t in layer.group_params(params, group).items()}
        norm_leaves = {name: p[name].requires_grad_(needs[name]) for name in norm_names}
        with torch.enable_grad():
            projected = layer.linear(x_leaf, p)  # (B, S/P, H/G·D), 2 × (B, S/P, Hkv/G·D)
            edges = [get_gradient_edge(t) for t in projected]
            q, k, v = layer.rotate(module, *projected, aux_leaves, {**p, **norm_leaves})
            del projected  # freed once RoPE has read them (Qwen3's norms save theirs)
            out = handle(q, k, v, causal=True, scale=layer.family.scale)  # (B, S/P, H/G, D): the replay
        del q, k, v
        w_o = p["o_proj.weight"]  # (hidden, H/G·D), a column block of Wo
        if needs["o_proj.weight"]:
            grads_o = layer.layout.slice(grads["o_proj.weight"], O_COLUMNS, group)
            grads_o.addmm_(grad_y_2d.t(), out.detach().view(-1, w_o.shape[1]))
        out_edge, out_shape = get_gradient_edge(out), out.shape
        del out  # the attention's backward holds it until it has run, no longer
        inputs = [*edges, *(a for a in aux_leaves if a.requires_grad),
                  *(t for t in norm_leaves.values() if t.requires_grad)]
        grad_out = (grad_y_2d @ w_o).view(out_shape)  # (B, S/P, H/G, D)
        results = iter(torch.autograd.grad([out_edge], inputs, [grad_out]))
        del grad_out, edges, out_edge  # the group's graph goes with them
        for name, result in zip(_PROJECTIONS, results):
            grad_2d = result.view(-1, result.shape[-1])  # (B·S/P, H/G·D or Hkv/G·D)
            role = Q_ROWS if name == "q_proj" else KV_ROWS
            if needs_x:
                grad_x.addmm_(grad_2d, p[f"{name}.weight"])
            if needs[f"{name}.weight"]:
                layer.layout.slice(grads[f"{name}.weight"], role, group).addmm_(grad_2d.t(), x_2d)
            if needs.get(f"{name}.bias"):
                layer.layout.slice(grads[f"{name}.bias"], role, group).add_(grad_2d.sum(0))
        for i, n in enumerate(needs_aux):
            if n:
                result = next(results)
                grad_aux[i] = result if grad_aux[i] is None else grad_aux[i].add_(result)
        for name in norm_names:
            if needs[name]:
                grads[name].add_(next(results))
        del results, result, grad_2d  # this group's dq, dk, dv: not alive through the next group's backward
    return (None if grad_x is None else grad_x.view(x.shape)), grad_aux, list(grads.values())


class _HeadGroupedFunction(torch.autograd.Function):
    """An attention module's projections, attention and output projection, head group by head group.

    ``h`` = hidden size, ``G`` groups, ``H/G`` query and ``Hkv/G`` kv heads per group:

    | tensor | shape | sharded dim | kept for backward |
    |---|---|---|---|
    | x (in) | (B, S/P, h) | sequence | yes: each group's q, k, v are recomputed from it (cheap matmuls) |
    | RoPE inputs (in) | position ids (B, S/P) or cos, sin (B, S/P, D) | sequence | yes: small |
    | q/k/v/o weights (in) | the module's own | — | yes (references): sliced per group, gradients written per slice |
    | q_g, k_g, v_g | (B, S/P, H/G, D), (B, S/P, Hkv/G, D) | sequence | no: recomputed per group in backward |
    | group chunks | (B, H/(G·P), C, D) per chunk | heads | in the group's handle's stash (host when offloading) |
    | out_g | (B, S/P, H/G, D) | sequence | kept by the group's handle (host memory when offloading) for its replay |
    | y (out) | (B, S/P, h) | sequence | no: the sum over groups of ``out_g @ Wo[:, cols_g]ᵀ`` |
    | dx | (B, S/P, h) | sequence | backward only: one buffer, each group's q/k/v projections add into it in place |

    So besides ``x`` and the stash, the device holds one group's q, k, v, out (and in backward their gradients, with
    ``dy`` and ``dx`` the only hidden-sized tensors) at a time: ``1/G`` of the full-width buffers. The attention runs
    once per group per step: the backward replays it.
    """

    @staticmethod
    def forward(ctx, layer: HeadGroupedAttention, module: nn.Module, x: Tensor, num_aux: int, *tensors: Tensor
                ) -> Tensor:
        aux, params = tensors[:num_aux], tensors[num_aux:]
        # a checkpoint's recompute (in a backward, every group recorded by its first forward): no attention here
        mode = "kept" if in_backward() and layer.recorded else "record"
        y = head_groups_forward(layer, module, x, aux, params, mode=mode)
        ctx.layer, ctx.module, ctx.num_aux = layer, module, num_aux
        ctx.save_for_backward(x, *tensors)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, *tensors = ctx.saved_tensors
        aux, params = tensors[:ctx.num_aux], tensors[ctx.num_aux:]
        needs = (ctx.needs_input_grad[2], *ctx.needs_input_grad[4:])
        grad_x, grad_aux, grad_params = head_groups_backward(ctx.layer, ctx.module, grad_y.contiguous(), x, aux,
                                                             params, needs)
        return None, None, grad_x, None, *grad_aux, *grad_params


# ---- installing it in attention modules ----------------------------------------------------------------------------
def _rope_reference_llama(module: nn.Module) -> Callable:
    def rope(q: Tensor, k: Tensor, aux: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        (position_ids,) = aux
        return apply_rotary(q, position_ids, module.rope_theta), apply_rotary(k, position_ids, module.rope_theta)

    return rope


def _sliding_window(module: nn.Module) -> Optional[int]:
    # Qwen2/Qwen3 keep it per layer on the module (None for full-attention layers); Mistral passes its config's
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(getattr(module, "config", None), "sliding_window", None)


def install_head_groups(module: nn.Module, attention: FPDTAttention, *, rope: Optional[Callable] = None
                        ) -> HeadGroupedAttention:
    """Run ``module`` (a reference Llama or a Hugging Face attention with separate projections: Llama, Qwen2, Qwen3,
    Mistral, ... see ``families/``) in ``attention.head_chunks`` head groups: replaces its ``forward``, keeps its
    parameters. ``rope``: the family's RoPE (``families.base.Family.rope``; ``None``: the ``apply_rotary_pos_emb`` of
    the module's file). ``ValueError`` for a module without separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` or
    heads that do not split (names the valid values)."""
    names = (*_PROJECTIONS, "o_proj")
    projections = [getattr(module, name, None) for name in names]
    head_dim = getattr(module, "head_dim", None)
    wrapped = [f"{name} is a {type(p).__module__}.{type(p).__name__}" for name, p in zip(names, projections)
               if isinstance(p, nn.Module) and not isinstance(p, nn.Linear)]
    if wrapped:  # head groups run slices of the projections' weights: an adapter's own weights would not train
        raise ValueError(
            f"head_chunks={attention.head_chunks} runs the q/k/v/o projections of {type(module).__name__} as slices "
            f"of their nn.Linear weights, but {', '.join(wrapped)} (an adapter such as LoRA wraps it): its own "
            f"weights would get no gradient. Set head_chunks=1 (or 'auto', which then chooses 1), or merge the "
            f"adapter into the weights first"
        )
    if not all(isinstance(p, nn.Linear) for p in projections) or not isinstance(head_dim, int):
        raise ValueError(
            f"head_chunks={attention.head_chunks} needs an attention module with q_proj, k_proj, v_proj, o_proj "
            f"(nn.Linear) and head_dim, as Llama, Qwen2, Qwen3 and Mistral have; {type(module).__name__} has not: "
            f"set head_chunks=1"
        )
    check_ring(attention.ring_size, head_chunks=attention.head_chunks)
    q_proj, k_proj = projections[:2]
    layout = _Layout(num_heads=q_proj.out_features // head_dim, num_kv_heads=k_proj.out_features // head_dim,
                     head_dim=head_dim, num_groups=attention.head_chunks)
    check_head_groups(layout.num_heads, layout.num_kv_heads, layout.num_groups, group_size(attention.group))
    if isinstance(module, LlamaAttention):
        family = _Family(module, _rope_reference_llama(module), scale=head_dim**-0.5)
        forward = functools.partial(_reference_llama_forward, module)
    else:
        family = _Family(module, rope or module_rope(module), scale=getattr(module, "scaling", head_dim**-0.5))
        forward = functools.partial(_hf_forward, module)
    grouped = HeadGroupedAttention(attention, layout, family)
    setattr(module, ATTENTION_HANDLE, grouped)
    replace_forward(module, forward)
    return grouped


def _output_bias(module: nn.Module, y: Tensor) -> Tensor:
    bias = module.o_proj.bias  # added once, not per group
    return y if bias is None else y + bias


def _reference_llama_forward(module: nn.Module, x: Tensor, position_ids: Tensor,
                             document_ids: Optional[Tensor] = None) -> Tensor:
    """``LlamaAttention.forward`` of ``lightning_fpdt.models.llama``, in head groups. Packed documents reach the
    attention as the strategy's boundaries of the global batch (``FPDTAttention.documents``), not as local ids."""
    grouped = getattr(module, ATTENTION_HANDLE)
    check_document_ids(grouped.shared, document_ids)
    return _output_bias(module, grouped(module, x, (position_ids,)))


def _hf_forward(module: nn.Module, hidden_states: Tensor, position_embeddings: Optional[tuple[Tensor, Tensor]] = None,
                attention_mask: Optional[Tensor] = None, cache: Any = None, **kwargs: Any) -> tuple[Tensor, None]:
    """A transformers ``*Attention.forward`` (Llama, Qwen2, Qwen3, Mistral) in head groups; refuses what the fpdt
    attention cannot compute exactly (:func:`~lightning_fpdt.sequence.blocks.check_exact_call`, as the whole-layer
    attention function of huggingface.py does)."""
    check_exact_call(attention_mask=attention_mask,
                     dropout=getattr(module, "attention_dropout", 0.0) if module.training else 0.0,
                     sliding_window=_sliding_window(module))
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError("head_chunks > 1 runs without a KV cache: call the model with use_cache=False")
    if position_embeddings is None:
        raise ValueError(f"{type(module).__name__} was called without position_embeddings (cos, sin)")
    y = getattr(module, ATTENTION_HANDLE)(module, hidden_states, tuple(position_embeddings))
    return _output_bias(module, y), None
