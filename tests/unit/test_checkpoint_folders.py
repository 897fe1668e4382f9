"""Checkpoint folders are checked before training (can be made, writable, room for one checkpoint) and a save that
runs out of space says so (lightning_fpdt/strategy/storage.py)."""

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_fpdt.strategy import storage
from lightning_fpdt.strategy.storage import CheckpointSize, checkpoint_size, folder_problem, out_of_space_error

DEV_FULL = Path("/dev/full")  # every write to it fails with ENOSPC: a full disk, from the kernel


def _model() -> nn.Module:
    sizes = torch.randint(3, 9, (3,), generator=torch.Generator().manual_seed(1)).tolist()
    return nn.Sequential(nn.Linear(sizes[0], sizes[1]), nn.Linear(sizes[1], sizes[2]))


def test_a_checkpoint_is_weights_and_optimizer_states():
    """The size counts every parameter's master weight once and once more per optimizer state (AdamW 2, SGD 0, an
    optimizer the planner does not list as Adam's 2), in the precision's master bytes."""
    model = _model()
    n = sum(p.numel() for p in model.parameters())
    adamw = checkpoint_size(model, "bf16-mixed", [torch.optim.AdamW(model.parameters())])
    assert adamw == CheckpointSize(n * 4 * 3, f"{n:,} parameters × 4 bytes × (1 weight + 2 AdamW states)")
    assert checkpoint_size(model, "bf16-true", [torch.optim.SGD(model.parameters(), lr=0.1)]).bytes == n * 2
    assert checkpoint_size(model, "32-true", [torch.optim.Adagrad(model.parameters())]).bytes == n * 4 * 3


def test_folders_that_cannot_take_a_checkpoint_are_named(tmp_path):
    """A folder under a file cannot be made, /sys cannot be written, a disk with less room than a checkpoint is too
    small; each message says which and why. A good folder is made and passes."""
    size = CheckpointSize(1000, "1 parameter")
    (tmp_path / "a-file").write_text("x")
    assert folder_problem(tmp_path / "a-file" / "checkpoints", size) == (
        f"{tmp_path / 'a-file' / 'checkpoints'} cannot be made (Not a directory)")
    if Path("/sys").is_dir() and not os.access("/sys", os.W_OK):
        assert folder_problem(Path("/sys"), size) == "/sys is not writable (Permission denied)"
    huge = CheckpointSize(shutil.disk_usage(tmp_path).free + 2**40, "many parameters × 4 bytes × (1 weight)")
    assert folder_problem(tmp_path, huge).startswith(f"{tmp_path} has ")
    assert "free and one checkpoint needs about" in folder_problem(tmp_path, huge)
    assert folder_problem(tmp_path / "new" / "checkpoints", size) is None
    assert (tmp_path / "new" / "checkpoints").is_dir()


@pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full")
def test_running_out_of_space_is_named(tmp_path, monkeypatch):
    """A write the kernel refuses with ENOSPC becomes an OSError(ENOSPC) naming the folder, its free space and a
    checkpoint's size; torch.save's short write (no errno) does too when the device has less room than a checkpoint,
    and is left alone when it has room; other errors pass through unchanged."""
    size = CheckpointSize(3 * 2**20, "786,432 parameters × 4 bytes × (1 weight)")
    target = tmp_path / "step=1.ckpt"
    os.symlink(DEV_FULL, target)
    with pytest.raises(OSError) as kernel:
        with storage.space_named(target, size):
            with open(target, "wb") as f:
                f.write(os.urandom(8192))
    assert kernel.value.errno == errno.ENOSPC
    assert f"No space left on the device of {tmp_path} while saving the checkpoint {target}" in str(kernel.value)
    assert "one checkpoint needs about 3.0 MiB (786,432 parameters" in str(kernel.value)

    with pytest.raises(RuntimeError) as short:
        torch.save({"w": torch.randn(4096)}, target)
    assert out_of_space_error(short.value, target, size) is None  # the folder has room: not a lack of space
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30, 0))
    named = out_of_space_error(short.value, target, size)
    assert named.errno == errno.ENOSPC and "0.0 MiB free now" in str(named)

    with pytest.raises(KeyError, match="unrelated"):
        with storage.space_named(target, size):
            raise KeyError("unrelated")
