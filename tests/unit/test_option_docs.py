"""The two strategies' options: their flat keyword signatures (LightningCLI reads them) and one text per option, so
an option both take reads the same under the Trainer and under Fabric (strategy/option_docs.py)."""

from __future__ import annotations

import pytest
from docstring_parser import parse

from lightning_fpdt import FPDTFabricStrategy, FPDTStrategy
from lightning_fpdt.cli import main
from lightning_fpdt.strategy.fabric import TRAINER_ONLY_OPTIONS
from lightning_fpdt.strategy.option_docs import OPTION_DOCS, constructor_options

TRAINER_OPTIONS = [
    "sequence_parallel_size", "data_parallel_size", "chunks", "offload", "offload_dq", "ring_size", "attention_backend",
    "head_chunks", "layer_classes", "cpu_offload_params", "host_step_in_backward", "device_step_in_backward",
    "pad_to_multiple", "nonfinite_loss", "pad_token_id", "save_distributed_checkpoint", "process_group_backend",
    "timeout", "heartbeat_timeout", "check_memory", "preemption", "preemption_timeout", "offload_dir",
    "sync_every_batch", "fused_ops", "predict_outputs", "plan_trial",
]
FABRIC_OPTIONS = [
    "sequence_parallel_size", "data_parallel_size", "chunks", "offload", "offload_dq", "ring_size", "attention_backend",
    "head_chunks", "layer_classes", "memory_callbacks", "pad_to_multiple", "pad_token_id",
    "save_distributed_checkpoint", "process_group_backend", "timeout", "fused_ops", "check_memory", "offload_dir",
]


def documented_options(cls: type) -> dict[str, str]:
    return {param.arg_name: " ".join(param.description.split()) for param in parse(cls.__doc__).params}


def test_the_signatures_stay_flat_and_keyword_only():
    """Both constructors take their options as flat keywords, in the order YAML configs and the README use."""
    assert constructor_options(FPDTStrategy) == TRAINER_OPTIONS
    assert constructor_options(FPDTFabricStrategy) == FABRIC_OPTIONS


def test_every_option_has_one_text_both_strategies_share():
    """Each strategy documents every option it takes, in its signature's order, and an option both take has the same
    text under either: the one in OPTION_DOCS."""
    trainer, fabric = documented_options(FPDTStrategy), documented_options(FPDTFabricStrategy)
    assert list(trainer) == TRAINER_OPTIONS and list(fabric) == FABRIC_OPTIONS
    shared = set(trainer) & set(fabric)
    assert len(shared) == 17
    for name in shared:
        assert trainer[name] == fabric[name] == " ".join(OPTION_DOCS[name].split()), name
    assert set(trainer) - shared == set(TRAINER_ONLY_OPTIONS)  # each option only the Trainer takes, refused by name


@pytest.mark.parametrize("strategy", ["lightning_fpdt.FPDTStrategy", "lightning_fpdt.strategy.FPDTStrategy"])
def test_lightning_cli_help_lists_the_options(capsys, strategy):
    """``lightning-fpdt fit --trainer.strategy.help`` prints every option of the strategy with its text."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.strategy.help", strategy])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in TRAINER_OPTIONS:
        assert f"--trainer.strategy.{name}" in out, name
    assert "ranks that share one sequence" in out and "what ``trainer.predict`` returns" in out
