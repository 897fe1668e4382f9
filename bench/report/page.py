"""docs/benchmarks.md: every table of the records, the plots, and the numbered commands, in one page."""

from __future__ import annotations

import argparse
import glob
import os
from typing import Any, Optional

from bench.provenance import REPO_ROOT
from bench.report import components, cost_model, lengths, neighbours, regions, training
from bench.report.markdown import HOST_NOTE, Commands, commits
from bench.report.plots import Plot, write_plots
from bench.report.records import load_records, of_kind

REGENERATE = "python3 -m bench.report bench/results/*.jsonl --doc docs/benchmarks.md --plots docs/plots"
SYSTEM_NAMES = {
    "fpdt": "FPDTStrategy with ActivationOffload, TiledMLP, TiledLoss and attention offload (this project)",
    "modelparallel": "Lightning's ModelParallelStrategy: FSDP2, SDPA, activation checkpointing per block",
    "ring": "torch's context parallelism: ring attention over SDPA, FSDP2, activation checkpointing per block",
    "fpdt-hf": "fpdt on the Hugging Face transformers Llama of the same geometry",
    "alst": "DeepSpeed's Arctic Long Sequence Training recipe on the Hugging Face Llama: Ulysses over SDPA, TiledMLP, "
            "tiled logits and loss, checkpoint inputs offloaded to the host, ZeRO-3",
}

NOT_RUN = ("Not among them: torchtitan. Its release 0.3.0 does not import on torch 2.11, the torch these runs use: "
           "`torchtitan.train` imports `torch.distributed.fsdp.DataParallelMeshDims`, which FSDP2 gained in torch "
           "2.12, and its context-parallel path calls `fully_shard(dp_mesh_dims=...)` and "
           "`torch.distributed.set_timeout` (torch 2.14). `python3 -m bench.peers.torch_api_audit` lists what a "
           "peer's sources need that the installed torch lacks; [bench/README.md](../bench/README.md) gives the "
           "details.")
"""A peer the page would hold and why it does not."""


def _header(records: list[dict[str, Any]]) -> list[str]:
    return [
        "# Benchmarks", "",
        f"Generated from the {len(records)} JSON records in `bench/results/` by `bench/report/`; do not edit by hand. "
        "To regenerate it and the plots in `docs/plots/`, run from the repository root:", "",
        "```", REGENERATE, "```", "",
        "## How to read this page", "",
        "- Every row names the card, the GPU count, the geometry and the sequence length S (global tokens of one "
        "sequence). `cmd` [n] is the command that produced it, listed under [Commands](#commands) with the "
        "environment it ran in; `commit` is the code that ran (for records stored before records carried a commit, "
        "the commit that added the record to the repository). Rerun a figure by checking out its commit and running "
        "its command; bench/README.md says what each script measures.",
        "- Figures of different cards are not compared within a row, and a card \"capped to 79 GiB\" is a larger card "
        "whose processes were limited to an 80 GB card's memory (`--gpu-memory-gib 79`): its memory figures hold for "
        "the smaller card, its speed is the larger card's.",
        "- Step time: the median of the steps after the first (a warm-up); \"(warm-up)\" marks a run of one step. "
        "FLOPs in the causal convention (6·N + 6·L·S·d_attn per token, `lightning_fpdt.flops`) of the layers run; "
        "MFU against the card's dense bf16 peak. Peak GPU memory: `torch.cuda.max_memory_allocated` within a step, "
        "the largest over steps and ranks, ballast included.",
        "- Host memory beside it: " + HOST_NOTE,
        "- Ballast protocol: \"2 of 32 layers + ballast\" ran 2 layers and held on each GPU a tensor the size of what "
        "the 30 layers not run would hold there (their sharded fp32 states and AdamW moments, and what each keeps "
        "between forward and backward), so the peak is the full depth's. Runs of one length at two depths check it. "
        "It stands for the GPU only: such a length is not shown to fit the host's memory at full depth.",
        "- Full-depth ballast: \"2 of 28 layers + full-depth ballast\" planned the full depth on the machine it ran "
        "on (`--ballast full`, bench/peers/full_depth.py), trained 2 layers with the options of that plan, and held "
        "for the layers not run what the plan keeps for them on the GPU, page-locked and pageable in host memory, and "
        "on disk. Blocks whose inputs the plan drops are regenerated in a full-depth backward; that work, and every "
        "layer's, is counted in its full-depth step estimate (the measured step times the planner's ratio of the "
        "two depths' step times).",
        "",
    ]


