"""Metrics under sequence parallelism: sums over all ranks, so validation perplexity and retrieval accuracy under
Trainer(strategy="fpdt") equal one process's over the same samples (docs/design.md §5, §7)."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist

import lightning_fpdt  # noqa: F401  (registers "fpdt")
from lightning_fpdt import FPDTStrategy
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.metrics import TokenAccuracy, TokenPerplexity
from lightning_fpdt.models.module import CausalLM, HFCausalLM, LlamaLM, targets_of, token_loss_sum
from tests.dist.training import trainer_kwargs

# fp32: the sharded forward sums the same products in another order (blockwise softmax merge, all-to-alls);
# per-token losses agree to ~1e-6, and the perplexity of a few hundred tokens to ~1e-5 relative
TOL = dict(rtol=1e-4, atol=1e-5)


def sum_states_are_global() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(2, 12, 7, generator=gen), torch.randint(0, 7, (2, 12), generator=gen)
    target[:, :5] = -100  # rank 0's half (below) has fewer scored tokens than rank 1's
    accuracy, perplexity = TokenAccuracy(), TokenPerplexity()
    local = slice(rank * 6, rank * 6 + 6)
    accuracy.update(logits[:, local], target[:, local])
    perplexity.update(*token_loss_sum(logits[:, local], target[:, local]))
    reference_loss, reference_count = token_loss_sum(logits, target)
    scored = target != -100
    torch.testing.assert_close(accuracy.compute(), (logits.argmax(-1)[scored] == target[scored]).double().mean())
    torch.testing.assert_close(perplexity.compute(), torch.exp(reference_loss / reference_count).double(), **TOL)
    assert world == 2


def test_metric_states_sum_over_ranks(dist_pool):
    """Each rank updates with its own tokens (unequal counts); compute() is the metric of all tokens."""
    dist_pool(2).run(sum_states_are_global)


def build(hf_path: str | None, accuracy: bool) -> CausalLM:
    if hf_path:
        return HFCausalLM(hf_path, from_pretrained=False, seed=3, accuracy=accuracy)  # a config-only folder
    return LlamaLM("tiny", config_overrides={"vocab_size": 96, "num_layers": 2}, seed=3, accuracy=accuracy)


def validation_matches_one_process(accuracy: bool, hf_path: str | None = None) -> None:
    data = RetrievalDataModule(seq_len=45, vocab_size=96, num_val=6, batch_size=2, num_pairs=6, num_queries=4)
    module = build(hf_path, accuracy)
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, **trainer_kwargs())
    (metrics,) = trainer.validate(module, datamodule=data, verbose=False)

    reference = build(hf_path, accuracy=False)
    loss_sum, count, correct = 0.0, 0, 0
    with torch.no_grad():
        for batch in data.val_dataloader():
            logits, targets = reference.model_logits(batch), targets_of(batch)
            batch_loss, batch_count = token_loss_sum(logits, targets)
            loss_sum, count = loss_sum + batch_loss, count + batch_count
            correct += int((logits.argmax(-1)[targets != -100] == targets[targets != -100]).sum())
    torch.testing.assert_close(torch.tensor(metrics["val/perplexity"]), torch.exp(loss_sum / count), **TOL)
    torch.testing.assert_close(torch.tensor(metrics["val/loss"]), loss_sum / count, **TOL)
    if accuracy:
        assert metrics["val/accuracy"] == correct / count  # exact: argmax of nearly equal logits, few tokens


def test_validation_perplexity_and_accuracy_match_one_process(dist_pool, tmp_path):
    """Validation under fpdt (2 ranks, 2 chunks, padded 45 -> 48 tokens) reports one process's perplexity, through
    the model's loss and through the logits, and its retrieval accuracy; for the reference Llama and HFCausalLM."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(tmp_path / "hf")
    pool = dist_pool(2)
    pool.run(validation_matches_one_process, accuracy=False)
    pool.run(validation_matches_one_process, accuracy=True)
    pool.run(validation_matches_one_process, accuracy=False, hf_path=str(tmp_path / "hf"))
    pool.run(validation_matches_one_process, accuracy=True, hf_path=str(tmp_path / "hf"))
