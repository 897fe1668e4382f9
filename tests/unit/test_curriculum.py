"""SequenceLengthCurriculum: schedules, their checks, and the lengths a model sees step by step."""

import lightning as L
import pytest

from lightning_fpdt.callbacks.curriculum import SequenceLengthCurriculum, geometric_schedule
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import LlamaLM


def test_schedule_lookup():
    """A length holds from its step until the next entry; before the first entry the first length applies."""
    curriculum = SequenceLengthCurriculum({2: 64, 5: 128, 0: 32})
    assert [curriculum.seq_len_at(step) for step in range(7)] == [32, 32, 64, 64, 64, 128, 128]
    assert SequenceLengthCurriculum([(3, 16), (6, 32)]).seq_len_at(0) == 16


def test_geometric_ramp():
    """start/target/ramp_steps doubles the length in equal stages and reaches the target at ramp_steps."""
    assert geometric_schedule(8192, 65536, 300) == [(0, 8192), (100, 16384), (200, 32768), (300, 65536)]
    assert geometric_schedule(100, 300, 10, multiple_of=64) == [(0, 64), (5, 192), (10, 300)]
    assert SequenceLengthCurriculum(start=32, target=128, ramp_steps=4).schedule == [(0, 32), (2, 64), (4, 128)]


def test_schedule_messages():
    """Contradictory or shrinking schedules are refused with the offending values."""
    with pytest.raises(ValueError, match="lengths must not shrink, but step 5 has 32 < 64 at step 2"):
        SequenceLengthCurriculum({2: 64, 5: 32})
    with pytest.raises(ValueError, match="give either schedule or start/target/ramp_steps, not both"):
        SequenceLengthCurriculum({0: 8}, start=8)
    with pytest.raises(ValueError, match=r"needs schedule=\{step: length, ...\} or start=..., ramp_steps=..."):
        SequenceLengthCurriculum()
    with pytest.raises(RuntimeError, match="not known before the data module is set up"):
        SequenceLengthCurriculum(start=8, ramp_steps=4).seq_len_at(0)


class RecordingLM(LlamaLM):
    def on_fit_start(self):
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.trainer.global_step, batch["input_ids"].shape[1]))
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.val_lengths.append(batch["input_ids"].shape[1])
        return super().validation_step(batch, batch_idx)


def _fit(curriculum, max_steps, accumulate=1):
    module = RecordingLM("tiny", config_overrides={"vocab_size": 96, "num_layers": 1})
    module.val_lengths = []
    data = RetrievalDataModule(seq_len=96, vocab_size=96, num_train=64, num_val=2, batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, accumulate_grad_batches=accumulate,
                        callbacks=[curriculum], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, val_check_interval=max_steps * accumulate, num_sanity_val_steps=0,
                        limit_val_batches=1)
    trainer.fit(module, data)
    return module


def test_model_sees_the_scheduled_lengths():
    """Training batches are cut to the length of their optimizer step (all micro-batches of a step alike);
    validation runs at the data module's full length."""
    module = _fit(SequenceLengthCurriculum({0: 32, 2: 64, 3: 96}), max_steps=4, accumulate=2)
    assert module.seen == [(0, 32), (0, 32), (1, 32), (1, 32), (2, 64), (2, 64), (3, 96), (3, 96)]
    assert module.val_lengths == [96]
    ramp = _fit(SequenceLengthCurriculum(start=30, ramp_steps=4), max_steps=5)  # target: the data's 96
    assert ramp.seen == [(0, 30), (1, 30), (2, 60), (3, 60), (4, 96)]


def test_lengths_outside_the_data_are_refused():
    """A schedule longer than the data's seq_len (or shorter than a sample's fixed part) fails at setup."""
    with pytest.raises(ValueError, match=r"lengths \[128\] are outside what RetrievalDataModule produces: 26 to "
                                         r"seq_len 96"):
        _fit(SequenceLengthCurriculum({0: 32, 2: 128}), max_steps=1)
