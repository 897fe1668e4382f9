"""bench.report's page and plots from synthetic and stored records, the provenance every record carries, and the
pieces of bench.peers that need no process group: the ballast arithmetic, the out-of-memory record, the length search,
primed AdamW states."""

from __future__ import annotations

import argparse
import glob
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from bench import provenance, step_profile
from bench.peers import ballast, cli, common, records, runner, search, systems
from bench.report import lengths, page
from bench.report import records as shown
from bench.report.plots import Plot, write_plots
from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.models.llama import LlamaConfig, sdpa_attention

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30
H100 = "NVIDIA H100 80GB HBM3"
COMMIT = "abc1234"


def run_record(system: str, *, gpus: int, layers: int, seq_len: int, status: str = "ok", peak_gib: float = 40.0,
               ballast_gib: float = 0.0, mfu: float = 0.4, tokens_per_s: float = 10_000.0, card: str = H100,
               host_fits: bool = True, limit: str = None, timed_steps: int = 2) -> dict:
    """A record shaped as bench.peers writes it (the fields the report reads)."""
    ok = status == "ok"
    command = (f"torchrun --standalone --nproc_per_node {gpus} -m bench.peers --system {system} --model llama3-8b "
               f"--layers {layers} --seq-len {seq_len} --ballast auto --check-host")
    return {
        "kind": "run", "system": system, "status": status, "limit": limit, "card": card,
        "card_memory_bytes": 80 * GIB, "gpus": gpus, "model": "llama3-8b", "layers": layers, "full_layers": 32,
        "seq_len": seq_len, "chunks": 8 if system == "fpdt" else None, "options": {"ballast": "auto"},
        "timed_steps": timed_steps,
        "step_time_s": 10.0 if ok else None, "tokens_per_s": tokens_per_s if ok else None,
        "tflops_per_gpu": 989 * mfu if ok else None, "mfu": mfu if ok else None,
        "peak_gpu_bytes": int(peak_gib * GIB) if ok else None, "ballast_bytes": int(ballast_gib * GIB),
        "peak_gpu_bytes_minus_ballast": int((peak_gib - ballast_gib) * GIB) if ok else None,
        "first_loss": 11.9321, "host_check": {"needed_bytes": 100 * GIB, "available_bytes": 1500 * GIB,
                                              "fits": host_fits, "planned_peak_gpu_bytes": 70 * GIB},
        "command": command, "commit": COMMIT, "env": {"NCCL_NVLS_ENABLE": "0"},
    }


def synthetic_records() -> list[dict]:
    """1 GPU: searches for fpdt and ring, single runs for modelparallel; 4 GPUs: two depths, equal length, full
    depth."""
    return [
        {"kind": "max_length", "system": "fpdt", "model": "llama3-8b", "layers": 2, "full_layers": 32, "gpus": 1,
         "card": H100, "ballast": "auto", "max_seq_len": 1_048_576, "first_failed_seq_len": 1_572_864,
         "limited_by": "gpu", "command": "python3 -m bench.peers --system fpdt --max-length --gpus 1 --seq-len 262144",
         "commit": COMMIT},
        {"kind": "max_length", "system": "ring", "model": "llama3-8b", "layers": 2, "full_layers": 32, "gpus": 1,
         "card": H100, "ballast": "auto", "max_seq_len": 131_072, "first_failed_seq_len": 196_608,
         "limited_by": "gpu", "command": "python3 -m bench.peers --system ring --max-length --gpus 1 --seq-len 65536",
         "commit": COMMIT},
        run_record("modelparallel", gpus=1, layers=2, seq_len=16_384, peak_gib=71.5),
        run_record("modelparallel", gpus=1, layers=2, seq_len=32_768, status="oom", limit="gpu"),
        run_record("fpdt", gpus=4, layers=2, seq_len=1_048_576, peak_gib=61.2, ballast_gib=25.4),
        run_record("fpdt", gpus=4, layers=4, seq_len=1_048_576, peak_gib=61.4, ballast_gib=23.6),
        run_record("fpdt", gpus=4, layers=4, seq_len=262_144, tokens_per_s=26_000.0, mfu=0.41),
        run_record("ring", gpus=4, layers=4, seq_len=262_144, tokens_per_s=20_000.0, mfu=0.31),
        run_record("fpdt", gpus=4, layers=32, seq_len=524_288, mfu=0.47, tokens_per_s=14_000.0),
        run_record("fpdt", gpus=4, layers=2, seq_len=2_097_152, host_fits=False),  # a step ran, the host can't hold it
        run_record("ring", gpus=4, layers=2, seq_len=131_072, timed_steps=0, mfu=0.05, tokens_per_s=999.0),  # 1 step
    ]


def test_report_names_every_figure_with_its_command(tmp_path):
    """Tables carry card, GPUs, geometry, length and a command reference with its commit."""
    doc = page.render_markdown(synthetic_records(), plot_note="no plots")
    for command in ("python3 -m bench.peers --system fpdt --max-length --gpus 1 --seq-len 262144",
                    "NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node 4 -m bench.peers --system fpdt "
                    "--model llama3-8b --layers 32 --seq-len 524288"):
        assert f"`{command}" in doc, command
    lines = doc.splitlines()

    def row(*cells: str) -> str:
        found = [line for line in lines if all(cell in line for cell in cells)]
        assert found, cells
        return found[0]

    # maximum length, 1 GPU: fpdt 1M (search), modelparallel 16K (runs: 32K ran out of memory), ring 128K
    one_gpu = row("| NVIDIA H100 80GB HBM3 | 1 |", "1,048,576")
    assert "16,384 [2]; 32,768 failed (gpu) [3]" in one_gpu and "131,072" in one_gpu
    # fpdt / modelparallel, fpdt / ring: the ratio of the lengths that fit, and the range the failures leave it
    assert "| 64.00× (32.00–96.00×) | 8.00× (5.33–12.00×) |" in one_gpu
    # 4 GPUs: 2M ran but the full depth's host memory does not fit, so 1M is the longest trainable length; ring's
    # single run is a lower bound only, so the ratio over it says nothing
    four_gpus = row("| NVIDIA H100 80GB HBM3 | 4 | llama3-8b |")
    assert ("1,048,576 (host: full depth planned to fit up to 1,048,576; GPU: 2,097,152 ran [5], nothing longer "
            "failed)") in four_gpus
    assert "≥ 262,144 (nothing longer run)" in four_gpus and "? (no failing length for ring)" in four_gpus
    # the ballast protocol: two depths at 1M, their peaks and their spread (0.2 GiB)
    assert "61.2" in row("| fpdt | NVIDIA H100 80GB HBM3 | 4 |", "2 of 32 layers + ballast", "1,048,576", "25.4")
    assert "| 0.2 |" in row("| fpdt | NVIDIA H100 80GB HBM3 | 4 |", "4 of 32 layers + ballast", "1,048,576")
    # throughput at equal length, with the ratio against ring in the same group; a one-step run (warm-up only) is not
    # a throughput figure, only a memory one
    assert "1.30×" in row("| 262,144 | fpdt |", "26,000")
    assert "47.0%" in row("| llama3-8b (32 layers) | 524,288 | fpdt |")
    assert not [line for line in lines if "| 131,072 | ring |" in line]
    assert "(warm-up)" in row("| ring | ok |", "131,072")
    # every run is listed, out-of-memory ones with their limit
    assert "oom (gpu)" in row("| modelparallel | oom")
    assert doc.count("| ok |") == 8  # the 9 runs of the "every run" table, one out of memory


