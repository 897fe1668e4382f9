"""Consolidating a distributed checkpoint into one file a plain model loads; Hugging Face export of the Llama."""

from __future__ import annotations

import os

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.export import consolidate, export_llama_to_hf, llama_config_from, main
from lightning_fpdt.models.llama import LlamaForCausalLM
from lightning_fpdt.models.module import LlamaLM
from tests.dist.training import TokenDataset, full_state, trainer_kwargs


def train_and_save(folder: str) -> None:
    module = LlamaLM("tiny", vocab_size=64, lr=1e-2)
    trainer = L.Trainer(strategy=FPDTStrategy(sequence_parallel_size=2, chunks=2), devices=2, max_steps=2,
                        **trainer_kwargs())
    trainer.fit(module, DataLoader(TokenDataset(8, 16, seed=1), batch_size=2))
    trainer.save_checkpoint(os.path.join(folder, "run.ckpt"))
    params = full_state(module)  # collective
    if dist.get_rank() == 0:
        torch.save({k: v.cpu() for k, v in params.items()}, os.path.join(folder, "trained.pt"))


def test_consolidate_and_export(dist_pool, tmp_path):
    """A 2-rank distributed checkpoint becomes one file a plain LlamaForCausalLM loads with the trained weights; its
    Hugging Face export computes the same logits."""
    dist_pool(2).run(train_and_save, folder=str(tmp_path))
    weights = consolidate(tmp_path / "run.ckpt", tmp_path / "single.pt")
    trained = torch.load(tmp_path / "trained.pt")
    hyper_parameters = torch.load(tmp_path / "single.pt", weights_only=False)["hyper_parameters"]
    config = llama_config_from(hyper_parameters)
    assert config.vocab_size == 64  # read back from the checkpoint's hyperparameters
    model = LlamaForCausalLM(config)
    model.load_state_dict(torch.load(tmp_path / "single.pt")["state_dict"])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, trained["model." + name], rtol=0, atol=0, msg=name)

    from transformers import LlamaForCausalLM as HFLlama

    export_llama_to_hf(weights, config, tmp_path / "hf")
    hf = HFLlama.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32, same weights, same RoPE convention: differences are summation order only (~1e-6)
        torch.testing.assert_close(hf(input_ids=ids).logits, model(input_ids=ids), rtol=1e-4, atol=1e-5)
    # the command line does the same in one go
    assert main([str(tmp_path / "run.ckpt"), str(tmp_path / "again.pt"), "--hf-dir", str(tmp_path / "hf2")]) == 0
    assert (tmp_path / "hf2" / "config.json").is_file() and (tmp_path / "again.pt").is_file()
