"""A host that runs short of memory mid-run ends every rank with the message naming the plan and the fix, quickly,
not with the kernel's silent kill and not with the other ranks waiting out the collective timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_host_short_on_one_rank_ends_every_rank_with_the_message():
    """Rank 1's host buffers are refused at the first step: rank 1 raises HostMemoryError naming its bytes and the
    fix; rank 0, waiting in the attention's collective, ends within seconds with the same message (well before its
    120 s collective timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    start = time.time()
    for rank in (0, 1):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), NODE_RANK="0", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        procs.append(subprocess.Popen([sys.executable, "-m", "tests.dist.host_short_run"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    elapsed = time.time() - start
    assert all(p.returncode != 0 for p in procs), outputs
    assert "HostMemoryError: host memory ran short: the checkpointed block inputs needs" in outputs[1], outputs[1][-3000:]
    assert "Plan the run with" in outputs[1] or "lightning-fpdt plan" in outputs[1]
    assert "rank 1: host memory ran short" in outputs[0], outputs[0][-3000:]
    assert elapsed < 100
