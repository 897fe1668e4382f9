"""What is alive on the GPU at a step's peak, by the code that allocated it: the measurement behind the planner.

:class:`MemoryTrace` records the CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``, with
the Python stack of every allocation) from the start of a run; :meth:`MemoryTrace.mark` puts a named marker into
that history (one allocation of a size nothing else uses); :func:`summarise` replays the history from a marker on:
the largest number of bytes allocated at once (what ``torch.cuda.max_memory_allocated`` reports), the tensors alive
at that moment grouped by allocation site, and the highest count reached inside each phase of the step.

An allocation's site is the innermost frame of this package, ``transformers``, FSDP2 or ``torch.optim`` on its stack
(``<autograd>`` when the stack has no Python frame: a built-in op's backward run by the autograd engine); its phase
is the first entry of :data:`PHASES` whose function is on the stack. Recording costs host time, not GPU memory.

``python3 -m bench.memory_trace train --seq-len S ...`` traces training steps of a named geometry (Llama-3-8B by
default; the planner's calibration runs, docs/planner.md) and reads, beside the GPU's, the host memory of each step:
the process's peak resident memory in its forward, backward and optimizer phases, the pinned bytes it holds and the
plan the run was accepted on (bench/host_readings.py). ``python3 -m bench.memory_trace show snapshot.pickle`` prints
the summary of a snapshot saved by :meth:`MemoryTrace.dump`.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections import defaultdict
from typing import Any, Iterator, Optional

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


def _replay(events: list[dict[str, Any]], start: int, num_marks: int) -> Iterator[tuple[int, Optional[str], int, dict]]:
    """The history after event ``start`` (the marker), one event at a time: ``(index, the phase of an allocation or
    None, bytes alive, the live allocations {addr: (size, site, phase)})``; the first yield (index ``start``, phase
    None) is what was alive at the marker. The live mapping is the replay's own: copy what is kept."""
    live: dict[int, tuple[int, str, str]] = {}
    for e in events[:start]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _site(e["frames"]), _phase(e["frames"]))
        elif e["action"] in ("free_requested", "free_completed"):
            live.pop(e["addr"], None)
    current = sum(size for size, _, _ in live.values())
    yield start, None, current, live
    for index in range(start + 1, len(events)):
        e = events[index]
        action = e["action"]
        if action == "alloc":
            if e["size"] >= MARK_BYTES and e["size"] < MARK_BYTES + 512 * (num_marks + 1):
                continue  # a marker
            phase = _phase(e["frames"])
            live[e["addr"]] = (e["size"], _site(e["frames"]), phase)
            current += e["size"]
            yield index, phase, current, live
        elif action in ("free_requested", "free_completed") and e["addr"] in live:
            # the allocator counts a tensor freed when it is freed (free_requested), also where its block waits for
            # another stream's work before it can be reused (free_completed comes later)
            current -= live.pop(e["addr"])[0]


def _by_site(live: dict[int, tuple[int, str, str]]) -> list[tuple[str, int]]:
    by_site: dict[str, int] = defaultdict(int)
    for size, site, _ in live.values():
        by_site[site] += size
    return sorted(by_site.items(), key=lambda item: -item[1])


