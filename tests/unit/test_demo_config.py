"""The demo's config builds what the README promises: fpdt over 2 CPU processes, chunks 2, TensorBoard, MFUMonitor,
and a retrieval task whose answers sit on the other rank than their keys."""

from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_fpdt import FPDTStrategy, MFUMonitor
from lightning_fpdt.cli import FPDTCLI
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.sequence import SequenceLayout

ROOT = Path(__file__).resolve().parents[2]


def test_demo_config(monkeypatch):
    """scripts/demo.sh runs examples/configs/demo_cpu.yaml, which builds the demo's trainer, model and data."""
    assert "examples/configs/demo_cpu.yaml" in (ROOT / "scripts" / "demo.sh").read_text()
    monkeypatch.setattr("sys.argv", ["lightning-fpdt"])
    cli = FPDTCLI(args=["--config", str(ROOT / "examples" / "configs" / "demo_cpu.yaml")], run=False)
    trainer, data = cli.trainer, cli.datamodule
    assert isinstance(trainer.strategy, FPDTStrategy) and trainer.strategy.num_chunks_for(data.seq_len) == 2
    assert trainer.num_devices == 2 and trainer.strategy.root_device.type == "cpu"
    assert isinstance(trainer.logger, TensorBoardLogger)
    assert any(isinstance(cb, MFUMonitor) for cb in trainer.callbacks)
    assert isinstance(data, RetrievalDataModule) and cli.model.accuracy
    assert cli.model.model.config.vocab_size >= data.task.vocab_size
    # sequence parallel 2 × chunks 2 at the full length: every key-value pair on rank 0, every query on rank 1
    owner = {int(t): rank for rank in range(2)
             for t in SequenceLayout(2, rank, 2).shard(torch.arange(data.seq_len)[None])[0]}
    assert {owner[p] for p in range(data.task.context_len)} == {0}
    assert {owner[int(p) - 1] for p in data.task.answer_positions()} == {1}
    assert data.chance_accuracy == pytest.approx(1 / 8)


def test_install_line_never_pulls_an_unpinned_torch():
    """The README's first install command is scripts/install.sh, which installs the pinned CPU torch before the
    package where there is none (an unpinned torch resolves to the multi-GB CUDA build)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.strip().splitlines()]
    assert commands[0] == "bash scripts/install.sh", commands
    script = (ROOT / "scripts" / "install.sh").read_text()
    pinned = script.index("pip install -q torch==")
    assert pinned < script.index("pip install -q -e") and 'import torch' in script[:pinned]