def table_rows(doc: str) -> list[tuple[list[str], list[str]]]:
    """``(header, cells)`` of every data row of every Markdown table in ``doc``."""
    rows, header = [], None
    for line in doc.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if header is None:
            header = cells
        elif not set(line) <= set("|-"):
            rows.append((header, cells))
    return rows


def listed_commands(doc: str) -> dict[str, str]:
    """``{"[n]": commit}`` of the page's command list."""
    return {f"[{n}]": commit for n, commit in re.findall(r"^(\d+)\. `.+` at commit `([0-9a-f]{7,})`", doc, re.M)}


def assert_provenance(doc: str) -> None:
    """Every table row and every plot names its card and GPU count, cites listed commands and names their commits."""
    commands = listed_commands(doc)
    rows = table_rows(doc)
    assert rows and commands
    for header, cells in rows:
        row = dict(zip(header, cells))
        assert row["card"] not in ("", "?", "–") and row["GPUs"].isdigit(), cells
        refs = re.findall(r"\[\d+\]", " ".join(cells))
        assert refs and all(ref in commands for ref in refs), cells
        assert {commands[ref] for ref in refs} <= set(re.findall(r"`([0-9a-f]{7,})`", row["commit"])), cells
    for image in re.finditer(r"^!\[(.+)\]\(.+\)\n\n(.+)$", doc, re.M):
        title, caption = image.groups()
        assert "GPU" in title, title  # card, GPU count and model
        refs = re.findall(r"\[\d+\]", caption)
        assert refs and all(ref in commands for ref in refs), caption
        assert {commands[ref] for ref in refs} <= set(re.findall(r"`([0-9a-f]{7,})`", caption)), caption


def test_every_figure_names_card_command_and_commit():
    """The page from the stored records: no record is left out for want of provenance, every table row names its card
    and GPU count and cites a listed command with the commit beside it, and so does every plot's caption. The page
    says how to regenerate itself and judges nothing against plans."""
    paths = sorted(glob.glob(str(ROOT / "bench" / "results" / "*.jsonl")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stored record the page would leave out fails here
        stored = shown.load_records(paths)
    # every kind the page shows has stored records; gemm may have none yet (its rates need a GPU run of bench/gemm.py)
    assert set(shown.KINDS) - {record["kind"] for record in stored} <= {"gemm"}
    fake_plots = [Plot(path=str(ROOT / "docs" / "plots" / "p.png"), title="peak GPU memory: NVIDIA H200, 4 GPUs",
                       records=[r for r in stored if r["kind"] == "run"][:3])]
    doc = page.render_markdown(stored, plots=fake_plots, doc_dir=str(ROOT / "docs"))
    assert_provenance(doc)
    assert "![peak GPU memory: NVIDIA H200, 4 GPUs](plots/p.png)" in doc
    assert page.REGENERATE in doc and page.REGENERATE.startswith("python3 -m bench.report ")
    assert "target" not in doc.lower() and "verdict" not in doc.lower()


def test_records_without_commit_are_left_out_with_a_warning(tmp_path):
    """An old-format record (no commit field, or one that could not be named) is not shown: a figure appears only with
    the commit that produced it. The warning names the line and the fix; the other records are shown."""
    old = run_record("fpdt", gpus=1, layers=2, seq_len=786_432, peak_gib=73.3)
    del old["commit"]
    unknown = {**run_record("ring", gpus=1, layers=2, seq_len=24_576), "commit": None}
    cardless = {**run_record("modelparallel", gpus=1, layers=2, seq_len=12_288), "card": None}
    kept = run_record("fpdt", gpus=1, layers=2, seq_len=262_144, peak_gib=35.8)
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (old, unknown, cardless, kept)))
    with pytest.warns(UserWarning) as caught:
        loaded = shown.load_records([str(path)])
    messages = [str(w.message) for w in caught]
    assert any(m.startswith(f"{path}:1: no commit") and "the one that added it to the repository" in m
               for m in messages)
    assert any(m.startswith(f"{path}:2: no commit") for m in messages)
    assert any(m.startswith(f"{path}:3: no card") for m in messages)
    assert loaded == [kept]
    assert shown.missing_provenance(old) == ["commit"] and shown.missing_provenance(kept) == []
    doc = page.render_markdown(loaded)
    assert "786,432" not in doc and "24,576" not in doc and "262,144" in doc
    assert_provenance(doc)


