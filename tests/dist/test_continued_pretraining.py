"""docs/continued_pretraining.md, run as written: tokenize, plan, YAML, fit, resume, export and check, on a tiny
Llama and a tiny Qwen3 saved with save_pretrained, with a byte-level BPE tokenizer trained here (no download).

The page's commands run in this process (tokenize, plan, export, the check script) or in the test's pool of two
gloo processes (``lightning-fpdt fit``, the same LightningCLI without the console script). Its YAML is written as it
is, with the GPU-sized values listed in ``CPU_VALUES`` replaced, each of which must occur exactly once."""

from __future__ import annotations

import glob
import json
import os
import re
import runpy
import shlex
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_fpdt.cli import FPDTCLI
from lightning_fpdt.cli import main as cli_main
from lightning_fpdt.data.tokenize_files import main as tokenize_main
from lightning_fpdt.export import main as export_main

PAGE = Path(__file__).resolve().parents[2] / "docs" / "continued_pretraining.md"
CPU_VALUES = {
    "accelerator": "cpu", "devices": "2", "precision": "32-true", "seq_len": "64", "max_steps": "8",
    "val_check_interval": "4", "limit_val_batches": "2", "every_n_train_steps": "4", "log_every_n_steps": "1",
    "warmup_steps": "2", "lr": "3.0e-3",
}
"""What a CPU run of the page's config changes: 2 processes, fp32, 64-token windows, 8 steps."""
STOPPED_AT = 4
"""The page's first fit is cut at this step (as a time limit would), then its resume command goes on to 8."""
WORDS = ("river stone light window garden morning letter music paper winter summer forest engine signal market "
         "harbor theory number silver orange table coffee bridge planet story tunnel lantern island").split()


def _corpus(folder: Path, seed: int) -> None:
    """Random sentences from a small word list, in paragraphs (documents), in three training files and one held-out."""
    gen = torch.Generator().manual_seed(seed)

    def paragraph() -> str:
        sentences = []
        for _ in range(int(torch.randint(2, 6, (1,), generator=gen))):
            picks = torch.randint(0, len(WORDS), (int(torch.randint(4, 12, (1,), generator=gen)),), generator=gen)
            sentences.append(" ".join(WORDS[i] for i in picks).capitalize() + ".")
        return " ".join(sentences)

    for split, files in (("train", 3), ("val", 1)):
        (folder / "corpus" / split).mkdir(parents=True)
        for i in range(files):
            text = "\n\n".join(paragraph() for _ in range(40))
            (folder / "corpus" / split / f"part-{i}.txt").write_text(text + "\n", encoding="utf-8")


def _tokenizer(texts: list[str]) -> Any:
    """A byte-level BPE tokenizer of about 300 tokens with an EOS token, trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def _model_folder(folder: Path, family: str, tokenizer: Any) -> None:
    """A tiny pretrained-looking model: random weights saved with save_pretrained, and the tokenizer beside them."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    sizes = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id)
    config = LlamaConfig(**sizes) if family == "llama" else Qwen3Config(head_dim=8, tie_word_embeddings=True, **sizes)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _blocks(page: str) -> list[tuple[str, str]]:
    return re.findall(r"```(\w+)\n(.*?)```", page, flags=re.S)


def _cpu_config(yaml: str) -> str:
    for key, value in CPU_VALUES.items():
        yaml, count = re.subn(rf"^(\s*{key}: ).*$", rf"\g<1>{value}", yaml, flags=re.M)
        assert count == 1, f"{key} occurs {count} times in the page's YAML"
    return yaml


