"""What is alive on the GPU at a step's peak, by the code that allocated it: the measurement behind the planner.

:class:`MemoryTrace` records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``, with
the Python stack of every allocation) from the start of a run; :meth:`MemoryTrace.mark` puts a named marker into
that history (one allocation of a size nothing else uses); :func:`summarise` replays the history from a marker on:
the largest number of bytes allocated at once (what ``torch.cuda.max_memory_allocated`` reports), the tensors alive
at that moment grouped by allocation site, and the highest count reached inside each phase of the step.

An allocation's site is the innermost frame of this package, ``transformers``, FSDP2 or ``torch.optim`` on its stack
(``<autograd>`` when the stack has no Python frame: a built-in op's backward run by the autograd engine); its phase
is the first entry of :data:`PHASES` whose function is on the stack. Recording costs host time, not GPU memory.

``python3 -m bench.memory_trace train --seq-len S ...`` traces training steps of the Llama-3-8B geometry (the
planner's calibration runs, docs/planner.md); ``python3 -m bench.memory_trace show snapshot.pickle`` prints the
summary of a snapshot saved by :meth:`MemoryTrace.dump`.
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict
from typing import Any, Optional

import torch

MARK_BYTES = 1_234_567 * 512
"""The markers' size: 632,098,304 bytes, a multiple of the allocator's 512-byte rounding that no tensor of a run has
by chance; the i-th marker adds ``i * 512``."""

PHASES = (
    ("fpdt.py", "fpdt_backward", "attention backward"),
    ("ring.py", "ring_backward", "attention backward"),
    ("head_groups.py", "head_groups_backward", "attention backward"),
    ("tiled_mlp.py", "tiled_mlp_backward", "MLP backward"),
    ("tiled_loss.py", "backward", "loss backward"),
    ("tiled_loss.py", "tiled_cross_entropy_forward", "loss forward"),
    ("head_groups.py", "head_groups_forward", "attention forward"),
    ("fpdt.py", "fpdt_forward", "attention forward"),
    ("ring.py", "ring_forward", "attention forward"),
    ("tiled_mlp.py", "tiled_mlp_forward", "MLP forward"),
    ("_fsdp_param_group.py", "post_backward", "FSDP2 reduce-scatter"),
    ("_fsdp_param_group.py", "pre_backward", "FSDP2 all-gather (backward)"),
    ("_fsdp_param_group.py", "pre_forward", "FSDP2 all-gather (forward)"),
    ("optimizer.py", "step", "optimizer"),
    ("adamw.py", "step", "optimizer"),
)
"""``(file name, function on the stack, phase)``, checked in this order."""

SITE_MARKERS = ("lightning_fpdt/", "transformers/", "torch/distributed/fsdp/", "torch/optim/", "bench/")


class MemoryTrace:
    """The allocator's history of one process, with named markers. ``start`` before the model is built."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        self.max_entries = max_entries
        self.marks: list[str] = []

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=self.max_entries)

    def mark(self, name: str) -> None:
        """A marker here: one allocation of ``MARK_BYTES + i·512`` bytes, freed at once."""
        size = MARK_BYTES + len(self.marks) * 512
        self.marks.append(name)
        torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

    def snapshot(self) -> dict[str, Any]:
        snap = torch.cuda.memory._snapshot()
        snap["fpdt_marks"] = list(self.marks)
        return snap

    def dump(self, path: str) -> None:
        with open(path, "wb") as f:
            pickle.dump(self.snapshot(), f)

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


def _site(frames: list[dict[str, Any]]) -> str:
    for frame in frames:
        name = frame["filename"]
        for marker in SITE_MARKERS:
            at = name.find(marker)
            if at >= 0:
                return f"{name[at:]}:{frame['line']} {frame['name']}"
    return "<autograd>" if not frames else f"{frames[0]['filename'].rsplit('/', 1)[-1]}:{frames[0]['name']}"


def _phase(frames: list[dict[str, Any]]) -> str:
    names = {(frame["filename"].rsplit("/", 1)[-1], frame["name"]) for frame in frames}
    for file, function, phase in PHASES:
        if (file, function) in names:
            return phase
    return "other"


