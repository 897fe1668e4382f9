"""Which language models a LightningModule holds and what each transform reaches (integrations/discovery.py), the
check that every attention runs sequence-parallel (integrations/audit.py), per-sequence sums (sequence/loss.py),
right-padding masks (strategy/batch.py) and the planner's count of the parameters beside the planned model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_fpdt.integrations.audit import AttentionAudit, allow_local_attention, watched_modules
from lightning_fpdt.integrations.discovery import (
    language_models,
    other_parameters,
    planned_model,
    transform_targets,
)
from lightning_fpdt.planner import plan_memory
from lightning_fpdt.sequence.attention import FPDTAttention
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.loss import is_sequence_level, sequence_mean, sequence_sum, token_sums
from lightning_fpdt.strategy.batch import right_padding, shard_batch
from tests.dist.multi_models import hf_llama


class Holder(nn.Module):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            self.add_module(name, child)


def test_every_language_model_is_found_wherever_it_sits():
    """A model beside a head, a policy beside a frozen reference inside a ModuleDict, a peft-wrapped model: each
    language model once, the search not descending into one it found; the planned one trains."""
    policy, reference, head = hf_llama(0), hf_llama(1).requires_grad_(False), nn.Linear(32, 1)
    assert language_models(Holder(model=policy, head=head)) == [policy]
    module = Holder(models=nn.ModuleDict(dict(reference=reference, policy=policy)), head=head)
    assert language_models(module) == [reference, policy]
    assert planned_model(module) is policy  # the first that trains
    total, trainable = other_parameters(module)
    assert total == sum(p.numel() for p in reference.parameters()) + 33 and trainable == 33


def test_adapter_wrappers_stand_for_their_model():
    """A peft LoRA wrapper is found as the network it wraps, which holds its adapters."""
    peft = pytest.importorskip("peft")
    base = hf_llama(0)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert language_models(Holder(model=wrapped, head=nn.Linear(32, 1))) == [base]


def test_plain_networks_are_one_model():
    """A module holding no Hugging Face model nor reference Llama is one plain network (its single child, or
    itself)."""
    net = nn.Sequential(nn.Linear(4, 4))
    assert language_models(Holder(net=net)) == [net]
    module = Holder(a=nn.Linear(4, 4), b=nn.Linear(4, 4))
    assert language_models(module) == [module]


def test_transforms_reach_the_models_they_apply_to():
    """The tiled MLP reaches every model, the tiled loss each causal LM, checkpointing the models that train."""
    from transformers import LlamaConfig, LlamaModel

    policy, reference = hf_llama(0), hf_llama(1).requires_grad_(False)
    base = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2))
    models = [reference, policy, base]
    assert transform_targets("tiled_mlp", models) == models
    assert transform_targets("tiled_loss", models) == [reference, policy]
    assert transform_targets("activation_checkpointing", models) == [policy, base]
    assert transform_targets("activation_checkpointing", [reference]) == [reference]


# ---- the attention check ---------------------------------------------------------------------------------------------
class CountingAttention(nn.Module):
    """Calls the shared attention's counter as an installed layer does."""

    def __init__(self, shared: FPDTAttention) -> None:
        super().__init__()
        self.shared = shared

    def forward(self, x):
        self.shared.kernel_calls += 1
        return x


class LocalAttention(nn.Module):
    def forward(self, x):
        return x.softmax(-1)


def test_a_module_without_the_sequence_parallel_attention_is_named():
    """Split over 2 ranks, an attention-like module whose first forward ran no sequence-parallel attention raises a
    ValueError naming it and the fix; one that did passes and is not watched again."""
    shared = FPDTAttention()
    root = Holder(good=CountingAttention(shared), bad=LocalAttention())
    audit = AttentionAudit(root, blocks=[], attention=shared, sequence_parallel_size=2)
    assert audit.watching == 2
    root.good(torch.ones(2))
    assert audit.checked == ["good"] and audit.watching == 1
    with pytest.raises(ValueError, match=r"bad \(LocalAttention\) .* split over 2 ranks.*allow_local_attention"):
        root.bad(torch.ones(2))
    root.good(torch.ones(2))  # no hook left on it
    assert audit.checked == ["good", "bad"]


class FailingAttention(CountingAttention):
    def forward(self, x):
        if self.fails:
            raise ConnectionError("a peer went away")
        return super().forward(x)


def test_a_forward_that_raises_ends_with_its_own_error():
    """A watched module whose forward raises (a collective whose peer died) ends with that error, not one of the
    audit's hook, which torch runs anyway; it is checked at its next forward that finishes."""
    shared = FPDTAttention()
    root = Holder(flaky=FailingAttention(shared))
    root.flaky.fails = True
    audit = AttentionAudit(root, blocks=[], attention=shared, sequence_parallel_size=2)
    with pytest.raises(ConnectionError, match="a peer went away"):
        root.flaky(torch.ones(2))
    assert audit.checked == [] and audit.watching == 1
    root.flaky.fails = False
    root.flaky(torch.ones(2))
    assert audit.checked == ["flaky"] and audit.watching == 0


