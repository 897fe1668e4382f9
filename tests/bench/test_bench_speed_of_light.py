"""The speed of light of the results page (bench/report/speed_of_light.py): the FLOPs a step's kernels must run, the
records whose rates time them, and bench/gemm.py, which measures the matmul rates."""

from __future__ import annotations

import json

import pytest

from bench import gemm
from bench.peers.deepspeed_fpdt import attention_flops
from bench.report import page, speed_of_light
from bench.report.records import load_records

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
LLAMA3_8B = {"num_layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
             "num_parameters_nonembedding": None}


def run(system: str = "fpdt", *, chunks: int = 2, seq_len: int = 131_072, gpus: int = 4, card: str = H100) -> dict:
    """A timed bench.peers run of 2 Llama-3-8B layers, one sequence shared by the GPUs."""
    return {"kind": "run", "system": system, "status": "ok", "card": card, "gpus": gpus, "model": "llama3-8b",
            "geometry": LLAMA3_8B, "layers": 2, "full_layers": 32, "seq_len": seq_len, "tokens_per_step": seq_len,
            "chunks": chunks if system.startswith("fpdt") else None, "options": {"offload": True},
            "timed_steps": 2, "step_time_s": 1.0, "tokens_per_s": seq_len / 1.0, "tflops_per_gpu": 365.0,
            "mfu": 0.369, "peak_gpu_bytes": 13 * 2**30, "command": f"python3 -m bench.peers --system {system}",
            "commit": "abc1234"}


def attention(seq_len: int, chunks: int, tflops: float, *, gpus: int = 1, card: str = H100, **extra) -> dict:
    """An attention-op record of bench/attention.py."""
    return {"kind": "attention", "card": card, "gpus": gpus, "seq_len": seq_len, "chunks": chunks, "offload": True,
            "heads": 32, "kv_heads": 8, "head_dim": 128, "step_s": 1.0, "tflops_per_gpu": tflops,
            "command": f"python3 bench/attention.py --seq-lens {seq_len}", "commit": "def5678", **extra}


def matmuls(tokens: int, block: float, head: float, *, gpus: int = 4, card: str = H100) -> dict:
    """A gemm record of bench/gemm.py (the fields the report reads)."""
    return {"kind": "gemm", "card": card, "gpus": gpus, "model": "llama3-8b", "tokens": tokens, "head_tokens": 8192,
            "block_tflops": block, "head_tflops": head, "products": [
                {"layer": "down", "product": "weight grad", "m": 4096, "n": 14336, "k": tokens, "tflops": block - 40}],
            "command": f"python3 bench/gemm.py --tokens {tokens}", "commit": "fed9876"}


def test_causal_blocks_add_up_to_the_causal_count():
    """u chunks of C = S/u: u(u-1)/2 full blocks of 4·C²·d and u causal halves add up to the causal 2·S²·d whatever
    u, and 3.5 × that is the count the attention records' TFLOP/s divide by."""
    # S = 1024, u = 4, d = 64: C = 256, a full block 4·256²·64 = 16,777,216; 6 full + 4 halves = 8 full
    assert speed_of_light.causal_block_flops(1024, 4, 64) == 8 * 16_777_216 == 2 * 1024**2 * 64
    for chunks in (1, 2, 8):
        assert speed_of_light.causal_block_flops(131_072, chunks, 4096) == pytest.approx(2 * 131_072**2 * 4096)
    assert speed_of_light.ATTENTION_PASSES * speed_of_light.causal_block_flops(131_072, 1, 32 * 128) == \
        pytest.approx(attention_flops(131_072, 32, 128))


def test_step_flops_are_per_gpu_and_split_the_lm_head_off():
    """A step's FLOPs per GPU: 3.5 × the causal attention of the layers run, 6 × the layers' parameters × tokens and
    6·hidden·vocab × tokens for the lm head, each over the GPUs."""
    flops = speed_of_light.step_flops(run())
    # attention: 2 layers × 3.5 × 2·S²·4096, S = 131,072, over 4 GPUs
    assert flops.attention == pytest.approx(246_290_604_621_824)
    # a Llama-3-8B layer: q, o 4096²; k, v 4096·1024; gate, up, down 4096·14336; 2 norms of 4096 = 218,112,000;
    # 2 layers + the final norm = 436,228,096 parameters, × 6 × 131,072 / 4
    assert flops.layers == pytest.approx(6 * 436_228_096 * 32_768) == pytest.approx(85_765_933_498_368)
    assert flops.head == pytest.approx(6 * 4096 * 128_256 * 32_768)
    assert (flops.chunk_tokens, flops.local_tokens) == (65_536, 32_768)
    assert speed_of_light.step_flops({**run(), "geometry": None, "model": "unknown"}) is None
    assert speed_of_light.step_flops({**run(), "chunks": None}) is None  # a fpdt run whose chunks are unknown