def test_commit_comes_from_git_then_the_environment(tmp_path, monkeypatch):
    """$FPDT_COMMIT names the commit of a copied tree, also one whose .git folder holds an older HEAD; without it a
    checkout names its own commit; neither gives None, not a guess."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        monkeypatch.setenv(provenance.COMMIT_VARIABLE, "fffffff")
        assert provenance.current_commit() == "fffffff"  # the variable wins over git
        monkeypatch.delenv(provenance.COMMIT_VARIABLE)
        assert provenance.current_commit() == head.stdout.strip()
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, "1234abc")
    assert provenance.current_commit(tmp_path) == "1234abc"
    monkeypatch.delenv(provenance.COMMIT_VARIABLE)
    assert provenance.current_commit(tmp_path) is None
    stamp = provenance.stamp("attention", card="cpu", gpus=1, command="python3 bench/attention.py")
    assert set(stamp) >= {"kind", "card", "gpus", "command", "commit", "torch", "time"}
    assert provenance.launch_command("-m bench.peers", ["--system", "fpdt"], gpus_per_node=1, world_size=1,
                                     under_torchrun=False) == "python3 -m bench.peers --system fpdt"
    assert provenance.launch_command("bench/attention.py", ["--seq-lens", "1024"], gpus_per_node=4, world_size=8,
                                     under_torchrun=True) == ("torchrun --nnodes 2 --nproc_per_node 4 "
                                                              "bench/attention.py --seq-lens 1024")


def test_plots_skipped_cleanly_without_matplotlib(tmp_path, monkeypatch, capsys):
    """No matplotlib: the tables are written, the plots skipped with a message saying why."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    path = tmp_path / "peers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_records()) + "not json\n")
    with pytest.warns(UserWarning, match="not JSON"):
        assert page.main([str(path), "--doc", str(tmp_path / "bench.md"), "--plots", str(tmp_path / "plots")]) == 0
    assert "matplotlib is not installed, plots skipped" in capsys.readouterr().err
    doc = (tmp_path / "bench.md").read_text()
    assert "Plots not drawn: matplotlib was not installed" in doc and "1,048,576" in doc
    assert not (tmp_path / "plots").exists()


def test_plots_written_with_matplotlib(tmp_path):
    """With matplotlib: a memory and an MFU plot per card, GPU count and model, linked from the document with the
    commands and commits of their points."""
    pytest.importorskip("matplotlib")
    plots = write_plots(synthetic_records(), str(tmp_path / "plots"))
    names = sorted(Path(p.path).name for p in plots)
    assert names == [f"peers_{m}_nvidia-h100-80gb-hbm3_{g}gpu_llama3-8b.png" for m in ("memory", "mfu") for g in (1, 4)]
    assert all(Path(p.path).stat().st_size > 1000 for p in plots)
    doc = page.render_markdown(synthetic_records(), plots=plots, doc_dir=str(tmp_path))
    assert "](plots/peers_mfu_nvidia-h100-80gb-hbm3_4gpu_llama3-8b.png)" in doc
    assert_provenance(doc)


def test_ballast_is_the_sharded_states_of_the_layers_not_run():
    """Llama-3-8B block: 2·4096² + 2·4096·1024 + 3·4096·14336 + 2·4096 = 218,112,000 parameters, 16 B each (bf16-mixed
    AdamW: fp32 master, fp32 gradient, two fp32 moments), sharded over the GPUs; none when the states are offloaded."""
    geometry = ModelGeometry.from_config(LlamaConfig.from_name("llama3-8b"))
    block = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert block == 218_112_000
    assert ballast.state_bytes_per_parameter("bf16-mixed") == 16 and ballast.state_bytes_per_parameter("32-true") == 16
    four = dict(num_gpus=4, precision="bf16-mixed", cpu_offload_params=False)
    assert ballast.ballast_bytes(geometry, layers_run=4, **four) == 28 * 218_112_000 * 16 // 4 == 24_428_544_000
    assert ballast.ballast_bytes(geometry, layers_run=8, **four) == 20_938_752_000
    assert ballast.ballast_bytes(geometry, layers_run=32, **four) == 0
    assert ballast.ballast_bytes(geometry, layers_run=2, num_gpus=1, precision="bf16-mixed",
                               cpu_offload_params=True) == 0
    tiny = ModelGeometry.from_config(LlamaConfig.from_name("tiny"))  # block: 2·64·64 + 2·64·32 + 3·64·128 + 2·64
    assert ballast.ballast_bytes(tiny, layers_run=1, num_gpus=2, precision="32-true",
                               cpu_offload_params=False) == 36_992 * 16 // 2


def test_ballast_holds_what_the_missing_blocks_keep_on_the_gpu():
    """Between forward and backward a block keeps on the GPU: modelparallel its checkpointed input, S·4096·2 B; ring
    the same for S/W tokens; fpdt nothing with offload, else its attention chunks (q, k, v in bf16 and the fp32
    lse: (32 + 2·8)·128·2 + 32·4 B per local token) and its output (32·128·2 B per local token)."""
    geometry = ModelGeometry.from_config(LlamaConfig.from_name("llama3-8b"))

    def kept(system, seq_len, offload=True):
        return ballast.kept_bytes_per_layer(system, geometry, seq_len=seq_len, num_gpus=4, precision="bf16-mixed",
                                          attention_offload=offload)

    assert kept("modelparallel", 16_384) == 16_384 * 4096 * 2 == 134_217_728
    assert kept("ring", 65_536) == 65_536 // 4 * 4096 * 2 == 134_217_728
    assert kept("fpdt", 262_144) == 0
    local = 262_144 // 4
    assert kept("fpdt", 262_144, offload=False) == local * (48 * 128 * 2 + 32 * 4 + 32 * 128 * 2) == 1_350_565_888
    states = 28 * 218_112_000 * 16 // 4
    assert ballast.ballast_bytes(geometry, layers_run=4, num_gpus=4, precision="bf16-mixed", cpu_offload_params=False,
                               kept_per_layer=134_217_728) == states + 28 * 134_217_728 == 28_186_640_384
    with pytest.raises(ValueError, match="--ballast auto needs --offload on or off"):
        cli.validate(cli.parse_args(["--system", "fpdt", "--ballast", "auto", "--offload", "auto",
                                         "--accelerator", "cpu"]), world_size=1)


def test_out_of_memory_becomes_a_record(monkeypatch, tmp_path):
    """A CUDA out-of-memory error inside a system ends the run with status "oom", the steps done and the message."""
    monkeypatch.setenv(provenance.COMMIT_VARIABLE, COMMIT)  # names the commit where the tree is not a checkout
    def runs_out(args, *, info, **kwargs):
        info.update(tokens_per_step=args.seq_len, step_times_s=[1.5], losses=[5.5], peak_gpu_bytes_per_step=[None])
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setitem(systems.SYSTEM_FUNCTIONS, "fpdt", runs_out)
    args = cli.parse_args(["--system", "fpdt", "--model", "tiny", "--layers", "1", "--seq-len", "64", "--steps", "2",
                             "--accelerator", "cpu", "--precision", "32-true", "--ballast", "auto",
                             "--out", str(tmp_path / "r.jsonl")])
    record = runner.run(args)
    assert record["status"] == "oom" and record["limit"] == "gpu" and "Tried to allocate" in record["error"]
    assert record["steps_done"] == 1 and record["losses"] == [5.5] and record["ranks_answered"] == [0]
    assert record["ballast_bytes"] == 36_992 * 16
    assert record["command"].startswith("python3 -m bench.peers --system fpdt") and record["commit"]
    provenance.append_record(args.out, record)
    assert "| oom (gpu) |" in page.render_markdown(shown.load_records([args.out]))

    def crashes(args, **kwargs):
        raise KeyError("a bug, not a memory limit")

    monkeypatch.setitem(systems.SYSTEM_FUNCTIONS, "fpdt", crashes)
    with pytest.raises(KeyError, match="a bug"):
        runner.run(args)


