"""``python3 -m bench.neighbours`` (bench/neighbours.py) and its table on the results page (bench/report/neighbours.py):
the configurations one option away from the planner's choice, each cell's options given explicitly as the planner
chose them, a grid's records, and the table made of them."""

from __future__ import annotations

import json
import warnings

from bench import neighbours
from bench.peers import cli
from bench.peers.full_depth import FullDepthRefused, plan_fpdt
from bench.report import neighbours as report
from bench.report.markdown import Commands
from bench.report.page import render_markdown
from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.models.llama import LlamaConfig

GIB = 2**30
LLAMA_3B = ModelGeometry.from_config(LlamaConfig.from_name("llama3-3b"))
BASE = ["--system", "fpdt-hf", "--model", "llama3-3b", "--seq-len", "65536", "--layers", "4", "--ballast", "full"]


def _full(argv):
    return plan_fpdt(cli.parse_args(argv), LLAMA_3B, num_gpus=1, gpus_per_node=1, gpu_memory_bytes=79 * GIB,
                     available_host=120 * GIB, disk_free=None)[0]


def test_neighbours_change_one_option_of_the_choice():
    """From the planner's choice at 65,536 tokens: chunks doubled (halving is below the fewest), offload and the
    attention's recompute flipped, fewer blocks checkpointed, fewer inputs kept; each differs from the choice in the
    option named (and what goes with it)."""
    chosen = _full(BASE + ["--auto-options"]).options
    found = dict(neighbours.neighbours(chosen, num_layers=28, seq_len=65536))
    assert set(found) >= {f"chunks {2 * chosen.chunks}", f"offload {'off' if chosen.offload else 'on'}",
                          f"attention {'kept' if chosen.recompute_attention else 'recomputed'}"}
    assert f"chunks {chosen.chunks // 2}" not in found  # 65,536 tokens: one chunk is the fewest
    assert found[f"chunks {2 * chosen.chunks}"].chunks == 2 * chosen.chunks
    recomputed = found.get("attention recomputed")
    if recomputed is not None:
        assert recomputed.recompute_attention and recomputed.checkpoint_blocks == "all"
    assert any(name.startswith("keep_inputs") for name in found)


def test_a_cells_flags_give_its_options_explicitly():
    """The bench.peers flags of a configuration plan the full depth to that configuration: what a cell runs is what
    the grid planned."""
    chosen = _full(BASE + ["--auto-options"]).options
    checked = 0
    for _, options in neighbours.neighbours(chosen, num_layers=28, seq_len=65536):
        try:
            full = _full(BASE + neighbours.option_flags(options))
        except FullDepthRefused:
            continue  # a neighbour that does not fit this machine: the grid leaves it out
        assert full.options == options
        checked += 1
    assert checked >= 3


def _record(cell: str, step: float, *, estimate: float, full: float, grid: str = "g1") -> dict:
    return {"kind": "run", "system": "fpdt-hf", "status": "ok", "card": "NVIDIA H200", "gpus": 1, "model": "llama3-3b",
            "layers": 4, "full_layers": 28, "seq_len": 65536, "step_time_s": step, "timed_steps": 2, "mfu": 0.4,
            "estimated_step_s": estimate, "plan_options": f"options of {cell}", "full_depth": {"step_time_s": full},
            "options": {"ballast": "full"}, "gpu_memory_cap_bytes": 79 * GIB,
            "neighbours": {"grid": grid, "cell": cell, "command": "python3 -m bench.neighbours ..."},
            "command": f"python3 -m bench.peers --cell {cell}", "commit": "abc1234", "torch": "2.11.0",
            "time": "2026-11-29T00:00:00+00:00"}


def test_the_table_sets_each_cell_against_the_grids_fastest():
    """One grid: "auto" first, then the neighbours fastest first; each row its measured step, MFU, estimate, their
    ratio, the full depth's step and its ratio to the fastest; another grid's cells apart; failed cells left out."""
    records = [_record("auto", 1.2, estimate=1.1, full=8.4), _record("offload off", 1.1, estimate=1.3, full=7.7),
               _record("chunks 2", 1.5, estimate=1.4, full=10.5), _record("auto", 2.0, estimate=2.0, full=14.0,
                                                                          grid="g2"),
               {**_record("attention recomputed", 1.0, estimate=1.0, full=7.0), "status": "oom"}]
    rows = list(report._rows(records))
    first = [cells for record, cells in rows if record["neighbours"]["grid"] == "g1"]
    assert [cells[4] for cells in first] == ["auto", "offload off", "chunks 2"]
    auto = first[0]
    assert auto[6:] == ["1.200", "40.0%", "1.100", "0.92", "8.40", f"{8.4 / 7.7:.3f}"]
    assert first[1][-1] == "1.000"
    assert [cells[4] for record, cells in rows if record["neighbours"]["grid"] == "g2"] == ["auto"]
    page = render_markdown(records)
    assert "### Auto against its neighbours" in page and "offload off" in page
    assert report.NEIGHBOURS.render([], Commands())[-1].startswith("No neighbour grid")


def test_a_grid_on_cpu_writes_a_record_per_cell_and_a_table(tmp_path, capsys):
    """One CPU process, tiny's 1 of 2 layers: the first two cells run, each a bench.peers record with its grid and
    cell, "auto" first; the table comes last."""
    out = tmp_path / "grid.jsonl"
    argv = ["--system", "fpdt", "--model", "tiny", "--layers", "1", "--seq-len", "64", "--steps", "2",
            "--accelerator", "cpu", "--precision", "32-true", "--max-cells", "2", "--out", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # MFUMonitor: no peak FLOP/s for a CPU
        assert neighbours.main(argv) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 2 and records[0]["neighbours"]["cell"] == "auto"
    assert {r["neighbours"]["grid"] for r in records} == {records[0]["neighbours"]["grid"]}
    assert records[0]["options"]["auto_options"] and records[0]["command"].startswith("python3 -m bench.peers")
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-3].startswith("cell") and "vs fastest" in text
