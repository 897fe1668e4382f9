"""LightningModules for causal language models: the reference Llama and Hugging Face models.

Both train with AdamW (optional linear warm-up and cosine decay) and log, per step, the training loss (the
sequence group's token mean, as the strategy reports it) and, per validation run, the token-mean loss and the
perplexity over all validation tokens. With ``accuracy=True`` they also log the token accuracy (on the retrieval
task: the retrieval accuracy), which needs the full logits of each rank's shard: meant for small vocabularies, not
for 128K-vocabulary models at long context.

Under sequence parallelism each rank holds different tokens of the same sequences, so every metric keeps sums and
counts that torchmetrics adds up over all ranks (see :mod:`lightning_fpdt.models.metrics`).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn

from lightning_fpdt.models.llama import LlamaConfig, LlamaForCausalLM
from lightning_fpdt.models.metrics import TokenAccuracy, TokenPerplexity
from lightning_fpdt.sequence.loss import IGNORE_INDEX, shift_labels, token_loss_sum

_MODEL_INPUTS = ("input_ids", "position_ids")


def _field(output: Any, name: str) -> Tensor:
    """A model's ``loss`` or ``logits``: the output itself when it is a tensor, else its attribute ``name``."""
    return output if isinstance(output, Tensor) else getattr(output, name)


def targets_of(batch: dict[str, Tensor]) -> Tensor:
    """Per-token targets of a batch: the strategy's ``shift_labels`` (shifted on the global sequence before
    sharding), else ``labels`` (or the input ids) shifted here on the whole, unsharded sequence."""
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return shift_labels(batch.get("labels", batch["input_ids"]))