class StopAt(Callback):
    """Ends training after ``step`` optimizer steps, as a time limit would: the schedule still plans for max_steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.should_stop = trainer.should_stop or trainer.global_step >= self.step


def fit_from_the_command_line(cwd: str, args: list[str], stop_at: int | None = None) -> dict:
    """``lightning-fpdt fit ...`` on this rank, in ``cwd`` (``stop_at``: cut after that step): the losses, the last
    step and what the sampler drew."""
    here, seed_env = os.getcwd(), {k: v for k, v in os.environ.items() if k.startswith("PL_")}
    os.chdir(cwd)
    try:
        if stop_at is None:
            cli = FPDTCLI(args=args)
        else:  # the same CLI and config, with one more callback
            assert args[0] == "fit" and "--ckpt_path" not in args
            cli = FPDTCLI(args=args[1:], run=False)
            cli.trainer.callbacks.append(StopAt(stop_at))
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        os.chdir(here)
        # seed_everything leaves PL_GLOBAL_SEED in the environment, where it would reseed the pool's later Trainers
        for name in [k for k in os.environ if k.startswith("PL_") and k not in seed_env]:
            del os.environ[name]
        os.environ.update(seed_env)
    sampler = cli.trainer.train_dataloader.sampler
    return {"losses": cli.model.losses, "step": cli.trainer.global_step, "order": list(sampler)[:16],
            "shuffle": sampler.shuffle, "seed": sampler.seed, "ckpt_path": cli.trainer.ckpt_path}


def _run_page(page: str, cwd: Path, pool: Any) -> dict[str, Any]:
    """Every command of ``page`` in ``cwd``, in order; what the fits returned, by command."""
    results: dict[str, Any] = {}
    for language, body in _blocks(page):
        first = body.splitlines()[0]
        if language in ("yaml", "python") and first.startswith("# "):
            text = _cpu_config(body) if language == "yaml" else body
            (cwd / first[2:].strip()).write_text(text)
            continue
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            argv = shlex.split(line)
            argv = [a for arg in argv for a in (sorted(glob.glob(str(cwd / arg))) if "*" in arg else [arg])]
            results[line] = _run(argv, cwd, pool)
    return results


def _run(argv: list[str], cwd: Path, pool: Any) -> Any:
    if argv[0] == "huggingface-cli":
        return None  # the model folder is made by the test (no download)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        if argv[:3] == ["python", "-m", "lightning_fpdt.data.tokenize_files"]:
            return tokenize_main(argv[3:])
        if argv[:2] == ["lightning-fpdt", "plan"]:
            with pytest.raises(SystemExit) as exit_info:
                cli_main(argv[1:])
            assert exit_info.value.code == 0, "the plan does not fit"
            return 0
        if argv[:3] == ["python", "-m", "lightning_fpdt.export"]:
            return export_main(argv[3:])
        if argv == ["python", "check.py"]:
            return runpy.run_path(str(cwd / "check.py"))
    finally:
        os.chdir(here)
    if argv[:2] == ["lightning-fpdt", "fit"]:
        stop_at = None if "--ckpt_path" in argv else STOPPED_AT  # the first run is cut short, the resume finishes it
        return pool.run(fit_from_the_command_line, cwd=str(cwd), args=argv[1:], stop_at=stop_at)
    raise AssertionError(f"the page runs a command this test does not know: {argv}")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_continued_pretraining_page_runs_end_to_end(dist_pool, tmp_path, family):
    """The page's commands in order: the token files record the tokenizer's ids, the plan fits, the fit trains in
    a shuffled window order that both ranks share, the resumed run repeats an uninterrupted one's losses exactly, the
    export reloads with transformers with the checkpoint's logits, and the check script's assertion holds."""
    pool = dist_pool(2)
    _corpus(tmp_path, seed=3)
    tokenizer = _tokenizer([p.read_text() for p in sorted(tmp_path.glob("corpus/train/*.txt"))])
    _model_folder(tmp_path / "models" / family, family, tokenizer)
    page = PAGE.read_text()
    if family != "qwen3":
        page = page.replace("qwen3", family)

    results = _run_page(page, tmp_path, pool)

    meta = json.loads((tmp_path / "data" / "train.json").read_text())
    assert meta["vocab_size"] == len(tokenizer) and meta["max_token_id"] < len(tokenizer) <= 320
    fits = [ranks for line, ranks in results.items() if line.startswith("lightning-fpdt fit")]
    (first, second), (resumed, _) = fits
    assert first["step"] == STOPPED_AT and resumed["step"] == int(CPU_VALUES["max_steps"])
    assert Path(resumed["ckpt_path"]).name == "last.ckpt"
    # Lightning's training sampler: shuffled (seed_everything's seed), the same windows on both ranks of the group
    assert first["shuffle"] and first["seed"] == 0 and first["order"] == second["order"]
    assert first["order"] != sorted(first["order"])

    # the same config uninterrupted, in a folder of its own: the resumed run's losses are its last ones, bit for bit
    straight = tmp_path / "uninterrupted"
    straight.mkdir()
    for name in ("models", "data", "cpt.yaml"):
        (straight / name).symlink_to(tmp_path / name)
    uninterrupted, _ = pool.run(fit_from_the_command_line, cwd=str(straight), args=["fit", "--config", "cpt.yaml"])
    assert len(uninterrupted["losses"]) == int(CPU_VALUES["max_steps"])
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(uninterrupted["losses"][:STOPPED_AT]),
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(uninterrupted["losses"][STOPPED_AT:]),
                               rtol=0, atol=0)

    exported = tmp_path / "models" / f"{family}-cpt"
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in exported.iterdir()}
    check = results["python check.py"]
    assert check["difference"] <= 1e-4 * max(1.0, check["logits"].abs().max().item())
    # the weights are the trained ones, not the folder's original ones
    assert check["after"] != check["before"]
