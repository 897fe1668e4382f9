"""bench.peers' training data: the same samples in the same order for every system."""

from types import SimpleNamespace

import torch

from bench.peers.common import RandomTokens
from bench.peers.systems import InOrder


def test_lightning_systems_train_the_samples_in_order_over_data_parallel_ranks():
    """Data-parallel rank r of D reads samples r, r + D, ...; with D = 1, sample i at step i (no shuffle)."""
    dataset = RandomTokens(vocab_size=97, seq_len=8, num_samples=6)
    for num_replicas, rank, expected in ((1, 0, [0, 1, 2, 3, 4, 5]), (2, 1, [1, 3, 5])):
        data = InOrder(dataset)
        data.trainer = SimpleNamespace(strategy=SimpleNamespace(
            distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": rank}))
        batches = list(data.train_dataloader())
        assert len(batches) == len(expected)
        assert all(torch.equal(b["input_ids"][0], dataset[i]["input_ids"]) for b, i in zip(batches, expected))
