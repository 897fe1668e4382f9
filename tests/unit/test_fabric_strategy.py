"""``Fabric(strategy="fpdt")`` without processes: the registry name, the options it takes and refuses, its precision,
its loader wrapper, and misuse before setup (docs/fabric.md)."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import STRATEGY_REGISTRY
from torch.utils.data import DataLoader, SequentialSampler

import lightning_fpdt
from lightning_fpdt import FPDTFabricStrategy, TiledMLP
from lightning_fpdt.strategy.fabric import TRAINER_ONLY_OPTIONS, SequenceShardedLoader
from lightning_fpdt.strategy.precision import FPDTFabricPrecision, FPDTPrecision


def test_registered_in_fabric_registry():
    """Importing lightning_fpdt registers "fpdt" with Fabric: the name and an instance both give the strategy."""
    assert "fpdt" in STRATEGY_REGISTRY
    assert isinstance(Fabric(strategy="fpdt", accelerator="cpu", devices=1).strategy, FPDTFabricStrategy)
    strategy = lightning_fpdt.FPDTFabricStrategy(chunks=2)
    assert Fabric(strategy=strategy, accelerator="cpu", devices=2).strategy is strategy


@pytest.mark.parametrize("option", sorted(TRAINER_ONLY_OPTIONS))
def test_trainer_only_options_are_refused_by_name(option):
    """An option of the Trainer's strategy that has no meaning in a Fabric loop is a ValueError naming it, never
    ignored."""
    with pytest.raises(ValueError, match=f"{option} is an option of Trainer"):
        FPDTFabricStrategy(**{option: True})


def test_unknown_option_is_a_type_error():
    """A misspelt option is refused like any unexpected keyword."""
    with pytest.raises(TypeError, match="chunk"):
        FPDTFabricStrategy(chunk=2)


def test_options_are_validated():
    """The shared options are checked as the Trainer's strategy checks them."""
    with pytest.raises(ValueError):
        FPDTFabricStrategy(chunks=0)
    with pytest.raises(ValueError, match="fused_ops"):
        FPDTFabricStrategy(fused_ops="yes")


def test_memory_callbacks_take_memory_callbacks_only():
    """memory_callbacks takes the callbacks that declare a memory transform; another callback is named."""
    FPDTFabricStrategy(memory_callbacks=[TiledMLP(num_tiles=2)])
    with pytest.raises(ValueError, match="object"):
        FPDTFabricStrategy(memory_callbacks=[object()])


@pytest.mark.parametrize("precision,dtype", [("32-true", None), ("bf16-mixed", torch.bfloat16),
                                             ("bf16-true", torch.bfloat16)])
def test_precision_is_fsdp2_policy(precision, dtype):
    """Fabric(precision=...) becomes the FSDP2 mixed-precision policy (no autocast), as under the Trainer."""
    plugin = Fabric(strategy="fpdt", accelerator="cpu", devices=1, precision=precision).strategy.precision
    assert isinstance(plugin, FPDTFabricPrecision) and plugin.precision == precision
    policy = plugin.mixed_precision_policy()
    assert (policy.param_dtype if policy is not None else None) == dtype
    assert issubclass(FPDTPrecision, FPDTFabricPrecision)  # one behaviour, both interfaces


def test_unsupported_precision_names_the_fix():
    """A precision FSDP2's policy cannot give is refused with the one to use."""
    with pytest.raises(ValueError, match="bf16-mixed"):
        Fabric(strategy=FPDTFabricStrategy(), accelerator="cpu", devices=1, precision="16-true")


def test_sharded_loader_keeps_the_loader():
    """The loader wrapper shards every batch and is otherwise the wrapped loader (length, sampler, dataset)."""
    data = [{"input_ids": torch.arange(4)}, {"input_ids": torch.arange(4, 8)}]
    loader = DataLoader(data, batch_size=1)
    sharded = SequenceShardedLoader(loader, lambda batch: batch["input_ids"][:, :2])
    assert len(sharded) == 2 and isinstance(sharded.sampler, SequentialSampler) and sharded.dataset is data
    assert [b.tolist() for b in sharded] == [[[0, 1]], [[4, 5]]]


def test_misuse_before_setup_is_a_runtime_error():
    """The mesh before launch, a batch sharded or a loss reduced before fabric.setup: RuntimeError saying what to call
    first."""
    strategy = FPDTFabricStrategy()
    with pytest.raises(RuntimeError, match="fabric.setup"):
        strategy.shard_batch({"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    with pytest.raises(RuntimeError, match="shard"):
        strategy.reduce_loss(torch.tensor(1.0))
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="launch"):
            strategy.device_mesh
