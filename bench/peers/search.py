"""``--max-length``: the longest sequence a system trains, each attempt in a fresh process.

The search doubles ``--seq-len`` until a step does not fit (halving first when the start does not), then tries once
the midpoint, rounded down to ``--length-multiple``. Each attempt leaves a record; a ``"max_length"`` summary at the
end gives the GPU's limit (the longest length that ran), the host's limit for the full depth (a planner bisection,
with ``--check-host``) and the smaller of the two as the maximum.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

from bench.peers.ballast import full_depth, host_check, layers_run
from bench.peers.records import MODULE, command_line, read_attempt
from bench.provenance import REPO_ROOT, append_record, launch_command, stamp

SEARCH_ONLY_OPTIONS = {"--max-length": 0, "--gpus": 1, "--max-seq-len": 1, "--length-multiple": 1, "--deadline-s": 1}
"""Options of the search process (with the number of values each takes), not passed on to the attempts."""
HOST_BOUND = "host (planned, full depth)"


def search_lengths(attempt: Callable[[int], bool], start: int, *, multiple: int, max_len: int) -> dict[str, Any]:
    """Double from ``start`` while ``attempt(S)`` fits (halve first when ``start`` does not), then try once the
    midpoint between the longest fit and the shortest failure, rounded down to ``multiple``.

    Returns ``{"max_fit", "min_fail", "tried": [(S, fits), ...]}``; ``max_fit`` is ``None`` when nothing fit."""
    if start < multiple or start % multiple:
        raise ValueError(f"the first length ({start}) must be a positive multiple of --length-multiple ({multiple})")
    tried: list[tuple[int, bool]] = []

    def check(seq_len: int) -> bool:
        fits = attempt(seq_len)
        tried.append((seq_len, fits))
        return fits

    max_fit: Optional[int] = None
    min_fail: Optional[int] = None
    seq_len = start
    if check(seq_len):
        max_fit = seq_len
        while 2 * seq_len <= max_len:
            seq_len *= 2
            if not check(seq_len):
                min_fail = seq_len
                break
            max_fit = seq_len
    else:
        min_fail = seq_len
        while seq_len // 2 >= multiple and seq_len // 2 % multiple == 0:
            seq_len //= 2
            if check(seq_len):
                max_fit = seq_len
                break
            min_fail = seq_len
    if max_fit is not None and min_fail is not None:
        middle = (max_fit + min_fail) // 2 // multiple * multiple
        if max_fit < middle < min_fail:
            if check(middle):
                max_fit = middle
            else:
                min_fail = middle
    return {"max_fit": max_fit, "min_fail": min_fail, "tried": tried}


def attempt_argv(argv: list[str], seq_len: int, attempt_id: str) -> list[str]:
    """The search's own argv without its search options, with ``--seq-len seq_len --attempt-id attempt_id``."""
    drop = dict(SEARCH_ONLY_OPTIONS, **{"--seq-len": 1, "--attempt-id": 1})
    out: list[str] = []
    skip = 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = drop[name] if "=" not in arg else 0
            continue
        out.append(arg)
    return [*out, "--seq-len", str(seq_len), "--attempt-id", attempt_id]


def host_limit(args: argparse.Namespace, *, available_bytes: int, gpu_memory_bytes: Optional[int]) -> int:
    """The longest multiple of ``--length-multiple`` up to ``--max-seq-len`` whose full depth's planned pinned host
    memory fits ``available_bytes`` (0 if none does): a planner bisection, no run."""
    def fits(seq_len: int) -> bool:
        trial = argparse.Namespace(**{**vars(args), "seq_len": seq_len})
        return bool(host_check(trial, num_gpus=args.gpus, gpus_per_node=args.gpus, resolved={},
                               gpu_memory_bytes=gpu_memory_bytes, available_bytes=available_bytes)["fits"])

    low, high = 0, args.max_seq_len // args.length_multiple  # in multiples; fits(low) holds, by convention for 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle * args.length_multiple):
            low = middle
        else:
            high = middle - 1
    return low * args.length_multiple