def summarise(snapshot: dict[str, Any], *, since: Optional[str] = None, top: int = 25) -> dict[str, Any]:
    """Replay the history of device 0 (``since``: from the named marker on; the bytes alive before it are counted
    as ``base``, their sites unknown when they were allocated before the recording started)."""
    marks = snapshot.get("fpdt_marks", [])
    events = snapshot["device_traces"][0]
    start = 0
    if since is not None:
        size = MARK_BYTES + marks.index(since) * 512
        start = next(i for i, e in enumerate(events) if e["action"] == "alloc" and e["size"] == size)
    live: dict[int, tuple[int, str, str]] = {}
    for e in events[:start]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e["frames"]), _phase(e["frames"]))
        elif e["action"] in ("free_requested", "free_completed"):
            live.pop(e["addr"], None)
    current = sum(size for size, _, _ in live.values())
    base = current
    peak, peak_live, peak_phase = current, dict(live), "before"
    phase_peaks: dict[str, int] = defaultdict(int)
    for e in events[start + 1:]:
        action = e["action"]
        if action == "alloc":
            if e["size"] >= MARK_BYTES and e["size"] < MARK_BYTES + 512 * (len(marks) + 1):
                continue  # a marker
            phase = _phase(e["frames"])
            live[e["addr"]] = (e["size"], _site(e["frames"]), phase)
            current += e["size"]
            phase_peaks[phase] = max(phase_peaks[phase], current)
            if current > peak:
                peak, peak_live, peak_phase = current, dict(live), phase
        elif action in ("free_requested", "free_completed") and e["addr"] in live:
            # the allocator counts a tensor freed when it is freed (free_requested), also where its block waits for
            # another stream's work before it can be reused (free_completed comes later)
            current -= live.pop(e["addr"])[0]
    by_site: dict[str, int] = defaultdict(int)
    by_phase_of_allocation: dict[str, int] = defaultdict(int)
    for size, site, phase in peak_live.values():
        by_site[site] += size
        by_phase_of_allocation[phase] += size
    sites = sorted(by_site.items(), key=lambda item: -item[1])
    return dict(
        peak_bytes=peak, peak_phase=peak_phase, base_bytes=base, events=len(events) - start,
        phase_peaks=dict(sorted(phase_peaks.items(), key=lambda item: -item[1])),
        at_peak_by_phase=dict(sorted(by_phase_of_allocation.items(), key=lambda item: -item[1])),
        at_peak_by_site=sites[:top], at_peak_rest=sum(size for _, size in sites[top:]),
    )


def format_summary(summary: dict[str, Any]) -> str:
    gib = 2**30
    lines = [f"peak {summary['peak_bytes'] / gib:.2f} GiB in phase {summary['peak_phase']!r} "
             f"(alive before the marker: {summary['base_bytes'] / gib:.2f} GiB; {summary['events']} events)",
             "highest count in each phase:"]
    lines += [f"  {phase:32s} {size / gib:8.2f} GiB" for phase, size in summary["phase_peaks"].items()]
    lines.append("alive at the peak, by the phase that allocated it:")
    lines += [f"  {phase:32s} {size / gib:8.2f} GiB" for phase, size in summary["at_peak_by_phase"].items()]
    lines.append("alive at the peak, by site:")
    lines += [f"  {size / gib:8.3f} GiB  {site}" for site, size in summary["at_peak_by_site"]]
    lines.append(f"  {summary['at_peak_rest'] / gib:8.3f} GiB  (other sites)")
    return "\n".join(lines)


