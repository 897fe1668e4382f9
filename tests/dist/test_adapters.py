"""LoRA under the strategy (docs/adapters.md): a ``peft`` ``PeftModel`` around a Hugging Face Llama takes the Hugging
Face path, so the loss the model returns (what ``self.log`` records) is the sequence's on every rank; after three
optimizer steps on 2 processes every parameter equals one process's and only the adapters moved; the adapters saved
after ``fit`` (by ``save_adapters`` on every rank, or by peft's own ``save_pretrained`` on one) load with
``PeftModel.from_pretrained``, merged with ``from_pretrained``, and compute the reference's logits."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.export import save_adapters
from lightning_fpdt.integrations import adapters as adapters_module
from tests.dist import test_strategy_parity as parity
from tests.dist.training import (VOCAB, LitLM, TokenDataset, _build_model, build_model, reference_training,
                                 trainer_kwargs)

pytest.importorskip("peft")

# fp32 logits of a 2-layer model: the trained weights match the reference within parity.TOL; the same weights
# saved and loaded give the same logits to rounding (merged: W + B·A·scale summed once, ~1e-7 relative)
LOGITS_TOL = dict(rtol=1e-4, atol=1e-5)


class LoggedLossLM(LitLM):
    """Records the loss the model returns, as a user's ``self.log`` sees it (before the strategy touches it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model_losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        self.model_losses.append(loss.item())
        return loss


def run_lora(directory: str, tuning: str, chunks: int, seq_len: int) -> None:
    seed, lr, steps, batch_size = 1234, 0.5, 3, 2
    dataset = TokenDataset(num_samples=batch_size * steps, seq_len=seq_len, seed=7)
    strategy = FPDTStrategy(sequence_parallel_size=2, chunks=chunks, heartbeat_timeout=None)
    trainer = L.Trainer(strategy=strategy, devices=dist.get_world_size(), max_steps=steps, **trainer_kwargs())
    module = LoggedLossLM("hf", seed, lr, tuning=tuning)
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, shuffle=False))
    ref_params, ref_losses = reference_training("hf", seed=seed, lr=lr, steps=steps, accumulate=1, dp=1,
                                                dataset=dataset, batch_size=batch_size, tuning=tuning)
    case = f"LoRA {tuning} chunks={chunks} S={seq_len}"
    # the model's own loss (and so what self.log records) is the sequence's on every rank, not the rank's share
    torch.testing.assert_close(torch.tensor(module.model_losses), torch.tensor(ref_losses[0]), **parity.TOL,
                               msg=lambda m: f"{case} model losses {module.model_losses} vs {ref_losses[0]}: {m}")
    assert trainer.callback_metrics["train_loss"].item() == module.model_losses[-1]
    _, moved = parity.compare_training(case, module, ref_params, module.losses, ref_losses[0],
                                       build_model("hf", seed, tuning))
    assert moved == sum(p.requires_grad for p in module.model.parameters()) > 0

    # saved after fit on every rank; one process writes
    adapters, merged = Path(directory) / f"{tuning}-adapters", Path(directory) / f"{tuning}-merged"
    save_adapters(module.model, adapters)
    save_adapters(module.model, merged, merged=True)
    dist.barrier()
    own = Path(directory) / f"{tuning}-own"  # peft's own save_pretrained, on rank 0 alone: no collective runs
    if dist.get_rank() == 0:
        module.model.save_pretrained(own)
    # weights too large to keep on the host after fit: save_pretrained names the way that gathers them
    kept_bytes, adapters_module.MAX_KEPT_BYTES = adapters_module.MAX_KEPT_BYTES, 0
    try:
        adapters_module.keep_trained_adapters(module)
    finally:
        adapters_module.MAX_KEPT_BYTES = kept_bytes
    with pytest.raises(ValueError, match=r"save_adapters\(model, directory\) on every rank"):
        module.model.save_pretrained(Path(directory) / f"{tuning}-refused")
    if dist.get_rank() != 0:
        return
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = build_model("hf", seed, tuning)
    reference.load_state_dict(ref_params)
    loaded = PeftModel.from_pretrained(_build_model("hf", seed), adapters)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, ref_params[name], **parity.TOL, msg=lambda m: f"{case} {name}: {m}")
    for name, value in PeftModel.from_pretrained(_build_model("hf", seed), own).state_dict().items():
        torch.testing.assert_close(value, loaded.state_dict()[name], rtol=0, atol=0, msg=lambda m: f"{case} {name}")
    tokens = torch.randint(0, VOCAB, (2, seq_len), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = reference.eval()(input_ids=tokens).logits
        torch.testing.assert_close(loaded.eval()(input_ids=tokens).logits, expected, **LOGITS_TOL)
        plain = AutoModelForCausalLM.from_pretrained(merged).eval()
        assert not any("lora" in name for name in plain.state_dict())
        torch.testing.assert_close(plain(input_ids=tokens).logits, expected, **LOGITS_TOL)


def test_lora_two_processes_against_one(dist_pool, tmp_path):
    """sp=2, LoRA on the attention (chunks 2) and on the MLP (padding to 16): the model's loss is the sequence's on
    both ranks, the adapters train as on one process and nothing else moves, the saved adapters and merged weights
    load and compute the trained model's logits."""
    for case in (dict(tuning="lora-attention", chunks=2, seq_len=16), dict(tuning="lora-mlp", chunks=1, seq_len=15)):
        dist_pool(2).run(run_lora, directory=str(tmp_path), **case)
