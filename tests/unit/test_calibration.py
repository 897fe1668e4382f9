"""The calibration of a GPU's rates (lightning_fpdt/planner/calibration.py, measure.py): its bounded loop, the rate
fits, the cache and its keys, what is measured when, and the rates a plan is timed at. On the CPU, with fake clocks
and the measurements replaced where a GPU would be needed."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_fpdt.planner import measure
from lightning_fpdt.planner.calibration import (
    CACHE_VERSION,
    Calibration,
    CalibrationKey,
    Shapes,
    cache_directory,
    find_cached,
    needed_shapes,
)
from lightning_fpdt.planner.plan import timed_sizes
from lightning_fpdt.planner.rates import BUILTIN_RATES, StepRates, attention_block_flops, attention_key, gemm_key
from lightning_fpdt.planner.request import PlanRequest

KEY = CalibrationKey(gpu="NVIDIA H200", torch="2.11.0+cu130", cudnn=91002)


class StepClock:
    """A fake clock: every call of the timed function takes ``seconds[i]`` (the i-th call), marks are call counts."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds_of_call = seconds
        self.calls = 0
        self.now = 0.0

    def call(self) -> None:
        self.now += self.seconds_of_call[min(self.calls, len(self.seconds_of_call) - 1)]
        self.calls += 1

    def mark(self) -> float:
        return self.now

    def seconds(self, start: float, end: float) -> float:
        return end - start


def test_time_calls_leaves_out_the_warm_up_and_takes_the_median():
    """The warm-up call is not timed; the result is the median of the timed calls."""
    clock = StepClock([10.0, 1.0, 3.0, 2.0])
    assert measure.time_calls(clock.call, clock=clock, warmup=1, calls=3, max_seconds=100.0) == 2.0
    assert clock.calls == 4


def test_time_calls_stops_at_its_bound():
    """Timed calls stop once they have taken ``max_seconds``, at least one timed: a slow shape costs about the
    bound, not ``calls`` times its time."""
    clock = StepClock([1.0, 4.0, 4.0, 4.0, 4.0])
    assert measure.time_calls(clock.call, clock=clock, warmup=1, calls=4, max_seconds=6.0) == 4.0
    assert clock.calls == 3  # the warm-up and two timed calls: 8 s >= 6 s
    clock = StepClock([1.0, 50.0])
    measure.time_calls(clock.call, clock=clock, warmup=1, calls=3, max_seconds=6.0)
    assert clock.calls == 2


def test_fit_rate_separates_latency_from_rate():
    """``seconds = latency + size / rate`` fitted by least squares gives back the rate and latency it was made of;
    one measurement is its own rate; times that do not grow are refused."""
    sizes = [1e6, 4e6, 16e6]
    latency, rate = measure.fit_rate(sizes, [2e-5 + s / 5e10 for s in sizes])
    # fp64 least squares on exact data: relative error ~1e-12
    assert latency == pytest.approx(2e-5, rel=1e-9) and rate == pytest.approx(5e10, rel=1e-9)
    assert measure.fit_rate([8.0], [2.0]) == (0.0, 4.0)
    with pytest.raises(ValueError, match="do not grow"):
        measure.fit_rate([1.0, 2.0], [3.0, 3.0])


def test_cpu_measurements_run_and_are_rates():
    """The GEMM, attention block and memory-bound measurements run on CPU tensors (the math kernel) and give
    positive figures: FLOP/s of the GEMM, seconds of the block."""
    clock = measure.HostClock()
    flops = measure.gemm_flops("weight_grad", 64, 32, 16, device=torch.device("cpu"), dtype=torch.float32,
                               clock=clock)
    seconds = measure.attention_seconds("backward", causal=True, batch=1, heads=4, kv_heads=2, tokens=32,
                                        head_dim=16, device=torch.device("cpu"), dtype=torch.float32, clock=clock,
                                        backend="math")
    rate = measure.elementwise_bytes(torch.device("cpu"), clock=clock, elements=1 << 16)
    assert flops > 0 and seconds > 0 and rate > 0
    assert measure.copy_overlap(torch.device("cpu"), clock=clock) == 0.0  # no streams on the CPU
    with pytest.raises(ValueError, match="GEMM kind"):
        measure.gemm_flops("sideways", 4, 4, 4, device=torch.device("cpu"), dtype=torch.float32, clock=clock)


