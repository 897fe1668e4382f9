"""The CPU stand-in for the GPU's memory statistics (tests/live_bytes.py): what it counts and what it leaves out."""

from __future__ import annotations

import torch

from tests.live_bytes import LiveBytes


def test_counts_fresh_storages_until_freed():
    """Fresh outputs count until their storage is freed; views, in-place results and untracked() allocations do
    not; the peak keeps what was alive at it, largest first."""
    gen = torch.Generator().manual_seed(0)
    before = torch.randn(256, 64, generator=gen)  # allocated before the mode: never counted
    tracker = LiveBytes()
    with tracker:
        scaled = before * 2  # (256, 64) fp32: 64 KiB
        view = scaled[1:].t()
        scaled.add_(torch.randn(64, generator=gen))  # in place; the (64,) draw is freed at once
        with tracker.untracked():
            host = torch.empty(4096)  # e.g. a host buffer, which a GPU's count would not see
        wide = scaled.to(torch.float64)  # 128 KiB
        assert tracker.current == scaled.nbytes + wide.nbytes
        del scaled
        assert tracker.current == 64 * 1024 + wide.nbytes  # the view keeps the storage alive
        del view
        assert tracker.current == wide.nbytes
        del wide, host
    assert tracker.current == 0
    assert tracker.peak == 192 * 1024
    assert [(a.nbytes, a.op) for a in tracker.at_peak] == [(128 * 1024, "aten._to_copy.default"),
                                                           (64 * 1024, "aten.mul.Tensor")]
    tracker.reset_peak()
    assert tracker.peak == 0 and tracker.at_peak == []
