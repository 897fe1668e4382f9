"""Host offload on a real GPU: copy streams and events, identical results, a 2-layer bf16 model (marker gpu)."""

import copy

import pytest
import torch

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.integrations import SequenceParallelContext, install_reference_llama
from lightning_fpdt.memory import find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import FPDTAttention, fpdt_attention

pytestmark = pytest.mark.gpu


def _inputs(seed: int, seq_len: int = 8192):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, seq_len, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, seq_len, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v, torch.randn_like(q)


def _run(q, k, v, dout, stashes, num_chunks=8):
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fpdt_attention(*inputs, num_chunks=num_chunks, stashes=stashes)
    out.backward(dout)
    return [out.detach()] + [x.grad for x in inputs]


@pytest.mark.parametrize("offload_dq", [False, True])
def test_offload_gives_identical_results(offload_dq):
    """Offloaded chunks give the non-offloaded output bit for bit, and gradients within the kernels' own
    run-to-run variation (zero when the backward kernels are deterministic)."""
    q, k, v, dout = _inputs(0)
    ref, again = _run(q, k, v, dout, StashFactory()), _run(q, k, v, dout, StashFactory())
    off = _run(q, k, v, dout, StashFactory(offload=True, offload_dq=offload_dq))
    assert torch.equal(off[0], ref[0])
    for r, a, o in zip(ref[1:], again[1:], off[1:]):
        noise = (r.float() - a.float()).abs().max().item()
        # partial dQ sums round-trip through host memory in fp32: no rounding is added
        assert (o.float() - r.float()).abs().max().item() <= 2 * noise + 1e-6


def test_offload_race_check_repeated_runs_are_stable():
    """Ten offloaded runs on one buffer pool (buffers reused while copies are in flight) give the same output."""
    q, k, v, dout = _inputs(1)
    stashes = StashFactory(offload=True)
    first = _run(q, k, v, dout, stashes)
    allocated = stashes.host_bytes
    for _ in range(9):
        assert torch.equal(_run(q, k, v, dout, stashes)[0], first[0])
    assert stashes.host_bytes == allocated  # pinned buffers allocated once, reused


def test_offloaded_attention_memory_does_not_keep_chunks_on_gpu():
    """With offload, GPU memory held between forward and backward is the output only, not the q/k/v chunks."""
    q, k, v, dout = _inputs(2, seq_len=32768)
    held = {}
    for offload in (False, True):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fpdt_attention(*inputs, num_chunks=8, stashes=StashFactory(offload=offload))
        torch.cuda.synchronize()
        held[offload] = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        out.backward(dout)
        del out, inputs
    chunk_bytes = (q.numel() + k.numel() * 2) * 2  # q, k, v of the whole sequence (out is the output itself)
    assert held[False] >= chunk_bytes * 0.9 and held[True] < chunk_bytes * 0.1


def test_two_layer_model_bf16_offloaded_matches_fp32():
    """A 2-layer reference Llama in bf16 with FPDT (u = 4, offload) and ActivationOffload matches fp32 SDPA."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                         num_kv_heads=2)
    ref = LlamaForCausalLM(config).cuda()
    model = copy.deepcopy(ref).bfloat16()
    attention = FPDTAttention(num_chunks=4, offload=True)
    install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
    ActivationOffload().fpdt_transform(model, find_blocks(model))
    ids = torch.randint(0, 1024, (1, 4096), device="cuda")
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device="cuda")], 1)
    ref_loss = ref(input_ids=ids, labels=ids)
    ref_loss.backward()
    loss = model(input_ids=ids, labels=targets)
    loss.backward()
    assert attention.kernel_calls == 2  # no attention recompute
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-2
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        rel = ((p.grad.float() - r.grad).norm() / r.grad.norm()).item()
        assert rel < 5e-2, f"{name}: {rel}"  # bf16 weights and activations through 2 layers


@pytest.mark.parametrize("prefetch", [0, 1])
def test_reload_input_on_the_gpu_matches_holding_it(prefetch):
    """ActivationOffload(reload_input=True) on CUDA (pinned buffers, copy streams, the device copy freed at the MLP
    and brought back for the first norm): gradients within the run-to-run variation of the default's, and the
    block-backward peak lower by about one block input (the step's peak is there at this size)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_layers=3, num_heads=8,
                         num_kv_heads=2)
    base = LlamaForCausalLM(config).cuda()
    ids = torch.randint(0, 1024, (1, 32768), device="cuda")
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100, device="cuda")], 1)
    grads, peaks = {}, {}
    for name, kwargs in (("held", {}), ("again", {}), ("reload", {"reload_input": True, "prefetch": prefetch})):
        model = copy.deepcopy(base)
        attention = FPDTAttention(num_chunks=4, offload=True)
        install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
        ActivationOffload(recompute_attention=True, **kwargs).fpdt_transform(model, find_blocks(model))
        loss = model(input_ids=ids, labels=targets)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss.backward()
        peaks[name] = torch.cuda.max_memory_allocated() - start
        grads[name] = [p.grad.clone() for p in model.parameters()]
        del model, loss
    for held, again, reload in zip(grads["held"], grads["again"], grads["reload"]):
        noise = (held - again).abs().max().item()
        assert (reload - held).abs().max().item() <= 2 * noise + 1e-6  # fp32: the same arithmetic
    block_input = 32768 * 1024 * 4
    assert peaks["reload"] <= peaks["held"] - 0.9 * block_input, (peaks, block_input)
