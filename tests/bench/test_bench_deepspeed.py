"""bench.peers' DeepSpeed peers and the Hugging Face fpdt system: option wiring, the ALST DeepSpeed config, the tile
counts, the data order, the ballast, and the flash_attn stand-in against plain attention. Tests that run DeepSpeed's
own code skip where DeepSpeed is not installed."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.peers import alst, ballast, cli, flash_shim, records, systems
from bench.peers.hf_llama import HFLlamaLM, hf_llama_config
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.models.llama import LlamaConfig

ROOT = Path(__file__).resolve().parents[2]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed")


def _args(*argv: str):
    return cli.parse_args(["--model", "tiny", "--seq-len", "64", *argv])


# ---- options -------------------------------------------------------------------------------------------------------
def test_new_systems_are_options():
    """--system takes alst and fpdt-hf, and each has a training function."""
    assert {"alst", "fpdt-hf"} <= set(systems.SYSTEMS) == set(systems.SYSTEM_FUNCTIONS)
    assert _args("--system", "alst").system == "alst"


def test_alst_refuses_what_its_recipe_cannot_run():
    """alst needs GPUs and a length the GPUs split evenly; fpdt-only options warn on it."""
    with pytest.raises(ValueError, match="alst: DeepSpeed's recipe runs ZeRO-3 .* on GPUs"):
        cli.validate(_args("--system", "alst", "--accelerator", "cpu"), world_size=1)
    with pytest.raises(ValueError, match=r"--seq-len \(66\) must be a multiple of the GPU count \(4\).*pick 68"):
        cli._check_alst(cli.parse_args(["--system", "alst", "--seq-len", "66"]), world_size=4)
    with pytest.warns(UserWarning, match="--chunks 4 has no effect on --system alst"):
        cli._warn_ignored(_args("--system", "alst", "--chunks", "4"))


def test_alst_needs_expandable_segments(monkeypatch):
    """Without the recipe's allocator setting ZeRO-3's GPU memory fragments and a length that fits fails: refused,
    naming the variable."""
    args = cli.parse_args(["--system", "alst", "--seq-len", "64"])
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(ValueError, match="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        cli._check_alst(args, world_size=4)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    cli._check_alst(args, world_size=4)


def test_alst_on_one_gpu_refuses_torchrun(monkeypatch):
    """One GPU under torchrun never finished a step of the recipe; with python3 it does, and several GPUs need
    torchrun."""
    args = cli.parse_args(["--system", "alst", "--seq-len", "64"])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    with pytest.raises(ValueError, match="alst on one GPU: start it with python3 -m bench.peers, not torchrun"):
        cli._check_alst(args, world_size=1)
    cli._check_alst(args, world_size=4)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    cli._check_alst(args, world_size=1)


def test_fpdt_hf_shares_fpdts_checks():
    """fpdt-hf refuses what fpdt refuses and takes fpdt's options without a warning."""
    with pytest.raises(ValueError, match="fpdt-hf: --attention-backend efficient"):
        cli.validate(_args("--system", "fpdt-hf", "--accelerator", "cpu", "--attention-backend", "efficient"), 1)
    with pytest.raises(ValueError, match="fpdt-hf: --ballast auto needs --offload on or off"):
        cli.validate(_args("--system", "fpdt-hf", "--accelerator", "cpu", "--ballast", "auto", "--offload", "auto"), 1)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cli._warn_ignored(_args("--system", "fpdt-hf", "--chunks", "4", "--head-chunks", "2"))


def test_help_imports_no_deepspeed():
    """--help, the option checks and the systems' modules import no DeepSpeed (a fresh process: tests import it)."""
    code = ("import sys; from bench.peers import alst, cli, deepspeed_fpdt, flash_shim, systems; cli.build_parser(); "
            "assert 'deepspeed' not in sys.modules and 'flash_attn' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ---- alst ----------------------------------------------------------------------------------------------------------
def test_alst_config_on_the_gpus():
    """GPU-resident: ZeRO-3, Ulysses over every GPU, torch's AdamW, bf16 with fp32 gradient reduction, no offload."""
    config = alst.deepspeed_config(_args("--system", "alst", "--lr", "3e-4"), world_size=4)
    assert config["zero_optimization"] == {"stage": 3}
    assert config["sequence_parallel_size"] == 4 and config["train_micro_batch_size_per_gpu"] == 1
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                               "weight_decay": 0.0, "torch_adam": True}}
    assert config["bf16"] == {"enabled": True} and config["communication_data_type"] == "fp32"
    assert config["seq_parallel_communication_data_type"] == "bf16" and config["gradient_clipping"] == 0.0


