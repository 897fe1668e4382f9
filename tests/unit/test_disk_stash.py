"""The disk tier under the host stash: entries beyond the host budget in files, written behind and read ahead a piece
at a time through a few staging buffers; files removed when freed and at exit; failures named, never garbage
(offload/disk/)."""

from __future__ import annotations

import copy
import errno
import os
import socket
import subprocess
import sys
import threading
from collections import namedtuple

import pytest
import torch

from lightning_fpdt.callbacks.activation_offload import ActivationOffload
from lightning_fpdt.integrations import SequenceParallelContext, install_reference_llama
from lightning_fpdt.memory import find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.offload.disk import (
    DiskStash,
    DiskTier,
    DiskTierError,
    SpillDirectory,
    check_free_space,
    prepare_offload_dir,
    staging_bytes,
    stale_directories,
)
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence import FPDTAttention, fpdt_attention


@pytest.fixture
def files(tmp_path):
    directory = SpillDirectory(str(tmp_path / "spill"), rank=3, pin_memory=False)
    yield directory
    directory.close()


def _stash(files, budget: int) -> DiskStash:
    factory = StashFactory(offload=True)
    factory.disk = DiskTier(files, host_budget_bytes=budget)
    stash = factory.chunks(torch.device("cpu"))
    assert isinstance(stash, DiskStash)
    return stash


@pytest.mark.parametrize("piece_bytes", [None, 40])
def test_round_trip_spills_beyond_the_budget_through_bounded_staging(tmp_path, piece_bytes):
    """Entries fill the host budget, the rest go to files; every entry comes back bit for bit (prefetched or not,
    several times), also when each streams through staging pieces smaller than itself (40 bytes: entries of 420, 44
    and 104 bytes in pieces that do not divide them); the staging buffers are each thread's two of at most a piece,
    and freeing removes each file."""
    kwargs = {} if piece_bytes is None else {"piece_bytes": piece_bytes}
    files = SpillDirectory(str(tmp_path / "spill"), rank=3, pin_memory=False, **kwargs)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    shapes = [((3, 5, 7), torch.float32), ((2, 11), torch.bfloat16), ((13,), torch.int64)]
    entries = {}
    for i in range(30):
        shape, dtype = shapes[i % 3]
        value = torch.randn(shape, generator=gen).mul(100).to(dtype)
        entries[i] = value.t() if i == 1 else value  # a non-contiguous one, too
    budget = sum(t.numel() * t.element_size() for t in list(entries.values())[:6])  # the first six fit
    stash = _stash(files, budget)
    for key, value in entries.items():
        stash.put(key, value)
    on_disk = [key for key in entries if stash.on_disk(key)]
    assert on_disk == list(range(6, 30)) and stash.nbytes == budget
    assert files.bytes_on_disk == stash.disk_bytes == sum(entries[k].numel() * entries[k].element_size()
                                                          for k in on_disk)
    for key in range(0, 30, 2):
        stash.prefetch(key)  # read ahead, while others are not
    for key, value in entries.items():
        for _ in range(2):  # released and brought back again
            got = stash.get(key)
            assert got.dtype == value.dtype and torch.equal(got, value), key
            stash.release(key)
    assert stash.resident_bytes == 0
    largest = max(t.numel() * t.element_size() for t in entries.values())
    assert files.staging.allocated_bytes == (staging_bytes(largest, piece_bytes) if piece_bytes else
                                             staging_bytes(largest))
    for key in on_disk[:5]:
        path = stash._entries[key].path
        stash.free(key)
        assert not os.path.exists(path)
    stash.clear()
    assert len(stash) == 0 and os.listdir(files.path) == [] and files.bytes_on_disk == 0
    files.close()


