"""``"auto"`` against its neighbours: for one geometry and length, a training step in the configuration the planner
chose and in each configuration one option away from it that fits, side by side in one process (bench.peers' runs,
each with its own record), then a short table: the measured steps against the planner's estimates.

One GPU, 65,536 tokens of the Llama-3.2-3B geometry as a Hugging Face model, 4 of its 28 layers with the full-depth
ballast, within 9 minutes:

    python3 -m bench.neighbours --system fpdt-hf --model llama3-3b --seq-len 65536 --layers 4 \\
        --gpu-memory-gib 79 --deadline-s 540 --out neighbours.jsonl

Several GPUs: the same under ``torchrun --standalone --nproc_per_node N``.

First this GPU is calibrated for the full depth's shapes (``lightning_fpdt.planner.calibration``; nothing to do where
its cache has them), so that the planner's choice and every estimate use the GPU's measured rates; its rates are
printed with the seconds it took. Then the full depth
is planned on this machine with every memory option ``"auto"`` (the strategy's choice; bench.peers ``--auto-options``),
and its neighbours (:func:`neighbours`): the chunks doubled and halved, the attention's offload on or off, its
recompute on or off, fewer or all blocks checkpointed (``checkpoint_blocks``), fewer or all block inputs kept
(``keep_inputs``). A neighbour whose full depth fits nothing here is left out, with the planner's reason. Each cell
runs as ``python3 -m bench.peers`` with the options given (``--ballast full``, every cell alike: the full depth's
memory held for the layers not run), so each record's command reproduces it alone; each record also carries
``neighbours`` (the cell's name, the grid it belongs to, this command) and the planner's estimate of its own step
(``estimated_step_s``). A cell that would end after ``--deadline-s`` is skipped (its time guessed from the cells run
before it, or from its estimate).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from bench.peers.cli import parse_args, validate
from bench.peers.full_depth import FullDepthRefused, plan_fpdt
from bench.peers.hf_llama import GEOMETRY_NAMES, named_geometry
from bench.peers.records import print_record
from bench.peers.runner import dist_environment, prepare_device, run
from bench.provenance import append_record, this_command
from lightning_fpdt.planner.calibration import Calibration, current_key, needed_shapes
from lightning_fpdt.planner.features.chunks import MIN_CHUNK_TOKENS
from lightning_fpdt.planner.features.residency import kept_input_choices
from lightning_fpdt.planner.measure import all_to_all_bytes, clock_for
from lightning_fpdt.planner.plan import timed_sizes
from lightning_fpdt.planner.plan_options import PlanOptions
from lightning_fpdt.planner.request import PlanRequest
from lightning_fpdt.planner.search import estimated_step_seconds
from lightning_fpdt.sequence.planning import MAX_CHUNK_TOKENS

PROG = "python3 -m bench.neighbours"
SETUP_SECONDS = 90.0
"""What a cell takes besides its steps, before one has run (building the model, the first compiles)."""


def neighbours(o: PlanOptions, *, num_layers: int, seq_len: int) -> list[tuple[str, PlanOptions]]:
    """The configurations one option away from ``o`` (the planner's choice): each ``(name, options)``, those the options
    refuse left out. The chunks doubled (down to 8,192 global tokens a chunk) and halved (to the fewest, 65,536 a
    chunk); offload flipped (the partial dQ sums stay on the GPU); the attention's recompute flipped; the blocks
    checkpointed: all where fewer are, else ``L/8`` fewer; the block inputs kept: all where fewer are, else about
    ``L/2``. The options that go with a change change with it: recompute and partial residency checkpoint every
    block."""
    changes: list[tuple[str, dict[str, Any]]] = []
    if o.ring_size == 1 and seq_len // (2 * o.chunks) >= max(MIN_CHUNK_TOKENS, o.sequence_parallel_size):
        changes.append((f"chunks {2 * o.chunks}", dict(chunks=2 * o.chunks)))
    if o.chunks % 2 == 0 and o.chunks // 2 >= math.ceil(seq_len / MAX_CHUNK_TOKENS):
        changes.append((f"chunks {o.chunks // 2}", dict(chunks=o.chunks // 2)))
    changes.append((f"offload {'off' if o.offload else 'on'}", dict(offload=not o.offload, offload_dq=False)))
    if o.activation_checkpointing:
        recompute = not o.recompute_attention
        changes.append((f"attention {'recomputed' if recompute else 'kept'}",
                        dict(recompute_attention=recompute, checkpoint_blocks="all") if recompute else
                        dict(recompute_attention=False)))
        step = max(1, num_layers // 8)
        if o.checkpoint_blocks != "all":
            changes.append(("checkpoint_blocks all", dict(checkpoint_blocks="all")))
        elif num_layers - step >= 1 and not o.recompute_attention and o.keep_inputs == "all":
            changes.append((f"checkpoint_blocks {num_layers - step}", dict(checkpoint_blocks=num_layers - step)))
        kept = kept_input_choices(num_layers)
        if o.keep_inputs != "all":
            changes.append(("keep_inputs all", dict(keep_inputs="all")))
        elif kept:
            changes.append((f"keep_inputs {kept[0]}", dict(keep_inputs=kept[0], checkpoint_blocks="all")))
    found = []
    for name, change in changes:
        try:
            found.append((name, dataclasses.replace(o, **change)))
        except ValueError:
            continue  # a combination the options refuse
    return found


def option_flags(o: PlanOptions) -> list[str]:
    """bench.peers' flags that give every memory option of ``o`` explicitly."""
    def on(value: bool) -> str:
        return "on" if value else "off"

    return (["--chunks", str(o.chunks), "--offload", on(o.offload), "--offload-dq", on(o.offload_dq),
             "--head-chunks", str(o.head_chunks), "--prefetch", str(o.prefetch), "--keep-inputs", str(o.keep_inputs),
             "--checkpoint-blocks", str(o.checkpoint_blocks)]
            + (["--recompute-attention"] if o.recompute_attention else [])
            + (["--reload-input"] if o.reload_input else []))


@dataclasses.dataclass
class Cell:
    """One configuration of the grid: its name, its bench.peers command line, the full depth's plan."""

    name: str
    argv: list[str]
    estimate_s: float
    """The planner's step of the layers run (what the cell's steps take)."""
    full_estimate_s: float


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="A training step in the planner's choice and in each "
                                     "configuration one option away from it, side by side; a record each.")
    parser.add_argument("--system", choices=("fpdt", "fpdt-hf"), default="fpdt-hf")
    parser.add_argument("--model", choices=GEOMETRY_NAMES, default="llama3-3b")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--layers", type=int, default=None, help="layers run (default: the full depth)")
    parser.add_argument("--steps", type=int, default=3, help="steps of each cell (the first is a warm-up)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None, help="cap each process's GPU memory")
    parser.add_argument("--offload-dir", default=None, help="FPDTStrategy(offload_dir=...) of every cell")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="wall time of the whole grid")
    parser.add_argument("--max-cells", type=int, default=None, help="run at most this many cells (auto first)")
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda", help="cpu: the tests only")
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--out", default="neighbours.jsonl", help="JSONL file the records are appended to")
    return parser