def test_alst_config_with_cpu_offload():
    """--cpu-offload-params: DeepSpeedCPUAdam with the optimizer on the CPU; the parameters too on one GPU only, as
    ArcticTraining's one-GPU and multi-GPU configs do."""
    args = _args("--system", "alst", "--cpu-offload-params")
    several, one = alst.deepspeed_config(args, world_size=4), alst.deepspeed_config(args, world_size=1)
    assert several["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert one["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert several["optimizer"]["params"]["torch_adam"] is False
    fp32 = alst.deepspeed_config(_args("--system", "alst", "--precision", "32-true"), world_size=2)
    assert "bf16" not in fp32 and "communication_data_type" not in fp32


def test_alst_tile_counts_follow_the_recipe():
    """MLP tiles: ceil(S/P / hidden); loss tiles: about 1 GiB of fp32 logits each."""
    assert alst.tiled_mlp_shards(32_768, 4096) == 8 and alst.tiled_mlp_shards(100, 4096) == 1
    assert alst.logits_loss_shards(32_768, 128_256) == 16  # 32768 · 128256 · 4 B = 15.7 GiB
    assert alst.logits_loss_shards(10, 256) == 1


def test_alst_step_i_trains_sample_i():
    """Rank r loads samples r, r + W, ...: the adapter's gather of one sample per rank then trains 0, 1, 2, ..."""
    shards = [list(alst.rank_samples(range(8), rank=r, world_size=4)) for r in range(4)]
    assert shards == [[0, 4], [1, 5], [2, 6], [3, 7]]
    trained = [shards[r][i] for i in range(2) for r in range(4)]  # UlyssesSPDataLoaderAdapter.refill's order
    assert trained == list(range(8))


def test_alst_ballast_keeps_the_parameter_shard_when_only_the_optimizer_is_offloaded():
    """alst keeps no block input on the GPU; with --cpu-offload-params on several GPUs ZeRO-3 keeps the bf16
    parameter shard there (2 B per parameter / GPUs), on one GPU nothing."""
    geometry = ModelGeometry.from_config(LlamaConfig.from_name("llama3-8b"))
    assert ballast.kept_bytes_per_layer("alst", geometry, seq_len=131_072, num_gpus=4, precision="bf16-mixed",
                                        attention_offload=True) == 0
    args = cli.parse_args(["--system", "alst", "--cpu-offload-params", "--ballast", "auto", "--layers", "2"])
    assert ballast.run_ballast(args, geometry, 4) == (30 * 218_112_000 * 2 // 4,) * 2
    assert ballast.run_ballast(args, geometry, 1) == (0, 0)


def test_records_name_what_shaped_the_new_systems():
    """A run record's options say which model code ran and, for alst, the recipe's parts."""
    hf = records.options(_args("--system", "fpdt-hf"), {})
    assert hf["model_code"] == "transformers" and hf["callbacks"][-1] == "MFUMonitor"
    shaped = records.options(_args("--system", "alst"), {"optimizer": "AdamW", "offload_param": False})
    assert shaped["zero_stage"] == 3 and shaped["loss"] == "TiledFusedLogitsLoss" and shaped["optimizer"] == "AdamW"


def test_prime_optimizer_states_refuses_other_optimizers():
    """Priming knows AdamW and DeepSpeedCPUAdam; it primes AdamW's moments as its first step would."""
    weight = torch.nn.Parameter(torch.randn(3, 2))
    optimizer = torch.optim.AdamW([weight])
    alst.prime_optimizer_states(optimizer)
    assert torch.equal(optimizer.state[weight]["exp_avg"], torch.zeros(3, 2))
    if importlib.util.find_spec("deepspeed") is not None:
        with pytest.raises(TypeError, match="expected AdamW or DeepSpeedCPUAdam, got SGD"):
            alst.prime_optimizer_states(torch.optim.SGD([weight], lr=0.1))


# ---- the Hugging Face Llama ----------------------------------------------------------------------------------------
def test_hf_llama_has_the_reference_geometry():
    """The Hugging Face Llama built from a named geometry has the reference model's parameter count and shapes."""
    config = hf_llama_config("llama3-8b", num_layers=2, max_seq_len=1 << 20)
    assert (config.hidden_size, config.intermediate_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (4096, 14336, 32, 8, 128, 128_256)
    assert config.max_position_embeddings == 1 << 20 and not config.tie_word_embeddings
    module = HFLlamaLM("tiny", num_layers=2, max_seq_len=64, seed=0, lr=1e-4)
    count = sum(p.numel() for p in module.model.parameters())
    assert count == LlamaConfig.from_name("tiny", num_layers=2).num_parameters()
    assert module.model.config._attn_implementation == "sdpa"


def test_fpdt_hf_uses_fpdts_strategy_and_callbacks():
    """fpdt-hf trains the Hugging Face Llama with fpdt's strategy and callbacks."""
    args = _args("--system", "fpdt-hf", "--layers", "1", "--accelerator", "cpu", "--chunks", "2")
    module, strategy, callbacks, precision = systems._lightning_parts(args, world_size=1)
    fpdt_parts = systems._lightning_parts(_args("--system", "fpdt", "--layers", "1", "--chunks", "2"), world_size=1)
    assert isinstance(module, HFLlamaLM) and isinstance(strategy, FPDTStrategy)
    assert [type(c) for c in callbacks] == [type(c) for c in fpdt_parts[2]] and precision == fpdt_parts[3]


# ---- the flash_attn stand-in ----------------------------------------------------------------------------------------
def _plain_attention(q, k, v, scale, causal):
    """(B, S, H, D) attention through autograd, k, v repeated to the query heads, causal to the bottom right."""
    groups = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(groups, 2)) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        scores = scores.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(groups, 2)), scores.logsumexp(-1)


@pytest.mark.parametrize("sq, sk, causal", [(24, 24, True), (8, 24, True), (16, 16, False)])
def test_flash_shim_matches_plain_attention(sq, sk, causal):
    """The stand-in's forward gives flash-attn's (out, lse) and its backward writes dq, dk, dv in place, for grouped
    heads (fp64 inputs: the reference computes in fp32, so 1e-5)."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, sq, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, sk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, sk, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, sq, 4, 8, generator=gen, dtype=torch.float64)
    want_out, want_lse = _plain_attention(q, k, v, 0.3, causal)
    want_out.backward(dout)
    out, lse, dmask, _rng = flash_shim.flash_attn_forward(q.detach(), k.detach(), v.detach(), 0.0, 0.3, causal,
                                                          -1, -1, 0.0, None, False)
    assert dmask is None and out.shape == q.shape and lse.shape == (2, 4, sq) and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse.detach().float(), rtol=1e-5, atol=1e-5)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    flash_shim.flash_attn_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, dq, dk, dv, 0.0, 0.3, causal,
                                   -1, -1, 0.0, None, False, rng_state=None)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flash_shim_refuses_what_it_does_not_compute():
    """Dropout, softcap, ALiBi and returned probabilities raise ValueErrors naming them."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"dropout_p \(0.1\)"):
        flash_shim.flash_attn_forward(q, q, q, 0.1, 0.3, True)
    with pytest.raises(ValueError, match="return_softmax=True"):
        flash_shim.flash_attn_forward(q, q, q, 0.0, 0.3, True, return_softmax=True)
    with pytest.raises(ValueError, match="alibi_slopes"):
        flash_shim.flash_attn_backward(q, q, q, q, q, q, q, q, q, 0.0, 0.3, True, alibi_slopes=torch.ones(2))


def test_flash_shim_installs_as_flash_attn_2_7(monkeypatch):
    """install() registers flash_attn (version 2.7.4, DeepSpeed's >= 2.7 calls) with the two functions."""
    if importlib.util.find_spec("flash_attn") is not None and not getattr(sys.modules.get("flash_attn"),
                                                                          "__stand_in__", False):
        pytest.skip("a real flash-attn is installed; install() leaves it")
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "deepspeed.sequence.fpdt_layer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert flash_shim.install() == "torch flash"
    from flash_attn import __version__
    from flash_attn.flash_attn_interface import _flash_attn_backward, _flash_attn_forward

    assert __version__ == "2.7.4" and _flash_attn_forward is flash_shim.flash_attn_forward
    assert _flash_attn_backward is flash_shim.flash_attn_backward


@needs_deepspeed
def test_deepspeed_fpdt_attention_runs_on_the_shim(monkeypatch):
    """DeepSpeed's FPDT attention (its GPU-resident implementation, 4 chunks, one gloo process) on the stand-in gives
    plain causal GQA attention of its QKV projection, and the input and weight gradients (fp64 in, fp32 inside)."""
    import torch.distributed as dist

    for name in ("flash_attn", "flash_attn.flash_attn_interface", "deepspeed.sequence.fpdt_layer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    flash_shim.install()
    import deepspeed
    from deepspeed.sequence.fpdt_layer import _FPDTGPUAttentionImpl_

    # DeepSpeed's CPU backend would compile a shared-memory all-reduce extension first (minutes); gloo needs none
    monkeypatch.setattr(importlib.import_module("deepspeed.comm.torch"), "build_shm_op", lambda: None)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29631")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        gen = torch.Generator().manual_seed(3)
        seq, heads, kv_heads, head_dim, hidden = 32, 4, 2, 8, 16
        x = torch.randn(seq, 1, hidden, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = (torch.randn((heads + 2 * kv_heads) * head_dim, hidden, generator=gen, dtype=torch.float64) / 4
                  ).requires_grad_()
        bias = torch.zeros((heads + 2 * kv_heads) * head_dim, dtype=torch.float64)
        out = _FPDTGPUAttentionImpl_.apply(x, None, None, None, dist.group.WORLD, 2, 0, hidden, heads * head_dim,
                                           head_dim, kv_heads * head_dim, weight, bias, 0.0, 4, False)
        dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        out.backward(dout)
        x2, weight2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        q, k, v = (x2[:, 0] @ weight2.t()).split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        want, _ = _plain_attention(q.reshape(1, seq, heads, head_dim), k.reshape(1, seq, kv_heads, head_dim),
                                   v.reshape(1, seq, kv_heads, head_dim), head_dim**-0.5, True)
        want.backward(dout)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(weight.grad, weight2.grad, rtol=1e-5, atol=1e-5)
    finally:
        if created:
            dist.destroy_process_group()


@needs_deepspeed
def test_alst_tiled_loss_is_the_token_mean():
    """One GPU: TiledFusedLogitsLoss over the recipe's tiles gives the model's token-mean cross-entropy and its hidden
    gradient; the head's gradient, taken inside the forward with the tiles' loss sums, is the target count times the
    mean's (DeepSpeed 0.19.8 scales only the hidden gradient by the division that follows; fp32, 1e-5)."""
    module = HFLlamaLM("tiny", num_layers=1, max_seq_len=64, seed=0, lr=1e-4)
    model = module.model
    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 256, (1, 40), generator=gen)
    labels = systems.SequenceLayout.shift_labels(input_ids)
    labels[0, :5] = -100  # some positions without a target
    hidden = torch.randn(1, 40, 64, generator=gen, requires_grad=True)
    loss = alst.tiled_loss(model, hidden, labels, sp_group=None, sp_size=1)
    loss.backward()
    got_hidden, got_head = hidden.grad.clone(), model.lm_head.weight.grad.clone()
    hidden.grad = model.lm_head.weight.grad = None
    logits = model.lm_head(hidden)
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_hidden, hidden.grad, rtol=1e-5, atol=1e-6)
    targets = int((labels != -100).sum())
    torch.testing.assert_close(got_head, targets * model.lm_head.weight.grad, rtol=1e-5, atol=1e-5)