def test_a_put_to_disk_waits_for_the_write_before_it(files, monkeypatch):
    """A write holds its tensor until the tensor is on the disk, so a second put to disk waits while the first is
    still being written (at most one written-behind tensor besides the one being put); both come back whole."""
    gate = threading.Event()
    real_pwrite = os.pwrite

    def held(fd, data, offset):
        gate.wait()
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", held)
    stash = _stash(files, budget=0)
    a, b = torch.randn(300), torch.randn(200)
    stash.put("a", a)  # returns: its write waits behind it
    second = threading.Thread(target=stash.put, args=("b", b))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # waiting for "a"'s write
    gate.set()
    second.join(timeout=30)
    assert not second.is_alive()
    assert torch.equal(stash.get("a"), a) and torch.equal(stash.get("b"), b)
    stash.clear()


def test_host_buffers_are_reused_before_spilling(files):
    """A freed host buffer of the entry's size is taken again (it costs no new host memory); only a new buffer
    beyond the budget spills."""
    stash = _stash(files, budget=2 * 64 * 4)
    a, b, c = (torch.randn(64) for _ in range(3))
    stash.put("a", a)
    stash.put("b", b)
    stash.put("c", c)
    assert not stash.on_disk("a") and not stash.on_disk("b") and stash.on_disk("c")
    stash.free("a")
    stash.put("a2", a)
    assert not stash.on_disk("a2")
    assert torch.equal(stash.get("c"), c) and torch.equal(stash.get("a2"), a)
    stash.clear()


def test_misuse_raises_like_the_other_stashes(files):
    """A second put of a key, or any use of a key never put or freed, raises RuntimeError naming the verb, also for
    entries on disk."""
    stash = _stash(files, budget=0)
    stash.put("a", torch.randn(4))
    assert stash.on_disk("a")
    with pytest.raises(RuntimeError, match="put of 'a', which is already stashed"):
        stash.put("a", torch.randn(4))
    stash.free("a")
    for verb in ("get", "prefetch", "release", "free"):
        with pytest.raises(RuntimeError, match=f"{verb} of 'a', which was never put or was already freed"):
            getattr(stash, verb)("a")


def test_truncated_file_is_an_error_not_garbage(files):
    """A file shorter than what was written is refused at the read, naming the file and both byte counts; the
    failure is raised again by the next put (nothing the tier holds is trusted after it)."""
    stash = _stash(files, budget=0)
    value = torch.randn(1000)
    stash.put("x", value)
    entry = stash._entries["x"]
    entry.written.result()
    os.truncate(entry.path, 1000)
    with pytest.raises(DiskTierError, match=rf"{entry.path} holds 1,000 bytes where 4,000 were written"):
        stash.get("x")
    with pytest.raises(DiskTierError, match="failed earlier"):
        stash.put("y", value)
    stash.free("x")
    assert not os.path.exists(entry.path)


def test_failed_write_surfaces_at_the_next_get(files, monkeypatch):
    """A write that fails in the background (a full disk) raises at the entry's get with the file and the bytes, and
    at the next put or clear of any stash on the directory."""
    stash = _stash(files, budget=0)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    stash.put("x", torch.randn(256))
    path = stash._entries["x"].path
    with pytest.raises(DiskTierError, match=rf"writing 1,024 bytes to {path} failed after 0 bytes.*disk is full"):
        stash.get("x")
    monkeypatch.undo()
    with pytest.raises(DiskTierError, match="failed earlier"):
        _stash(files, budget=0).put("y", torch.randn(4))
    with pytest.raises(DiskTierError, match="failed earlier"):
        stash.clear()