def _peers_argv(args: argparse.Namespace) -> list[str]:
    """The bench.peers options every cell shares."""
    argv = ["--system", args.system, "--model", args.model, "--seq-len", str(args.seq_len), "--steps",
            str(args.steps), "--ballast", "full", "--accelerator", args.accelerator, "--precision", args.precision,
            "--out", args.out]
    argv += ["--layers", str(args.layers)] if args.layers is not None else []
    argv += ["--gpu-memory-gib", str(args.gpu_memory_gib)] if args.gpu_memory_gib is not None else []
    return argv + (["--offload-dir", args.offload_dir] if args.offload_dir else [])


def calibrate(args: argparse.Namespace, *, world_size: int, gpus_per_node: int, rank: int,
              device: torch.device) -> Optional[str]:
    """Measure what this GPU's calibration lacks for the full depth's shapes (rank 0; every rank the all-to-all);
    its table and the seconds it took (rank 0's), ``None`` without a GPU."""
    if device.type != "cuda":
        return None
    started = time.monotonic()
    calibration = None
    group = dist.group.WORLD if dist.is_initialized() and world_size > 1 else None
    if rank == 0:
        calibration = Calibration.load(current_key(device))
        request = PlanRequest.of(geometry=named_geometry(args.model), seq_len=args.seq_len, num_gpus=world_size,
                                 gpus_per_node=gpus_per_node, chunks="auto", head_chunks="auto",
                                 activation_offload=True, tiled_mlp=True, tiled_loss=True)
        calibration.measure(device, shapes=needed_shapes(timed_sizes(request)), group=group)
        calibration.save()
    elif group is not None:
        all_to_all_bytes(group, device, clock=clock_for(device))
    if group is not None:
        dist.barrier()
    seconds = time.monotonic() - started
    return None if calibration is None else f"{calibration.table()}\n\nbench.neighbours: calibration {seconds:.1f} s"


