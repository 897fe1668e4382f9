"""Models, data and the single-process reference loop shared by the whole-training parity tests."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.sequence import SequenceLayout
from tests.tuning import tune

VOCAB = 64


class TokenDataset(Dataset):
    """Random tokens; some samples mask a long prefix of labels so a rank's shard can have no valid target."""

    def __init__(self, num_samples: int, seq_len: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(0, VOCAB, (num_samples, seq_len), generator=gen)
        self.labels = self.input_ids.clone()
        for i in range(num_samples):
            masked = (i * 7) % (seq_len - 2) if i % 2 else seq_len // 2 + 1  # uneven -100 across ranks
            self.labels[i, :masked] = -100

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


class PlainBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, D)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(x)


class PlainLM(nn.Module):
    """A plain PyTorch LM calling F.scaled_dot_product_attention, with learned absolute positions."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(PlainBlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(kind: str, seed: int, tuning: Optional[str] = None) -> nn.Module:
    """The model of ``kind`` from ``seed``, with the parameters ``tuning`` leaves trainable (``tests/tuning.py``)."""
    model = _build_model(kind, seed)
    return model if tuning is None else tune(model, tuning, seed)


def _build_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=VOCAB, num_heads=4, num_kv_heads=2))
    if kind == "llama-gqa8":  # 8 query / 4 kv heads: head groups at sequence_parallel_size 4
        return LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=VOCAB, num_heads=8, num_kv_heads=4))
    if kind == "llama-mha":
        return LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=VOCAB, num_heads=4, num_kv_heads=4))
    if kind == "llama-6q2kv":  # 6 query / 2 kv heads: an uneven head split on 4 ranks (2, 2, 1, 1 query heads)
        return LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=VOCAB, num_heads=6, num_kv_heads=2,
                                                      head_dim=8))
    if kind == "hf-qwen2-6q2kv":  # a Qwen2-shaped Hugging Face model with 6 query / 2 kv heads (uneven on 4 ranks)
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
                             attn_implementation="sdpa")
        return Qwen2ForCausalLM(config)
    if kind == "llama-2heads":  # fewer heads than 4 ranks: the Ulysses x ring hybrid
        return LlamaForCausalLM(LlamaConfig.from_name("tiny", vocab_size=VOCAB, num_heads=2, num_kv_heads=1))
    if kind in ("hf", "hf-2heads"):
        from transformers import LlamaConfig as HFConfig, LlamaForCausalLM as HFLlama

        heads = (4, 2) if kind == "hf" else (2, 1)  # hf-2heads: fewer heads than 4 ranks (the ring hybrid)
        config = HFConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=heads[0], num_key_value_heads=heads[1], max_position_embeddings=128,
                          attn_implementation="sdpa")
        return HFLlama(config)
    if kind == "plain":
        return PlainLM()
    if kind.startswith("family:"):  # family:<model_type>[:no-router-loss], a row of tests/families.py
        from tests.families import MINI_MODELS, MOE_WITHOUT_ROUTER_LOSS, build

        _, model_type, *variant = kind.split(":")
        return build(model_type, MOE_WITHOUT_ROUTER_LOSS[model_type] if variant else MINI_MODELS[model_type])
    raise ValueError(kind)


def model_loss(kind: str, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss as a user's training_step computes it (the same code runs under the strategy and alone)."""
    if kind.startswith("llama"):
        return model(**batch)
    if kind.startswith(("hf", "family:")):
        return model(**batch).loss
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """``"sgd"``, or ``"adamw"`` (with weight decay, so every update also reads the parameter)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    return torch.optim.SGD(params, lr=lr)


class LitLM(L.LightningModule):
    def __init__(self, kind: str, seed: int, lr: float, optimizer: str = "sgd", tuning: Optional[str] = None) -> None:
        super().__init__()
        self.kind, self.lr, self.optimizer_name = kind, lr, optimizer
        self.model = build_model(kind, seed, tuning)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return model_loss(self.kind, self.model, batch)

    def on_train_batch_end(self, outputs: dict[str, torch.Tensor], batch: Any, batch_idx: int) -> None:
        # the loss Lightning got back from the strategy (divided by the accumulation steps): under fpdt the
        # sequence group's token mean, also for a plain module whose own loss is its rank's local mean
        self.losses.append(outputs["loss"].item() * self.trainer.accumulate_grad_batches)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.optimizer_name, self.parameters(), self.lr)


def reference_batch(kind: str, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What one process feeds the model: plain models get globally shifted labels and positions by hand."""
    if kind == "plain":
        s = batch["input_ids"].shape[1]
        return {"input_ids": batch["input_ids"], "labels": SequenceLayout.shift_labels(batch["labels"]),
                "position_ids": torch.arange(s).expand_as(batch["input_ids"])}
    return batch


def reference_training(kind: str, *, seed: int, lr: float, steps: int, accumulate: int, dp: int,
                       dataset: Dataset, batch_size: int, optimizer: str = "sgd",
                       tuning: Optional[str] = None) -> tuple[dict[str, torch.Tensor], list[list[float]]]:
    """Single process: per optimizer step, the mean over data-parallel groups of each group's token-mean loss."""
    model = build_model(kind, seed, tuning)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    # Lightning replaces a training loader's sampler by DistributedSampler(shuffle=True, seed=0) keyed on the
    # strategy's data-parallel rank; group d of the parallel run sees exactly these batches
    loaders = [iter(DataLoader(dataset, batch_size=batch_size,
                               sampler=DistributedSampler(dataset, num_replicas=dp, rank=d, shuffle=True, seed=0)))
               for d in range(dp)]
    losses: list[list[float]] = [[] for _ in range(dp)]
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            for d in range(dp):
                loss = model_loss(kind, model, reference_batch(kind, next(loaders[d])))
                losses[d].append(loss.item())
                (loss / (dp * accumulate)).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to a full tensor (FSDP2 DTensors unsharded)."""
    out = {}
    for name, p in module.state_dict().items():
        out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
    return out


def trainer_kwargs(**extra: Any) -> dict[str, Any]:
    kwargs = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    return {**kwargs, **extra}


class FirstBatchGradients(L.Callback):
    """Whether the parameters had gradients after the first batch of each accumulation window: FSDP2 has put them
    in their shards only where that batch reduce-scattered."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.seen.append(all(p.grad is not None for p in pl_module.parameters() if p.requires_grad))