@pytest.mark.parametrize("error, fails", [(errno.EIO, True), (errno.EINVAL, False)])
def test_a_write_error_reported_at_writeback_is_not_lost(tmp_path, monkeypatch, error, fails):
    """Each piece is pushed to the disk as it is written (sync_file_range): a write error reported there (reported
    once, so fdatasync would not see it again) fails the entry like a failed write; a file system that does not take
    the call (EINVAL) only leaves the pages to the file's fdatasync."""
    import ctypes

    from lightning_fpdt.offload.disk import files as disk_files

    def refused(fd, offset, count, flags):
        ctypes.set_errno(error)
        return -1

    monkeypatch.setattr(disk_files, "_sync_file_range", refused)
    files = SpillDirectory(str(tmp_path), rank=0, pin_memory=False, piece_bytes=64)
    stash = _stash(files, budget=0)
    value = torch.randn(100)
    stash.put("x", value)
    if fails:
        with pytest.raises(DiskTierError, match=rf"writing 400 bytes to .* failed after .*{os.strerror(error)}"):
            stash.get("x")
    else:
        assert torch.equal(stash.get("x"), value)
        stash.clear()
    files.close()


def test_files_removed_at_exit(tmp_path):
    """A process that ends without closing its spill directory leaves no file: the directory is removed at exit."""
    code = (
        "import sys, torch\n"
        "from lightning_fpdt.offload.disk import SpillDirectory, DiskTier\n"
        "from lightning_fpdt.offload.host_stash import StashFactory\n"
        "files = SpillDirectory(sys.argv[1], rank=0, pin_memory=False)\n"
        "f = StashFactory(offload=True); f.disk = DiskTier(files, 0)\n"
        "s = f.chunks(torch.device('cpu')); s.put('a', torch.randn(1000)); s._entries['a'].written.result()\n"
        "print(files.path)\n"
    )
    root = str(tmp_path / "spill")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, env=env, check=True)
    path = out.stdout.strip()
    assert os.path.basename(path).startswith(f"fpdt-{socket.gethostname()}-") and path.endswith("-rank0")
    assert os.listdir(root) == []


def test_close_removes_the_directory(tmp_path):
    """Closing (the strategy's teardown) removes the process's directory and every file in it; later use raises."""
    files = SpillDirectory(str(tmp_path), rank=1, pin_memory=False)
    stash = _stash(files, budget=0)
    stash.put("a", torch.randn(10))
    files.close()
    assert not os.path.exists(files.path) and os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError, match="is closed"):
        stash.put("b", torch.randn(10))


def test_stale_directories_of_dead_processes_are_named(tmp_path):
    """Directories of this host's processes that are gone are found (with their bytes); a live process's, another
    host's and this process's are not."""
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(dead.stdout)
    for name in (f"fpdt-{host}-{dead_pid}-rank0", f"fpdt-{host}-{os.getppid()}-rank1",
                 f"fpdt-other-host-{dead_pid}-rank0", "unrelated"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "0.bin").write_bytes(b"x" * 100)
    mine = SpillDirectory(str(tmp_path), rank=0, pin_memory=False)
    try:
        stale = stale_directories(str(tmp_path))
    finally:
        mine.close()
    assert [(os.path.basename(s.path), s.pid, s.nbytes) for s in stale] == [(f"fpdt-{host}-{dead_pid}-rank0",
                                                                             dead_pid, 100)]
    assert (tmp_path / f"fpdt-{host}-{dead_pid}-rank0").exists()  # named, not removed