def test_rates_come_from_the_records_of_the_card_nearest_in_size():
    """The attention rate is the same card's record of the nearest chunk length (then the run's GPU count); the GEMM
    rates the same card's record of the run's GPU count, then the nearest local token count."""
    records = [attention(131_072, 4, 480.0), attention(262_144, 4, 500.0), attention(262_144, 4, 700.0, card=H200),
               attention(262_144, 4, 900.0, system="deepspeed-fpdt"), attention(262_144, 1, 300.0, ring=2),
               matmuls(32_768, 600.0, 700.0), matmuls(131_072, 650.0, 710.0), matmuls(32_768, 800.0, 800.0, gpus=1)]
    time = speed_of_light.kernel_time(run(), records)  # C = 65,536; 32,768 local tokens on 4 GPUs
    assert time.attention_record["tflops_per_gpu"] == 500.0 and time.gemm_record["block_tflops"] == 600.0
    # 246,290,604,621,824 / 500e12 + 85,765,933,498,368 / 600e12 + 103,285,373,534,208 / 700e12
    assert time.attention_s == pytest.approx(0.492581209)
    assert time.matmul_s == pytest.approx(0.142943222 + 0.147550534)
    kernels, light, rates = speed_of_light.light_cells(run(), records)
    assert (kernels, light) == ("0.783", "78.3%")  # over the step's 1.0 s
    assert rates == ("attention 0.493 s at 500.0 (S 262,144, 4 chunks, 1 GPU, offload on); "
                     "matmuls 0.290 s at 600.0, lm head 700.0 (32,768 tokens, 4 GPUs)")


def test_systems_without_chunks_are_one_block_of_the_whole_sequence():
    """ring, alst and modelparallel attend in one block of S: their rate is the record whose chunk length is nearest
    S, and their attention FLOPs are the same causal count."""
    records = [attention(131_072, 4, 480.0), attention(524_288, 4, 520.0)]
    ring = run("ring")
    time = speed_of_light.kernel_time(ring, records)
    assert time.flops.chunk_tokens == 131_072 and time.attention_record["tflops_per_gpu"] == 520.0
    assert time.flops.attention == pytest.approx(speed_of_light.step_flops(run()).attention)


def test_a_card_without_gemm_records_shows_a_dash():
    """Without a gemm record of the card the kernel time and its fraction are –, and the rates cell still shows the
    attention's part."""
    records = [attention(262_144, 4, 500.0), matmuls(32_768, 600.0, 700.0, card=H200)]
    kernels, light, rates = speed_of_light.light_cells(run(), records)
    assert (kernels, light) == ("–", "–")
    assert rates.endswith("; matmuls –") and rates.startswith("attention 0.493 s at 500.0")
    assert speed_of_light.light_cells(run(card="NVIDIA A100"), records)[2] == "attention –; matmuls –"
    doc = page.render_markdown([run(), run("ring"), *records])
    assert "| kernels s | of light | kernel rates TFLOP/s |" in doc and "`bench/gemm.py`" in doc
    assert "| 36.9% | – | – | attention 0.493 s at 500.0 (S 262,144, 4 chunks, 1 GPU, offload on); matmuls – |" in doc


def test_gemm_smoke_run_on_the_cpu(tmp_path, monkeypatch):
    """bench/gemm.py --device cpu --tiny times the three products of the tiny block's seven layers and of the lm head;
    the block's products are 6 × its matrices' parameters × tokens, and the page reads the record."""
    monkeypatch.setenv("FPDT_COMMIT", "abc1234")  # the record's commit where the tree is no git checkout
    out = tmp_path / "gemm.jsonl"
    [record] = gemm.main(["--device", "cpu", "--tiny", "--warmup", "0", "--repeats", "1", "--iters", "1",
                          "--out", str(out)])
    assert record["kind"] == "gemm" and record["card"] == "cpu" and record["tokens"] == 64
    assert [(p["layer"], p["product"]) for p in record["products"][:3]] == [
        ("q", "forward"), ("q", "input grad"), ("q", "weight grad")]
    block = [p for p in record["products"] if p["layer"] != gemm.HEAD]
    # tiny: hidden 64, q 64, k and v 32, MLP 128: 64·64 + 2·64·32 + 64·64 + 3·64·128 = 36,864 parameters
    assert sum(p["flops"] for p in block) == 6 * 64 * 36_864
    assert sum(p["flops"] for p in record["products"] if p["layer"] == gemm.HEAD) == 6 * 64 * 256 * 64
    assert record["block_tflops"] > 0 and record["head_tflops"] > 0
    assert json.loads(out.read_text())["products"] == record["products"]
    doc = page.render_markdown(load_records([str(out)]))
    assert "| cpu | 1 | tiny | 64 | 64 |" in doc
