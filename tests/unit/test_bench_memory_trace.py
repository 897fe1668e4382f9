"""bench/memory_trace.py's replay of an allocator history, on a hand-written history."""

from bench.memory_trace import MARK_BYTES, summarise


def _frame(file: str, name: str) -> dict:
    return {"filename": f"/x/lightning_fpdt/{file}", "line": 1, "name": name}


def _history() -> dict:
    mlp = [_frame("memory/tiled_mlp.py", "tiled_mlp_backward")]
    attn = [_frame("sequence/fpdt.py", "fpdt_backward")]
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},
        {"action": "free_completed", "addr": 2, "size": 50, "frames": []},
        {"action": "alloc", "addr": 9, "size": MARK_BYTES, "frames": []},
        {"action": "free_completed", "addr": 9, "size": MARK_BYTES, "frames": []},
        {"action": "alloc", "addr": 3, "size": 40, "frames": mlp},
        {"action": "alloc", "addr": 4, "size": 30, "frames": mlp},
        {"action": "free_completed", "addr": 4, "size": 30, "frames": mlp},
        {"action": "alloc", "addr": 5, "size": 60, "frames": attn},
        {"action": "free_completed", "addr": 3, "size": 40, "frames": mlp},
        {"action": "free_requested", "addr": 5, "size": 60, "frames": attn},
        {"action": "alloc", "addr": 6, "size": 20, "frames": attn},
        {"action": "free_completed", "addr": 5, "size": 60, "frames": attn},
    ]
    return {"device_traces": [events], "fpdt_marks": ["step1"]}


def test_peak_is_the_largest_sum_of_live_allocations_after_the_marker():
    """The peak counts what was alive before the marker, skips the marker, and counts a tensor freed when its free is requested."""
    summary = summarise(_history(), since="step1")
    assert summary["base_bytes"] == 100
    assert summary["peak_bytes"] == 200  # 100 + 40 + 60
    assert summary["peak_phase"] == "attention backward"
    assert summary["phase_peaks"] == {"attention backward": 200, "MLP backward": 170}
    assert summary["at_peak_by_phase"] == {"other": 100, "attention backward": 60, "MLP backward": 40}
    sites = dict(summary["at_peak_by_site"])
    assert sites["lightning_fpdt/sequence/fpdt.py:1 fpdt_backward"] == 60
    assert sites["<autograd>"] == 100
