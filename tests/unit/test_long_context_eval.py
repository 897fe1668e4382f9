"""LongContextEval on one process: where the needle goes, the refusals, scores near 1 for a model that solves the task
and near chance for a fresh one, and the scalars and the heatmap in TensorBoard."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn

from lightning_fpdt import LongContextEval
from lightning_fpdt.callbacks.heatmap import heatmap
from lightning_fpdt.data import KeyValueNeedle, PasskeyNeedle, RetrievalDataModule, RetrievalTask
from lightning_fpdt.data.needle import probe_rng, probe_sample, synthetic_filler
from lightning_fpdt.models.module import CausalLM, LlamaLM

TASK = dict(seq_len=64, vocab_size=96, num_val=2, batch_size=2)


def test_the_needle_sits_at_its_depth():
    """Depth 0 puts the needle first in the filler, 1 right before the question; only the answer has a label, and
    the sample has the probe's length."""
    task = RetrievalTask(seq_len=64, vocab_size=96)
    needle = KeyValueNeedle(task)
    for depth, position in ((0.0, 1), (0.5, 1 + round(0.5 * (64 - 5))), (1.0, 64 - 4)):
        rng = probe_rng(0, 64, 0, 3)
        pair, question, answer = needle.draw(rng)
        filler = synthetic_filler(rng, 63, *needle.filler_range)
        sample = probe_sample(filler, pair, question, answer, depth=depth, bos=task.BOS)
        ids, labels = sample["input_ids"], sample["labels"]
        assert ids.shape == labels.shape == (64,) and ids[0] == task.BOS
        assert ids[position] == pair[0] and (ids >= task.pair_start).sum() - (ids >= task.filler_start).sum() == 1
        assert ids[-3:].tolist() == [task.QUERY, *question[1:], *answer]
        assert labels[-1] == answer[0] and (labels != -100).sum() == 1
        # the value encoded in the pair token is the answer
        assert task.value_start + (pair[0] - task.pair_start) % task.num_values == answer[0]


def test_passkey_from_raw_ids():
    """A passkey in raw token ids: the needle holds the digits, the answer is them, chance 10^-digits."""
    digits = list(range(10, 20))
    needle = PasskeyNeedle(digit_ids=digits, prefix=[3, 4], suffix=[5], question=[6, 7], num_digits=3)
    pair, question, answer = needle.draw(probe_rng(1, 32, 0, 0))
    assert pair[:2] == [3, 4] and pair[2:5] == answer and pair[5:] == [5] and question == [6, 7]
    assert all(a in digits for a in answer) and needle.chance == pytest.approx(1e-3)
    with pytest.raises(ValueError, match="10 distinct ids"):
        PasskeyNeedle(digit_ids=[1, 2, 3], prefix=[], question=[])


def test_user_mistakes_are_refused():
    """Depths outside [0, 1], a length above the training length, a passkey without a tokenizer, a module without
    logits, and an option with no effect each raise a ValueError naming the fix."""
    with pytest.raises(ValueError, match=r"outside \[0, 1\]"):
        LongContextEval(depths=[0.5, 1.5])
    with pytest.raises(ValueError, match="no effect"):
        LongContextEval(filler="validation", filler_range=(5, 9))
    trainer = SimpleNamespace(datamodule=RetrievalDataModule(**TASK))
    module = LlamaLM("tiny", config_overrides={"vocab_size": 96})
    with pytest.raises(ValueError, match="above the training length"):
        LongContextEval(lengths=[32, 128]).setup(trainer, module, "fit")
    with pytest.raises(ValueError, match="tokenizer="):
        LongContextEval(needle="passkey").setup(trainer, module, "fit")
    with pytest.raises(ValueError, match="at least 5 tokens"):
        LongContextEval(lengths=[4, 64]).setup(trainer, module, "fit")
    with pytest.raises(ValueError, match="model_logits"):
        LongContextEval().setup(trainer, L.LightningModule(), "fit")
    callback = LongContextEval()
    callback.setup(trainer, module, "fit")
    assert callback.lengths == [16, 32, 64]  # a quarter, half and all of the training length


