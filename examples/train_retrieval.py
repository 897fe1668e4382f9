"""The CPU demo in plain Python (what examples/configs/demo_cpu.yaml says in YAML), with a sequence-length curriculum.

A tiny Llama learns long-context key-value retrieval with Trainer(strategy="fpdt"): the sequence split over 2 CPU
processes (gloo), 2 FPDT chunks per rank. Training starts on 64-token samples and grows to 256 (the curriculum
crops filler between the key-value pairs and the queries, so the answers move further from their keys).

    python examples/train_retrieval.py            # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import lightning as L

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy, MFUMonitor
from lightning_fpdt.callbacks.curriculum import SequenceLengthCurriculum
from lightning_fpdt.cli import fit_summary
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import LlamaLM


def main() -> None:
    L.seed_everything(0)
    data = RetrievalDataModule(seq_len=256, vocab_size=96, batch_size=32, num_val=256)
    module = LlamaLM("tiny", config_overrides={"vocab_size": 96}, lr=3e-3, accuracy=True)
    trainer = L.Trainer(
        strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), accelerator="cpu", devices=2, max_steps=700,
        val_check_interval=350, check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=10,
        enable_checkpointing=False,
        callbacks=[MFUMonitor(log_every_n_steps=10), SequenceLengthCurriculum({0: 64, 200: 128, 400: 256})],
    )
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        print(fit_summary(trainer, data))


if __name__ == "__main__":
    main()