def train(args: argparse.Namespace) -> None:
    """``--steps`` steps of the Llama-3-8B geometry under ``FPDTStrategy`` with all memory callbacks, AdamW's moments
    primed (the first step's peak is the steady state's), the history traced from the start; rank 0 appends a JSON
    record to ``--out`` and the summary of the last step to ``--out`` with ``.txt`` for ``.jsonl``."""
    import os
    import time

    trace = MemoryTrace()
    trace.start()
    import lightning as L
    from torch.utils.data import DataLoader

    from bench.peers.ballast import ON_OFF_AUTO
    from bench.peers.hf_llama import HFLlamaLM
    from bench.peers.systems import RandomTokens, prime_adam_states
    from bench.provenance import append_record, stamp, this_command
    from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
    from lightning_fpdt.models.module import LlamaLM

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if args.model == "reference":
        module = LlamaLM("llama3-8b", lr=1e-4, num_layers=args.layers)
    else:
        module = HFLlamaLM("llama3-8b", num_layers=args.layers, max_seq_len=args.seq_len, seed=0, lr=1e-4)
    strategy = FPDTStrategy(chunks=args.chunks if args.chunks == "auto" else int(args.chunks),
                            offload=ON_OFF_AUTO[args.offload], offload_dq=ON_OFF_AUTO[args.offload_dq],
                            head_chunks=args.head_chunks, cpu_offload_params=args.cpu_offload_params)
    peaks: list[int] = []

    class _Steps(L.Callback):
        primed = False

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
            if not self.primed:
                self.primed = True
                for optimizer in trainer.optimizers:
                    prime_adam_states(optimizer)
            trace.mark(f"step{idx}")
            torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               idx: int) -> None:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())

    trainer = L.Trainer(strategy=strategy, accelerator="gpu", devices=world, precision="bf16-mixed",
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[ActivationOffload(recompute_attention=args.recompute_attention,
                                                     reload_input=args.reload_input, prefetch=args.prefetch),
                                   TiledMLP(), TiledLoss(), _Steps()])
    trainer.fit(module, DataLoader(RandomTokens(128256, args.seq_len, args.steps * world), batch_size=1))
    if rank == 0:
        resolved = strategy.resolved_options(args.seq_len)
        summary = summarise(trace.snapshot(), since=f"step{args.steps - 1}")
        record = stamp("memory_trace", card=torch.cuda.get_device_name(), gpus=world,
                       command=this_command("-m bench.memory_trace"))
        record.update(model=args.model, geometry="llama3-8b", layers=args.layers,
                      seq_len=args.seq_len, gpus=world, chunks=resolved.chunks, offload=resolved.offload,
                      offload_dq=resolved.offload_dq, head_chunks=args.head_chunks,
                      recompute_attention=args.recompute_attention, cpu_offload_params=args.cpu_offload_params,
                      reload_input=args.reload_input, prefetch=args.prefetch, peak_gpu_bytes_per_step=peaks,
                      peak_phase=summary["peak_phase"])
        append_record(args.out, record)
        with open(args.out.removesuffix(".jsonl") + ".txt", "a") as f:
            f.write(f"== {args.model} S={args.seq_len} gpus={world}\n{format_summary(summary)}\n")
        print(format_summary(summary))
    trace.stop()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="summarise a snapshot written by MemoryTrace.dump")
    show.add_argument("snapshot")
    show.add_argument("--since", default=None, help="replay from this marker on")
    show.add_argument("--top", type=int, default=25)
    run = commands.add_parser("train", help="trace training steps (torchrun for several GPUs)")
    run.add_argument("--model", choices=["reference", "hf"], default="reference")
    run.add_argument("--layers", type=int, default=2)
    run.add_argument("--seq-len", type=int, required=True)
    run.add_argument("--chunks", default="auto")
    run.add_argument("--head-chunks", type=int, default=1)
    run.add_argument("--offload", choices=["on", "off", "auto"], default="auto")
    run.add_argument("--offload-dq", choices=["on", "off", "auto"], default="auto")
    run.add_argument("--recompute-attention", action="store_true")
    run.add_argument("--reload-input", action="store_true", help="ActivationOffload(reload_input=True)")
    run.add_argument("--prefetch", type=int, default=1, help="ActivationOffload(prefetch=...)")
    run.add_argument("--cpu-offload-params", action="store_true")
    run.add_argument("--steps", type=int, default=2)
    run.add_argument("--out", default="memory_trace.jsonl")
    args = parser.parse_args(argv)
    if args.command == "train":
        train(args)
        return
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    print(format_summary(summarise(snapshot, since=args.since, top=args.top)))


if __name__ == "__main__":
    main()