class CausalLM(L.LightningModule):
    """Training, evaluation and optimizer of a causal LM held in ``self.model``; subclasses build the model.

    Subclasses build ``self.model``: a causal LM taking ``input_ids``, ``position_ids`` and ``labels`` /
    ``shift_labels``, returning the loss or logits as a tensor (the reference Llama) or in an output's ``loss`` /
    ``logits`` (Hugging Face). :meth:`model_loss` is the model computing its own loss, which the fpdt strategy has
    switched to the sequence group's token mean, tiled by ``TiledLoss`` when present.

    Args:
        lr: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up from 0 over this many optimizer steps.
        decay: ``"constant"`` after warm-up, or ``"cosine"`` to 10% of ``lr`` at the last step.
        accuracy: also compute token accuracy (train: every step, synced over the ranks; validation/test). Needs the
            logits of the whole shard, and bypasses ``TiledLoss``.
    """

    model: nn.Module

    def __init__(
        self,
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        decay: Literal["constant", "cosine"] = "constant",
        accuracy: bool = False,
    ) -> None:
        super().__init__()
        if lr <= 0 or weight_decay < 0 or warmup_steps < 0:
            raise ValueError(
                f"need lr ({lr}) > 0, weight_decay ({weight_decay}) >= 0, warmup_steps ({warmup_steps}) >= 0"
            )
        if decay not in ("constant", "cosine"):
            raise ValueError(f"decay must be 'constant' or 'cosine', got {decay!r}")
        self.lr, self.weight_decay, self.warmup_steps, self.decay = lr, weight_decay, warmup_steps, decay
        self.accuracy = accuracy
        self.losses: list[float] = []
        """The training loss of every micro-batch (the sequence group's token mean)."""
        # every state is a sum, added up over all ranks when computed (see lightning_fpdt.models.metrics)
        self.train_accuracy = TokenAccuracy(dist_sync_on_step=True)  # the answers may all sit on another rank
        self.val_perplexity, self.val_accuracy = TokenPerplexity(), TokenAccuracy()
        self.test_perplexity, self.test_accuracy = TokenPerplexity(), TokenAccuracy()

    # ---- the model's own loss and logits ---------------------------------------------------------------------------
    def model_loss(self, batch: dict[str, Tensor]) -> Tensor:
        inputs = {k: batch[k] for k in (*_MODEL_INPUTS, "labels", "shift_labels") if k in batch}
        inputs.setdefault("labels", batch["input_ids"])
        return _field(self.model(**inputs), "loss")

    def model_logits(self, batch: dict[str, Tensor]) -> Tensor:
        return _field(self.model(**{k: batch[k] for k in _MODEL_INPUTS if k in batch}), "logits")

    # ---- steps ----------------------------------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        if not self.accuracy:
            return self.model_loss(batch)
        targets = targets_of(batch)
        logits = self.model_logits(batch)
        loss_sum, count = token_loss_sum(logits, targets)
        self.log("train/accuracy", self.train_accuracy(logits.detach(), targets), prog_bar=True)
        # this rank's token mean; the fpdt strategy turns it into the group's (a plain module's loss, docs/design.md §5)
        return loss_sum / count.clamp(min=1)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # the loss after the strategy (the sequence group's token mean), undone from Lightning's division by the
        # accumulation steps
        if not isinstance(outputs, dict) or outputs.get("loss") is None:
            return  # a skipped step
        loss = outputs["loss"].detach() * self.trainer.accumulate_grad_batches
        self.losses.append(loss.item())
        self.log("train/loss", loss, prog_bar=True)

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_perplexity, self.val_accuracy)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_perplexity, self.test_accuracy)

    def on_validation_epoch_end(self) -> None:
        self._log_evaluation("val", self.val_perplexity, self.val_accuracy)

    def on_test_epoch_end(self) -> None:
        self._log_evaluation("test", self.test_perplexity, self.test_accuracy)

    def _evaluate(self, batch: dict[str, Tensor], perplexity: TokenPerplexity, accuracy: TokenAccuracy) -> None:
        targets = targets_of(batch)
        if self.accuracy:
            logits = self.model_logits(batch)
            perplexity.update(*token_loss_sum(logits, targets))
            accuracy.update(logits, targets)
        else:
            # the model's loss is its sequence group's token mean m; the group's ranks add up m · n_local to the
            # group's total loss (m alone, averaged over ranks, would weight ranks with few tokens wrongly)
            count = (targets != IGNORE_INDEX).sum()
            perplexity.update(self.model_loss(batch).detach() * count, count)

    def _log_evaluation(self, prefix: str, perplexity: TokenPerplexity, accuracy: TokenAccuracy) -> None:
        value = perplexity.compute()  # summed over every rank: the same on all
        metrics = {f"{prefix}/loss": value.log(), f"{prefix}/perplexity": value}
        if self.accuracy:
            metrics[f"{prefix}/accuracy"] = accuracy.compute()
        # already global (the same on every rank); sync_dist averages equal values and keeps Lightning from warning
        for name, metric in metrics.items():
            self.log(name, metric.float(), prog_bar=name.endswith("accuracy"), sync_dist=True)
        perplexity.reset()
        accuracy.reset()

    # ---- optimizer ------------------------------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        if not self.warmup_steps and self.decay == "constant":
            return optimizer
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self.decay == "cosine" else 0
        warmup, decay = self.warmup_steps, self.decay

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if decay == "constant":
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LlamaLM(CausalLM):
    """The reference Llama (:mod:`lightning_fpdt.models.llama`) as a causal LM.

    Args:
        name: a named size of :class:`LlamaConfig` (``"tiny"``, ``"llama3-1b"``, ``"llama3-8b"``).
        config_overrides: config fields to change, e.g. ``{"num_layers": 2, "vocab_size": 96}``.
        seed: seed of the weight initialisation (the same on every rank; the global RNG is left alone). Unused with
            ``meta_init`` (a seed other than 0 warns).
        meta_init: build the model on the meta device (no memory, no init) instead of in fp32 on the CPU of every
            process (Llama-3-8B: 32 GB and minutes of init per process). The strategy then materialises each rank's
            FSDP2 shards on its device and initialises them with the model's own ``reset_parameters`` (Linear and
            Embedding weights ~ N(0, initializer_range), norms 1) from the global RNG: seed it with
            ``seed_everything``. The values differ from the CPU init of the same ``seed``. Needs a strategy that
            materialises meta modules (``fpdt``).
        lr, weight_decay, warmup_steps, decay, accuracy: see :class:`CausalLM`.
        **overrides: more config fields, for Python callers (``LlamaLM("tiny", num_layers=2)``).
    """

    def __init__(
        self,
        name: str = "tiny",
        *,
        config_overrides: Optional[dict[str, Any]] = None,
        seed: int = 0,
        meta_init: bool = False,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        decay: Literal["constant", "cosine"] = "constant",
        accuracy: bool = False,
        **overrides: Any,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, decay=decay, accuracy=accuracy)
        self.save_hyperparameters()
        config = LlamaConfig.from_name(name, **{**(config_overrides or {}), **overrides})
        if meta_init:
            if seed != 0:
                rank_zero_warn(
                    f"LlamaLM: seed ({seed}) has no effect with meta_init=True: the strategy initialises the shards "
                    f"from the global RNG; seed that with seed_everything({seed})"
                )
            with torch.device("meta"):  # shapes only: the strategy allocates and initialises the shards
                self.model = LlamaForCausalLM(config)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.model = LlamaForCausalLM(config)


