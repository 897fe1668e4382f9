"""Every misconfiguration a user can make gets a ValueError that names the value and the fix (table-driven).

Mistakes that need a running multi-process job are checked in tests/dist (a batch without input_ids, a padding
mask with zeros, an undivisible length with padding off: test_strategy_lifecycle.py)."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import ActivationOffload, FPDTAttention, FPDTStrategy, MFUMonitor, TiledLoss, TiledMLP
from lightning_fpdt.integrations import SDPAInterception, SequenceParallelContext
from lightning_fpdt.integrations.huggingface import hf_attention
from lightning_fpdt.memory import find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.sequence import SequenceLayout, check_heads, fpdt_attention
from lightning_fpdt.sequence.sizes import resolve_sizes
from lightning_fpdt.strategy.parallelize import ParallelizeConfig, apply_fpdt

Q = torch.randn(1, 6, 2, 4)


class _Causal(torch.nn.Module):
    is_causal = True

    def __init__(self):
        super().__init__()
        self._fpdt_attention = FPDTAttention().for_layer()


class _ParamsOnRoot(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(1))


def _sdpa(**kwargs):
    q = torch.randn(1, 2, 6, 4)
    with SDPAInterception(FPDTAttention()):
        F.scaled_dot_product_attention(q, q, q, **kwargs)


def _sliding_window_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_fpdt.integrations import install_hf_model

    config = Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=4)
    install_hf_model(Qwen2ForCausalLM(config), SequenceParallelContext(group=None, attention=FPDTAttention()))


MISCONFIGURATIONS = [
    # strategy options
    ("chunks 0", lambda: FPDTStrategy(chunks=0), "chunks must be 'auto' or a positive int, got 0"),
    ("chunks text", lambda: FPDTStrategy(chunks="many"), "chunks must be 'auto' or a positive int, got 'many'"),
    ("backend", lambda: FPDTStrategy(attention_backend="xformers"), "attention_backend must be one of"),
    ("offload", lambda: FPDTStrategy(offload="yes"), "offload must be 'auto', True or False"),
    ("offload_dq", lambda: FPDTStrategy(offload_dq=2), "offload_dq must be 'auto', True or False"),
    ("nonfinite", lambda: FPDTStrategy(nonfinite_loss="skip"), "nonfinite_loss must be 'raise' or 'ignore'"),
    ("sync_every_batch", lambda: FPDTStrategy(sync_every_batch="last"),
     "sync_every_batch must be 'auto', True or False"),
    ("preemption timeout", lambda: FPDTStrategy(preemption_timeout=0), "preemption_timeout must be positive seconds"),
    # precision, also with the strategy given by name
    ("16-true", lambda: L.Trainer(strategy="fpdt", accelerator="cpu", precision="16-true", logger=False),
     "supports precision .* got '16-true': use precision='bf16-mixed'"),
    ("64-true", lambda: L.Trainer(strategy="fpdt", accelerator="cpu", precision="64-true", logger=False),
     "got '64-true'"),
    # mesh sizes and heads
    ("dp×sp", lambda: resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size=3, sequence_parallel_size=4),
     r"sequence_parallel_size \(4\) \* data_parallel_size \(3\) = 12 != world size 8"),
    ("sp vs world", lambda: resolve_sizes(world_size=8, devices_per_node=8, data_parallel_size="auto",
                                          sequence_parallel_size=3), "does not divide the world size 8"),
    ("sp 0", lambda: resolve_sizes(world_size=2, devices_per_node=2, data_parallel_size="auto",
                                   sequence_parallel_size=0), "must be 'auto' or a positive int"),
    ("heads vs sp", lambda: check_heads(6, 6, 4), r"num_heads \(6\) is not divisible by sequence_parallel_size \(4\)"),
    ("kv heads vs sp", lambda: check_heads(12, 6, 4), "must divide one another"),
    ("heads vs kv heads", lambda: check_heads(6, 4, 1), r"must be a multiple of num_kv_heads \(4\)"),
    # the attention call
    ("non-causal", lambda: fpdt_attention(Q, Q, Q, causal=False), "causal only"),
    ("kv shape", lambda: fpdt_attention(Q, Q, Q[:, :, :1]), "equal shape"),
    ("length vs chunks", lambda: fpdt_attention(Q, Q, Q, num_chunks=4), "not divisible by num_chunks"),
    ("backend vs device", lambda: fpdt_attention(Q, Q, Q, backend="cudnn"), "cannot run torch.float32 on cpu"),
    ("chunks in FPDTAttention", lambda: FPDTAttention(num_chunks=0), "num_chunks must be >= 1"),
    # the layout
    ("layout size", lambda: SequenceLayout(0, 0), "sp_size must be >= 1"),
    ("layout rank", lambda: SequenceLayout(2, 5), r"sp_rank must be in \[0, sp_size=2\)"),
    ("undivisible length", lambda: SequenceLayout(2, 0, 2).shard(torch.zeros(1, 10)), "pad it to 12"),
    # what the attention cannot compute exactly
    ("padding mask", lambda: hf_attention(_Causal(), Q, Q, Q, torch.ones(1, 1, 6, 6)), "takes no attention mask"),
    ("dropout", lambda: hf_attention(_Causal(), Q, Q, Q, None, dropout=0.1), "attention dropout"),
    ("sliding window", _sliding_window_model, "use_sliding_window=False"),
    ("SDPA mask", lambda: _sdpa(attn_mask=torch.ones(6, 6, dtype=torch.bool)), "with attn_mask"),
    ("SDPA dropout", lambda: _sdpa(dropout_p=0.1, is_causal=True), "dropout_p > 0"),
    ("SDPA bidirectional", lambda: _sdpa(), "is_causal=False"),
    # model structure
    ("params on the LightningModule",
     lambda: apply_fpdt(_ParamsOnRoot(), None, config=ParallelizeConfig(
         context=SequenceParallelContext(group=None, attention=FPDTAttention()))), "move them into a submodule"),
    ("layer_classes", lambda: find_blocks(LlamaForCausalLM(LlamaConfig.from_name("tiny")), ["Block"]),
     "matched no module"),
    ("model config", lambda: LlamaConfig.from_name("tiny", num_heads=3), "must be a multiple of num_kv_heads"),
    ("model name", lambda: LlamaConfig.from_name("llama4"), "llama3-8b"),
    # callbacks
    ("offload prefetch", lambda: ActivationOffload(prefetch=-1), "prefetch must be >= 0"),
    ("MLP tiles", lambda: TiledMLP(num_tiles=0), "give 'auto' or a positive int"),
    ("loss tiles", lambda: TiledLoss(num_tiles=0), "give 'auto' or a positive int"),
    ("MFU convention", lambda: MFUMonitor(convention="x"), r"choose one of \['causal', 'megatron'\]"),
    ("MFU interval", lambda: MFUMonitor(log_every_n_steps=0), "must be at least 1"),
]


@pytest.mark.parametrize("name,make,match", MISCONFIGURATIONS, ids=[m[0] for m in MISCONFIGURATIONS])
def test_misconfiguration_raises_value_error_naming_the_fix(name, make, match):
    """Each misconfiguration raises ValueError with a message that names the value and what to do."""
    with pytest.raises(ValueError, match=match):
        make()