def _peers(records: list[dict[str, Any]], commands: Commands, plots: Optional[list[Plot]], doc_dir: str,
           plot_note: str) -> list[str]:
    lines = ["## Against the peers", "",
             "`python3 -m bench.peers` trains the reference Llama (same initialisation, same data, bf16 compute with "
             "fp32 master weights through FSDP2's MixedPrecisionPolicy, AdamW) with each system:", ""]
    lines += [f"- **{system}**: {name}." for system, name in SYSTEM_NAMES.items()]
    lines += ["", "The example configurations run through `lightning_fpdt.cli` are fpdt runs too.", "", NOT_RUN, ""]
    lines += [*lengths.section(records, commands), ""]
    for section in (training.DEPTH, training.THROUGHPUT, training.CHANGES, training.PROFILES, training.HOST,
                    training.PLAN, training.FULL_DEPTH, training.PLACEMENT, cost_model.COST_MODEL,
                    neighbours.NEIGHBOURS):
        lines += [*section.render(records, commands), ""]
    lines += _plots(plots, commands, doc_dir, plot_note)
    return lines + training.RUNS.render(records, commands)


def _plots(plots: Optional[list[Plot]], commands: Commands, doc_dir: str, note: str) -> list[str]:
    lines = ["### Plots", ""]
    if not plots:
        return lines + [note or "No plots.", ""]
    for plot in plots:
        refs = " ".join(dict.fromkeys(commands.ref(record) for record in plot.records))
        lines += [f"![{plot.title}]({os.path.relpath(plot.path, doc_dir)})", "",
                  f"{plot.title}. Points: {refs}; commits {commits(plot.records)}.", ""]
    return lines


def render_markdown(records: list[dict[str, Any]], *, plots: Optional[list[Plot]] = None, doc_dir: str = ".",
                    plot_note: str = "") -> str:
    """The whole page."""
    commands = Commands()
    lines = _header(records)
    for section in components.SECTIONS:
        lines += [*section.render(records, commands), ""]
    if of_kind(records, "run") or of_kind(records, "max_length"):
        lines += [*_peers(records, commands, plots, doc_dir, plot_note), ""]
    lines += ["## Commands", "", "Run from the repository root at the commit given.", "", *commands.markdown()]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.report",
                                     description="docs/benchmarks.md and its plots from the JSON records of bench/.")
    parser.add_argument("records", nargs="*",
                        help="JSONL files of records (default: every bench/results/*.jsonl of this checkout)")
    parser.add_argument("--doc", default="docs/benchmarks.md", help="the page to write")
    parser.add_argument("--plots", default="docs/plots", help="folder of the PNG plots")
    parser.add_argument("--no-regions", action="store_true",
                        help="leave the results regions of README.md, docs/planner.md and docs/head_chunks.md as they "
                             "are (bench/report/regions.py; they are rewritten only when --doc is this checkout's "
                             "docs/benchmarks.md)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    paths = args.records or sorted(glob.glob(str(REPO_ROOT / "bench" / "results" / "*.jsonl")))
    if not paths:
        raise ValueError("no records: name JSONL files written by the bench scripts, or run from a checkout whose "
                         "bench/results/ holds some")
    records = load_records(paths)
    plots = write_plots(records, args.plots)
    note = "" if plots is not None else "Plots not drawn: matplotlib was not installed where bench.report ran."
    doc_dir = os.path.dirname(os.path.abspath(args.doc))
    os.makedirs(doc_dir, exist_ok=True)
    with open(args.doc, "w") as f:
        f.write(render_markdown(records, plots=plots and [_absolute(p) for p in plots], doc_dir=doc_dir,
                                plot_note=note))
    print(f"bench.report: {len(records)} records -> {args.doc}" + (f", {len(plots)} plots in {args.plots}" if plots
                                                                    else ""))
    # the figures of the other pages, from the same records: only beside the repository's own results page (a page
    # written elsewhere, from other records, leaves the repository's pages alone)
    if not args.no_regions and os.path.abspath(args.doc) == str(REPO_ROOT / "docs" / "benchmarks.md"):
        changed = regions.fill_pages(REPO_ROOT, records)
        print("bench.report: results regions rewritten in " + (", ".join(changed) if changed else "no page"))
    return 0


def _absolute(plot: Plot) -> Plot:
    return Plot(path=os.path.abspath(plot.path), title=plot.title, records=plot.records)