def test_memory_errors_are_told_from_bugs():
    """CUDA OOM, allocation failures in libraries and the planner's pinned-memory refusal count as limits."""
    assert records.out_of_memory(torch.OutOfMemoryError("CUDA out of memory")) == "gpu"
    assert records.out_of_memory(RuntimeError("CUDA error: out of memory")) == "gpu"
    assert records.out_of_memory(RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate")) == "gpu"
    assert records.out_of_memory(ValueError("this run needs 900 GiB of pinned host memory per host")) == "host"
    assert records.out_of_memory(ValueError("chunks must be 'auto' or a positive int")) is None
    assert records.out_of_memory(RuntimeError("NCCL error")) is None


def test_length_search_doubles_then_bisects_once():
    """Double while it fits, then try the midpoint once (rounded to the multiple); halve first if the start fails."""
    def limit(longest):
        return lambda seq_len: seq_len <= longest

    result = search.search_lengths(limit(1_300_000), 262_144, multiple=8192, max_len=16 * 2**20)
    assert result["tried"] == [(262_144, True), (524_288, True), (1_048_576, True), (2_097_152, False),
                               (1_572_864, False)]
    assert (result["max_fit"], result["min_fail"]) == (1_048_576, 1_572_864)
    result = search.search_lengths(limit(100_000), 524_288, multiple=8192, max_len=16 * 2**20)
    assert [s for s, _ in result["tried"]] == [524_288, 262_144, 131_072, 65_536, 98_304]
    assert (result["max_fit"], result["min_fail"]) == (98_304, 131_072)
    result = search.search_lengths(limit(10**9), 1_048_576, multiple=8192, max_len=4_194_304)
    assert (result["max_fit"], result["min_fail"]) == (4_194_304, None)  # capped, nothing failed
    with pytest.raises(ValueError, match="multiple of --length-multiple"):
        search.search_lengths(limit(1), 1000, multiple=8192, max_len=10**6)


def test_a_killed_attempt_is_recorded_as_killed_on_the_host():
    """An attempt the kernel ends with SIGKILL (host memory: page-locked pages cannot be swapped) writes no record of
    its own; the search records it as killed, bound by the host, both when the process itself died (rc -9) and when
    torchrun reports a killed rank and exits 1. A crash and a deadline are told apart from it."""
    rc, tail = search.run_attempt([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                                  timeout_s=60)
    assert rc == -9 and search.killed(rc, tail)
    assert search.killed(1, "traceback : Signal 9 (SIGKILL) received by PID 2243")
    assert not search.killed(1, "RuntimeError: NCCL error") and not search.killed(None, "")
    args = cli.parse_args(["--system", "alst", "--model", "llama3-3b", "--layers", "2", "--max-length", "--gpus", "1"])
    child = search.attempt_argv(args.argv, 786_432, "a1")
    record = search._unfinished_record(args, child, 786_432, "a1", rc, tail)
    assert record["status"] == "killed" and record["limit"] == "host (SIGKILL)" and not shown.fits(record)
    assert search._unfinished_record(args, child, 786_432, "a1", 1, "NCCL error")["status"] == "error"
    assert search._unfinished_record(args, child, 786_432, "a1", None, "")["status"] == "timeout"


def test_attempt_argv_drops_the_search_options():
    """Each attempt runs the search's own options minus the search ones, at its own length."""
    argv = ["--system", "ring", "--max-length", "--gpus", "4", "--seq-len", "65536", "--deadline-s=500",
            "--layers", "2", "--length-multiple", "16384", "--ballast", "auto"]
    assert search.attempt_argv(argv, 131072, "a1") == ["--system", "ring", "--layers", "2", "--ballast", "auto",
                                                       "--seq-len", "131072", "--attempt-id", "a1"]


def test_primed_adam_states_train_exactly_like_lazy_ones():
    """AdamW's moments created before the first step give the same parameters as its own lazy initialisation."""
    torch.manual_seed(3)
    reference = torch.nn.Linear(8, 4)
    primed = torch.nn.Linear(8, 4)
    primed.load_state_dict(reference.state_dict())
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (reference, primed)]
    common.prime_adam_states(optimizers[1])
    state = optimizers[1].state[primed.weight]
    assert float(state["step"]) == 0 and not state["exp_avg"].any() and state["exp_avg_sq"].shape == (4, 8)
    for _ in range(3):
        x = torch.randn(5, 8)
        for model, optimizer in zip((reference, primed), optimizers):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(reference.parameters(), primed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="Adam or AdamW"):
        common.prime_adam_states(torch.optim.SGD(primed.parameters(), lr=0.1))


def test_expanded_kv_attention_matches_the_reference():
    """ring's --ring-kv-heads expand: k, v repeated to the query heads give the reference GQA attention."""
    torch.manual_seed(0)
    q = torch.randn(2, 24, 8, 16, dtype=torch.float64)  # (B, S, H, D)
    k, v = torch.randn(2, 24, 2, 16, dtype=torch.float64), torch.randn(2, 24, 2, 16, dtype=torch.float64)
    # fp64: the two differ only in where the heads are repeated, so they agree to rounding (~1e-15)
    torch.testing.assert_close(systems.sdpa_expanded_kv(q, k, v, scale=0.3), sdpa_attention(q, k, v, scale=0.3),
                               rtol=1e-12, atol=1e-12)


def test_host_limit_is_the_planners_and_bounds_the_maximum():
    """The search's host limit: the longest full-depth length whose planned pinned memory fits (4 H100s, 500 GiB:
    557,056 tokens by lightning_fpdt.planner); when it is below the GPU's limit, the report gives it as the maximum."""
    args = cli.parse_args(["--system", "fpdt", "--max-length", "--gpus", "4", "--check-host",
                             "--length-multiple", "16384", "--max-seq-len", "2097152"])
    limit = search.host_limit(args, available_bytes=500 * GIB, gpu_memory_bytes=int(79.2 * GIB))
    assert limit == 557_056
    plan = ballast.host_check(argparse.Namespace(**{**vars(args), "seq_len": limit + 16384}), num_gpus=4,
                            gpus_per_node=4, resolved={}, gpu_memory_bytes=int(79.2 * GIB),
                            available_bytes=500 * GIB)
    assert plan["fits"] is False and plan["needed_bytes"] > 500 * GIB
    summary = {"kind": "max_length", "system": "fpdt", "model": "llama3-8b", "layers": 2, "full_layers": 32,
              "gpus": 4, "card": H100, "ballast": "auto", "max_seq_len": limit, "max_seq_len_gpu": 1_572_864,
              "first_failed_seq_len": 2_097_152, "host_max_seq_len": limit, "limited_by": "host (planned, full depth)",
              "command": "python3 -m bench.peers --system fpdt --max-length --gpus 4 --check-host", "commit": COMMIT}
    doc = page.render_markdown([summary])
    assert ("557,056 (host: full depth planned to fit up to 557,056; GPU: 1,572,864 ran, 2,097,152 failed) [1]"
            in doc)


def test_host_limit_shown_by_full_ballast_runs():
    """Where runs with the full depth's host memory held (``--ballast full``) show the host's limit, the cell cites
    the one that ran and the length its plan refused, with the GPU's own limit (the GPU-only ballast) beside them."""
    def full(record: dict) -> dict:
        return {**record, "options": {"ballast": "full"},
                "command": record["command"].replace("--ballast auto --check-host", "--ballast full")}

    full_ok = full(run_record("alst", gpus=4, layers=2, seq_len=1_310_720))
    refused = {**full(run_record("alst", gpus=4, layers=2, seq_len=1_572_864, status="oom", limit="host")),
               "error": lengths.PLANNED + " alst at full depth: its host memory ..."}
    gpu_only = run_record("alst", gpus=4, layers=2, seq_len=1_572_864, host_fits=False)  # a step ran, host not held
    gpu_oom = run_record("alst", gpus=4, layers=2, seq_len=1_638_400, status="oom", limit="gpu")
    doc = page.render_markdown([gpu_only, gpu_oom, full_ok, refused])
    assert ("1,310,720 [2]; 1,572,864 failed (host, planned) [3] (GPU alone: 1,572,864 ran [1], 1,638,400 failed)"
            in doc)


def test_step_profile_categories_and_summary():
    """Kernels and copies are grouped by name; busy = attention + matmul + other; waiting is the rest of the wall."""
    from types import SimpleNamespace

    names = {
        "void cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
        "ncclDevKernel_AllToAll_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "communication",
        "Memcpy HtoD (Pinned -> Device)": "copy host->device",
        "Memcpy DtoH (Device -> Pinned)": "copy device->host",
        "void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor>": "other",
    }
    for name, expected in names.items():
        assert step_profile.category(name) == expected, name
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [SimpleNamespace(key=name, count=2, self_device_time_total=us, device_type=cuda)
              for name, us in zip(names, (400_000, 300_000, 50_000, 20_000, 10_000, 100_000))]
    # a CPU operator carries its kernels' device time too: counting it would count the matmul twice
    events.append(SimpleNamespace(key="aten::mm", count=5, self_device_time_total=300_000, device_type=cpu))
    events.append(SimpleNamespace(key="Optimizer.step#AdamW.step", count=1, self_device_time_total=900_000,
                                  device_type=cuda, is_user_annotation=True))  # a range over the kernels above
    events.append(SimpleNamespace(key="Command Buffer Full", count=9, self_device_time_total=70_000, device_type=cuda))
    summary = step_profile.summarize(events, wall_s=1.0, top=3)
    assert summary["host_stalls_s"] == {"launch queue full": pytest.approx(0.07)}
    assert summary["busy_s"] == pytest.approx(0.8) and summary["wait_s"] == pytest.approx(0.2)
    assert summary["device_s"]["communication"] == pytest.approx(0.05)
    assert [k["category"] for k in summary["top_kernels"]] == ["attention", "matmul", "other"]
    assert "waiting 0.200 s" in step_profile.format_summary(summary)
    summary["idle"] = step_profile.idle_gaps([(0.0, 100.0, "sm90_xmma_gemm_bf16"),
                                              (100.0, 400.0, "ncclDevKernel_AllGather")])
    assert "compute idle (gaps >= 20 us)" in step_profile.format_summary(summary)
    profiler = step_profile.StepProfiler(1, "/tmp/unused", device=torch.device("cpu"), rank=1)
    profiler.stop(0)  # not the profiled step: nothing happens
    with pytest.raises(RuntimeError, match=r"stop\(1\) called before start\(1\)"):
        profiler.stop(1)



def test_step_time_leaves_out_the_warm_up_and_the_profiled_step():
    """The profiler slows the step it records (more for the system launching more kernels): a step time that
    included it would compare a profiled step of one system with an unprofiled one of the other."""
    geometry = ModelGeometry(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=128, vocab_size=96)
    info = {"step_times_s": [3.0, 0.44, 0.49, 0.46], "tokens_per_step": 1000}
    common = dict(geometry_run=geometry, seq_len=1000, world_size=1, peak=None)
    assert records.summarize(info, **common)["step_time_s"] == pytest.approx(0.46)
    profiled = records.summarize(info, **common, profile_step=2)
    assert profiled["step_time_s"] == pytest.approx(0.45) and profiled["timed_steps"] == 2
    only = records.summarize({"step_times_s": [3.0, 0.49], "tokens_per_step": 1000}, **common, profile_step=1)
    assert only["step_time_s"] == pytest.approx(0.49) and only["timed_steps"] == 1  # nothing else to time


def test_host_bound_lengths_show_the_gpu_limit_beside_the_hosts():
    """fpdt ran 1M on one GPU but the host holds the full depth's pinned memory at no length run; the peers fit 32K
    and failed at 48K on the same card: the length table gives the host's limit (none) and the GPU's (1M ran), and
    the ratio over the peer on GPU memory (≥ 21.33×: 1M over the 48K that failed) beside the host's, never one for
    the other."""
    records = [
        run_record("fpdt", gpus=1, layers=2, seq_len=1_048_576, timed_steps=0, host_fits=False),
        {"kind": "max_length", "system": "modelparallel", "model": "llama3-8b", "layers": 2, "full_layers": 32,
         "gpus": 1, "card": H100, "ballast": "auto", "max_seq_len": 32_768, "first_failed_seq_len": 49_152,
         "max_seq_len_gpu": 32_768, "host_max_seq_len": 16_777_216, "limited_by": "gpu",
         "command": "python3 -m bench.peers --system modelparallel --max-length --gpus 1 --seq-len 32768",
         "commit": COMMIT},
    ]
    systems_found = lengths.max_lengths(records)[(H100, 1, "llama3-8b")]
    ours, theirs = systems_found["fpdt"], systems_found["modelparallel"]
    assert lengths.gpu_limit(ours) == {"max": 1_048_576, "fail": None, "exact": False, "system": "fpdt"}
    assert lengths.both_ratios(ours, theirs) == "– (GPU memory: ≥ 21.33×)"
    doc = page.render_markdown(records)
    assert ("| none (host: the full depth's pinned memory fits no length run; GPU: 1,048,576 ran [1], nothing longer "
            "failed) [1] | 32,768; 49,152 failed (gpu) [2] | not run | not run | – (GPU memory: ≥ 21.33×) |") in doc
    # where the host does not bind there is one figure only
    records[0] = run_record("fpdt", gpus=1, layers=2, seq_len=1_048_576, timed_steps=0)
    systems_found = lengths.max_lengths(records)[(H100, 1, "llama3-8b")]
    assert lengths.gpu_limit(systems_found["fpdt"]) is None
    assert lengths.both_ratios(systems_found["fpdt"], systems_found["modelparallel"]) == "≥ 21.33×"
    assert "| ≥ 1,048,576 (nothing longer run) [1] | 32,768; 49,152 failed (gpu) [2] |" in page.render_markdown(records)


def test_a_model_only_fpdt_hf_ran_has_its_length_row_against_alst():
    """Where fpdt ran only on the Hugging Face model (fpdt-hf), its maximum fills the fpdt column, said so, and is
    set against ALST's on the same card: 2M ran against ALST's 512K (768K failed), 4×. A length the full depth's
    plan refused before anything ran (``--ballast full``) is a failure said to be planned, cited beside the length
    that fit."""
    records = [run_record("fpdt-hf", gpus=1, layers=1, seq_len=2_097_152, card="NVIDIA H200"),
               run_record("alst", gpus=1, layers=2, seq_len=524_288, card="NVIDIA H200"),
               run_record("alst", gpus=1, layers=2, seq_len=786_432, card="NVIDIA H200", status="oom", limit="host")]
    systems_found = lengths.max_lengths(records)[("NVIDIA H200", 1, "llama3-8b")]
    assert lengths.ours_of(systems_found)["system"] == "fpdt-hf"
    doc = page.render_markdown(records)
    assert ("| NVIDIA H200 | 1 | llama3-8b | ≥ 2,097,152 (nothing longer run) [3] (fpdt-hf: the Hugging Face model) "
            "| not run | not run | 524,288 [1]; 786,432 failed (host) [2] | – | – | ≥ 2.67× |") in doc
    refused = run_record("fpdt-hf", gpus=1, layers=1, seq_len=2_621_440, card="NVIDIA H200", status="oom",
                         limit="host")
    refused["error"] = "planned: llama3-8b at full depth (32 layers), 2,621,440 tokens: nothing fits the host"
    doc = page.render_markdown(records + [refused])
    assert ("| 2,097,152 [3]; 2,621,440 failed (host, planned) [4] (fpdt-hf: the Hugging Face model) | not run | "
            "not run | 524,288 [1]; 786,432 failed (host) [2] | – | – | 4.00× (2.67–5.00×) |") in doc


def test_capped_runs_and_fpdt_variants_are_told_apart():
    """A run capped with --gpu-memory-gib is another card in every table (what fits differs), and so is a search's
    summary (it carries its attempts' cap); fpdt runs that recompute the attention, use head groups or keep the chunks
    on the GPU are separate lines of the plots."""
    capped = run_record("ring", gpus=4, layers=2, seq_len=65_536, card="NVIDIA H200")
    assert shown.card_name(capped) == "NVIDIA H200"
    capped["gpu_memory_cap_bytes"] = int(79 * GIB)
    assert shown.card_name(capped) == "NVIDIA H200, capped to 79 GiB"
    summary = {"kind": "max_length", "card": "NVIDIA H200", "gpu_memory_cap_bytes": int(79 * GIB),
              "command": "python3 -m bench.peers --max-length --gpus 4 --system ring --gpu-memory-gib 79"}
    assert shown.card_name(summary) == "NVIDIA H200, capped to 79 GiB"
    fpdt = run_record("fpdt", gpus=1, layers=2, seq_len=1_048_576)
    assert shown.variant(fpdt) == ""
    fpdt["options"] = {"recompute_attention": True, "head_chunks": 4, "offload": True}
    assert shown.variant(fpdt) == "attention recomputed, 4 head groups"
    fpdt["options"] = {"recompute_attention": False, "head_chunks": 1, "offload": False}
    assert shown.variant(fpdt) == "offload off"


def test_alst_has_its_maximum_and_is_set_against_at_equal_placement():
    """ALST's maximum length is a column of its own, with fpdt's over it; a fpdt lower bound below ALST's exact
    maximum says nothing, so no ratio. In the throughput table fpdt's host-resident runs, whichever way the host
    stepped, are set against ALST's host-resident run (the optimizer on the CPU), and the GPU-resident ones against
    its GPU-resident run."""
    def with_states(record: dict, host_step: str = None) -> dict:
        record["options"] = {**record["options"], "cpu_offload_params": True}
        if host_step:
            record["options"]["host_step"] = host_step
        return record

    records = [
        run_record("alst", gpus=4, layers=2, seq_len=1_572_864, timed_steps=0),
        run_record("alst", gpus=4, layers=2, seq_len=1_638_400, status="oom", limit="gpu"),
        run_record("fpdt", gpus=4, layers=2, seq_len=131_072),
        run_record("alst", gpus=1, layers=2, seq_len=393_216, timed_steps=0),
        run_record("alst", gpus=1, layers=2, seq_len=458_752, status="oom", limit="gpu"),
        run_record("fpdt", gpus=1, layers=2, seq_len=1_048_576, timed_steps=0),
        with_states(run_record("alst", gpus=4, layers=2, seq_len=524_288, tokens_per_s=36_000.0)),
        with_states(run_record("fpdt-hf", gpus=4, layers=2, seq_len=524_288, tokens_per_s=54_000.0), "in backward"),
        with_states(run_record("fpdt-hf", gpus=4, layers=2, seq_len=524_288, tokens_per_s=45_000.0),
                    "after backward"),
        run_record("alst", gpus=4, layers=2, seq_len=524_288, tokens_per_s=40_000.0),
        run_record("fpdt-hf", gpus=4, layers=2, seq_len=524_288, tokens_per_s=56_000.0),
    ]
    found = lengths.max_lengths(records)
    four, one = found[(H100, 4, "llama3-8b")], found[(H100, 1, "llama3-8b")]
    assert (four["alst"]["max"], four["alst"]["fail"]) == (1_572_864, 1_638_400)
    assert lengths.length_ratio(four["fpdt"], four["alst"])[0] == "? (nothing longer run for fpdt)"
    # fpdt ran 1M, nothing longer; ALST fit 384K and failed at 448K: fpdt's maximum is at least 1M / 448K of ALST's
    assert lengths.length_ratio(one["fpdt"], one["alst"])[0] == "≥ 2.29×"
    doc = page.render_markdown(records)
    assert "| fpdt / modelparallel | fpdt / ring | fpdt / alst | commit |" in doc
    assert "| 393,216 [" in doc and "]; 458,752 failed (gpu) [" in doc and "| ≥ 2.29× |" in doc

    def throughput_row(*cells: str) -> list[str]:
        found_rows = [line for line in doc.splitlines() if all(cell in line for cell in cells) and "tokens" not in line]
        assert len(found_rows) == 1, (cells, found_rows)
        return [cell.strip() for cell in found_rows[0].strip("|").split("|")]

    # columns: ..., peak GiB, × ring, × alst, cmd, commit
    assert throughput_row("| 524,288 | fpdt-hf | host, step in backward |")[-4:-2] == ["–", "1.50×"]
    assert throughput_row("| 524,288 | fpdt-hf | host, step after backward |")[-4:-2] == ["–", "1.25×"]
    assert throughput_row("| 524,288 | fpdt-hf | GPU |")[-4:-2] == ["–", "1.40×"]
    assert throughput_row("| 524,288 | alst | host |")[-4:-2] == ["–", "–"]


def test_block_input_placements_are_set_against_all_in_host_memory():
    """Full-depth steps of one length and card: the run with every block input in host memory is the baseline; runs
    whose plan spills inputs to disk or keeps only some are shown with their step against it, and where each plan put
    the inputs; a length run in one place only has no row."""
    from bench.report import training

    def step(seconds: float, plan: str, held_gib: int = 0, seq_len: int = 262_144) -> dict:
        r = run_record("fpdt-hf", gpus=1, layers=32, seq_len=seq_len, card="NVIDIA H200")
        r.update(step_time_s=seconds, plan_options=f"sp=1 dp=1 chunks=4 bf16-mixed adamw{plan}",
                 held_host_bytes=held_gib * GIB, peak_disk_bytes=None if "disk" not in plan else 21 * GIB)
        return r

    records = [step(100.0, ""), step(103.0, " disk_inputs=14", 92), step(106.0, " keep_inputs=8", 105),
               step(50.0, "", seq_len=131_072)]
    assert training.plan_inputs(records[1]) == (None, 14) and training.plan_inputs(records[2]) == (8, 0)
    rows = [cells for _, cells in training.PLACEMENT.rows(records)]
    assert [row[6] for row in rows] == ["32 in host memory", "18 in host memory, 14 on disk",
                                        "8 kept (24 regenerated): 8 in host memory"]
    assert [row[-1] for row in rows] == ["+0.0%", "+3.0%", "+6.0%"]
    assert [row[5] for row in rows] == ["0", "92", "105"] and rows[1][7] == "21.0"


def test_sequence_layouts_get_their_own_throughput_rows():
    """Runs of one model and length in different sequence layouts (one sequence over every GPU, two sequences over
    half of them each, ring x Ulysses) are separate rows, each naming its layout; the default layout names none."""
    from bench.report import training

    def run(sp: int, dp: int, ring: object, tokens_per_s: float) -> dict:
        r = run_record("fpdt-hf", gpus=4, layers=24, seq_len=131_072, tokens_per_s=tokens_per_s)
        r.update(sequence_parallel_size=sp, data_parallel_size=dp)
        r["options"] = {**r.get("options", {}), "ring_size": ring}
        return r

    records = [run(4, 1, "auto", 63_000.0), run(2, 2, "auto", 72_000.0), run(4, 1, 2, 62_000.0)]
    states = sorted(cells[5] for _, cells in training._throughput_rows(records))
    assert states == ["GPU", "GPU; ring 2 × Ulysses 2", "GPU; sp 2 × dp 2"]


def test_the_same_run_at_two_commits_on_one_day():
    """A setting measured at two commits on one day gets a row per commit, oldest first, with its speed-up over the
    oldest; the same setting at another commit on another day is not compared with them."""
    from bench.report import training

    old = {**run_record("fpdt", gpus=4, layers=8, seq_len=32768), "commit": "aaaaaaa", "time": "2026-11-27T21:00"}
    new = {**old, "commit": "bbbbbbb", "time": "2026-11-27T21:05", "step_time_s": 8.0, "command": old["command"] + " "}
    later = {**old, "commit": "ccccccc", "time": "2026-11-28T09:00", "step_time_s": 5.0}
    rows = [(r["commit"], cells[-3:]) for r, cells in training._change_rows([new, old, later])]
    assert rows == [("aaaaaaa", ["10.000", "40.0%", "1.00×"]), ("bbbbbbb", ["8.000", "40.0%", "1.25×"])]


def test_idle_gaps_split_by_what_ran_meanwhile():
    """A gap between compute kernels counts as communication where a collective overlapped it, as a copy where only
    a copy did, else as the host's (nothing on the device); gaps shorter than the threshold are left out."""
    kernels = [
        (0.0, 100.0, "sm90_xmma_gemm_bf16"),
        (150.0, 250.0, "ncclDevKernel_AllGather"),  # gap 100-300: 100 us communication, 100 us nothing
        (300.0, 400.0, "cudnn_flash_fprop"),
        (400.0, 405.0, "elementwise_kernel"),  # a 0 us gap, then 405-505: a copy for 60 us, then nothing
        (410.0, 470.0, "Memcpy DtoH (Device -> Pinned)"),
        (505.0, 600.0, "elementwise_kernel"),
        (610.0, 615.0, "elementwise_kernel"),  # a 10 us gap: under the threshold
    ]
    host_ops = [(0.0, 2000.0, "training_step"), (410.0, 500.0, "aten::item"), (300.0, 320.0, "aten::mm")]
    idle = step_profile.idle_gaps(kernels, host_ops=host_ops, min_us=20.0)
    assert idle["idle_s"] == pytest.approx(300e-6)
    assert idle["communication_s"] == pytest.approx(100e-6)
    assert idle["copy_s"] == pytest.approx(60e-6)
    assert idle["host_s"] == pytest.approx(140e-6)
    largest = idle["gaps"][0]
    assert largest["ms"] == pytest.approx(0.2) and largest["at_ms"] == pytest.approx(0.1)
    assert largest["before"] == "sm90_xmma_gemm_bf16" and largest["after"] == "cudnn_flash_fprop"
    assert largest["during"] == ["ncclDevKernel_AllGather"] and largest["host"] == []  # training_step: a caller
    assert idle["gaps"][1]["host"] == ["aten::item"]
    assert step_profile.idle_gaps([(0.0, 5.0, "ncclDevKernel_AllGather")])["gaps"] == []


def test_launch_sites_name_the_package_caller():
    """An elementwise kernel's device time goes to the CPU operator that launched it, with its shapes, and to the
    innermost Python frame of the package among its callers; matmuls are left out."""
    from types import SimpleNamespace as Event

    caller = Event(name="lightning_fpdt/sequence/all_to_all.py(62): seq_to_head",
                   cpu_parent=Event(name="torch/autograd/function.py(575): apply", cpu_parent=None))
    copy = Event(name="aten::copy_", input_shapes=[[2, 3]], cpu_parent=Event(name="aten::clone", cpu_parent=caller),
                 kernels=[Event(name="direct_copy_kernel", duration=100.0),
                          Event(name="direct_copy_kernel", duration=50.0)])
    mm = Event(name="aten::mm", input_shapes=[], cpu_parent=caller, kernels=[Event(name="sm90_gemm", duration=900.0)])
    sites = step_profile.launch_sites([copy, mm])
    assert len(sites) == 1 and sites[0]["calls"] == 2 and sites[0]["seconds"] == pytest.approx(150e-6)
    assert sites[0]["site"] == "lightning_fpdt/sequence/all_to_all.py(62): seq_to_head"
    assert sites[0]["op"] == "aten::copy_ [[2, 3]]"


def test_profiled_step_names_the_host_python(tmp_path):
    """Asked for (``python=True``, ``--profile-python``), rank 0's profiled step carries its Python time: the
    package's and bench's functions by cumulative time and every function by its own time. By default it does not:
    cProfile slows the host enough to open gaps on the device that the run does not have."""
    for python in (True, False):
        sink = {}
        profiler = step_profile.StepProfiler(1, str(tmp_path / "step"), device=torch.device("cpu"), rank=0, sink=sink,
                                             python=python)
        profiler.start(1)
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.stop(1)
        if not python:
            assert "python" not in sink["profile"]
            continue
        hotspots = sink["profile"]["python"]
        assert any("bench/step_profile.py" in row["function"] for row in hotspots["cumulative"])
        assert hotspots["own"] and {"function", "calls", "own_s", "cumulative_s"} <= set(hotspots["own"][0])
        assert json.loads((tmp_path / "step.json").read_text())["python"] == hotspots


def test_neighbours_are_set_against_the_cost_model():
    """Runs of one setting in different options are a group, fastest measured first, each with the cost model's step
    of the full depth under its own options; a setting run in one configuration only, or without full-depth options,
    has no row."""
    import dataclasses

    from bench.report import cost_model
    from lightning_fpdt.planner.geometry import resolve_geometry

    geometry = dataclasses.asdict(resolve_geometry("llama3-1b"))

    def run(step: float, chunks: int, offload: bool, seq_len: int = 65_536) -> dict:
        r = run_record("fpdt", gpus=2, layers=4, seq_len=seq_len)
        r.update(step_time_s=step, geometry=geometry, full_layers=16, plan_options=f"sp=2 chunks={chunks} {offload}",
                 full_depth={"options": {"FPDTStrategy": {"sequence_parallel_size": 2, "chunks": chunks,
                                                          "offload": offload, "offload_dir": None},
                                         "ActivationOffload": {"checkpoint_blocks": "all"}},
                             "checkpoint_blocks": 16, "step_time_s": 4 * step})
        return r

    records = [run(1.2, 2, True), run(1.0, 1, False), run(3.0, 1, False, seq_len=131_072)]
    groups = cost_model.neighbour_groups(records)
    assert [[r["step_time_s"] for r, _ in group] for group in groups] == [[1.0, 1.2]]
    (fast, fast_estimate), (slow, slow_estimate) = groups[0]
    assert slow_estimate > fast_estimate > 0  # offloading the stash and halving the chunks cost time in the model
    rows = [cells for _, cells in cost_model.COST_MODEL.rows(records)]
    assert [row[5] for row in rows] == ["chunks 1, offload off, 16 of 16 blocks checkpointed",
                                        "chunks 2, offload on, 16 of 16 blocks checkpointed"]
    assert [row[8] for row in rows] == ["+0.0%", "+20.0%"] and [row[9] for row in rows] == ["4.00", "4.80"]


def test_the_figure_shown_is_the_newest_codes_when_an_older_commit_ran_last(monkeypatch):
    """Runs side by side: the older commit's run came after the newer's; the table shows the newer commit's run, in
    the order the settings first appear."""
    ages = {"new1234": "2026-01-02T00:00:00+00:00", "old1234": "2026-01-01T00:00:00+00:00"}
    monkeypatch.setattr(shown, "commit_time", lambda commit: ages.get(commit, ""))
    runs = [dict(setting="a", commit="new1234", time="t1", step=1.0), dict(setting="a", commit="old1234", time="t2",
                                                                            step=2.0),
            dict(setting="b", commit="old1234", time="t3", step=3.0)]
    chosen = shown.latest(runs, key=lambda r: r["setting"])
    assert [(r["setting"], r["commit"]) for r in chosen] == [("a", "new1234"), ("b", "old1234")]
