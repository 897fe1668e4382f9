"""StepProgress: the blocks' hooks record forward and backward positions, the text says where the step is and what
is left, and a slow step shows while it runs: in the bar on a terminal (Rich or TQDM), in the log otherwise, with
logging nobody configured too."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_fpdt.callbacks.step_progress import StepPosition, StepProgress, describe
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.memory.surgery import find_blocks
from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.models.module import LlamaLM


def test_hooks_follow_the_blocks():
    """A forward leaves the position at the last block's forward, the backward at the first block's backward, a
    block run again inside the backward (checkpointing) shows as a recompute, and a forward in eval mode (an
    evaluation between steps) moves nothing."""
    model = LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=32))
    progress = StepProgress()
    progress.install(model)
    assert progress.num_blocks == 2
    seen = []
    first_block = find_blocks(model)[0]
    first_block.register_forward_pre_hook(lambda m, a: seen.append((progress.position.phase,
                                                                        progress.position.block)))
    ids = torch.randint(0, 32, (2, 16))
    loss = model(input_ids=ids, labels=ids)
    assert (progress.position.phase, progress.position.block) == ("forward", 1)
    loss.backward()
    assert (progress.position.phase, progress.position.block) == ("backward", 0)
    model(input_ids=ids, labels=ids)  # a forward while the position is in the backward: a recompute
    assert (progress.position.phase, progress.position.block) == ("recompute", 1)
    assert seen[0] == ("forward", 0) and seen[1] == ("recompute", 0)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # an evaluation between steps: not the step's
    assert (progress.position.phase, progress.position.block) == ("recompute", 1)
    model.train()
    progress.remove()
    model(input_ids=ids, labels=ids)
    assert progress.position.phase == "recompute" and len(seen) == 4  # the hooks are gone


def test_text_says_where_and_what_is_left():
    """Nothing before after_seconds; then the phase, the block, the tokens, the time, and the time left from the
    previous step, or for the first step from the planner's estimate."""
    progress = StepProgress(after_seconds=5)
    progress.num_blocks = 32
    progress.position = StepPosition(step=12, started=100.0, phase="backward", block=2, tokens=1 << 20, running=True)
    assert progress.text(now=104.0) is None
    assert progress.text(now=141.0) == "step 12: backward, block 3 of 32, 1,048,576 tokens, 41 s"
    progress.planned_seconds = 50.0
    assert progress.text(now=141.0).endswith("; ~9 s left (planner's estimate at an H100's rates 50 s)")
    progress.previous_seconds = 30.0
    assert progress.text(now=141.0).endswith("; 11 s over (previous step 30 s)")
    assert describe(StepPosition(step=0, started=0.0), 2, 1.0, None, "") == "step 0: starting, 0 tokens, 1 s"
    with pytest.raises(ValueError, match="refresh_seconds"):
        StepProgress(refresh_seconds=0)


class SlowLM(LlamaLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        time.sleep(0.3)  # a long step: the display thread sees it running, after the forward of the last block
        return loss


def test_a_slow_step_shows_in_the_log(caplog):
    """Without a progress bar, a step longer than after_seconds is logged while it runs; the next step's estimate
    is the previous step's duration."""
    progress = StepProgress(after_seconds=0.1, refresh_seconds=0.02, log_every_seconds=0.05)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[progress])
    with caplog.at_level(logging.INFO, logger="lightning_fpdt"):
        trainer.fit(SlowLM("tiny", config_overrides={"vocab_size": 96}),
                    datamodule=RetrievalDataModule(seq_len=32, vocab_size=96, batch_size=2))
    lines = [r.getMessage() for r in caplog.records if r.name == "lightning_fpdt"]
    assert any(line.startswith("step 0: forward, block 2 of 2, 64 tokens") for line in lines)
    assert any(line.startswith("step 1: ") and "(previous step" in line for line in lines)
    assert progress.previous_seconds >= 0.3 and not progress._handles  # hooks removed at the end


# ---- what a user sees by default ---------------------------------------------------------------------------------
class Terminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def slow_fit(progress: StepProgress, **trainer_options) -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[progress, *trainer_options.pop(
                            "callbacks", [])], **trainer_options)
    trainer.fit(SlowLM("tiny", config_overrides={"vocab_size": 96}),
                datamodule=RetrievalDataModule(seq_len=32, vocab_size=96, batch_size=2))


def test_rich_bar_on_a_terminal_shows_the_step():
    """With the Rich progress bar Lightning picks when rich is installed, on a terminal, the step's position follows
    the training task's description while it runs, and the description is Lightning's again after the step."""
    from lightning.pytorch.callbacks import RichProgressBar

    screen = Terminal()
    bar = RichProgressBar(console_kwargs=dict(file=screen, force_terminal=True, width=200))
    slow_fit(StepProgress(after_seconds=0.1, refresh_seconds=0.02), callbacks=[bar])
    assert "step 0: forward, block 2 of 2, 64 tokens" in screen.getvalue()
    assert "·" not in bar.train_progress_bar.description


def test_tqdm_bar_on_a_terminal_shows_the_step(monkeypatch):
    """With the TQDM progress bar on a terminal, the step's position is the bar's postfix while it runs."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    screen = Terminal()
    monkeypatch.setattr("sys.stdout", screen)
    slow_fit(StepProgress(after_seconds=0.1, refresh_seconds=0.02), callbacks=[TQDMProgressBar()])
    assert "step 0: forward, block 2 of 2, 64 tokens" in screen.getvalue()


DEFAULT_RUN = """
import sys, time
import lightning as L
from lightning_fpdt import StepProgress
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import LlamaLM


class SlowLM(LlamaLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        time.sleep(0.3)
        return loss


for bar in ("default", "tqdm", "none"):
    print(f"=== {bar}", flush=True)
    options = dict(enable_progress_bar=bar != "none")
    if bar == "tqdm":
        options["callbacks"] = [L.pytorch.callbacks.TQDMProgressBar()]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, limit_val_batches=0, **options)
    trainer.callbacks.append(StepProgress(after_seconds=0.1, refresh_seconds=0.02, log_every_seconds=0.05))
    trainer.fit(SlowLM("tiny", config_overrides={"vocab_size": 96}),
                datamodule=RetrievalDataModule(seq_len=32, vocab_size=96, batch_size=2))
    sys.stderr.flush()
"""


def test_a_slow_step_shows_in_a_log_file_by_default(tmp_path):
    """A run whose output goes to a file, with logging nobody configured, shows the step's position in that file:
    under the bar Lightning picks by default, under the TQDM bar, and with no bar."""
    log_file = tmp_path / "run.log"
    with log_file.open("w") as out:
        subprocess.run([sys.executable, "-c", DEFAULT_RUN], stdout=out, stderr=subprocess.STDOUT, check=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=300)
    text = log_file.read_text()
    sections = dict(part.split("\n", 1) for part in text.split("=== ")[1:])
    assert set(sections) == {"default", "tqdm", "none"}, text[-2000:]
    for bar, section in sections.items():
        assert "step 0: forward, block 2 of 2, 64 tokens" in section, f"{bar}: {section[-1500:]}"