class RetrievalOracle(CausalLM):
    """Solves the task exactly: at a query key it puts all the mass on the value of the pair with that key."""

    def __init__(self, task: RetrievalTask) -> None:
        super().__init__(lr=1e-9)
        self.task = task
        self.unused = nn.Parameter(torch.zeros(1))  # something for the optimizer

    def model_logits(self, batch: dict[str, Tensor]) -> Tensor:
        t, ids = self.task, batch["input_ids"]
        logits = torch.zeros(*ids.shape, t.vocab_size)
        for b, row in enumerate(ids.tolist()):
            pairs = {(p - t.pair_start) // t.num_values: (p - t.pair_start) % t.num_values
                     for p in row if t.pair_start <= p < t.filler_start}
            for position in range(1, len(row)):
                key = row[position] - t.key_start
                if row[position - 1] == t.QUERY and key in pairs:
                    logits[b, position, t.value_start + pairs[key]] = 30.0
        return logits + 0 * self.unused

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return (self.unused ** 2).sum()


def _trainer(tmp_path, callback, **extra):
    return L.Trainer(accelerator="cpu", devices=1, logger=TensorBoardLogger(tmp_path, name="eval"),
                     callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, **extra)


def test_scores_near_one_when_solved_near_chance_when_fresh_and_logged(tmp_path):
    """A model that solves the task scores exact match 1 and answer log-prob ~0 in every cell; a fresh tiny Llama
    scores near chance (log-prob ~ -log V over its V = 96 ids); the scalars and the heatmap reach TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = RetrievalDataModule(**TASK)
    solved = LongContextEval(every_n_steps=1, probes_per_cell=3)
    _trainer(tmp_path, solved, max_steps=1, limit_val_batches=0).fit(RetrievalOracle(data.task), datamodule=data)
    assert solved.scores.probes.eq(3).all() and solved.scores.exact_match.eq(1).all()
    assert solved.scores.answer_logprob.max() <= 0 and solved.scores.answer_logprob.min() > -1e-6  # logit 30: ~1e-11
    assert [s.step for s in solved.history] == [1]  # at step 1, not again at the end

    fresh = LongContextEval(probes_per_cell=3)
    _trainer(tmp_path, fresh).validate(LlamaLM("tiny", config_overrides={"vocab_size": 96}), datamodule=data)
    # a fresh Llama (init std 0.02) has logits within ~0.1 of each other: log-prob -log 96 = -4.56 to within 0.5,
    # and an argmax that rarely lands on the value (chance 1/8 among values, ~1/96 among all ids)
    assert (fresh.scores.answer_logprob + math.log(96)).abs().max() < 0.5
    assert fresh.scores.exact_match.mean() < 0.2

    events = EventAccumulator(str(tmp_path / "eval" / "version_0"), size_guidance={"images": 0}).Reload()
    assert "long_context/heatmap" in events.Tags()["images"]
    scalars = events.Tags()["scalars"]
    for name in ("long_context/exact_match", "long_context/exact_match/len64_depth0.5",
                 "long_context/answer_logprob/len16_depth1", "long_context/exact_match/len32"):
        assert name in scalars
    assert events.Scalars("long_context/exact_match/len64_depth0.25")[0].value == 1.0


def test_heatmap_is_a_grid_of_cells():
    """One square per (length, depth): lengths left to right, depths top to bottom, red at 0, green at 1."""
    scores = torch.tensor([[0.0, 1.0], [0.5, 1.0], [1.0, 0.0]])  # 3 lengths x 2 depths
    image = heatmap(scores, cell=4)
    assert image.dtype == torch.uint8 and image.shape == (3, 2 * 5 + 1, 3 * 5 + 1)
    assert image[:, 1, 1].tolist() == [200, 40, 40]  # length 0, depth 0: 0.0, red
    assert image[:, 6, 1].tolist() == [40, 170, 70]  # length 0, depth 1: 1.0, green
    assert image[:, 1, 6].tolist() == [235, 200, 60]  # length 1, depth 0: 0.5, yellow
    assert image[:, 0, 0].tolist() == [128, 128, 128]  # the grid


def test_example_config(monkeypatch):
    """examples/configs/long_context_eval_cpu.yaml builds the demo with LongContextEval: fpdt over 2 CPU processes,
    TensorBoard, key-value needles at lengths up to the training length."""
    from pathlib import Path

    from lightning_fpdt import FPDTStrategy
    from lightning_fpdt.cli import FPDTCLI

    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "long_context_eval_cpu.yaml"
    monkeypatch.setattr("sys.argv", ["lightning-fpdt"])
    cli = FPDTCLI(args=["--config", str(config)], run=False)
    trainer, data = cli.trainer, cli.datamodule
    assert isinstance(trainer.strategy, FPDTStrategy) and trainer.num_devices == 2
    assert isinstance(trainer.logger, TensorBoardLogger)
    (callback,) = [cb for cb in trainer.callbacks if isinstance(cb, LongContextEval)]
    assert callback.needle_option == "key_value" and max(callback.lengths) == data.seq_len
    assert callback.every_n_steps < trainer.max_steps


def test_passkey_from_a_local_tokenizer(tmp_path):
    """needle="passkey" with a tokenizer directory (loaded offline): the needle sentence holds the digits, the
    question ends the probe, the answer is the digits, the filler is the passkey test's sentence."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "The the pass key is Remember it What ? . grass green sky blue sun yellow Here we go There and back again"
    vocab = {word: i for i, word in enumerate(["[UNK]", *"0123456789", *sorted(set(words.split()))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation apart, each digit a word
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(tmp_path / "tok")

    callback = LongContextEval(needle="passkey", tokenizer=str(tmp_path / "tok"), lengths=[48, 64], probes_per_cell=2)
    callback.setup(SimpleNamespace(datamodule=SimpleNamespace(seq_len=64)), LlamaLM("tiny"), "fit")
    assert isinstance(callback._needle, PasskeyNeedle) and callback._needle.chance == pytest.approx(1e-5)
    sample = callback.probe(64, 2, 1)  # depth 0.5
    ids, labels = sample["input_ids"], sample["labels"]
    digits = [vocab[d] for d in "0123456789"]
    answer = ids[labels != -100].tolist()
    assert ids.shape == (64,) and len(answer) == 5 and all(a in digits for a in answer)
    question = [vocab[w] for w in ("What", "is", "the", "pass", "key", "?", "The", "pass", "key", "is")]
    assert ids[-15:-5].tolist() == question
    text = ids.tolist()
    start = next(i for i in range(len(text)) if text[i:i + 4] == [vocab[w] for w in ("The", "pass", "key", "is")])
    assert text[start + 4:start + 9] == answer  # the needle holds the answer
    assert vocab["grass"] in text[:start]  # the filler is the passkey test's sentence


def test_filler_from_the_validation_data():
    """filler="auto" with a data module that has validation data (and no retrieval task): the probes' filler is
    windows of the validation token stream, a different window for each probe of a cell."""
    stream = torch.randint(100, 200, (4, 40), generator=torch.Generator().manual_seed(0))
    data = SimpleNamespace(seq_len=32, val_dataloader=lambda: [{"input_ids": stream[:2]}, {"input_ids": stream[2:]}])
    needle = PasskeyNeedle(digit_ids=list(range(10)), prefix=[10, 11], question=[12, 13], num_digits=2)
    callback = LongContextEval(needle=needle, lengths=[32], probes_per_cell=2)
    callback.setup(SimpleNamespace(datamodule=data), LlamaLM("tiny"), "fit")
    flat = stream.flatten().tolist()
    for index in range(2):
        ids = callback.probe(32, 0, index)["input_ids"].tolist()  # depth 0: needle, then the filler
        filler = ids[4:32 - 4]
        assert ids[:4] == [10, 11, *ids[-2:]]
        assert any(flat[s:s + len(filler)] == filler for s in range(len(flat)))
        assert filler == flat[index * 32:index * 32 + len(filler)]


def test_the_logged_heatmap_has_axes_and_a_legend():
    """The image logged holds the grid, the column labels (lengths, in K where whole), the row labels (depths), the
    axis titles and a colour bar from red (0) to green (1)."""
    from lightning_fpdt.callbacks.heatmap import GLYPHS, depth_label, labelled_heatmap, length_label

    assert [length_label(n) for n in (64, 4096, 65536, 3000, 2**20)] == ["64", "4K", "64K", "3000", "1M"]
    assert [depth_label(d) for d in (0.0, 0.25, 0.5, 1.0)] == ["0", ".25", ".5", "1"]
    scores = torch.tensor([[0.0, 1.0], [0.5, 1.0], [1.0, 0.0]])
    image = labelled_heatmap(scores, [64, 128, 65536], [0.0, 1.0], cell=24)
    pixels = image.permute(1, 2, 0).reshape(-1, 3).tolist()
    assert [200, 40, 40] in pixels and [40, 170, 70] in pixels and [235, 200, 60] in pixels  # the cells
    assert [0, 0, 0] in pixels  # ink of the labels
    bar = image[:, -30:, :]  # the legend's colour bar sits below the grid
    colors = {tuple(c) for c in bar.permute(1, 2, 0).reshape(-1, 3).tolist()}
    assert (200, 40, 40) in colors and (40, 170, 70) in colors
    assert all(len(glyph.split("|")) == 5 for glyph in GLYPHS.values())
