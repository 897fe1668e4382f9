"""The disk tier's directory: one per process under ``offload_dir``, its name, the stale ones a crash left, and the
check that its file system has room."""

from __future__ import annotations

import os
import re
import shutil
import socket
from dataclasses import dataclass

DIRECTORY_PATTERN = re.compile(r"^fpdt-(?P<host>.+)-(?P<pid>\d+)-rank(?P<rank>\d+)$")


class DiskTierError(RuntimeError):
    """A write or a read of the disk tier failed (the message names the file and the bytes)."""


def directory_name(rank: int) -> str:
    """This process's directory under ``offload_dir``: ``fpdt-<host>-<pid>-rank<r>``."""
    return f"fpdt-{socket.gethostname()}-{os.getpid()}-rank{rank}"


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's process counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tree_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@dataclass(frozen=True)
class StaleDirectory:
    """The spill directory of a process of this host that is no longer alive."""

    path: str
    pid: int
    nbytes: int


def stale_directories(offload_dir: str) -> list[StaleDirectory]:
    """Spill directories under ``offload_dir`` left by processes of this host that are no longer alive (a crash).
    Directories of other hosts are not judged (their processes cannot be seen from here), nor those of live
    processes."""
    host, found = socket.gethostname(), []
    try:
        names = sorted(os.listdir(offload_dir))
    except OSError:
        return []
    for name in names:
        match = DIRECTORY_PATTERN.match(name)
        path = os.path.join(offload_dir, name)
        if match is None or match["host"] != host or not os.path.isdir(path):
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and not _alive(pid):
            found.append(StaleDirectory(path, pid, _tree_bytes(path)))
    return found


def prepare_offload_dir(offload_dir: str) -> str:
    """The absolute ``offload_dir``, created if missing; ``ValueError`` naming it when it cannot be created or
    written (the check the strategy runs at setup, before any step)."""
    path = os.path.abspath(os.fspath(offload_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"offload_dir {path!r} is a file, not a directory: give a directory on a local disk (it is "
                         f"created if missing), or offload_dir=None")
    blocker = next((parent for parent in _parents(path) if os.path.exists(parent) and not os.path.isdir(parent)), None)
    if blocker is not None:
        raise ValueError(f"offload_dir {path!r} does not exist and cannot be created: {blocker!r} is a file, not a "
                         f"directory; give a directory on a local disk, or offload_dir=None")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"offload_dir {path!r} does not exist and cannot be created ({error.strerror or error}): give a directory "
            f"on a local disk that this process can create and write, or offload_dir=None"
        ) from error
    if not os.path.isdir(path):
        raise ValueError(f"offload_dir {path!r} is not a directory: give a directory on a local disk")
    probe = os.path.join(path, f".fpdt-probe-{socket.gethostname()}-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise ValueError(
            f"offload_dir {path!r} is not writable ({error.strerror or error}): the disk tier writes block inputs "
            f"there; give a writable directory on a local disk, or offload_dir=None"
        ) from error
    return path


def _parents(path: str) -> list[str]:
    """The folders above ``path``, nearest first."""
    parents, current = [], os.path.dirname(path)
    while current and current != os.path.dirname(current):
        parents.append(current)
        current = os.path.dirname(current)
    return parents


def check_free_space(offload_dir: str, needed_bytes: int, what: str = "") -> None:
    """``ValueError`` naming the directory, the bytes needed and the bytes free when ``offload_dir``'s file system
    has less than ``needed_bytes`` free (``what``: what needs them, for the message)."""
    free = shutil.disk_usage(offload_dir).free
    if needed_bytes <= free:
        return
    stale = stale_directories(offload_dir)
    hint = ""
    if stale:
        hint = (f" {len(stale)} directories of processes of this host that are no longer alive hold "
                f"{sum(s.nbytes for s in stale):,} bytes there: " + ", ".join(s.path for s in stale)
                + " (remove them if no run uses them).")
    raise ValueError(
        f"offload_dir {offload_dir!r} is too small: {what or 'the disk tier'} needs {needed_bytes:,} bytes "
        f"({needed_bytes / 2**30:.2f} GiB) on its file system, which has {free:,} bytes ({free / 2**30:.2f} GiB) "
        f"free.{hint} Free space there, give a larger directory, or plan the run with `lightning-fpdt plan "
        f"--disk-gib {free / 2**30:.0f}` to see what fits."
    )
