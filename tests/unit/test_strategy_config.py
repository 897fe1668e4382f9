"""Strategy options, mesh sizes, precision and integration errors, checked without processes (docs/design.md §5)."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTAttention, FPDTStrategy
from lightning_fpdt.integrations import SDPAInterception, SequenceParallelContext, install_hf_model
from lightning_fpdt.integrations.huggingface import hf_attention
from lightning_fpdt.sequence.loss import sequence_parallel_loss
from lightning_fpdt.sequence.sizes import resolve_ring_size, resolve_sizes
from lightning_fpdt.strategy.parallelize import ParallelizeConfig, apply_fpdt


def test_mesh_size_messages():
    """dp × sp must equal the world size, and the message prints every factor."""
    with pytest.raises(
        ValueError, match=r"sequence_parallel_size \(4\) \* data_parallel_size \(3\) = 12 != world size 8"
    ):
        resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size=3, sequence_parallel_size=4)
    with pytest.raises(ValueError, match=r"sequence_parallel_size \(3\) does not divide the world size 8"):
        resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size="auto", sequence_parallel_size=3)
    with pytest.raises(ValueError, match=r"data_parallel_size \(3\) does not divide the world size 8"):
        resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size=3, sequence_parallel_size="auto")
    with pytest.raises(ValueError, match="sequence_parallel_size must be 'auto' or a positive int, got 0"):
        resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size="auto", sequence_parallel_size=0)


def test_heads_limit_sequence_parallel_size():
    """An explicit size beyond the query heads is refused without a ring; one that does not divide them splits them
    unevenly; "auto" takes the largest in-node size up to the heads (never turning the ring on by itself)."""
    with pytest.raises(ValueError, match=r"num_heads \(4\) < sequence_parallel_size \(8\).*ring_size"):
        resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size=1, sequence_parallel_size=8, heads=(4, 4),
                      ring_size=1)
    assert resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size=1, sequence_parallel_size=8,
                         heads=(12, 4), ring_size=1) == (1, 8)  # 2 q heads on the first 4 ranks, 1 on the others
    dp, sp = resolve_sizes(world_size=16, devices_per_node=8, data_parallel_size="auto",
                           sequence_parallel_size="auto", heads=(12, 4))
    assert (dp, sp) == (2, 8)  # 8 does not divide 12 heads: the uneven split takes the whole node of 8
    dp, sp = resolve_sizes(world_size=16, devices_per_node=8, data_parallel_size="auto",
                           sequence_parallel_size="auto", heads=(6, 6))
    assert (dp, sp) == (4, 4)  # at most 6 ranks for 6 heads: the largest in-node size up to them
    assert resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size="auto",
                         sequence_parallel_size="auto", heads=(32, 8)) == (1, 8)


def test_ring_size_auto_and_explicit():
    """ring_size "auto" is 1 when P <= H (the heads split over P, unevenly if need be), else the smallest R whose
    U = P/R splits them evenly; an explicit R must divide P and leave a U the heads allow (an even one for R > 1),
    and the message prints every factor."""
    assert resolve_ring_size(sequence_parallel_size=8, ring_size="auto", heads=(32, 8)) == 1
    assert resolve_ring_size(sequence_parallel_size=8, ring_size="auto", heads=(12, 4)) == 1  # uneven: 2 or 1 heads
    assert resolve_ring_size(sequence_parallel_size=8, ring_size=2, heads=(12, 4)) == 2  # the ring stays reachable
    # a group spanning hosts prefers a ring whose Ulysses groups split the heads evenly (only the ring leaves a host)
    assert resolve_ring_size(sequence_parallel_size=16, ring_size="auto", heads=(24, 8), devices_per_node=8) == 2
    assert resolve_ring_size(sequence_parallel_size=16, ring_size="auto", heads=(24, 8), devices_per_node=16) == 1
    with pytest.raises(ValueError, match=r"sequence_parallel_size \(8\) / ring_size \(4\) = 2 Ulysses ranks: "
                                         r"num_kv_heads \(3\).*ring sizes the heads allow: \[1, 8\]"):
        resolve_ring_size(sequence_parallel_size=8, ring_size=4, heads=(12, 3))  # the ring's Ulysses level is even
    assert resolve_ring_size(sequence_parallel_size=4, ring_size="auto", heads=(2, 1)) == 2  # U = 2, kv replicated
    assert resolve_ring_size(sequence_parallel_size=8, ring_size="auto", heads=(6, 6)) == 4  # U = 2 (6 % 8, 6 % 4)
    assert resolve_ring_size(sequence_parallel_size=4, ring_size="auto", heads=(1, 1)) == 4  # U = 1: a pure ring
    assert resolve_ring_size(sequence_parallel_size=4, ring_size="auto", heads=None) == 1
    assert resolve_ring_size(sequence_parallel_size=8, ring_size=4, heads=(32, 8)) == 4
    with pytest.raises(ValueError, match=r"ring_size \(3\) does not divide sequence_parallel_size \(8\).*"
                                         r"\[1, 2, 4, 8\]"):
        resolve_ring_size(sequence_parallel_size=8, ring_size=3, heads=(32, 8))
    with pytest.raises(ValueError, match=r"sequence_parallel_size \(8\) / ring_size \(2\) = 4 Ulysses ranks: num_heads "
                                         r"\(6\).*ring sizes the heads allow: \[4, 8\]"):
        resolve_ring_size(sequence_parallel_size=8, ring_size=2, heads=(6, 6))
    with pytest.raises(ValueError, match="ring_size must be 'auto' or a positive int, got 0"):
        resolve_ring_size(sequence_parallel_size=8, ring_size=0)
    # P > heads is accepted with the ring; "auto" sequence parallelism with an explicit ring counts U = P/R heads
    assert resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size=1, sequence_parallel_size=8,
                         heads=(12, 4)) == (1, 8)
    assert resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size="auto", sequence_parallel_size="auto",
                         heads=(2, 1), ring_size=4) == (1, 8)


def test_ring_refuses_options_it_does_not_compose_with():
    """chunks > 1 or offload_dq=True with ring_size > 1 raise ValueErrors naming the fix (never silently ignored)."""
    with pytest.raises(ValueError, match=r"chunks=2 with ring_size=2: .* use chunks=1 \(or 'auto'\) with a ring"):
        FPDTStrategy(ring_size=2, chunks=2)
    with pytest.raises(ValueError, match=r"offload_dq=True with ring_size=4: the ring has no partial dQ sums"):
        FPDTStrategy(ring_size=4, offload_dq=True)
    FPDTStrategy(ring_size=2, offload=True)  # the shares go to the host stash like chunks
    with pytest.raises(ValueError, match="ring_size must be 'auto' or a positive int, got 'big'"):
        FPDTStrategy(ring_size="big")


def test_strategy_option_messages():
    """Wrong strategy options raise ValueErrors naming the accepted values."""
    with pytest.raises(ValueError, match=r"attention_backend must be one of .* got 'xformers'"):
        FPDTStrategy(attention_backend="xformers")
    with pytest.raises(ValueError, match="chunks must be 'auto' or a positive int, got 0"):
        FPDTStrategy(chunks=0)
    with pytest.raises(ValueError, match=r"predict_outputs must be 'sequence' .* or 'rank' .* got 'local'"):
        FPDTStrategy(predict_outputs="local")
    strategy = FPDTStrategy(chunks="auto")
    assert [strategy.num_chunks_for(s) for s in (1000, 65536, 65537, 1 << 20)] == [1, 1, 2, 16]


# (on CPU Lightning itself turns "16-mixed" into "bf16-mixed" before the strategy sees it)
@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_is_refused_with_strategy_string(precision):
    """precision other than 32-true / bf16-mixed / bf16-true is refused even for strategy="fpdt" (a string)."""
    with pytest.raises(ValueError, match=r"the fpdt strategy supports precision .* got '" + precision):
        L.Trainer(strategy="fpdt", accelerator="cpu", devices=1, precision=precision, logger=False)


def test_supported_precision_maps_to_fsdp_policy():
    """bf16-mixed becomes FSDP2's MixedPrecisionPolicy (bf16 params, fp32 reduction), not autocast."""
    trainer = L.Trainer(strategy="fpdt", accelerator="cpu", devices=1, precision="bf16-mixed", logger=False)
    policy = trainer.strategy.precision_plugin.mixed_precision_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32