def test_one_rank_warns_and_allowed_modules_are_left_alone():
    """On one rank (nothing split) an unreached attention is a warning; a module marked allow_local_attention, and
    what it holds, are not watched; a block is watched whatever its class."""
    shared = FPDTAttention()
    block = nn.Linear(2, 2)
    root = Holder(local=allow_local_attention(Holder(inner=LocalAttention())), other=LocalAttention(), block=block)
    assert {id(m) for m in watched_modules(root, [block])} == {id(block), id(root.other)}
    AttentionAudit(root, blocks=[block], attention=shared, sequence_parallel_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        root.other(torch.ones(2))
        block(torch.ones(2))
    assert len(caught) == 2 and "outside FPDT's chunk pipeline" in str(caught[0].message)


# ---- per-sequence sums -----------------------------------------------------------------------------------------------
def test_sequence_sums_and_the_mark_of_a_sequence_level_loss():
    """On one process sequence_sum and sequence_mean are the masked sums and means (fp32 for bf16 values; 0 where no
    token counts); a loss built from them, or from a model's reduced loss, is sequence-level, a local loss is not."""
    torch.manual_seed(0)
    values = torch.randn(3, 5, 2, requires_grad=True)
    mask = torch.rand(3, 5) > 0.4
    mask[2] = False
    expected = (values * mask[..., None]).sum(1)
    torch.testing.assert_close(token_sums(values, mask), expected)
    torch.testing.assert_close(sequence_mean(values, mask, group=None),
                               expected / mask.sum(1, keepdim=True).clamp(min=1))
    assert sequence_sum(values.bfloat16(), mask, group=None).dtype == torch.float32
    loss = -torch.nn.functional.logsigmoid(sequence_sum(values, mask, group=None)).mean()
    assert is_sequence_level(loss) and not is_sequence_level((values ** 2).mean())
    with pytest.raises(ValueError, match="one flag per token"):
        sequence_sum(values, mask[:, :4], group=None)


# ---- right-padding masks ---------------------------------------------------------------------------------------------
def test_right_padding_masks_are_dropped_with_their_targets():
    """A right-padding attention_mask is accepted: its padding gets no target (from input ids) and no place in the
    token mask; labels that give the padding targets, left padding and holes are refused."""
    layout = SequenceLayout(sp_size=2, sp_rank=1, num_chunks=1)
    ids = torch.arange(1, 13).reshape(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    sharded, plan = shard_batch({"input_ids": ids, "attention_mask": mask}, layout=layout)
    assert "attention_mask" not in sharded
    assert sharded["labels"].tolist() == [[5, -100, -100], [-100, -100, -100]]  # rank 1: tokens 3..5
    assert plan.token_mask.tolist() == [[True, True, False], [False, False, False]]
    _, plan0 = shard_batch({"input_ids": ids, "attention_mask": mask}, layout=SequenceLayout(sp_size=2, sp_rank=0,
                                                                                              num_chunks=1))
    assert plan0.valid_tokens.item() + plan.valid_tokens.item() == 4 + 2  # real tokens with a real next token
    with pytest.raises(ValueError, match="labels give targets"):
        shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask}, layout=layout)
    with pytest.raises(ValueError, match="zeros before kept tokens"):
        right_padding(torch.tensor([[0, 1, 1]]), torch.Size([1, 3]))
    with pytest.raises(ValueError, match="zeros before kept tokens"):
        right_padding(torch.tensor([[1, 0, 1]]), torch.Size([1, 3]))
    assert right_padding(torch.ones(1, 3), torch.Size([1, 3])) is None


# ---- the planner -----------------------------------------------------------------------------------------------------
def test_the_planner_counts_the_models_beside_the_planned_one():
    """A frozen reference model of the same size adds its sharded weights to the persistent memory; a trained one its
    gradients and optimizer states too."""
    common = dict(geometry="llama3-1b", seq_len=65536, num_gpus=4, gpus_per_node=4, gpu_memory_gib=80,
                  host_memory_gib=1000, chunks=2, offload=True, activation_offload=True, tiled_mlp=True,
                  tiled_loss=True)
    alone = plan_memory(**common)
    parameters = 1_000_000_000
    frozen = plan_memory(**common, other_parameters=parameters)
    trained = plan_memory(**common, other_parameters=parameters, other_trainable_parameters=parameters)
    assert frozen.persistent_gpu_bytes - alone.persistent_gpu_bytes == 4 * parameters // 4  # fp32 master over 4
    assert trained.persistent_gpu_bytes - frozen.persistent_gpu_bytes == (4 + 8) * parameters // 4
    assert "other_parameters=1,000,000,000 (0 trained)" in frozen.options.describe()