def test_cache_key_names_one_file_per_gpu_torch_and_cudnn(tmp_path, monkeypatch):
    """The cache lives under $XDG_CACHE_HOME/lightning_fpdt, one file per GPU model, torch version and cuDNN
    version; a file name is safe whatever the GPU's name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_directory() == tmp_path / "lightning_fpdt"
    names = {CalibrationKey(gpu, version, cudnn).file_name()
             for gpu in ("NVIDIA H200", "NVIDIA H100 80GB HBM3") for version in ("2.11.0", "2.12.0")
             for cudnn in (91002, None)}
    assert len(names) == 8 and all("/" not in name and " " not in name for name in names)
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert str(cache_directory()).endswith(".cache/lightning_fpdt")


def _fake_measurements(monkeypatch, calls: list[str]) -> None:
    """Every measurement replaced by a constant, noting what was measured."""
    def note(name, value):
        def measured(*args, **kwargs):
            calls.append(name)
            return value
        return measured

    monkeypatch.setattr(measure, "copy_rates", note("copies", {"host_to_device": 50e9, "device_to_host": 40e9}))
    monkeypatch.setattr(measure, "copy_overlap", note("overlap", 0.9))
    monkeypatch.setattr(measure, "elementwise_bytes", note("elementwise", 4e12))
    monkeypatch.setattr(measure, "gemm_flops", note("gemm", 700e12))
    monkeypatch.setattr(measure, "attention_seconds", note("attention", 0.01))
    monkeypatch.setattr(measure, "disk_bytes", note("disk", 2e9))


def test_machine_rates_once_shapes_when_first_needed_and_the_cache_round_trip(tmp_path, monkeypatch):
    """The machine's rates are measured once; each shape once, when a plan first needs it; what is measured is
    cached and read back (an unreadable file or one of another version is measured again)."""
    calls: list[str] = []
    _fake_measurements(monkeypatch, calls)
    shapes = Shapes(frozenset({("forward", 4096, 3072, 3072)}),
                    frozenset({("forward", True, 1, 24, 8, 65536, 128)}))
    calibration = Calibration.load(KEY, tmp_path)
    assert not calibration.measured and calibration.missing(shapes) == shapes
    left = calibration.measure(torch.device("cpu"), shapes=shapes, offload_dir=str(tmp_path))
    assert len(left) == 0 and sorted(calls) == ["attention", "copies", "disk", "elementwise", "gemm", "overlap"]
    calibration.save()
    again = Calibration.load(KEY, tmp_path)
    assert again.measured and len(again.missing(shapes)) == 0 and again.data == calibration.data
    calls.clear()
    more = Shapes(shapes.gemms | {("input_grad", 4096, 3072, 3072)}, shapes.attention)
    again.measure(torch.device("cpu"), shapes=more)
    assert calls == ["gemm"]  # only the shape not measured before
    (tmp_path / KEY.file_name()).write_text(json.dumps({**calibration.data, "version": CACHE_VERSION + 1}))
    assert not Calibration.load(KEY, tmp_path).measured
    (tmp_path / KEY.file_name()).write_text("{not json")
    assert not Calibration.load(KEY, tmp_path).measured


def test_shapes_stop_at_the_time_bound(tmp_path, monkeypatch):
    """Past ``budget_seconds`` the shapes left are not measured (they are returned, and measured when next needed):
    each measurement takes 10 s of the fake clock, the bound is 25 s, so three of five are measured."""
    calls: list[str] = []
    _fake_measurements(monkeypatch, calls)
    clock = {"now": 0.0}

    def gemm(*args, **kwargs):
        clock["now"] += 10.0
        return 700e12

    monkeypatch.setattr(measure, "gemm_flops", gemm)
    calibration = Calibration(KEY, path=tmp_path / KEY.file_name())
    shapes = Shapes(frozenset(("forward", rows, 1024, 1024) for rows in (1024, 2048, 4096, 8192, 16384)))
    left = calibration.measure(torch.device("cpu"), shapes=shapes, budget_seconds=25.0, now=lambda: clock["now"])
    assert len(calibration.data["gemms"]) == 3 and len(left) == 2
    assert {rows for _, rows, _, _ in left.gemms} == {8192, 16384}  # the cheapest first


def test_rates_are_the_measured_ones_and_the_nearest_shape_stands_for_one_not_measured(tmp_path):
    """A measured GEMM's rate, the nearest measured rows of its width where its own were not measured, the median
    measured rate for another width; a measured block's seconds, the nearest measured block scaled by the FLOPs for
    another, the built-in table's rule only where nothing of its kind was measured."""
    calibration = Calibration(KEY, path=tmp_path / KEY.file_name())
    calibration.data["machine"] = {"host_to_device": 55e9, "device_to_host": 45e9, "copy_overlap": 0.8,
                                   "elementwise_bytes": 4e12}
    calibration.data["all_to_all"] = {"2": 150e9}
    calibration.data["gemms"] = {gemm_key("forward", 8192, 3072, 8192): 800e12,
                                 gemm_key("forward", 1024, 3072, 8192): 400e12}
    shape = dict(batch=1, heads=24, kv_heads=8, tokens=32768, head_dim=128)
    calibration.data["attention"] = {attention_key("forward", causal=True, **shape): 0.02}
    rates = calibration.rates(group_size=2)
    assert rates.calibrated and str(tmp_path) in rates.source and "NVIDIA H200" in rates.source
    assert rates.copy_bytes == 45e9 and rates.copy_overlap == 0.8 and rates.all_to_all_bytes == 150e9
    assert calibration.rates().all_to_all_bytes is None  # one process: no all-to-all
    assert rates.gemm_flops("forward", 8192, 3072, 8192) == 800e12
    assert rates.gemm_flops("forward", 65536, 3072, 8192) == 800e12  # beyond the rows measured: the largest
    assert rates.gemm_flops("forward", 1500, 3072, 8192) == 400e12  # nearest by ratio: 1024
    assert rates.gemm_flops("forward", 8192, 4096, 4096) == rates.matmul_flops == 600e12  # the median
    assert rates.attention_seconds("forward", causal=True, **shape) == 0.02
    # twice the tokens, half the heads: the nearest measured block, scaled by the FLOPs (2^2 / 2 = 2x)
    other = dict(shape, tokens=65536, heads=12)
    assert rates.attention_seconds("forward", causal=True, **other) == pytest.approx(0.04, rel=1e-12)
    # a backward: nothing of its kind measured, the table's FLOPs at the median measured attention rate
    flops = attention_block_flops("backward", causal=True, batch=1, heads=24, tokens=32768, head_dim=128)
    assert rates.attention_seconds("backward", causal=True, **shape) == pytest.approx(flops / rates.attention_flops)
    assert BUILTIN_RATES.attention_seconds("forward", causal=True, **shape) == pytest.approx(
        attention_block_flops("forward", causal=True, batch=1, heads=24, tokens=32768, head_dim=128) / 520e12)


