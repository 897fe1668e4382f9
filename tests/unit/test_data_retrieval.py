"""The synthetic retrieval task: deterministic samples, answers only scored, context and query on different ranks."""

import pytest
import torch

from lightning_fpdt.data import RetrievalDataModule, RetrievalDataset, RetrievalTask
from lightning_fpdt.sequence import SequenceLayout


@pytest.mark.parametrize("pair_format", ["one_token", "two_tokens"])
def test_samples_are_a_function_of_seed_split_and_index(pair_format):
    """The same (seed, split, index) gives the same tokens; another index, split or seed gives others."""
    task = RetrievalTask(seq_len=96, vocab_size=128, pair_format=pair_format, seed=3)
    first = task.sample(5)
    again = RetrievalTask(seq_len=96, vocab_size=128, pair_format=pair_format, seed=3).sample(5)
    assert torch.equal(first["input_ids"], again["input_ids"]) and torch.equal(first["labels"], again["labels"])
    others = [task.sample(6), task.sample(5, "val"), RetrievalTask(seq_len=96, vocab_size=128, seed=4,
                                                                   pair_format=pair_format).sample(5)]
    for other in others:
        assert not torch.equal(first["input_ids"], other["input_ids"])
    assert first["input_ids"].shape == (96,) and first["input_ids"].dtype == torch.int64
    assert int(first["input_ids"].max()) < 128


@pytest.mark.parametrize("pair_format", ["one_token", "two_tokens"])
def test_answers_are_the_values_of_the_queried_keys(pair_format):
    """Labels are -100 except at the answers, and each answer is the value its key has in the context."""
    task = RetrievalTask(seq_len=64, vocab_size=100, num_keys=10, num_values=6, num_pairs=7, num_queries=3,
                         pair_format=pair_format)
    for index in range(20):
        sample = task.sample(index)
        ids, labels = sample["input_ids"], sample["labels"]
        scored = (labels != -100).nonzero().flatten()
        assert torch.equal(scored, task.answer_positions())
        assert ids[0] == task.BOS and ids[-2 * 3 - 1] == task.QUERY
        context = {}
        if pair_format == "one_token":
            for token in ids[1:8].tolist():
                key, value = divmod(token - task.pair_start, task.num_values)
                context[task.key_start + key] = task.value_start + value
        else:
            pairs = ids[1:15].view(-1, 2).tolist()
            context = {key: value for key, value in pairs}
        assert len(context) == 7  # distinct keys
        for position in scored.tolist():
            assert labels[position] == ids[position] == context[int(ids[position - 1])]
        filler = ids[task.context_len: 64 - task.query_len]
        assert bool((filler >= task.filler_start).all())


def test_context_and_answers_lie_on_different_sequence_parallel_ranks():
    """With the demo's geometry (256 tokens, 2 ranks, 2 chunks) the pairs are on rank 0 and every answer on rank 1."""
    task = RetrievalTask(seq_len=256, vocab_size=96, num_queries=8)
    owner = torch.empty(256, dtype=torch.long)
    for rank in range(2):
        owner[SequenceLayout(2, rank, 2).shard(torch.arange(256)[None])[0]] = rank
    assert set(owner[: task.context_len].tolist()) == {0}
    # the shifted target of position t is token t+1: the query key at t sees the answer's label
    assert set(owner[task.answer_positions() - 1].tolist()) == {1}
    assert task.chance_accuracy == 1 / 8


def test_crop_keeps_context_and_queries():
    """Cropping for a curriculum drops filler only: the cropped sample is a valid shorter instance."""
    task = RetrievalTask(seq_len=128, vocab_size=96)
    batch = {k: torch.stack([task.sample(i)[k] for i in range(3)]) for k in ("input_ids", "labels")}
    cropped = task.crop(batch, 40)
    assert cropped["input_ids"].shape == (3, 40)
    assert torch.equal(cropped["input_ids"][:, : task.context_len], batch["input_ids"][:, : task.context_len])
    assert torch.equal(cropped["labels"][:, -task.query_len:], batch["labels"][:, -task.query_len:])
    assert torch.equal((cropped["labels"][0] != -100).nonzero().flatten(), task.answer_positions(40))
    with pytest.raises(ValueError, match=r"to 10 tokens: they need at least 26 \(context 9 \+ queries 17\)"):
        task.crop(batch, 10)


def test_task_option_messages():
    """Impossible geometries raise ValueErrors that print the numbers and the fix."""
    with pytest.raises(ValueError, match=r"vocab_size \(50\) is too small: 3 specials \+ 8 keys \+ 8 values \+ 64 pair "
                                         r"tokens = 83; use vocab_size >= 83"):
        RetrievalTask(seq_len=64, vocab_size=50)
    with pytest.raises(ValueError, match=r"num_pairs \(9\) > num_keys \(8\)"):
        RetrievalTask(seq_len=64, vocab_size=96, num_pairs=9)
    with pytest.raises(ValueError, match=r"num_queries \(5\) > num_pairs \(4\)"):
        RetrievalTask(seq_len=64, vocab_size=96, num_pairs=4, num_queries=5)
    with pytest.raises(ValueError, match=r"seq_len \(16\) < 18, the length of BOS \+ 8 pairs \+ QUERY \+ 4"):
        RetrievalTask(seq_len=16, vocab_size=96, num_queries=4)
    with pytest.raises(IndexError):
        RetrievalDataset(RetrievalTask(seq_len=64, vocab_size=96), 4)[4]


def test_data_module_loaders():
    """Train, val and test loaders give (B, S) batches from separate streams."""
    dm = RetrievalDataModule(seq_len=64, vocab_size=96, num_train=8, num_val=4, batch_size=4)
    train, val, test = (next(iter(loader())) for loader in (dm.train_dataloader, dm.val_dataloader, dm.test_dataloader))
    assert train["input_ids"].shape == val["input_ids"].shape == (4, 64)
    assert not torch.equal(val["input_ids"], test["input_ids"])
    assert dm.chance_accuracy == 1 / 8