class HFCausalLM(CausalLM):
    """A Hugging Face ``AutoModelForCausalLM`` by name or path, pretrained weights when available.

    Args:
        model_name_or_path: a Hub model name (``"Qwen/Qwen2.5-0.5B"``) or a local directory with a ``config.json``.
            A local path that does not exist is refused at once (no Hub look-ups), naming what its nearest existing
            folder holds.
        from_pretrained: ``True``: load the weights (downloading them if needed); ``False``: random init from the
            config; ``"auto"``: load the weights if they are on this machine (the directory or the Hub cache),
            else random init from the config. A local directory without weights is refused unless ``False``: a
            model folder whose weights were not copied would otherwise train from random weights unnoticed.
        config_overrides: config fields to change, e.g. ``{"num_hidden_layers": 2}`` (random init only uses
            them all; with weights, only fields that keep the shapes make sense).
        dtype: dtype of the weights when built (``"bfloat16"``, ``"float32"``); ``None``: float32, which
            mixed precision expects.
        trust_remote_code: passed to transformers.
        seed: seed of a random initialisation.
        lr, weight_decay, warmup_steps, decay, accuracy: see :class:`CausalLM`.
    """

    def __init__(
        self,
        model_name_or_path: str,
        *,
        from_pretrained: Union[bool, Literal["auto"]] = "auto",
        config_overrides: Optional[dict[str, Any]] = None,
        dtype: Optional[str] = None,
        trust_remote_code: bool = False,
        seed: int = 0,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        decay: Literal["constant", "cosine"] = "constant",
        accuracy: bool = False,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, decay=decay, accuracy=accuracy)
        if from_pretrained not in (True, False, "auto"):
            raise ValueError(f"from_pretrained must be True, False or 'auto', got {from_pretrained!r}")
        self.save_hyperparameters()
        self.model, self.loaded_pretrained = build_hf_model(
            model_name_or_path, from_pretrained=from_pretrained, config_overrides=config_overrides,
            dtype=dtype, trust_remote_code=trust_remote_code, seed=seed,
        )


