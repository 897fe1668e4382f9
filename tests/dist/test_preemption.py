"""Preemption loses nothing: real signals to real processes stop every rank after the same step, a checkpoint saved
on the way out resumes exactly, and a rank stuck behind a hung peer still exits (docs/multi_node.md).

Three cases are 2-process CPU runs started for the purpose (``tests/dist/preempted_run.py``), started together since
starting processes is most of their time: SIGTERM to rank 1 only, SLURM's requeue signal to both ranks, and a rank
stuck behind a hung peer. Two more (SIGTERM to both ranks, to rank 0 only) signal the processes of the test's pool
while they train. The seconds from the signal to each rank's exit (for the pool: to the end of ``fit``) are printed.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.dist.preempted_run import fit, train_until_stopped
from tests.dist.training import full_state

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240
EXIT_TIMEOUT_S = 60
"""A hang guard only: the runs exit in seconds (see the printed times)."""
SLURM_JOB = "4242"
STUCK_TIMEOUT_S = 5.0
"""preempted_run's preemption_timeout in its ``stuck`` mode."""


@dataclass
class Case:
    mode: str
    signum: int
    ranks: tuple[int, ...]
    slurm: bool = False
    folder: Path = Path()
    procs: list[subprocess.Popen] = field(default_factory=list)
    sent: float = 0.0
    exit_s: dict[int, float] = field(default_factory=dict)
    outputs: dict[int, str] = field(default_factory=dict)

    def output_of(self, rank: int) -> str:
        return self.outputs[rank]


