"""LongContextEval under Trainer(strategy="fpdt") scores what one process scores on the same probes: the answer
tokens sit on one rank (or two), the sequence-parallel group adds up each probe's sums, the data-parallel groups
split the probes (docs/long_context_eval.md)."""

from __future__ import annotations

import lightning as L
import torch

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy, LongContextEval
from lightning_fpdt.callbacks.long_context_eval import probe_sums
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import LlamaLM
from lightning_fpdt.sequence.loss import shift_labels
from tests.dist.training import trainer_kwargs

# fp32: the sharded forward sums the same products in another order (blockwise softmax merge, all-to-alls), so an
# answer's log-probability agrees to ~1e-6; 1e-4 relative leaves room for a few hundred accumulated terms
TOL = dict(rtol=1e-4, atol=1e-5)


def build(kv_heads: int) -> LlamaLM:
    return LlamaLM("tiny", config_overrides={"vocab_size": 96, "num_kv_heads": kv_heads}, seed=7)


def evaluation_matches_one_process(sequence_parallel_size: int, kv_heads: int) -> None:
    data = RetrievalDataModule(seq_len=48, vocab_size=96, num_val=2, batch_size=2)
    # 21 tokens pad to 24 under the layout; 3 depths x 3 probes = 9 per length, split 5/4 over 2 data-parallel groups
    callback = LongContextEval(lengths=[21, 48], depths=[0.0, 0.5, 1.0], probes_per_cell=3, batch_size=2)
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=sequence_parallel_size, chunks=2),
                        devices=torch.distributed.get_world_size(), callbacks=[callback], **trainer_kwargs())
    trainer.validate(build(kv_heads), datamodule=data, verbose=False)
    scores = callback.scores

    reference = build(kv_heads)
    sums = torch.zeros(2, 3, 2, dtype=torch.float64)
    with torch.no_grad():
        for i, length in enumerate(callback.lengths):
            for j in range(3):
                for k in range(3):
                    probe = callback.probe(length, j, k)
                    batch = {key: value[None] for key, value in probe.items()}
                    logits = reference.model_logits(batch)  # (1, S, V): the whole sequence on one process
                    logprob, wrong, count = probe_sums(logits, shift_labels(batch["labels"]))[0]
                    assert count == 1
                    sums[i, j] += torch.stack([logprob, (wrong == 0).double()])
    assert scores.probes.eq(3).all()
    torch.testing.assert_close(scores.answer_logprob, sums[..., 0] / 3, **TOL)
    # exact: the argmax of logits that agree to ~1e-6 (a fresh model's are ~0.1 apart at the top)
    torch.testing.assert_close(scores.exact_match, sums[..., 1] / 3, rtol=0, atol=0)


def test_evaluation_matches_one_process_on_2_ranks(dist_pool):
    """2 ranks, sequence parallel 2 x chunks 2: the scores are one process's."""
    dist_pool(2).run(evaluation_matches_one_process, sequence_parallel_size=2, kv_heads=2)


def test_evaluation_matches_one_process_on_4_ranks(dist_pool):
    """4 ranks: sequence parallel 2 x data parallel 2 (the probes split unevenly), and sequence parallel 4; the
    scores are one process's."""
    pool = dist_pool(4)
    pool.run(evaluation_matches_one_process, sequence_parallel_size=2, kv_heads=2)
    pool.run(evaluation_matches_one_process, sequence_parallel_size=4, kv_heads=4)


def example_config_logs(save_dir: str) -> list[str]:
    from pathlib import Path

    from lightning_fpdt.cli import FPDTCLI

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "long_context_eval_cpu.yaml"
    FPDTCLI(args=["fit", "--config", str(config), "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false",
                  "--trainer.logger.init_args.save_dir", save_dir, "--data.num_train", "128"])
    if torch.distributed.get_rank() != 0:
        return []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(Path(save_dir) / "long_context_eval" / "version_0"),
                              size_guidance={"images": 0}).Reload()
    return [*events.Tags()["images"], *events.Tags()["scalars"]]


def test_example_config_writes_scalars_and_heatmap(dist_pool, tmp_path):
    """examples/configs/long_context_eval_cpu.yaml on 2 processes (2 steps): the evaluation at the end writes the
    heatmap and the scalars per length and depth to TensorBoard."""
    tags, _ = dist_pool(2).run(example_config_logs, save_dir=str(tmp_path))
    assert "long_context/heatmap" in tags
    for length in (64, 128, 256):
        for depth in ("0", "0.25", "0.5", "0.75", "1"):
            assert f"long_context/exact_match/len{length}_depth{depth}" in tags
            assert f"long_context/answer_logprob/len{length}_depth{depth}" in tags