def build_hf_model(
    model_name_or_path: str,
    *,
    from_pretrained: Union[bool, Literal["auto"]] = "auto",
    config_overrides: Optional[dict[str, Any]] = None,
    dtype: Optional[str] = None,
    trust_remote_code: bool = False,
    seed: int = 0,
) -> tuple[nn.Module, bool]:
    """``(model, whether pretrained weights were loaded)``; see :class:`HFCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype is not None and not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as 'bfloat16' or 'float32', got {dtype!r}")
    torch_dtype = getattr(torch, dtype) if dtype else torch.float32
    common = dict(trust_remote_code=trust_remote_code, attn_implementation="sdpa")  # the strategy swaps in "fpdt"
    overrides = dict(config_overrides or {})
    check_model_source(model_name_or_path, weights_needed=from_pretrained is not False)
    if from_pretrained is True or (from_pretrained == "auto" and _weights_available(model_name_or_path)):
        with _progress_bars(rank_zero_only.rank == 0):  # one loading bar per job, not one per rank
            model = AutoModelForCausalLM.from_pretrained(
                model_name_or_path, dtype=torch_dtype, local_files_only=from_pretrained == "auto", **overrides,
                **common,
            )
        model.train()  # from_pretrained returns the model in eval mode; this one is built to be trained
        rank_zero_info(f"HFCausalLM: loaded the pretrained weights of {model_name_or_path}")
        return model, True
    config = AutoConfig.from_pretrained(model_name_or_path, trust_remote_code=trust_remote_code, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, **common)
    rank_zero_info(f"HFCausalLM: {model_name_or_path} initialised at random from its config (no weights loaded)")
    return model, False


_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
)
_HUB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
"""A Hub model name: ``name`` or ``owner/name``."""


def check_model_source(model_name_or_path: str, *, weights_needed: bool) -> None:
    """Refuse, before any Hub look-up, a ``model_name_or_path`` that is meant as a local path but is not a model
    folder: a path that does not exist (absolute, relative to ``.``/``~``, or under a local folder, as
    ``models/qwen3`` is when ``models/`` exists), a file, a folder without ``config.json``, or (``weights_needed``)
    a folder without weights. Each ``ValueError`` says what is there instead."""
    path = Path(model_name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{model_name_or_path} is not a model folder: it has no config.json ({_listing(path)})")
        if weights_needed and not any((path / name).exists() for name in _WEIGHT_FILES):
            raise ValueError(
                f"{model_name_or_path} holds a config.json but no weights (none of {', '.join(_WEIGHT_FILES)}; "
                f"{_listing(path)}): copy the weights there, or pass from_pretrained=False (YAML: from_pretrained: "
                f"false) to start from random weights with this config"
            )
        return
    if path.exists():
        raise ValueError(f"{model_name_or_path} is a file; pass the folder that holds config.json and the weights")
    first = Path(model_name_or_path.split("/", 1)[0]).expanduser()
    meant_local = (not _HUB_NAME.fullmatch(model_name_or_path) or model_name_or_path.startswith((".", "~"))
                   or ("/" in model_name_or_path and first.is_dir()))
    if not meant_local:
        return  # a Hub name: transformers looks it up
    parent = next((p for p in path.absolute().parents if p.is_dir()), None)
    near = ""
    if parent is not None:
        missing = path.absolute().relative_to(parent).parts[0]
        close = difflib.get_close_matches(missing, [p.name for p in parent.iterdir()], n=1)
        near = f"; {parent} holds {_listing(parent)}" + (f" (did you mean {parent / close[0]}?)" if close else "")
    raise ValueError(f"model folder {model_name_or_path} does not exist{near}")


def _listing(folder: Path, limit: int = 12) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "it is empty"
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


@contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """transformers' progress bars on or off for the duration (on where they were, and ``show``)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    if enabled and not show:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled and not show:
            hf_logging.enable_progress_bar()


def _weights_available(model_name_or_path: str) -> bool:
    """Whether ``from_pretrained`` can load weights without downloading: a local directory holding them, or a Hub
    name whose weights are in the local cache."""
    path = Path(model_name_or_path).expanduser()
    if path.is_dir():
        return any((path / name).exists() for name in _WEIGHT_FILES)
    from huggingface_hub import try_to_load_from_cache

    try:
        return any(isinstance(try_to_load_from_cache(model_name_or_path, name), str) for name in _WEIGHT_FILES)
    except ValueError:  # not a valid Hub name either (huggingface_hub's HFValidationError)
        return False
