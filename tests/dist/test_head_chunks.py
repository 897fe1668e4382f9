"""Head-group chunking on gloo processes against the single-process attention (docs/design.md §7):
one attention module's output and the gradients of its input and every parameter, and whole training."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.models.llama import LlamaAttention, LlamaConfig
from lightning_fpdt.integrations import HeadGroupedAttention, install_head_groups
from lightning_fpdt.sequence import FPDTAttention, SequenceLayout
from lightning_fpdt.sequence.all_to_all import group_rank, group_size
from tests.dist import test_strategy_parity as parity

# fp64: the parallel run and the reference differ only in summation order (blockwise softmax merge, G partial output
# projections, gradients summed over ranks), ~1e-15 relative; 1e-10 catches any wrong head, row, column or token.
TOL = dict(rtol=1e-10, atol=1e-10)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 24, 8, 4, 4  # H·D = 32 != hidden: a slice along the wrong dimension fails


def _module(family: str, seed: int, heads: tuple[int, int] = (HEADS, KV_HEADS)) -> tuple[torch.nn.Module, object]:
    """A fp64 attention module with random weights (biases and norms too) and its rotary embedding (HF), if any."""
    torch.manual_seed(seed)
    if family == "reference":
        config = LlamaConfig(vocab_size=8, hidden_size=HIDDEN, intermediate_size=8, num_layers=1, num_heads=heads[0],
                             num_kv_heads=heads[1], head_dim=HEAD_DIM)
        return LlamaAttention(config).double(), None
    import transformers

    sizes = dict(vocab_size=8, hidden_size=HIDDEN, intermediate_size=8, num_hidden_layers=1, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, attn_implementation="sdpa")
    if family == "hf-llama":
        config = transformers.LlamaConfig(**sizes, attention_bias=True)
        module = transformers.models.llama.modeling_llama.LlamaAttention(config, layer_idx=0)
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    elif family == "hf-qwen3":
        config = transformers.Qwen3Config(**sizes)
        module = transformers.models.qwen3.modeling_qwen3.Qwen3Attention(config, layer_idx=0)
        rotary = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(config)
    else:
        raise ValueError(family)
    module = module.double()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return module, rotary.double()


def _call(family: str, module: torch.nn.Module, rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    if family == "reference":
        return module(x, positions)
    cos_sin = rotary(x, positions)
    return module(hidden_states=x, position_embeddings=cos_sin, attention_mask=None)[0]


def _check_layer(family: str, seq_len: int, num_chunks: int, head_chunks: int, offload: bool, seed: int,
                 heads: tuple[int, int] = (HEADS, KV_HEADS)) -> None:
    """Every rank: the reference on the whole sequence, the grouped module on its shard; compare y and all grads."""
    sp_size, rank = group_size(None), group_rank(None)
    reference, rotary = _module(family, seed, heads)
    grouped = copy.deepcopy(reference)
    install_head_groups(grouped, FPDTAttention(group=None, num_chunks=num_chunks, backend="math", offload=offload,
                                               head_chunks=head_chunks))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq_len, HIDDEN, generator=gen, dtype=torch.float64)
    grad_y = torch.randn(2, seq_len, HIDDEN, generator=gen, dtype=torch.float64)
    positions = torch.arange(seq_len).expand(2, seq_len)

    x_ref = x.clone().requires_grad_()
    y_ref = _call(family, reference, rotary, x_ref, positions)
    params_ref = list(reference.parameters())
    grads_ref = torch.autograd.grad(y_ref, [x_ref, *params_ref], grad_y)

    layout = SequenceLayout(sp_size, rank, num_chunks)
    padded = layout.padded_length(seq_len)
    # pad tokens sit after every real token: causality keeps them out of the real tokens' outputs
    x_local = layout.shard(layout.pad(x, dim=1)).requires_grad_()
    grad_local = layout.shard(layout.pad(grad_y, dim=1))  # zero on pad tokens
    pos_local = layout.shard(layout.pad_position_ids(positions))
    y_local = _call(family, grouped, rotary, x_local, pos_local)
    params = list(grouped.parameters())
    grads = torch.autograd.grad(y_local, [x_local, *params], grad_local)

    case = f"{family} heads={heads} S={seq_len} P={sp_size} u={num_chunks} G={head_chunks} offload={offload}"
    y_full = layout.gather(y_local.detach(), None)
    assert y_full.shape[1] == padded
    torch.testing.assert_close(y_full[:, :seq_len], y_ref.detach(), **TOL, msg=lambda m: f"{case} y: {m}")
    torch.testing.assert_close(layout.gather(grads[0], None)[:, :seq_len], grads_ref[0], **TOL,
                               msg=lambda m: f"{case} dx: {m}")
    names = [name for name, _ in grouped.named_parameters()]
    for name, grad, ref in zip(names, grads[1:], grads_ref[1:]):
        if sp_size > 1:
            dist.all_reduce(grad)  # each rank's share of the weight gradient: its tokens
        torch.testing.assert_close(grad, ref, **TOL, msg=lambda m: f"{case} d{name}: {m}")


def run_layer_cases(cases: list[dict]) -> None:
    for case in cases:
        _check_layer(**case)


def _layer_cases(sp_size: int) -> list[dict]:
    """Every valid G for 8 query / 4 kv heads on P ranks (P = 4: G = 2 replicates each group's 2 kv heads), sequence
    chunks 1 and 2, offload on (the CPU host-stash path); one padded length per P."""
    cases = []
    valid = [g for g in (1, 2, 4) if (HEADS // g) % sp_size == 0]
    for head_chunks in valid:
        for num_chunks in (1, 2):
            seq_len = sp_size * num_chunks * 3 + (1 if head_chunks == valid[-1] and num_chunks == 2 else 0)
            cases.append(dict(family="reference", seq_len=seq_len, num_chunks=num_chunks, head_chunks=head_chunks,
                              offload=True, seed=len(cases)))
    for family in ("hf-llama", "hf-qwen3"):
        cases.append(dict(family=family, seq_len=sp_size * 2 * 3, num_chunks=2, head_chunks=valid[-1], offload=True,
                          seed=40 + len(cases)))
    return cases


def test_head_groups_single_process():
    """P = 1, G = 1, 2, 4, u = 1, 2: grouped layer output and all gradients equal the whole-layer attention."""
    run_layer_cases(_layer_cases(1))


@pytest.mark.parametrize("sp_size", [2, 4])
def test_head_groups_match_single_process(dist_pool, sp_size):
    """P = 2 (G = 1, 2, 4) and 4 (G = 1, 2; kv replicated), u = 1, 2, offload, reference and HF Llama/Qwen3."""
    dist_pool(sp_size).run(run_layer_cases, cases=_layer_cases(sp_size))


def test_head_groups_three_processes(dist_pool):
    """P = 3 (12 query / 6 kv heads, G = 2: 6 query and 3 kv heads per group, scattered), u = 1, 2, padded length:
    catches layout slips that powers of two hide."""
    dist_pool(3).run(run_layer_cases, cases=[
        dict(family="reference", seq_len=3 * num_chunks * 3 + 1, num_chunks=num_chunks, head_chunks=2, offload=True,
             seed=60 + num_chunks, heads=(12, 6)) for num_chunks in (1, 2)
    ])


# ---- training through the strategy ---------------------------------------------------------------------------------
def run_training(cases: list[dict]) -> None:
    for case in cases:
        activation_offload = case.pop("activation_offload", True)
        trainer = parity.train_and_compare(**case, callbacks=[ActivationOffload()] if activation_offload else [])
        grouped = [m._fpdt_attention for m in trainer.lightning_module.modules()
                   if isinstance(getattr(m, "_fpdt_attention", None), HeadGroupedAttention)]
        head_chunks = case["head_chunks"]
        assert len(grouped) == 2 and all(g.layout.num_groups == head_chunks for g in grouped)  # both layers
        # each group's attention ran once per layer and micro-batch (3 steps): never again in a recompute
        assert grouped[0].shared.kernel_calls == head_chunks * 2 * 3 * case["accumulate"]


def test_training_parity_head_chunks_two_processes(dist_pool):
    """1×2, head_chunks 2 and 4 (one kv head per group, replicated), ActivationOffload, attention offload, padding."""
    dist_pool(2).run(run_training, cases=[
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=2, seq_len=15,
             head_chunks=2, offload=True),
        dict(kind="llama-gqa8", dp=1, sp=2, chunks=1, accumulate=1, seq_len=16, head_chunks=4),
        dict(kind="hf", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16,
             head_chunks=2, offload=True),
        dict(kind="llama", dp=1, sp=2, chunks=2, accumulate=1, seq_len=16, head_chunks=2,
             activation_offload=False),
    ])


def test_training_parity_head_chunks_four_processes(dist_pool):
    """1×4 (G = 2, kv replicated) and 2×2 (data parallel, HF Llama), ActivationOffload, attention offload."""
    dist_pool(4).run(run_training, cases=[
        dict(kind="llama-gqa8", dp=1, sp=4, chunks=2, accumulate=1, seq_len=24,
             head_chunks=2, offload=True),
        dict(kind="hf", dp=2, sp=2, chunks=2, accumulate=1, seq_len=16, head_chunks=2),
    ])
