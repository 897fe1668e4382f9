"""The lightning-fpdt CLI: short names, --print_config round trips, every example config parses, HF models."""

import importlib
from pathlib import Path

import pytest
import torch

from lightning_fpdt import FPDTStrategy, MFUMonitor
from lightning_fpdt.callbacks.curriculum import SequenceLengthCurriculum
from lightning_fpdt.cli import FPDTCLI, main
from lightning_fpdt.data import RetrievalDataModule
from lightning_fpdt.models.module import HFCausalLM, LlamaLM

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"


@pytest.fixture(autouse=True)
def command_line(monkeypatch):
    """The CLI reads args= only; pytest's own arguments must not look like a second command line."""
    monkeypatch.setattr("sys.argv", ["lightning-fpdt"])


def print_config(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        FPDTCLI(args=[*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_print_config_round_trip(tmp_path, capsys):
    """The config --print_config prints, fed back with --config, prints the same config again."""
    first = print_config(["fit", "--config", str(CONFIGS / "demo_cpu.yaml")], capsys)
    assert "class_path: lightning_fpdt.FPDTStrategy" in first
    assert "class_path: lightning_fpdt.models.module.LlamaLM" in first
    (tmp_path / "printed.yaml").write_text(first)
    assert print_config(["fit", "--config", str(tmp_path / "printed.yaml")], capsys) == first


def test_short_names_and_strategy_string(tmp_path):
    """model/data/callbacks by short class name and trainer.strategy: fpdt build the project's classes."""
    (tmp_path / "short.yaml").write_text(
        "trainer:\n  accelerator: cpu\n  devices: 1\n  strategy: fpdt\n  logger: false\n"
        "  callbacks:\n    - MFUMonitor\n"
        "    - class_path: SequenceLengthCurriculum\n      init_args: {schedule: {0: 32, 4: 64}}\n"
        "model: LlamaLM\n"
        "data:\n  class_path: RetrievalDataModule\n  init_args: {seq_len: 64}\n"
    )
    cli = FPDTCLI(args=["--config", str(tmp_path / "short.yaml")], run=False)
    assert isinstance(cli.model, LlamaLM) and isinstance(cli.datamodule, RetrievalDataModule)
    assert isinstance(cli.trainer.strategy, FPDTStrategy)
    assert any(isinstance(cb, MFUMonitor) for cb in cli.trainer.callbacks)
    curriculum = next(cb for cb in cli.trainer.callbacks if isinstance(cb, SequenceLengthCurriculum))
    assert curriculum.schedule == [(0, 32), (4, 64)]


def test_strategy_by_class_path_with_options(tmp_path):
    """trainer.strategy as class_path + init_args reaches the strategy's keyword-only options."""
    cli = FPDTCLI(args=["--config", str(CONFIGS / "demo_cpu.yaml"), "--trainer.devices", "1", "--trainer.logger",
                        "false"], run=False)
    assert isinstance(cli.trainer.strategy, FPDTStrategy) and cli.trainer.strategy.num_chunks_for(256) == 2


def test_an_option_out_of_range_is_one_line(tmp_path, capsys, monkeypatch):
    """chunks: 0 in a YAML ends with the strategy's own message on one line (exit status 2), not LightningCLI's
    traceback with the message buried; FPDT_TRACEBACK=1 shows the whole traceback."""
    config = (CONFIGS / "demo_cpu.yaml").read_text().replace("chunks: 2 ", "chunks: 0 ")
    (tmp_path / "chunks0.yaml").write_text(config)
    args = ["fit", "--config", str(tmp_path / "chunks0.yaml"), "--trainer.logger", "false"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == ("lightning-fpdt: error: lightning_fpdt.FPDTStrategy: chunks must be 'auto' or a "
                                   "positive int, got 0") and "Traceback" not in err
    monkeypatch.setenv("FPDT_TRACEBACK", "1")
    with pytest.raises(ValueError, match="chunks must be 'auto' or a positive int, got 0"):
        main(args)


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_example_configs_parse(config, capsys):
    """Every example config parses (GPU ones too: --print_config instantiates nothing)."""
    text = (CONFIGS / config).read_text()
    for module in ("tiled_mlp", "tiled_loss", "activation_offload"):
        if f"lightning_fpdt.callbacks.{module}" in text:
            try:
                importlib.import_module(f"lightning_fpdt.callbacks.{module}")
            except ModuleNotFoundError:
                pytest.skip(f"{config} needs lightning_fpdt.callbacks.{module}, which does not exist yet")
    printed = print_config(["fit", "--config", str(CONFIGS / config)], capsys)
    assert "class_path: lightning_fpdt.FPDTStrategy" in printed


def _tiny_hf_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=128)


def test_hf_model_from_config_or_weights(tmp_path):
    """HFCausalLM loads the weights of a local directory ("auto"), in training mode; a local directory without
    weights is refused unless from_pretrained is False, which initialises at random from the config;
    config_overrides change the config."""
    from transformers import AutoModelForCausalLM

    config_only, with_weights = tmp_path / "config_only", tmp_path / "with_weights"
    _tiny_hf_config().save_pretrained(config_only)
    torch.manual_seed(1)
    saved = AutoModelForCausalLM.from_config(_tiny_hf_config())
    saved.save_pretrained(with_weights)

    for from_pretrained in ("auto", True):
        with pytest.raises(ValueError, match=r"config_only holds a config.json but no weights \(none of "
                                             r"model.safetensors, .*config.json\): copy the weights there, or pass "
                                             r"from_pretrained=False"):
            HFCausalLM(str(config_only), from_pretrained=from_pretrained)
    random_init = HFCausalLM(str(config_only), from_pretrained=False, config_overrides={"num_hidden_layers": 1})
    assert not random_init.loaded_pretrained and random_init.model.config.num_hidden_layers == 1
    loaded = HFCausalLM(str(with_weights))
    assert loaded.loaded_pretrained
    assert all(module.training for module in loaded.model.modules())  # from_pretrained left them in eval mode
    torch.testing.assert_close(loaded.model.state_dict(), saved.state_dict(), rtol=0, atol=0)
    not_loaded = HFCausalLM(str(with_weights), from_pretrained=False, seed=2)
    assert not not_loaded.loaded_pretrained
    assert not torch.equal(not_loaded.model.lm_head.weight, saved.lm_head.weight)

    batch = {"input_ids": torch.randint(0, 64, (2, 16))}
    assert loaded.model_logits(batch).shape == (2, 16, 64)
    assert loaded.model_loss(batch).dim() == 0
    with pytest.raises(ValueError, match="from_pretrained must be True, False or 'auto'"):
        HFCausalLM(str(config_only), from_pretrained="yes")


def test_mistyped_model_paths_are_refused_without_hub_lookups(tmp_path, monkeypatch):
    """A local path that does not exist (absolute, or under an existing folder as a Hub name would look), a file or a
    folder without config.json raise a ValueError saying what is there, before transformers is asked (which would
    retry the Hub for half a minute offline)."""
    import transformers

    models = tmp_path / "models"
    _tiny_hf_config().save_pretrained(models / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", _no_hub_lookup)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", _no_hub_lookup)
    for name in ("models/tiny-lama", str(models / "tiny-lama")):
        with pytest.raises(ValueError, match=r"model folder .*models/tiny-lama does not exist; .*models holds "
                                             r"tiny-llama/ \(did you mean .*models/tiny-llama\?\)"):
            HFCausalLM(name)
    with pytest.raises(ValueError, match=r"models is not a model folder: it has no config.json \(tiny-llama/\)"):
        HFCausalLM("models")
    with pytest.raises(ValueError, match=r"config.json is a file; pass the folder that holds config.json"):
        HFCausalLM("models/tiny-llama/config.json")


def _no_hub_lookup(*args, **kwargs):
    raise AssertionError(f"transformers was asked for {args}")


def test_plan_subcommand(capsys):
    """`lightning-fpdt plan ...` prints the memory plan (lightning_fpdt.planner.main) and exits with its status."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "tiny", "--seq-len", "4096", "--gpus", "2"])
    assert exit_info.value.code == 0
    assert "predicted peak per GPU" in capsys.readouterr().out


def test_help_lists_plan(capsys):
    """`lightning-fpdt --help` lists plan and calibrate beside Lightning's subcommands."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,plan,calibrate}" in out and "plan                Predict a run's GPU peak" in out
    assert "calibrate           Measure this GPU's rates" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, calibrate measures it")
def test_calibrate_without_a_gpu_says_so(capsys):
    """`lightning-fpdt calibrate` on a machine without CUDA exits 1 naming the table plans use instead."""
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate"])
    assert exit_info.value.code == 1 and "no CUDA device" in capsys.readouterr().err


def test_lightning_noise_is_silenced(caplog):
    """Once a fpdt strategy is made, a Trainer logs no Lightning tip, Lightning's loaders raise no LeafSpec
    deprecation, and the rich progress bar of a run bounded by max_steps says "Epoch 0", not "Epoch 0/-2"."""
    import logging
    import warnings
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.utilities.combined_loader import CombinedLoader

    from lightning_fpdt import FPDTStrategy
    from lightning_fpdt.strategy.noise import steps_only_epochs

    FPDTStrategy()  # quiets Lightning (strategy/noise.py)
    with caplog.at_level(logging.INFO):
        L.Trainer(accelerator="cpu", devices=1, logger=True, enable_checkpointing=True, max_steps=2)
    assert caplog.records and not [r for r in caplog.records if "Tip" in r.getMessage()]
    with warnings.catch_warnings(record=True) as caught:
        CombinedLoader([torch.randn(3, 2), torch.randn(5, 2)])
    assert not [w for w in caught if "LeafSpec" in str(w.message)]
    bar = RichProgressBar()
    steps_only_epochs(SimpleNamespace(max_epochs=-1, callbacks=[bar]))
    assert bar._get_train_description(0).rstrip() == "Epoch 0"