def plan_cells(args: argparse.Namespace, *, world_size: int, gpus_per_node: int,
               device: torch.device) -> tuple[list[Cell], list[str]]:
    """The grid's cells, ``"auto"`` first then by the planner's full-depth estimate, and what was left out and why."""
    base = _peers_argv(args)
    usable = None
    if device.type == "cuda":
        from lightning_fpdt.planner.machine import usable_total_bytes

        usable = usable_total_bytes(device)
    geometry = named_geometry(args.model)

    def planned(name: str, argv: list[str]) -> tuple[Cell, PlanOptions]:
        full, layers = plan_fpdt(parse_args(argv), geometry, num_gpus=world_size, gpus_per_node=gpus_per_node,
                                 gpu_memory_bytes=usable, available_host=None, disk_free=None)
        return Cell(name, argv, estimated_step_seconds(layers), estimated_step_seconds(full)), full.options

    auto, chosen = planned("auto", base + ["--auto-options"])
    cells, left_out = [], []
    for name, options in neighbours(chosen, num_layers=geometry.num_layers, seq_len=args.seq_len):
        try:
            cells.append(planned(name, base + option_flags(options))[0])
        except FullDepthRefused as refused:
            left_out.append(f"{name}: does not fit ({str(refused)[:160]})")
    return [auto] + sorted(cells, key=lambda cell: cell.full_estimate_s), left_out


def table(rows: list[tuple[Cell, Optional[dict[str, Any]]]]) -> str:
    """The grid as a short table: each cell's measured step, MFU, estimate, the full depth's step (measured, scaled
    by the planner's ratio of the depths) and its ratio to the fastest."""
    def full_step(record: Optional[dict[str, Any]]) -> Optional[float]:
        if not record or record.get("status") != "ok" or not record.get("step_time_s"):
            return None
        return (record.get("full_depth") or {}).get("step_time_s") or record["step_time_s"]

    measured = [s for s in (full_step(r) for _, r in rows) if s]
    fastest = min(measured) if measured else None
    lines = [f"{'cell':<26} {'step s':>8} {'MFU':>6} {'estimate s':>10} {'est/meas':>8} {'full depth s':>12} "
             f"{'vs fastest':>10}"]
    for cell, record in rows:
        step = record.get("step_time_s") if record else None
        full = full_step(record)
        mfu = record.get("mfu") if record else None
        estimate = (record or {}).get("estimated_step_s") or cell.estimate_s
        status = "" if record is None else ("" if record.get("status") == "ok" else record.get("status"))
        lines.append(f"{cell.name:<26} {f'{step:.3f}' if step else (status or 'skipped'):>8} "
                     f"{f'{100 * mfu:.1f}%' if mfu else '-':>6} {estimate:>10.3f} "
                     f"{f'{estimate / step:.2f}' if step else '-':>8} {f'{full:.2f}' if full else '-':>12} "
                     f"{f'{full / fastest:.3f}x' if full and fastest else '-':>10}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    rank, world_size, local_rank, gpus_per_node = dist_environment()
    device = prepare_device(args, local_rank)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    calibration = calibrate(args, world_size=world_size, gpus_per_node=gpus_per_node, rank=rank, device=device)
    if calibration is not None:
        print(calibration, flush=True)
    cells, left_out = plan_cells(args, world_size=world_size, gpus_per_node=gpus_per_node, device=device)
    if args.max_cells is not None:
        cells = cells[:args.max_cells]
    grid = {"grid": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": this_command("-m bench.neighbours", sys.argv[1:] if argv is None else argv)}
    rows: list[tuple[Cell, Optional[dict[str, Any]]]] = []
    longest = SETUP_SECONDS
    for cell in cells:
        guess = max(longest, args.steps * cell.estimate_s + SETUP_SECONDS / 3)
        if time.monotonic() - started + guess > args.deadline_s:
            rows.append((cell, None))  # it would end after the deadline
            continue
        cell_started = time.monotonic()
        peers = parse_args(cell.argv)
        validate(peers, world_size)
        record = run(peers)
        record["neighbours"] = {**grid, "cell": cell.name}
        if rank == min(record["ranks_answered"]):
            append_record(peers.out, record)
            print_record(record)
        rows.append((cell, record))
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        longest = time.monotonic() - cell_started
    if rank == 0:
        print("\n".join(["", f"bench.neighbours: {args.model}, S = {args.seq_len:,}, {world_size} GPU(s), "
                             f"{time.monotonic() - started:.0f} s", *left_out, table(rows)]), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
