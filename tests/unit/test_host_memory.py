"""Host memory that costs what it holds: exact host buffers, their registration with CUDA, the guard that ends a run
with a message instead of the kernel's kill, and the readings of the process's memory."""

from __future__ import annotations

import mmap

import pytest
import torch

from lightning_fpdt.offload.host_memory import (
    HostAllocator,
    HostMemoryError,
    HostMemoryGuard,
    page_rounded,
    peak_resident_bytes,
    reset_peak_resident,
    resident_bytes,
)
from lightning_fpdt.offload.host_stash import HostBufferPool, HostStash, StashFactory

PAGE = mmap.PAGESIZE


class FakeCudart:
    """Stands for ``torch.cuda.cudart()`` on a machine without CUDA: records what is registered, byte for byte."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        assert address not in self.registered, "registered twice"
        self.registered[address] = nbytes
        self.calls.append(("register", address, nbytes))
        return 0

    def cudaHostUnregister(self, address: int) -> int:  # noqa: N802
        assert address in self.registered, "unregistered without a registration"
        self.calls.append(("unregister", address, self.registered.pop(address)))
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def test_pool_buffers_hold_exactly_the_bytes_asked_for(cudart):
    """Each new buffer of the pool is page-locked for exactly its bytes (the caching host allocator would round a
    3 GiB buffer to 4), counted by the pool byte for byte; a buffer handed back is reused, not allocated again."""
    pool = HostBufferPool(pin_memory=True)
    sizes = [(torch.bfloat16, 3 * 1000 * 1001), (torch.float32, 12_345), (torch.bfloat16, 7), (torch.int64, 2**20 + 1)]
    buffers = []
    for dtype, numel in sizes:
        buffer, last_read = pool.acquire(dtype, numel)
        assert last_read is None and buffer.dtype == dtype and buffer.numel() == numel
        assert buffer.untyped_storage().nbytes() == numel * buffer.element_size()
        assert buffer.untyped_storage().data_ptr() % PAGE == 0  # its own mapping
        buffers.append(buffer)
    requested = [numel * torch.empty((), dtype=dtype).element_size() for dtype, numel in sizes]
    assert pool.allocated_bytes == sum(requested)
    assert pool.allocator.mapped_bytes == sum(page_rounded(n) for n in requested)
    assert sorted(cudart.registered.values()) == sorted(requested)  # registered exactly, not rounded up
    buffer = buffers[0]
    pool.give_back(buffer, None)
    again, _ = pool.acquire(torch.bfloat16, 3 * 1000 * 1001)
    assert again.data_ptr() == buffer.data_ptr() and pool.allocated_bytes == sum(requested)
    pool.give_back(again, None)
    assert pool.trim() == requested[0]  # an idle buffer freed: unregistered, uncounted
    assert pool.allocated_bytes == sum(requested[1:]) and len(cudart.registered) == 3
    pool.allocator.close()
    assert not cudart.registered  # every registration ended


def test_registered_tensors_are_counted_once(cudart):
    """An existing host tensor (an FSDP2 shard) is registered over its whole storage, once however many views."""
    allocator = HostAllocator(pin=True)
    shard = torch.randn(1000, 37)
    allocator.register(shard)
    allocator.register(shard[3:])  # a view of the same storage
    assert allocator.allocated_bytes == shard.untyped_storage().nbytes() == 1000 * 37 * 4
    assert list(cudart.registered.values()) == [1000 * 37 * 4]
    allocator.close()
    assert not cudart.registered


def test_unpinned_allocator_counts_the_same_without_cuda():
    """On a CPU run the buffers are the same exact mappings, counted the same, and nothing is registered."""
    allocator = HostAllocator(pin=False)
    buffer = allocator.empty(4097, torch.float16)
    buffer.copy_(torch.randn(4097).half())  # writable, the values kept
    assert allocator.allocated_bytes == 8194 and allocator.mapped_bytes == page_rounded(8194)


def test_guard_refuses_a_buffer_the_host_cannot_give():
    """A buffer that would leave less than the reserve ends the run with an error naming the bytes, the host's, the
    plan the run was accepted on and the fix, before anything is allocated."""
    gib = 2**30
    guard = HostMemoryGuard(reserve_bytes=2 * gib, available=lambda: 3 * gib,
                            describe=lambda: "The run was accepted on this plan: 80.00 GiB per host. Fix: less.")
    guard.check(gib, "the checkpointed block inputs")  # leaves 2 GiB: allowed
    pool = HostBufferPool(pin_memory=False, guard=guard, what="the checkpointed block inputs")
    with pytest.raises(HostMemoryError, match=r"host memory ran short: the checkpointed block inputs needs 1\.50 GiB "
                                              r"more, the host has 3\.00 GiB available and 2\.00 GiB stay in reserve.*"
                                              r"accepted on this plan: 80\.00 GiB per host\. Fix: less\."):
        pool.acquire(torch.bfloat16, 3 * gib // 4)
    assert pool.allocated_bytes == 0


def test_stashes_ask_the_guard_the_strategy_sets():
    """A stash factory's pool asks the guard set on the factory, also when the guard came after the pool."""
    factory = StashFactory(offload=True, what="the attention stash")
    stash = factory.chunks(torch.device("cpu"))
    stash.put("q", torch.randn(64))  # no guard yet
    factory.guard = HostMemoryGuard(reserve_bytes=0, available=lambda: 10)
    stash = factory.chunks(torch.device("cpu"))
    with pytest.raises(HostMemoryError, match="the attention stash needs"):
        stash.put("k", torch.randn(4096))
    assert isinstance(stash, HostStash)


