"""The rates a run plans with (strategy/run_rates.py): rank 0 calibrates this GPU once where nothing is cached, says so,
measures a new length's shapes when first planned, and every rank plans with rank 0's rates."""

from __future__ import annotations

import torch

from lightning_fpdt.planner import measure
from lightning_fpdt.planner.calibration import CalibrationKey
from lightning_fpdt.planner.request import PlanRequest
from lightning_fpdt.strategy import run_rates
from lightning_fpdt.strategy.run_rates import RunRates

KEY = CalibrationKey(gpu="NVIDIA H200", torch="2.11.0", cudnn=91002)


def _fake(monkeypatch, tmp_path) -> list[str]:
    calls: list[str] = []

    def note(name, value):
        def measured(*args, **kwargs):
            calls.append(name)
            return value
        return measured

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(run_rates, "current_key", lambda device: KEY)
    monkeypatch.setattr(measure, "copy_rates", note("copies", {"host_to_device": 50e9, "device_to_host": 45e9}))
    monkeypatch.setattr(measure, "copy_overlap", note("overlap", 0.9))
    monkeypatch.setattr(measure, "elementwise_bytes", note("elementwise", 4e12))
    monkeypatch.setattr(measure, "gemm_flops", note("gemm", 700e12))
    monkeypatch.setattr(measure, "attention_seconds", note("attention", 0.01))
    return calls


def _request(seq_len: int) -> PlanRequest:
    return PlanRequest.of(geometry="tiny", seq_len=seq_len, num_gpus=1, activation_offload=True, tiled_mlp=True,
                          tiled_loss=True)


def test_rank_0_calibrates_once_and_every_rank_plans_with_its_rates(monkeypatch, tmp_path):
    """The first plan of a run on a GPU with nothing cached: rank 0 measures the machine and the length's shapes,
    logs it with the cache's path and the seconds, caches them; another rank measures nothing and gets rank 0's
    rates; a second length measures only its new shapes; a new run reads the cache and measures nothing."""
    calls = _fake(monkeypatch, tmp_path)
    logged: list[str] = []
    shared: list = []
    zero = RunRates(log=logged.append)
    rates = zero.for_request(_request(256), device=torch.device("cpu"), global_rank=0,
                             share=lambda value: shared.append(value) or value)
    assert rates.calibrated and {"copies", "overlap", "elementwise", "gemm", "attention"} <= set(calls)
    assert logged[0].startswith(f"fpdt: calibrating this GPU ({KEY.describe()}) once; cached at {tmp_path}")
    assert logged[1].startswith("fpdt: calibrated in ") and (tmp_path / "lightning_fpdt" / KEY.file_name()).exists()
    calls.clear()
    other = RunRates(log=logged.append).for_request(_request(256), device=torch.device("cpu"), global_rank=1,
                                                    share=lambda value: shared[0])
    assert calls == [] and other == rates
    zero.for_request(_request(1024), device=torch.device("cpu"), global_rank=0, share=lambda value: value)
    assert calls and set(calls) <= {"gemm", "attention"}  # the new length's shapes only
    calls.clear()
    again = RunRates(log=logged.append).for_request(_request(1024), device=torch.device("cpu"), global_rank=0,
                                                    share=lambda value: value)
    assert calls == [] and again.calibrated