def test_rates_need_the_machine_measured():
    """A calibration that has not measured its machine gives no rates: the error says to measure it."""
    with pytest.raises(ValueError, match="lightning-fpdt calibrate"):
        Calibration(KEY).rates()


def test_needed_shapes_are_what_the_search_times():
    """A plan's shapes: every GEMM of a layer and the lm_head in its three kinds, and the attention's blocks of each
    chunk count the search may try (causal and full, forward and backward), at the busiest rank's heads."""
    request = PlanRequest.of(geometry="llama3-3b", seq_len=131072, num_gpus=1, activation_offload=True,
                             tiled_mlp=True, tiled_loss=True)
    shapes = needed_shapes(timed_sizes(request))
    tokens = {shape[5] for shape in shapes.attention}
    assert tokens == {65536, 32768, 16384, 8192}  # chunks 2, 4, 8, 16 of 131,072
    assert {shape[3] for shape in shapes.attention} == {24}  # one GPU: every head
    widths = {(inner, cols) for _, _, inner, cols in shapes.gemms}
    assert (3072, 8192) in widths and (8192, 3072) in widths and (3072, 128256) in widths  # up, down, lm_head
    assert {kind for kind, *_ in shapes.gemms} == {"forward", "input_grad", "weight_grad"}


def test_find_cached_reads_the_named_gpus_calibration(tmp_path):
    """``plan --card NAME`` reads that GPU's cached calibration (one that measured its machine), none for a GPU with
    none cached."""
    calibration = Calibration(KEY, path=tmp_path / KEY.file_name())
    calibration.data["machine"] = {"host_to_device": 55e9, "device_to_host": 45e9, "copy_overlap": 0.8,
                                   "elementwise_bytes": 4e12}
    calibration.save()
    found = find_cached("NVIDIA H200", tmp_path)
    assert found is not None and found.data == calibration.data
    assert find_cached("NVIDIA A100-SXM4-80GB", tmp_path) is None


def test_step_rates_hash_and_compare_by_their_figures():
    """Rates are values: two made of the same figures are equal (the planner's runs compare them)."""
    one = StepRates(gemms=(("forward:4x4x4", 1.0),))
    assert one == StepRates(gemms=(("forward:4x4x4", 1.0),)) and hash(one) == hash(StepRates(gemms=one.gemms))
    assert one != BUILTIN_RATES