LAUNCHED = {
    "one": Case("train", signal.SIGTERM, (1,)),
    "slurm": Case("train", signal.SIGUSR1, (0, 1), slurm=True),
    "stuck": Case("stuck", signal.SIGTERM, (0,)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(case: Case, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if case.slurm:  # what srun gives each task; scontrol is a stand-in that records its arguments
        bin_dir = case.folder / "bin"
        env.update(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                   SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_ID=SLURM_JOB, SLURM_JOB_NAME="fpdt-test",
                   SLURM_NODELIST="127.0.0.1", PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    else:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", NODE_RANK="0")
    return env


def _start(case: Case) -> None:
    port = _free_port()
    if case.slurm:
        bin_dir = case.folder / "bin"
        bin_dir.mkdir()
        (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{case.folder}/scontrol.log"\n')
        (bin_dir / "scontrol").chmod(0o755)
    for rank in (0, 1):
        log = open(case.folder / f"out.{rank}", "w")
        case.procs.append(subprocess.Popen([sys.executable, "-m", "tests.dist.preempted_run", case.mode,
                                            str(case.folder)], cwd=ROOT, env=_env(case, rank, port), stdout=log,
                                           stderr=subprocess.STDOUT, text=True))


def _step_of(folder: Path) -> int:
    """The global step rank 0 last finished (-1 before the first)."""
    try:
        return int((folder / "step.0").read_text() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def _ready(case: Case) -> bool:
    """Whether to send the signal: after 3 steps; in the stuck case once rank 1 hangs, so that no step end where
    rank 0 could still agree to stop remains."""
    if case.mode == "stuck":
        return (case.folder / "stuck").exists()
    return _step_of(case.folder) >= 3


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> dict[str, Case]:
    """Every case started at once; each signalled once it is ready (:func:`_ready`); each rank's exit timed."""
    cases = {name: Case(c.mode, c.signum, c.ranks, c.slurm, tmp_path_factory.mktemp(name))
             for name, c in LAUNCHED.items()}
    try:
        for case in cases.values():
            _start(case)
        deadline = time.time() + START_TIMEOUT_S
        while any(not case.sent for case in cases.values()):
            for name, case in cases.items():
                if case.procs[0].poll() is not None and not case.sent:
                    raise AssertionError(f"{name}: rank 0 ended before the signal:\n"
                                         f"{(case.folder / 'out.0').read_text()[-3000:]}")
                if not case.sent and _ready(case):
                    for rank in case.ranks:
                        os.kill(case.procs[rank].pid, case.signum)
                    case.sent = time.time()
            assert time.time() < deadline, "the runs did not start training"
            time.sleep(0.02)
        while any(len(case.exit_s) < 2 for case in cases.values()):
            for case in cases.values():
                for rank, proc in enumerate(case.procs):
                    if rank not in case.exit_s and proc.poll() is not None:
                        case.exit_s[rank] = time.time() - case.sent
            assert all(time.time() - case.sent < EXIT_TIMEOUT_S for case in cases.values() if len(case.exit_s) < 2), \
                {name: case.exit_s for name, case in cases.items()}
            time.sleep(0.02)
    finally:
        for case in cases.values():
            for proc in case.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
    for name, case in cases.items():
        case.outputs = {rank: (case.folder / f"out.{rank}").read_text() for rank in (0, 1)}
        print(f"preemption {name}: {signal.Signals(case.signum).name} to ranks {list(case.ranks)}, exits after "
              + ", ".join(f"rank {r} {case.exit_s[r]:.2f} s" for r in (0, 1)))
    return cases


def _saved(outputs: dict[int, str]) -> tuple[Path, int]:
    """The checkpoint every rank's line names, and the global step each says it stopped after."""
    found = [re.search(rf"fpdt: rank {rank}: .*stopped after global step (\d+) and saved the checkpoint (\S+) in",
                       outputs[rank]) for rank in (0, 1)]
    assert None not in found, outputs
    (match,) = {(m.group(1), m.group(2)) for m in found}  # the same step and path on both ranks
    return Path(match[1]), int(match[0])


def _check_sigterm_stop(outputs: dict[int, str], signalled: tuple[int, ...], folder: Path) -> tuple[Path, int]:
    checkpoint, step = _saved(outputs)
    assert checkpoint == folder / "hpc_ckpt_1.ckpt"
    assert {p.name for p in checkpoint.iterdir()} >= {".metadata", "meta.pt", "fpdt_checksums.json"}
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["global_step"] == step >= 3
    counts = {int(re.search(r"SIGTERM reached (\d) of 2 ranks", outputs[rank]).group(1)) for rank in (0, 1)}
    assert len(counts) == 1, outputs
    (reached,) = counts
    if len(signalled) == 1:  # the other rank never receives it: it learns of it from the step's all-reduce
        assert reached == 1
        for rank in (0, 1):
            received = "this one among them" if rank in signalled else "not this one"
            assert f"SIGTERM reached 1 of 2 ranks ({received})" in outputs[rank], outputs[rank]
    else:  # sent to both, one may have been signalled only after the step end that stopped them
        assert reached in (1, 2)
    for rank in (0, 1):
        assert "exiting with status 143" in outputs[rank]
    return checkpoint, step


def resume_matches_uninterrupted(folder: str, checkpoint: str, saved_step: int, slurm: bool,
                                 accumulate: int = 1) -> None:
    torch.set_num_threads(1)
    steps = saved_step + 3
    full, _ = fit(os.path.join(folder, "uninterrupted"), steps, accumulate=accumulate)
    if slurm:  # a restarted SLURM job: no ckpt_path, Lightning finds hpc_ckpt_1.ckpt in default_root_dir
        rank = torch.distributed.get_rank()
        slurm_env = dict(SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                         SLURM_NODEID="0", SLURM_NNODES="1", SLURM_JOB_NAME="fpdt-test", SLURM_JOB_ID=SLURM_JOB)
        os.environ.update(slurm_env)
        try:
            resumed, trainer = fit(folder, steps)
        finally:
            for name in slurm_env:
                os.environ.pop(name)
        assert os.path.samefile(trainer.ckpt_path, checkpoint)
    else:
        resumed, trainer = fit(os.path.join(folder, "resumed"), steps, ckpt_path=checkpoint, accumulate=accumulate)
    # fp32 and the same batches in the same order: the resumed run repeats the uninterrupted one exactly (one loss and
    # one draw per micro-batch)
    saved_batches = saved_step * accumulate
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[saved_batches:]), rtol=0, atol=0)
    assert resumed.draws == full.draws[saved_batches:]
    resumed_params = full_state(resumed)
    for name, value in full_state(full).items():
        torch.testing.assert_close(resumed_params[name], value, rtol=0, atol=0, msg=name)


def test_sigterm_to_rank_one_saves_a_checkpoint_that_resumes_exactly(stopped, dist_pool):
    """SIGTERM to rank 1 only: both processes stop after the same step, save one checksummed checkpoint, say so
    naming the signal and the path, and exit with status 143; training resumed from that checkpoint gives the losses,
    random draws and parameters of an uninterrupted run, bit for bit."""
    case = stopped["one"]
    assert [proc.returncode for proc in case.procs] == [128 + signal.SIGTERM] * 2, case.outputs
    checkpoint, step = _check_sigterm_stop(case.outputs, case.ranks, case.folder)
    dist_pool(2).run(resume_matches_uninterrupted, folder=str(case.folder), checkpoint=str(checkpoint),
                     saved_step=step, slurm=False)


@pytest.mark.parametrize("signalled,accumulate", [((0, 1), 1), ((0,), 1), ((1,), 2)],
                         ids=["all-ranks", "rank-0", "rank-1-accumulating"])
def test_sigterm_to_training_pool_processes_stops_them_together(dist_pool, tmp_path, signalled, accumulate):
    """SIGTERM sent from outside to both training processes, to rank 0 only, or to rank 1 only while gradients
    accumulate over 2 batches: fit ends on both ranks with status 143 after one shared optimizer step (never between
    the micro-batches of one) and a checkpoint, which resumes exactly."""
    pool = dist_pool(2)
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["ranks"] = pool.run(train_until_stopped, root_dir=str(tmp_path), accumulate=accumulate)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            outcome["error"] = error

    thread = threading.Thread(target=train)
    thread.start()
    deadline = time.time() + START_TIMEOUT_S
    while _step_of(tmp_path) < 3:
        assert thread.is_alive() and time.time() < deadline, outcome
        time.sleep(0.02)
    sent = time.time()
    for rank in signalled:
        os.kill(pool.pids[rank], signal.SIGTERM)
    thread.join(EXIT_TIMEOUT_S)
    assert not thread.is_alive() and "error" not in outcome, outcome
    ranks = outcome["ranks"]
    print(f"preemption pool {signalled}: fit ended after "
          + ", ".join(f"rank {r} {ranks[r]['stopped_at'] - sent:.2f} s" for r in (0, 1)))
    assert [r["code"] for r in ranks] == [128 + signal.SIGTERM] * 2, ranks
    checkpoint, step = _check_sigterm_stop({r: ranks[r]["log"] for r in (0, 1)}, signalled, tmp_path)
    assert torch.load(checkpoint / "meta.pt", weights_only=False)["loops"]["fit_loop"]["epoch_loop.batch_progress"][
        "current"]["processed"] == step * accumulate  # the checkpoint ends an optimizer step
    pool.run(resume_matches_uninterrupted, folder=str(tmp_path), checkpoint=str(checkpoint), saved_step=step,
             slurm=False, accumulate=accumulate)


def test_slurm_requeue_signal_saves_requeues_and_resumes(stopped, dist_pool):
    """SIGUSR1 under SLURMEnvironment(auto_requeue=True): the checkpoint is saved, rank 0 alone runs `scontrol
    requeue <job>`, both ranks exit with status 138, and the restarted job (no ckpt_path) resumes from that
    checkpoint exactly."""
    case = stopped["slurm"]
    assert [proc.returncode for proc in case.procs] == [128 + signal.SIGUSR1] * 2, case.outputs
    assert (case.folder / "scontrol.log").read_text().splitlines() == [f"requeue {SLURM_JOB}"]
    checkpoint, step = _saved(case.outputs)
    assert f"requeued SLURM job {SLURM_JOB}" in case.output_of(0)
    dist_pool(2).run(resume_matches_uninterrupted, folder=str(case.folder), checkpoint=str(checkpoint),
                     saved_step=step, slurm=True)


def test_rank_behind_a_hung_peer_still_exits(stopped):
    """Rank 1 hangs outside any collective and SIGTERM reaches only rank 0, which waits in a collective (its Python
    handler cannot run): the signal still travels through the store, and both ranks exit non-zero about
    preemption_timeout after it, naming the signal and where each rank is, without writing a checkpoint."""
    case = stopped["stuck"]
    assert [proc.returncode for proc in case.procs] == [1, 1], case.outputs
    for rank in (0, 1):
        line = next(line for line in case.output_of(rank).splitlines() if "made no progress" in line)
        assert f"SIGTERM on rank 0, and rank {rank} made no progress" in line and "without a checkpoint" in line
        assert f"preemption_timeout {STUCK_TIMEOUT_S:g} s" in line
    assert "rank 1 is not in the collective the others wait in; it is at" in case.output_of(0)
    assert "in on_train_batch_start, outside any collective" in case.output_of(1)
    assert not list(case.folder.glob("*.ckpt"))
