"""What every benchmark record carries about where it came from: the card, the GPU count, the command and the commit.

A record without them cannot be told apart from a run of other code on another machine, so every script of bench/
stamps its records with :func:`stamp`, and bench/report leaves out records that lack a commit.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMIT_VARIABLE = "FPDT_COMMIT"
"""Names the commit of a tree that runs as a copy (a tree sent to a GPU machine, with or without a .git folder, which
may hold an older HEAD than the files it came with)."""


def current_commit(root: Path = REPO_ROOT) -> Optional[str]:
    """The short commit of the code that runs: ``$FPDT_COMMIT`` where it is set (whoever copied the tree named it),
    else git's where ``root`` is a checkout, else ``None`` (the record then says the commit is unknown instead of
    guessing one)."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    if (root / ".git").exists():
        try:
            done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    return None


def launch_command(target: str, argv: Sequence[str], *, gpus_per_node: int, world_size: int,
                   under_torchrun: bool) -> str:
    """The command that reproduces a run from the repository root. ``target`` is what python runs: a module
    (``-m bench.peers``; a script path, ``bench/attention.py``, in records made before the scripts ran as modules)."""
    tail = f"{target} {shlex.join(argv)}".rstrip()
    if world_size == 1 and not under_torchrun:
        return f"python3 {tail}"
    nodes = f"--nnodes {world_size // gpus_per_node} " if world_size != gpus_per_node else "--standalone "
    return f"torchrun {nodes}--nproc_per_node {gpus_per_node} {tail}"


def this_command(target: str, argv: Optional[Sequence[str]] = None) -> str:
    """:func:`launch_command` of the running process: its arguments, and its GPU counts from torchrun's environment."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return launch_command(target, sys.argv[1:] if argv is None else argv, world_size=world_size,
                          gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))),
                          under_torchrun="LOCAL_WORLD_SIZE" in os.environ)


def stamp(kind: str, *, card: Optional[str], gpus: Optional[int], command: str) -> dict[str, Any]:
    """The fields every record starts with: what it is, where and how it ran, which code, when."""
    return {
        "kind": kind, "card": card, "gpus": gpus, "command": command, "commit": current_commit(),
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def card_name(device: torch.device) -> str:
    """The card as torch names it (``"NVIDIA H100 80GB HBM3"``), or ``"cpu"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def append_record(path: str, record: dict[str, Any]) -> None:
    """Append ``record`` to the JSONL file ``path`` (bench/report reads these)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
