"""The calibration on a real GPU (marker gpu): every rate it measures exists and is a rate, every shape a small plan
times is measured through the package's attention kernel, and a second calibration of the same GPU measures nothing
(the figures themselves are timings: they belong to bench/, not to an assertion)."""

import pytest
import torch

from lightning_fpdt.planner.calibration import Calibration, current_key, needed_shapes
from lightning_fpdt.planner.plan import timed_sizes
from lightning_fpdt.planner.request import PlanRequest

pytestmark = pytest.mark.gpu


def test_calibration_measures_the_machine_and_the_shapes_once(tmp_path):
    """A plan of a small model at 16,384 tokens: its GEMMs and attention blocks measured, the copies, their overlap
    with a GEMM and a memory-bound op measured; cached, read back, and nothing measured the second time."""
    device = torch.device("cuda", 0)
    request = PlanRequest.of(geometry=dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                           num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=8),
                             seq_len=16384, num_gpus=1, activation_offload=True, tiled_mlp=True, tiled_loss=True,
                             chunks="auto")
    shapes = needed_shapes(timed_sizes(request))
    calibration = Calibration.load(current_key(device), tmp_path)
    left = calibration.measure(device, shapes=shapes)
    machine = calibration.data["machine"]
    assert len(left) == 0 and len(calibration.missing(shapes)) == 0
    assert machine["host_to_device"] > 0 and machine["device_to_host"] > 0 and machine["elementwise_bytes"] > 0
    assert 0.0 <= machine["copy_overlap"] <= 1.0
    assert all(rate > 0 for rate in calibration.data["gemms"].values())
    assert all(seconds > 0 for seconds in calibration.data["attention"].values())
    calibration.save()
    again = Calibration.load(current_key(device), tmp_path)
    assert again.data == calibration.data and len(again.measure(device, shapes=shapes)) == 0
    assert again.data["gemms"] == calibration.data["gemms"]  # nothing measured again
    rates = again.rates()
    assert rates.calibrated and torch.cuda.get_device_name(device) in rates.source
