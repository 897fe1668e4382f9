"""``trainer.predict`` under the strategy returns what one process returns (docs/design.md §5.8): the outputs of the
whole sequence on every rank, or with ``predict_outputs="rank"`` each rank's shard in the layout's order."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.sequence import SequenceLayout
from tests.dist.training import VOCAB, build_model, trainer_kwargs

# fp32, forward only: the blockwise softmax merge and the all-to-alls sum the same products in another order, a few
# 1e-7 relative per op over 2 layers; a token from the wrong place or a lost chunk is off by O(1)
TOL = dict(rtol=1e-5, atol=1e-5)


class InputIds(Dataset):
    """Random token ids, no labels (what a predict loader gives)."""

    def __init__(self, num_samples: int, seq_len: int, seed: int) -> None:
        self.input_ids = torch.randint(0, VOCAB, (num_samples, seq_len), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i]}


def logits_of(kind: str, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).logits if kind == "hf" else model(**batch)


class PredictLM(L.LightningModule):
    def __init__(self, kind: str, seed: int) -> None:
        super().__init__()
        self.kind = kind
        self.model = build_model(kind, seed)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, object]:
        # the strategy adds the shifted labels to every batch: without them the model returns its logits
        logits = logits_of(self.kind, self.model, {k: batch[k] for k in ("input_ids", "position_ids")})  # (B, S/P, V)
        # besides the logits: a per-token tensor of another dtype; a per-sample tensor (of the rank's first token,
        # returned as it is); a value that is no tensor
        return {"logits": logits, "tokens": logits.argmax(-1), "first": logits[:, 0, 0], "name": self.kind}


def run_predict(kind: str, chunks: int, seq_len: int, predict_outputs: str) -> None:
    seed, batch_size = 1234, 2
    dataset = InputIds(num_samples=2 * batch_size, seq_len=seq_len, seed=11)
    strategy = FPDTStrategy(sequence_parallel_size=2, chunks=chunks, predict_outputs=predict_outputs,
                            heartbeat_timeout=None)
    trainer = L.Trainer(strategy=strategy, devices=dist.get_world_size(), **trainer_kwargs())
    outputs = trainer.predict(PredictLM(kind, seed), DataLoader(dataset, batch_size=batch_size))

    reference = build_model(kind, seed).eval()
    layout = SequenceLayout(2, trainer.strategy.sequence_parallel_rank, chunks)
    assert len(outputs) == 2
    for i, output in enumerate(outputs):
        with torch.no_grad():
            logits = logits_of(kind, reference, {"input_ids": dataset.input_ids[i * batch_size:(i + 1) * batch_size]})
        local = layout.shard(layout.pad(logits))  # this rank's tokens of the padded sequence
        if predict_outputs == "rank":
            logits = local
        case = f"{kind} chunks={chunks} S={seq_len} {predict_outputs} batch {i}"
        torch.testing.assert_close(output["logits"], logits, **TOL, msg=lambda m: f"{case}: {m}")
        assert torch.equal(output["tokens"], output["logits"].argmax(-1)), case
        torch.testing.assert_close(output["first"], local[:, 0, 0], **TOL, msg=lambda m: f"{case} first: {m}")
        assert output["name"] == kind


def run_cases(cases: list[dict]) -> None:
    for case in cases:
        run_predict(**case)


def test_predict_returns_the_whole_sequence(dist_pool):
    """sp=2: a Hugging Face Llama with chunks 2 and padding (15 tokens), the reference Llama: every rank returns the
    logits of one process on the whole sequence; ``predict_outputs="rank"`` returns each rank's shard of them."""
    dist_pool(2).run(run_cases, cases=[
        dict(kind="hf", chunks=2, seq_len=15, predict_outputs="sequence"),
        dict(kind="llama", chunks=1, seq_len=16, predict_outputs="sequence"),
        dict(kind="hf", chunks=2, seq_len=16, predict_outputs="rank"),
    ])