def test_process_readings():
    """The resident memory of this process, its peak and the reset of the peak read from /proc."""
    now = resident_bytes()
    assert now is not None and now > 2**20
    assert peak_resident_bytes() >= now
    if reset_peak_resident():
        start = resident_bytes()
        fresh = HostAllocator(pin=False).empty(64 * 2**20, torch.uint8)  # pages of its own, never resident before
        fresh.fill_(1)
        assert peak_resident_bytes() >= start + 60 * 2**20
        del fresh


def _vm_flags(address: int) -> list[str]:
    """The kernel's VmFlags of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_host_buffers_are_not_inherited_by_child_processes():
    """A fork would copy page-locked pages of a private mapping at once: every buffer is MADV_DONTFORK ("dc")."""
    allocator = HostAllocator(pin=False)
    buffer = allocator.empty(3 * 2**20 + 7, torch.uint8)
    assert "dc" in _vm_flags(buffer.data_ptr())


def test_a_registration_that_cannot_end_keeps_its_memory_mapped(cudart, monkeypatch):
    """cudaHostUnregister failing (released, or at close): the buffer stays alive, so its memory is not unmapped while
    the driver may still have it registered, and a warning names it; a registration that ends lets its buffer go."""
    from lightning_fpdt.offload import host_memory

    monkeypatch.setattr(host_memory, "_STILL_REGISTERED", [])
    allocator = HostAllocator(pin=True)
    released, closed, ended = (allocator.empty(n, torch.float32) for n in (1000, 2000, 3000))
    addresses = [t.untyped_storage().data_ptr() for t in (released, closed, ended)]
    failing = {addresses[0], addresses[1]}
    unregister = cudart.cudaHostUnregister
    monkeypatch.setattr(cudart, "cudaHostUnregister",
                        lambda address: 801 if address in failing else unregister(address))
    with pytest.warns(RuntimeWarning, match="failed with CUDA error 801"):
        allocator.release(released)
    with pytest.warns(RuntimeWarning, match="stays mapped until the process ends"):
        allocator.close()
    kept = [address for address, _ in host_memory._STILL_REGISTERED]
    assert sorted(kept) == sorted(failing)
    assert all(t.untyped_storage().nbytes() for _, t in host_memory._STILL_REGISTERED)
    assert addresses[2] not in cudart.registered  # the third's registration ended normally


def test_memory_that_cannot_be_kept_from_a_child_is_named():
    """MADV_DONTFORK refused (here: pages nobody mapped) is a warning naming the range, not silence."""
    from lightning_fpdt.offload.host_memory import _not_inherited

    with pytest.warns(RuntimeWarning, match=f"MADV_DONTFORK.*{PAGE:#x} failed"):
        _not_inherited(PAGE, PAGE)