def test_hf_attention_refuses_what_it_cannot_compute():
    """A mask, dropout, a sliding window, a non-causal module or a module not prepared raise ValueErrors."""
    q = torch.randn(1, 2, 4, 8)

    class Module(torch.nn.Module):
        is_causal = True

    module = Module()
    with pytest.raises(ValueError, match="not prepared by the fpdt strategy"):
        hf_attention(module, q, q, q, None)
    module._fpdt_attention = FPDTAttention()
    with pytest.raises(ValueError, match="takes no attention mask: drop padding"):
        hf_attention(module, q, q, q, torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match=r"attention dropout \(0.1\) is not supported"):
        hf_attention(module, q, q, q, None, dropout=0.1)
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        hf_attention(module, q, q, q, None, sliding_window=4)
    module.is_causal = False
    with pytest.raises(ValueError, match="is not causal"):
        hf_attention(module, q, q, q, None)


def test_sdpa_interception_routes_causal_calls_and_refuses_others():
    """Inside the interception, causal SDPA equals plain SDPA; a mask, dropout or is_causal=False raise."""
    q, k, v = (torch.randn(2, 4, 6, 8, dtype=torch.float64) for _ in range(3))
    with SDPAInterception(FPDTAttention(num_chunks=2, backend="math")):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with pytest.raises(ValueError, match="with attn_mask cannot be sequence-parallelized"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool))
        with pytest.raises(ValueError, match="dropout_p > 0"):
            F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        with pytest.raises(ValueError, match=r"is_causal=False\) is bidirectional"):
            F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_hf_model_on_one_rank_equals_sdpa():
    """A Hugging Face Llama switched to attn_implementation="fpdt" gives SDPA's logits and loss (P = 1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(0, 64, (2, 12))
    ref = model(input_ids=ids, labels=ids)
    context = SequenceParallelContext(group=None, attention=FPDTAttention(num_chunks=3, backend="math"))
    install_hf_model(model, context)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)  # the strategy passes pre-shifted labels
    out = model(input_ids=ids, labels=targets)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.loss, ref.loss.double())
    assert model.config._attn_implementation == "fpdt" and context.loss_reduced


def test_hf_model_in_eval_mode_trains_in_training_mode():
    """A Hugging Face model in eval mode as from_pretrained returns it (also inside a PeftModel) is put in training
    mode for fit; one in training mode, and any other module, keep their modes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_fpdt.integrations.huggingface import train_mode_for_fit
    from lightning_fpdt.memory.surgery import find_model

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config).eval()
    assert train_mode_for_fit(model) and all(m.training for m in model.modules())
    assert not train_mode_for_fit(model)  # already training
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(LlamaForCausalLM(config).eval(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert train_mode_for_fit(find_model(wrapped)) and all(m.training for m in wrapped.modules())
    plain = torch.nn.Linear(2, 2).eval()
    assert not train_mode_for_fit(plain) and not plain.training


def test_adapter_wrappers_are_looked_through():
    """find_model gives the network an adapter wrapper names (get_base_model(), as peft's PeftModel), whether the
    wrapper is the module given or its single child: the strategy then prepares that network (the Hugging Face path)."""
    from lightning_fpdt.memory.surgery import find_model

    class Wrapper(torch.nn.Module):
        def __init__(self, network: torch.nn.Module) -> None:
            super().__init__()
            self.inner = torch.nn.ModuleDict({"network": network})

        def get_base_model(self) -> torch.nn.Module:
            return self.inner["network"]

    network = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    container = torch.nn.Module()
    container.model = Wrapper(network)
    assert find_model(container.model) is network and find_model(container) is network
    assert find_model(network) is network


def test_hf_sliding_window_config_is_refused():
    """A model configured with a sliding window is refused when the strategy installs the attention."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window=8; the fpdt attention is full causal attention"):
        install_hf_model(Qwen2ForCausalLM(config), SequenceParallelContext(group=None, attention=FPDTAttention()))


def test_family_refusal_reaches_through_a_peft_model():
    """A PeftModel around a model its family refuses (a sliding window) is refused alike, before anything changes:
    the strategy takes the Hugging Face path through the wrapper, never the plain-module one."""
    peft = pytest.importorskip("peft")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_fpdt.integrations import install
    from lightning_fpdt.memory.surgery import find_blocks, find_model

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8)
    container = torch.nn.Module()
    container.model = peft.get_peft_model(Qwen2ForCausalLM(config), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    network = find_model(container)
    assert isinstance(network, Qwen2ForCausalLM)
    context = SequenceParallelContext(group=None, attention=FPDTAttention())
    with pytest.raises(ValueError, match="sliding_window=8; the fpdt attention is full causal attention"):
        install(network, find_blocks(network), context)
    assert network.config._attn_implementation != "fpdt"


def test_loss_of_rank_without_valid_tokens_is_zero_not_nan():
    """A rank whose targets are all -100 contributes 0 with zero gradients instead of NaN."""
    logits = torch.randn(5, 7, requires_grad=True)
    local_mean = F.cross_entropy(logits, torch.full((5,), -100))  # 0/0 = NaN
    loss = sequence_parallel_loss(local_mean, 0, group=None)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_parameters_on_the_lightning_module_itself_are_refused():
    """FSDP2 never wraps the LightningModule root: parameters held directly by it get a ValueError."""

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

    config = ParallelizeConfig(context=SequenceParallelContext(group=None, attention=FPDTAttention()))
    with pytest.raises(ValueError, match=r"holds parameters \['scale'\] directly.*move them into a submodule"):
        apply_fpdt(Module(), mesh=None, config=config)


def test_planner_offloads_and_chunks_by_memory():
    """offload/chunks "auto": 8B attention geometry at 1M tokens on 4 ranks offloads and chunks to fit 80 GB."""
    from lightning_fpdt.sequence.planning import (
        AttentionGeometry,
        choose_chunks,
        choose_offload,
        choose_offload_dq,
        stash_bytes,
        working_set_bytes,
    )

    geometry = AttentionGeometry(num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128)
    free = 70 * 2**30
    # per layer: 262144 local tokens × (32 + 2·8) heads (q, k, v) × 128 × 2 bytes + lse 262144 × 32 × 4 = 3.03 GiB
    assert stash_bytes(geometry, batch_size=1, seq_len=1 << 20, sp_size=4) == 262144 * 48 * 256 + 262144 * 128
    assert choose_offload(geometry, batch_size=1, seq_len=1 << 20, sp_size=4, free_bytes=free)
    assert not choose_offload(geometry, batch_size=1, seq_len=1 << 14, sp_size=4, free_bytes=free)
    chunks = choose_chunks(geometry, batch_size=1, seq_len=1 << 20, sp_size=4, free_bytes=free)
    assert chunks == 16  # 65536 global tokens per chunk; its working set is far under free / 16
    assert working_set_bytes(geometry, batch_size=1, seq_len=1 << 20, sp_size=4, num_chunks=chunks) < free / 16
    # a small budget forces more chunks
    assert choose_chunks(geometry, batch_size=1, seq_len=1 << 20, sp_size=4, free_bytes=2**30) > 16
    with pytest.raises(ValueError, match="offload must be 'auto', True or False, got 'yes'"):
        FPDTStrategy(offload="yes")
    with pytest.raises(ValueError, match="offload_dq must be 'auto', True or False, got 1.5"):
        FPDTStrategy(offload_dq=1.5)
    # partial dQ of 1M tokens on 4 ranks: 4 · 262144 · 32 · 128 bytes = 4 GiB, over 1/8 of 16 GiB but not of 70
    assert choose_offload_dq(geometry, batch_size=1, seq_len=1 << 20, sp_size=4, free_bytes=16 * 2**30)
    assert not choose_offload_dq(geometry, batch_size=1, seq_len=1 << 20, sp_size=4, free_bytes=free)


def test_planning_follows_the_per_process_memory_cap(monkeypatch):
    """An 80 GB card's budget run on a 139 GiB card: the planner sees the cap, not the card."""
    from types import SimpleNamespace

    from lightning_fpdt.planner.machine import usable_free_bytes, usable_total_bytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=139 * gib))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 79 / 139)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (120 * gib, 139 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * gib)
    device = torch.device("cuda", 0)
    assert usable_total_bytes(device) == 79 * gib
    assert usable_free_bytes(device) == 69 * gib  # the cap less what this process holds, below the card's free 120
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * gib, 139 * gib))
    assert usable_free_bytes(device) == 50 * gib  # other processes took more than the cap leaves