def summarise(snapshot: dict[str, Any], *, since: Optional[str] = None, top: int = 25,
              phase_top: int = 8) -> dict[str, Any]:
    """Replay the history of device 0 (``since``: from the named marker on; the bytes alive before it are counted
    as ``base``, their sites unknown when they were allocated before the recording started): the peak and what is
    alive there, and for each phase its highest count and what is alive at that moment (``phase_top`` sites)."""
    marks = snapshot.get("fpdt_marks", [])
    events = snapshot["device_traces"][0]
    start = 0
    if since is not None:
        size = MARK_BYTES + marks.index(since) * 512
        start = next(i for i, e in enumerate(events) if e["action"] == "alloc" and e["size"] == size)
    replay = _replay(events, start, len(marks))
    _, _, base, live = next(replay)
    peak, peak_live, peak_phase = base, dict(live), "before"
    phase_peaks: dict[str, int] = defaultdict(int)
    reached: dict[str, int] = {}  # the event where each phase reached its highest count, the first time
    for index, phase, current, live in replay:
        if phase is None:
            continue
        if current > phase_peaks[phase]:
            phase_peaks[phase] = current
            reached[phase] = index
        if current > peak:
            peak, peak_live, peak_phase = current, dict(live), phase
    phase_peak_at = {index: phase for phase, index in reached.items()}
    phase_sites: dict[str, list[tuple[str, int]]] = {}
    for index, phase, _, live in _replay(events, start, len(marks)):
        if index in phase_peak_at:
            phase_sites[phase_peak_at[index]] = _by_site(live)[:phase_top]
            if len(phase_sites) == len(phase_peak_at):
                break
    by_phase_of_allocation: dict[str, int] = defaultdict(int)
    for size, _, phase in peak_live.values():
        by_phase_of_allocation[phase] += size
    sites = _by_site(peak_live)
    ordered = dict(sorted(phase_peaks.items(), key=lambda item: -item[1]))
    return dict(
        peak_bytes=peak, peak_phase=peak_phase, base_bytes=base, events=len(events) - start,
        phase_peaks=ordered, phase_peak_sites={phase: phase_sites[phase] for phase in ordered},
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
    for phase, sites in summary["phase_peak_sites"].items():
        lines.append(f"alive at the highest count of {phase!r}, by site:")
        lines += [f"  {size / gib:8.3f} GiB  {site}" for site, size in sites]
    return "\n".join(lines)


OPTION_DEFAULTS = {"chunks": "auto", "offload": "auto", "offload_dq": "auto", "head_chunks": 1,
                   "recompute_attention": "off", "reload_input": "off", "prefetch": 1, "sync_every_batch": "auto"}
"""The memory options ``train`` takes and their defaults; ``--auto-options`` sets every one not given to ``"auto"``."""


def _int_or_auto(value: str) -> Any:
    return value if value == "auto" else int(value)


def resolve_option_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the options left out: ``"auto"`` under ``--auto-options``, else :data:`OPTION_DEFAULTS`."""
    for name, default in OPTION_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, "auto" if args.auto_options else default)
    from bench.peers.hf_llama import HF_GEOMETRIES, named_depth

    if args.geometry in HF_GEOMETRIES and args.model != "hf":
        raise SystemExit(f"--geometry {args.geometry} is a Hugging Face geometry: run it with --model hf")
    if args.layers is None:
        args.layers = named_depth(args.geometry)
    return args


def strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """``FPDTStrategy``'s memory options of ``args``; ``"auto"`` is passed on as the string."""
    from bench.peers.ballast import ON_OFF_AUTO

    return dict(chunks=args.chunks, offload=ON_OFF_AUTO[args.offload], offload_dq=ON_OFF_AUTO[args.offload_dq],
                head_chunks=args.head_chunks, cpu_offload_params=args.cpu_offload_params,
                sync_every_batch=ON_OFF_AUTO[args.sync_every_batch])


def offload_options(args: argparse.Namespace) -> dict[str, Any]:
    """``ActivationOffload``'s options of ``args``; ``"auto"`` is passed on as the string."""
    from bench.peers.ballast import ON_OFF_AUTO

    return dict(recompute_attention=ON_OFF_AUTO[args.recompute_attention],
                reload_input=ON_OFF_AUTO[args.reload_input], prefetch=args.prefetch)


def _known(*values: Any) -> Any:
    """The first of ``values`` that is neither ``None`` nor ``"auto"`` (what a run resolved), else ``None``."""
    return next((v for v in values if v is not None and v != "auto"), None)


def resolved_options(args: argparse.Namespace, strategy: Any, offload: Any, plan: Any) -> dict[str, Any]:
    """The options the run trained with: the strategy's resolution of chunks and offload for the length, the rest
    from the plan the run was accepted on (its ``options``), the callback or the strategy where they say, else
    what was asked; ``None`` where an ``"auto"`` was resolved where nothing here can read it."""
    resolved = strategy.resolved_options(args.seq_len)
    planned = getattr(plan, "options", None)
    options = getattr(strategy, "options", None)
    return dict(
        chunks=resolved.chunks, offload=resolved.offload, offload_dq=resolved.offload_dq,
        head_chunks=_known(getattr(resolved, "head_chunks", None), getattr(planned, "head_chunks", None),
                           getattr(options, "head_chunks", None), args.head_chunks),
        recompute_attention=_known(getattr(planned, "recompute_attention", None),
                                   getattr(offload, "recompute_attention", None),
                                   offload_options(args)["recompute_attention"]),
        reload_input=_known(getattr(planned, "reload_input", None), getattr(offload, "reload_input", None),
                            offload_options(args)["reload_input"]),
        prefetch=_known(getattr(offload, "prefetch", None), args.prefetch),
    )


def format_host(record: dict[str, Any]) -> str:
    """The host lines of the text summary: the last traced step's peak resident memory in each phase and in the
    step, the pinned bytes at its end, and the plan the run was accepted on."""
    from bench.host_readings import PHASES

    gib = 2**30

    def shown(value: Optional[int]) -> str:
        return "       -" if value is None else f"{value / gib:8.2f} GiB"

    how = {"peak": "the kernel's high-water mark", "sampled": "read at the phase boundaries only, a lower bound"}
    phases = record["host_phase_peak_rss_bytes_per_step"][-1] if record["host_phase_peak_rss_bytes_per_step"] else {}
    lines = [f"host memory of the last step (rank 0's process; peak RSS: {how.get(record['host_rss_reading'], '-')}):"]
    lines += [f"  {phase:32s} {shown(phases.get(phase))}" for phase in PHASES]
    step = record["peak_host_rss_bytes_per_step"]
    lines.append(f"  {'step':32s} {shown(step[-1] if step else None)}")
    lines.append(f"  {'pinned at the step end':32s} {shown(record['pinned_host_bytes'])} (strategy "
                 f"{shown(record['pinned_host_bytes_strategy']).strip()}, caching host allocator "
                 f"{shown(record['pinned_host_bytes_caching_allocator']).strip()})")
    if record.get("planned_peak_gpu_bytes") is None:
        lines.append("  plan: none (the strategy carries no memory_plan)")
    else:
        lines.append(f"  {'planned resident (per GPU)':32s} {shown(record['planned_resident_host_bytes'])}")
        lines.append(f"  {'planned pinned (per GPU)':32s} {shown(record['planned_pinned_host_bytes'])}")
        lines.append(f"  {'planned peak GPU':32s} {shown(record['planned_peak_gpu_bytes'])}")
        lines.append(f"  plan options: {record['plan_options']}")
    return "\n".join(lines)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """``--steps`` steps of ``--geometry`` (the reference Llama or, ``--model hf``, transformers') under
    ``FPDTStrategy`` with all memory callbacks, AdamW's moments primed (the first step's peak is the steady state's),
    the CUDA allocator's history traced from the start. Beside the GPU peaks each step records rank 0's peak resident
    host memory in its forward, backward and optimizer phases (bench/host_readings.py), the pinned bytes at its end
    and the plan the run was accepted on. Rank 0 appends a JSON record to ``--out`` and the summary of the last step
    to ``--out`` with ``.txt`` for ``.jsonl``, and returns the record (the other ranks: an empty dict).
    ``--accelerator cpu`` (the tests) trains on gloo processes without the trace: host figures only."""
    import os
    import time

    from bench.host_readings import PHASES, ResidentPeaks, largest, pinned_bytes, plan_fields
    from bench.peers.runner import dist_environment, prepare_device

    resolve_option_defaults(args)
    cuda = args.accelerator == "cuda"
    if args.gpu_memory_gib is not None and (not cuda or args.gpu_memory_gib <= 0):
        raise ValueError(f"--gpu-memory-gib ({args.gpu_memory_gib}) caps a GPU's memory: give a positive number of GiB "
                         "on --accelerator cuda, or drop it")
    rank, world, local_rank, gpus_per_node = dist_environment()
    device = prepare_device(args, local_rank)
    trace = MemoryTrace() if cuda else None
    if trace is not None:
        trace.start()
    import lightning as L
    from torch.utils.data import DataLoader

    from bench.peers.common import RandomTokens, prime_adam_states
    from bench.peers.hf_llama import HFLlamaLM, named_vocab
    from bench.provenance import append_record, card_name, launch_command, stamp
    from lightning_fpdt import ActivationOffload, FPDTStrategy, TiledLoss, TiledMLP
    from lightning_fpdt.models.module import LlamaLM

    if args.model == "reference":
        module = LlamaLM(args.geometry, lr=1e-4, num_layers=args.layers)
    else:
        module = HFLlamaLM(args.geometry, num_layers=args.layers, max_seq_len=args.seq_len, seed=0, lr=1e-4)
    strategy = FPDTStrategy(**strategy_options(args), plan_trial=False)  # one configuration traced, no trial
    offload = ActivationOffload(**offload_options(args))
    steps: dict[str, list[Any]] = {"gpu": [], "host": [], "phases": [], "pinned": [], "seconds": []}
    last: dict[str, Any] = {}
    host = ResidentPeaks()

    class _Steps(L.Callback):
        primed = False

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
            if not self.primed:
                self.primed = True
                for optimizer in trainer.optimizers:
                    prime_adam_states(optimizer)
            if trace is not None:
                trace.mark(f"step{idx}")
                torch.cuda.reset_peak_memory_stats()
            self.phases: dict[str, Optional[int]] = {}
            host.start()  # last of the step's setup, so the marker and the priming are not in the forward
            self.start = time.perf_counter()

        def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Any) -> None:
            self.phases["forward"] = host.split()

        def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.phases["backward"] = host.split()

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               idx: int) -> None:
            self.phases["optimizer"] = host.stop()
            if trace is not None:
                torch.cuda.synchronize()
                steps["gpu"].append(torch.cuda.max_memory_allocated())
            else:
                steps["gpu"].append(None)
            steps["phases"].append({phase: self.phases.get(phase) for phase in PHASES})
            steps["seconds"].append(time.perf_counter() - self.start)  # under the allocator trace: a bit slower
            steps["host"].append(largest(self.phases.values()))
            last.update(pinned_bytes(trainer.strategy, fpdt=True))
            steps["pinned"].append(last["pinned_host_bytes"])
            last["plan"] = getattr(trainer.strategy, "memory_plan", None)
            last["sync_every_batch"] = trainer.strategy.syncs_every_batch()  # as the window's batches ran
            last.update(plan_fields(trainer.strategy))

    vocab = named_vocab(args.geometry)
    batches = args.steps * args.accumulate_grad_batches  # every batch is traced; a step is a window's optimizer step
    trainer = L.Trainer(strategy=strategy, accelerator="gpu" if cuda else "cpu", devices=gpus_per_node,
                        num_nodes=world // gpus_per_node, precision=args.precision, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate_grad_batches,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[offload, TiledMLP(), TiledLoss(), _Steps()])
    # before fit: Lightning's teardown takes torchrun's variables out of the environment
    command = launch_command("-m bench.memory_trace", args.argv, gpus_per_node=gpus_per_node, world_size=world,
                             under_torchrun="LOCAL_WORLD_SIZE" in os.environ)
    trainer.fit(module, DataLoader(RandomTokens(vocab, args.seq_len, batches * world), batch_size=1))
    record: dict[str, Any] = {}
    if rank == 0:
        summary = summarise(trace.snapshot(), since=f"step{batches - 1}") if trace is not None else None
        record = stamp("memory_trace", card=card_name(device), gpus=world, command=command)
        requested = {**strategy_options(args), **offload_options(args)}
        record.update(model=args.model, geometry=args.geometry, layers=args.layers, seq_len=args.seq_len, gpus=world,
                      precision=args.precision, gpu_memory_cap_bytes=_cap_bytes(device) if args.gpu_memory_gib
                      else None,
                      **resolved_options(args, strategy, offload, last.get("plan")),
                      cpu_offload_params=args.cpu_offload_params, accumulate_grad_batches=args.accumulate_grad_batches,
                      sync_every_batch=last.get("sync_every_batch"),
                      requested_options={k: v for k, v in requested.items() if k != "cpu_offload_params"},
                      peak_gpu_bytes_per_step=steps["gpu"], step_seconds=steps["seconds"],
                      peak_phase=summary["peak_phase"] if summary is not None else None,
                      phase_peak_bytes=summary["phase_peaks"] if summary is not None else None,
                      phase_peak_sites=summary["phase_peak_sites"] if summary is not None else None,
                      peak_host_rss_bytes_per_step=steps["host"],
                      host_phase_peak_rss_bytes_per_step=steps["phases"], host_rss_reading=host.reading,
                      peak_host_rss_bytes=largest(steps["host"]),
                      pinned_host_bytes_per_step=steps["pinned"],
                      **{k: last.get(k) for k in ("pinned_host_bytes", "pinned_host_bytes_strategy",
                                                  "pinned_host_bytes_caching_allocator")},
                      **{k: v for k, v in last.items() if k.startswith("plan") and k != "plan"})
        append_record(args.out, record)
        text = format_host(record) if summary is None else f"{format_summary(summary)}\n{format_host(record)}"
        with open(args.out.removesuffix(".jsonl") + ".txt", "a") as f:
            f.write(f"== {args.model} {args.geometry} S={args.seq_len} gpus={world}\n{text}\n")
        print(text)
    if trace is not None:
        trace.stop()
    return record


def _cap_bytes(device: torch.device) -> Optional[int]:
    """The GPU memory this process may use under ``--gpu-memory-gib``."""
    from lightning_fpdt.planner.machine import usable_total_bytes

    return usable_total_bytes(device) if device.type == "cuda" else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.memory_trace", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="summarise a snapshot written by MemoryTrace.dump")
    show.add_argument("snapshot")
    show.add_argument("--since", default=None, help="replay from this marker on")
    show.add_argument("--top", type=int, default=25)
    run = commands.add_parser("train", help="trace training steps (torchrun for several GPUs)")
    run.add_argument("--model", choices=["reference", "hf"], default="reference",
                     help="the reference Llama (lightning_fpdt.models) or transformers' LlamaForCausalLM")
    run.add_argument("--geometry", default="llama3-8b", help="named size of lightning_fpdt.models.llama.NAMED_CONFIGS "
                     "(llama3-8b, llama3-3b, ...), or with --model hf one of bench.peers.hf_llama.HF_GEOMETRIES "
                     "(qwen3-4b, mixtral-8x7b)")
    run.add_argument("--layers", type=lambda v: None if v == "full" else int(v), default=2,
                     help="layers run; 'full': the geometry's depth")
    run.add_argument("--seq-len", type=int, required=True)
    run.add_argument("--auto-options", "--callbacks-auto", action="store_true",
                     help="every memory option below not given is 'auto' (the strategy's chunks, offload, offload_dq, "
                          "head_chunks; ActivationOffload's recompute_attention, reload_input, prefetch)")
    run.add_argument("--chunks", type=_int_or_auto, default=None, help="int or auto (default auto)")
    run.add_argument("--head-chunks", type=_int_or_auto, default=None, help="int or auto (default 1)")
    run.add_argument("--offload", choices=["on", "off", "auto"], default=None, help="default auto")
    run.add_argument("--offload-dq", choices=["on", "off", "auto"], default=None, help="default auto")
    run.add_argument("--recompute-attention", nargs="?", const="on", choices=["on", "off", "auto"], default=None,
                     help="ActivationOffload(recompute_attention=...); alone: on (default off)")
    run.add_argument("--reload-input", nargs="?", const="on", choices=["on", "off", "auto"], default=None,
                     help="ActivationOffload(reload_input=...); alone: on (default off)")
    run.add_argument("--prefetch", type=_int_or_auto, default=None, help="ActivationOffload(prefetch=...): int or auto "
                     "(default 1)")
    run.add_argument("--cpu-offload-params", action="store_true")
    run.add_argument("--gpu-memory-gib", type=float, default=None,
                     help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction; the strategy "
                          "plans with the cap)")
    run.add_argument("--precision", choices=["bf16-mixed", "32-true"], default="bf16-mixed")
    run.add_argument("--accelerator", choices=["cuda", "cpu"], default="cuda",
                     help="cpu: gloo processes, no allocator trace (the tests)")
    run.add_argument("--steps", type=int, default=2)
    run.add_argument("--accumulate-grad-batches", type=int, default=1,
                     help="Trainer(accumulate_grad_batches=...): batches per step, each traced (the lists per step are "
                          "per batch)")
    run.add_argument("--sync-every-batch", choices=["on", "off", "auto"], default=None,
                     help="FPDTStrategy(sync_every_batch=...), with --accumulate-grad-batches above 1 (default auto)")
    run.add_argument("--out", default="memory_trace.jsonl")
    return parser


def main(argv: Optional[list[str]] = None) -> Optional[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "train":
        args.argv = argv
        return train(args)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    print(format_summary(summarise(snapshot, since=args.since, top=args.top)))
    return None


if __name__ == "__main__":
    main()