def run_attempt(command: list[str], *, timeout_s: float, grace_s: float = 60.0) -> tuple[Optional[int], str]:
    """Run one attempt, its output echoed; ``(exit code or None if cut by the timeout, the output's tail)``.

    Cut: SIGTERM first, which torchrun passes on to its workers (they run in sessions of their own, out of reach of
    a signal to torchrun's process group), SIGKILL to the attempt's group after ``grace_s``. The output goes through
    a file, not a pipe, so a worker that outlives torchrun cannot keep this process waiting for its end. The
    repository root goes on the attempt's ``PYTHONPATH`` so ``-m bench.peers`` resolves from any working folder."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO_ROOT), os.environ.get("PYTHONPATH"))))}
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env=env)
        try:
            rc: Optional[int] = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
            process.terminate()
            try:
                process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the group this function started (start_new_session)
                process.wait()
        log.seek(0)
        output = log.read()
    sys.stdout.write(output)
    sys.stdout.flush()
    return rc, output[-2000:]


def _launcher(gpus: int) -> list[str]:
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"] if gpus > 1 else []
    return [sys.executable, *torchrun, *MODULE.split()]


def _check_search_options(args: argparse.Namespace) -> None:
    if "WORLD_SIZE" in os.environ:
        raise ValueError("--max-length launches its own torchrun per attempt: start it with python3, not torchrun")
    if args.gpus < 1 or args.length_multiple < 1:
        raise ValueError(f"--gpus ({args.gpus}) and --length-multiple ({args.length_multiple}) must be positive")
    if args.system == "ring" and args.length_multiple % (2 * args.gpus):
        raise ValueError(f"ring: --length-multiple ({args.length_multiple}) must be a multiple of 2 x GPUs "
                         f"({2 * args.gpus}) so every length tried keeps the load balancing")


KILLED = "killed"
"""The status of an attempt ended by SIGKILL that the search did not send: on a Linux host the kernel's out-of-memory
killer ends a process so (page-locked host memory cannot be swapped), without a word of its own."""
KILLED_LIMIT = "host (SIGKILL)"


def killed(rc: Optional[int], tail: str) -> bool:
    """Whether an attempt that exited with ``rc`` and printed ``tail`` died of a SIGKILL (its own, ``rc == -9``, or
    a rank's, which torchrun reports and then exits 1)."""
    return rc is not None and (rc == -signal.SIGKILL or "Signal 9 (SIGKILL)" in tail)


def _unfinished_record(args: argparse.Namespace, child: list[str], seq_len: int, attempt_id: str,
                       rc: Optional[int], tail: str) -> dict[str, Any]:
    """The record of an attempt that crashed, was killed (:func:`killed`) or was cut by the deadline before writing
    its own. Its card is not known here: the search process never touches the GPUs, which would take memory from the
    attempts."""
    command = command_line(child, args.gpus, args.gpus)
    status = "timeout" if rc is None else KILLED if killed(rc, tail) else "error"
    return {**stamp("run", card=None, gpus=args.gpus, command=command), "system": args.system,
            "status": status, "limit": KILLED_LIMIT if status == KILLED else None, "seq_len": seq_len,
            "model": args.model, "layers": layers_run(args), "full_layers": full_depth(args.model),
            "attempt": attempt_id, "rc": rc, "error": tail}


def _host_maximum(args: argparse.Namespace, records: dict[int, dict[str, Any]]) -> tuple[Optional[int], Any]:
    """``(the host's maximum length for the full depth, the host memory it was planned against)``: with
    ``--check-host`` only, from the memory the last checked attempt found available."""
    checked = [r for r in records.values() if (r.get("host_check") or {}).get("available_bytes")]
    if not checked:
        return None, None
    available = checked[-1]["host_check"]["available_bytes"]
    return host_limit(args, available_bytes=available, gpu_memory_bytes=checked[-1].get("card_memory_bytes")), available


def _summary(args: argparse.Namespace, result: dict[str, Any], records: dict[int, dict[str, Any]],
             elapsed_s: float) -> dict[str, Any]:
    """The ``"max_length"`` record: the GPU's limit, the host's, the smaller of the two, and every length tried."""
    failed = records.get(result["min_fail"]) if result["min_fail"] is not None else None
    fitted = records.get(result["max_fit"]) if result["max_fit"] is not None else None
    host_max, available = _host_maximum(args, records)
    gpu_max = result["max_fit"]
    overall = gpu_max if host_max is None or gpu_max is None else min(gpu_max, host_max)
    if host_max is not None and gpu_max is not None and host_max < gpu_max:
        limited_by = HOST_BOUND
    else:
        limited_by = None if failed is None else (failed.get("limit") or failed["status"])
    card = next((r["card"] for r in records.values() if r.get("card")), None)
    command = launch_command(MODULE, args.argv, gpus_per_node=1, world_size=1, under_torchrun=False)
    return {
        **stamp("max_length", card=card, gpus=args.gpus, command=command),
        "system": args.system, "model": args.model, "layers": layers_run(args), "full_layers": full_depth(args.model),
        "sequence_parallel_size": getattr(args, "sequence_parallel_size", "auto"),
        "gpu_memory_cap_bytes": next((r["gpu_memory_cap_bytes"] for r in records.values()
                                      if r.get("gpu_memory_cap_bytes")), None),
        "ballast": args.ballast, "max_seq_len": overall, "max_seq_len_gpu": gpu_max,
        "first_failed_seq_len": result["min_fail"], "host_max_seq_len": host_max, "host_available_bytes": available,
        "limited_by": limited_by, "peak_gpu_bytes_at_max": fitted and fitted.get("peak_gpu_bytes"),
        "peak_host_rss_bytes_at_max": fitted and fitted.get("peak_host_rss_bytes"),
        "tried": [{"seq_len": s, "fits": fits, "status": records[s]["status"]} for s, fits in result["tried"]],
        "attempts": [records[s].get("attempt") for s, _ in result["tried"]],
        "elapsed_s": elapsed_s,
    }


def max_length_search(args: argparse.Namespace) -> dict[str, Any]:
    """Each attempt in a fresh process (a CUDA out-of-memory error can leave a process unable to go on), one record
    per attempt in ``args.out`` and a ``"max_length"`` summary record at the end."""
    _check_search_options(args)
    started = time.monotonic()
    stamp_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    records: dict[int, dict[str, Any]] = {}

    def attempt(seq_len: int) -> bool:
        attempt_id = f"{args.system}-{args.gpus}gpu-{seq_len}-{stamp_id}"
        child = attempt_argv(args.argv, seq_len, attempt_id)
        remaining = args.deadline_s - (time.monotonic() - started)
        rc, tail = None, ""
        if remaining > 0:
            print(f"max-length: S={seq_len} ({remaining:.0f} s left)", flush=True)
            rc, tail = run_attempt([*_launcher(args.gpus), *child], timeout_s=remaining)
        record = read_attempt(args.out, attempt_id)
        if record is None:
            record = _unfinished_record(args, child, seq_len, attempt_id, rc, tail)
            append_record(args.out, record)
        records[seq_len] = record
        return record.get("status") == "ok"  # the GPU limit; the host's is planned in the summary

    start = max(args.length_multiple, args.seq_len // args.length_multiple * args.length_multiple)
    result = search_lengths(attempt, start, multiple=args.length_multiple, max_len=args.max_seq_len)
    summary = _summary(args, result, records, time.monotonic() - started)
    append_record(args.out, summary)
    print(f"MAX_LENGTH system={args.system} gpus={args.gpus} max_seq_len={summary['max_seq_len']} "
          f"(gpu {summary['max_seq_len_gpu']}, first failed {result['min_fail']}; host {summary['host_max_seq_len']}) "
          f"limited_by={summary['limited_by']}", flush=True)
    return summary