def test_strategy_with_preemption_pickles_and_copies():
    """The preemption state (locks, threads, the wake-up pipe) never stops a strategy from being pickled or deep-copied
    before its fit, as it could be without preemption."""
    import copy
    import pickle

    strategy = FPDTStrategy(preemption_timeout=7.5)
    for clone in (pickle.loads(pickle.dumps(strategy)), copy.deepcopy(strategy)):
        assert clone._preemption is not strategy._preemption and clone._preemption.timeout == 7.5


def test_every_lightning_hook_override_is_marked():
    """FPDTStrategy and FPDTPrecision mark with ``@override`` every method and property they override from
    Lightning's classes."""
    from lightning_fpdt.strategy.precision import FPDTPrecision

    unmarked = []
    for cls in (FPDTStrategy, FPDTPrecision):
        for name, attribute in vars(cls).items():
            if name.startswith("__") or not any(name in vars(base) for base in cls.__mro__[1:]):
                continue
            if not callable(attribute) and not isinstance(attribute, (property, classmethod, staticmethod)):
                continue  # a class attribute, not a hook
            functions = ([attribute.fget, attribute.fset] if isinstance(attribute, property) else
                         [getattr(attribute, "__func__", attribute)])
            for function in filter(None, functions):
                function = getattr(function, "__wrapped__", function)  # under @contextmanager
                if not getattr(function, "__override__", False):
                    unmarked.append(f"{cls.__name__}.{name}")
    assert not unmarked, unmarked


def test_padding_is_logged_once_per_length(monkeypatch):
    """The padding notice is said for every new length that pads (a curriculum's), once each, never for a length that
    needs none."""
    from lightning_fpdt.sequence import SequenceLayout
    from lightning_fpdt.strategy import run as strategy_module
    from lightning_fpdt.strategy.batch import shard_batch

    said = []
    monkeypatch.setattr(strategy_module, "rank_zero_info", said.append)
    strategy = FPDTStrategy()
    layout = SequenceLayout(2, 0, 2)
    for seq_len in (15, 15, 30, 16, 30, 13):
        _, plan = shard_batch({"input_ids": torch.randint(0, 8, (1, seq_len))}, layout=layout)
        strategy._batches.say_padding(plan)
    assert [m.split(" (")[0] for m in said] == ["fpdt: padding sequences of 15 tokens to 16",
                                                "fpdt: padding sequences of 30 tokens to 32",
                                                "fpdt: padding sequences of 13 tokens to 16"]