def test_offload_dir_that_cannot_be_created_or_written(tmp_path, monkeypatch):
    """A directory whose parent cannot hold it, or one that cannot be written, is a ValueError naming it."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=rf"offload_dir '{blocker}/spill' does not exist and cannot be created"):
        prepare_offload_dir(str(blocker / "spill"))
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    if os.geteuid() == 0:  # root writes through the mode bits: refuse the write as the kernel would for a user
        real_open = os.open

        def denied(path, *args, **kwargs):
            if str(path).startswith(str(read_only)):
                raise PermissionError(errno.EACCES, "Permission denied")
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", denied)
    with pytest.raises(ValueError, match=rf"offload_dir '{read_only}' is not writable \(Permission denied\)"):
        prepare_offload_dir(str(read_only))


def test_offload_dir_that_is_a_file_says_so(tmp_path):
    """An offload_dir that is a file is named as a file, not as a directory that does not exist."""
    spill = tmp_path / "spill"
    spill.write_text("")
    with pytest.raises(ValueError, match=rf"offload_dir '{spill}' is a file, not a directory"):
        prepare_offload_dir(str(spill))
    with pytest.raises(ValueError, match=rf"'{spill}' is a file, not a directory"):
        prepare_offload_dir(str(spill / "below"))


def test_too_little_free_space_names_the_bytes(tmp_path, monkeypatch):
    """A directory whose file system has less free space than the plan puts there is a ValueError naming the
    directory, the bytes needed and the bytes free."""
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda path: usage(100 * 2**30, 90 * 2**30, 10 * 2**30))
    check_free_space(str(tmp_path), 10 * 2**30)
    with pytest.raises(ValueError, match=rf"offload_dir '{tmp_path}' is too small: the block inputs on disk needs "
                                         rf"12,884,901,888 bytes \(12.00 GiB\).*has 10,737,418,240 bytes \(10.00 GiB\) "
                                         rf"free"):
        check_free_space(str(tmp_path), 12 * 2**30, what="the block inputs on disk")


@pytest.mark.parametrize("offload_dq", [False, True])
def test_attention_on_disk_equals_host_memory(files, offload_dq):
    """The FPDT attention with its chunks (and partial dQ sums) partly on disk gives the output and gradients of the
    host stash bit for bit (the same arithmetic on the same values)."""
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    q = torch.randn(2, 24, 4, 8, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 24, 2, 8, generator=gen, requires_grad=True) for _ in range(2))
    g = torch.randn(2, 24, 4, 8, generator=gen)
    on_disk = StashFactory(offload=True, offload_dq=offload_dq)
    on_disk.disk = DiskTier(files, host_budget_bytes=2 * 2 * 8 * 8 * 4 * 4)  # a few chunks in memory, most on disk
    results = []
    for stashes in (StashFactory(offload=True, offload_dq=offload_dq), on_disk):
        out = fpdt_attention(q, k, v, num_chunks=3, stashes=stashes)
        results.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    assert files.peak_bytes_on_disk > 0 and files.bytes_on_disk == 0 and os.listdir(files.path) == []
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reload_input, prefetch", [(False, 1), (True, 1), (False, 0)])
def test_block_inputs_on_disk_equal_host_memory(tmp_path, reload_input, prefetch):
    """ActivationOffload with the block inputs beyond the host budget on disk (and the attention stash too) gives
    the gradients of the all-in-host-memory run bit for bit, over two steps; every file is gone after each step."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    host = LlamaForCausalLM(LlamaConfig.from_name("tiny", num_layers=4)).double()
    disk = copy.deepcopy(host)
    files = SpillDirectory(str(tmp_path), rank=0, pin_memory=False)
    callbacks = []
    for model in (host, disk):
        attention = FPDTAttention(num_chunks=2, backend="math", offload=True)
        install_reference_llama(model, SequenceParallelContext(group=None, attention=attention))
        callback = ActivationOffload(prefetch=prefetch, reload_input=reload_input, recompute_attention=False)
        callback.fpdt_transform(model, find_blocks(model))
        callbacks.append(callback)
        if model is disk:
            attention.stashes.disk = DiskTier(files, host_budget_bytes=0)
    ids = torch.randint(0, 256, (2, 16))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    block_input = 2 * 16 * host.config.hidden_size * 8  # B·S·hidden fp64
    callbacks[1].stashes.disk = DiskTier(files, host_budget_bytes=block_input)  # one block input in memory
    for _ in range(2):
        for model in (host, disk):
            model(input_ids=ids, labels=targets).backward()
        assert files.bytes_on_disk == 0 and os.listdir(files.path) == []
    assert files.peak_bytes_on_disk >= 3 * block_input  # three of the four inputs went to disk
    assert callbacks[1].host_bytes == block_input
    for (name, a), (_, b) in zip(host.named_parameters(), disk.named_parameters()):
        assert torch.equal(a.grad, b.grad), name
    files.close()
