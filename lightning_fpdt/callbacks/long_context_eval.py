"""LongContextEval: needle retrieval scored during training, per length and depth (docs/long_context_eval.md).

Each probe is one teacher-forced forward (no generation) of a sequence with a needle at a chosen depth of filler and
a question at the end (:mod:`lightning_fpdt.data.needle`); it is scored by the log-probability of the answer tokens
and by exact match (every answer token the argmax). The forward runs as a validation batch does: through the
strategy's ``batch_to_device`` (under ``fpdt`` that shards the sequence over the sequence-parallel ranks, pads it and
shifts the labels on the global sequence) and the module's ``model_logits``.

Scores are sums, added up exactly across ranks: the answer tokens of a probe live on one rank (or straddle two), so
each rank sums its own answer tokens' log-probabilities and wrong argmaxes per probe, the sequence-parallel group adds
those up (one all-reduce per forward), a probe is an exact match when the group counts no wrong token, and the
probes of the data-parallel groups (each group runs its share of them) are added up over the world at the end.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_fpdt.callbacks.heatmap import labelled_heatmap
from lightning_fpdt.data.needle import (
    PASSKEY_FILLER,
    KeyValueNeedle,
    Needle,
    PasskeyNeedle,
    check_depths,
    probe_rng,
    probe_sample,
    stream_filler,
    synthetic_filler,
)
from lightning_fpdt.data.retrieval import RetrievalTask
from lightning_fpdt.sequence.loss import IGNORE_INDEX, shift_labels

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class LongContextScores:
    """The scores of one evaluation, ``(num_lengths, num_depths)`` tensors (the same on every rank)."""

    step: int
    """The optimizer step evaluated after."""
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    exact_match: Tensor
    """Fraction of a cell's probes whose every answer token is the argmax."""
    answer_logprob: Tensor
    """Mean over a cell's probes of the answer's log-probability (the sum over its tokens), in nats."""
    probes: Tensor
    """Probes scored per cell."""

    def metrics(self, prefix: str) -> dict[str, float]:
        """Scalars for the loggers: per cell, per length, and overall."""
        out = {f"{prefix}/exact_match": float(self.exact_match.mean()),
               f"{prefix}/answer_logprob": float(self.answer_logprob.mean())}
        for i, length in enumerate(self.lengths):
            out[f"{prefix}/exact_match/len{length}"] = float(self.exact_match[i].mean())
            for j, depth in enumerate(self.depths):
                cell = f"len{length}_depth{depth:g}"
                out[f"{prefix}/exact_match/{cell}"] = float(self.exact_match[i, j])
                out[f"{prefix}/answer_logprob/{cell}"] = float(self.answer_logprob[i, j])
        return out


class LongContextEval(pl.Callback):
    """Scores needle retrieval at several lengths and depths every ``every_n_steps`` optimizer steps and at the end
    of training (and in ``trainer.validate``), under the run's strategy, and logs the scores and a heatmap.

    Logged (rank 0's loggers, at the optimizer step): ``<prefix>/exact_match`` and ``<prefix>/answer_logprob``
    (means over all cells), ``<prefix>/exact_match/len<L>`` (per length), and per cell
    ``<prefix>/exact_match/len<L>_depth<d>`` and ``<prefix>/answer_logprob/len<L>_depth<d>``; to TensorBoard (and
    loggers with ``log_image``) the image ``<prefix>/heatmap``: exact match per cell, lengths left to right (shortest
    first), depths top to bottom (0 first), red 0 to green 1. The last scores are in :attr:`scores`.

    Needs a module with ``model_logits(batch)`` returning ``(B, S, V)`` logits (``LlamaLM``, ``HFCausalLM``): the
    logits of each rank's shard are computed whole, as ``CausalLM(accuracy=True)`` does.

    Args:
        every_n_steps: evaluate after every this many optimizer steps (and at the end of training); 0: only at the
            end.
        lengths: probe lengths in tokens, each at most the training length (the data module's ``seq_len``).
            ``None``: a quarter, half and all of the training length.
        depths: where the needle sits in the filler, each in [0, 1] (0: first, 1: right before the question).
        probes_per_cell: probes per (length, depth); a cell's exact match moves in steps of ``1 / probes_per_cell``.
        needle: ``"key_value"``: a key–value pair of the data module's retrieval task (``RetrievalDataModule``);
            ``"passkey"``: a passkey sentence encoded by ``tokenizer``; ``"auto"``: ``"key_value"`` with a retrieval
            data module, else ``"passkey"``. Python callers may pass a ``KeyValueNeedle`` or ``PasskeyNeedle``
            (e.g. a passkey from raw token ids).
        tokenizer: a local Hugging Face tokenizer directory or cached name, for ``"passkey"`` (loaded offline:
            nothing is downloaded).
        filler: ``"validation"``: windows of the validation data's token stream; ``"synthetic"``: random ids from
            ``filler_range`` (the retrieval task's filler ids; with a tokenizer, the passkey test's repeated
            sentence); ``"auto"``: the task's filler with a retrieval data module (its validation samples hold pairs
            and queries), else the validation data where the data module has some, else synthetic.
        filler_range: ``(low, high)``: synthetic filler ids in ``[low, high)``, overriding the defaults above.
        batch_size: probes per forward.
        seed: probes are a function of (seed, length, depth, index): the same at every evaluation.
        prefix: the metrics' name prefix.
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 100,
        lengths: Optional[list[int]] = None,
        depths: Sequence[float] = DEFAULT_DEPTHS,
        probes_per_cell: int = 4,
        needle: Union[Literal["auto", "key_value", "passkey"], KeyValueNeedle, PasskeyNeedle] = "auto",
        tokenizer: Optional[str] = None,
        filler: Literal["auto", "validation", "synthetic"] = "auto",
        filler_range: Optional[tuple[int, int]] = None,
        batch_size: int = 8,
        seed: int = 0,
        prefix: str = "long_context",
    ) -> None:
        super().__init__()
        if every_n_steps < 0:
            raise ValueError(f"LongContextEval(every_n_steps={every_n_steps}) must be >= 0 (0: only at the end)")
        if probes_per_cell < 1 or batch_size < 1:
            raise ValueError(f"LongContextEval: probes_per_cell ({probes_per_cell}) and batch_size ({batch_size}) "
                             f"must be at least 1")
        check_depths(depths)
        if lengths is not None and (not lengths or min(lengths) < 2):
            raise ValueError(f"LongContextEval(lengths={lengths}): give lengths of at least 2 tokens, or None for a "
                             f"quarter, half and all of the training length")
        if needle not in ("auto", "key_value", "passkey") and not isinstance(needle, (KeyValueNeedle, PasskeyNeedle)):
            raise ValueError(f"LongContextEval(needle={needle!r}): choose 'auto', 'key_value', 'passkey', or pass a "
                             f"KeyValueNeedle / PasskeyNeedle")
        if filler not in ("auto", "validation", "synthetic"):
            raise ValueError(f"LongContextEval(filler={filler!r}): choose 'auto', 'validation' or 'synthetic'")
        if filler_range is not None and not 0 <= filler_range[0] < filler_range[1]:
            raise ValueError(f"LongContextEval(filler_range={filler_range}): need 0 <= low < high")
        if filler == "validation" and filler_range is not None:
            raise ValueError("LongContextEval: filler_range has no effect with filler='validation'; drop one")
        self.every_n_steps = every_n_steps
        self.lengths_option = None if lengths is None else sorted(set(int(n) for n in lengths))
        self.lengths: list[int] = list(self.lengths_option or [])
        """The lengths evaluated: the option, or (at setup) a quarter, half and all of the training length."""
        self.depths = tuple(float(d) for d in depths)
        self.probes_per_cell, self.batch_size, self.seed, self.prefix = probes_per_cell, batch_size, seed, prefix
        self.needle_option, self.tokenizer, self.filler, self.filler_range = needle, tokenizer, filler, filler_range
        self.scores: Optional[LongContextScores] = None
        """The last evaluation's scores."""
        self.history: list[LongContextScores] = []
        """Every evaluation of the last fit (or validate), in order."""
        self._needle: Optional[Needle] = None
        self._datamodule: Any = None
        self._filler_kind: Optional[str] = None
        self._stream: Optional[Tensor] = None
        self._last_step: Optional[int] = None
        self._image_note_shown = False

    # ---- setup: the lengths, the needle and the filler ----------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not callable(getattr(pl_module, "model_logits", None)):
            raise ValueError(f"LongContextEval scores the answer from the logits: {type(pl_module).__name__} has no "
                             f"model_logits(batch) -> (B, S, V); use LlamaLM / HFCausalLM or define it")
        datamodule = self._datamodule = trainer.datamodule
        train_len = getattr(datamodule, "seq_len", None)
        if self.lengths_option is None:
            if train_len is None:
                raise ValueError("LongContextEval: the data module has no seq_len to take the lengths from; pass "
                                 "lengths=[...]")
            self.lengths = sorted({max(2, train_len // 4), max(2, train_len // 2), train_len})
        else:
            self.lengths = list(self.lengths_option)
        if train_len is not None and max(self.lengths) > train_len:
            raise ValueError(f"LongContextEval(lengths={self.lengths}): {max(self.lengths)} is above the training "
                             f"length ({train_len}); evaluate at lengths up to {train_len}")
        task = getattr(datamodule, "task", None)
        self._needle = self._resolve_needle(task)
        self._filler_kind = self._resolve_filler(task, datamodule)
        needle, question, answer = self._needle.draw(probe_rng(self.seed, 0, 0, 0))
        shortest = len(needle) + len(question) + len(answer) + isinstance(self._needle, KeyValueNeedle)  # + BOS
        if min(self.lengths) < shortest:
            raise ValueError(f"LongContextEval(lengths={self.lengths}): a probe needs at least {shortest} tokens (the "
                             f"needle, the question and the answer); raise the shortest length")
        if self.tokenizer is not None and isinstance(self._needle, KeyValueNeedle):
            rank_zero_warn("LongContextEval: tokenizer has no effect with a key-value needle (its ids are the "
                           "retrieval task's); drop it, or use needle='passkey'")
        self._stream = None
        self.history, self._last_step = [], None

    def _resolve_needle(self, task: Any) -> Needle:
        option = self.needle_option
        if isinstance(option, (KeyValueNeedle, PasskeyNeedle)):
            return option
        if option == "key_value" or (option == "auto" and isinstance(task, RetrievalTask)):
            if not isinstance(task, RetrievalTask):
                raise ValueError("LongContextEval(needle='key_value') asks a pair of the data module's retrieval task, "
                                 "and this data module has none; use RetrievalDataModule or needle='passkey'")
            return KeyValueNeedle(task)
        if self.tokenizer is None:
            raise ValueError("LongContextEval(needle='passkey') needs tokenizer='<a local tokenizer directory>' (or, "
                             "from Python, needle=PasskeyNeedle(digit_ids=..., prefix=..., question=...) in raw ids)")
        return PasskeyNeedle.from_tokenizer(self._load_tokenizer())

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True)

    def _resolve_filler(self, task: Any, datamodule: Any) -> str:
        if self.filler != "auto":
            return self.filler
        if isinstance(self._needle, KeyValueNeedle) or self.filler_range is not None:
            return "synthetic"
        return "validation" if callable(getattr(datamodule, "val_dataloader", None)) else "synthetic"

    def _filler(self, rng: Any, length: int, index: int) -> Tensor:
        """``length`` filler tokens for probe ``index``."""
        if self._filler_kind == "validation":
            return stream_filler(self._filler_stream(), length, index)
        if self.filler_range is not None:
            return synthetic_filler(rng, length, *self.filler_range)
        if isinstance(self._needle, KeyValueNeedle):
            return synthetic_filler(rng, length, *self._needle.filler_range)
        return stream_filler(self._filler_stream(), length, index)  # the passkey sentence, repeated

    def _filler_stream(self) -> Tensor:
        if self._stream is None:
            needed = max(self.lengths) * self.probes_per_cell
            if self._filler_kind == "validation":
                self._stream = validation_stream(self._datamodule, needed)
            elif self.tokenizer is not None:
                sentence = self._load_tokenizer().encode(PASSKEY_FILLER, add_special_tokens=False)
                self._stream = torch.tensor(sentence * (needed // len(sentence) + 1), dtype=torch.long)
            else:
                raise ValueError("LongContextEval(filler='synthetic') needs filler_range=(low, high) for a passkey in "
                                 "raw ids")
        return self._stream

    # ---- when ---------------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if self.every_n_steps and step > 0 and step % self.every_n_steps == 0 and step != self._last_step:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_step:
            self.run(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING and not trainer.sanity_checking:  # trainer.validate(...)
            self.run(trainer, pl_module)

    def run(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LongContextScores:
        """Evaluate now and log the scores and the heatmap (collective: every rank calls it)."""
        scores = self.evaluate(trainer, pl_module)
        self._last_step = trainer.global_step
        self.scores = scores
        self.history.append(scores)
        if trainer.is_global_zero:
            self._log(trainer, scores)
        return scores

    # ---- the evaluation -----------------------------------------------------------------------------------------
    def probe(self, length: int, depth_index: int, index: int) -> dict[str, Tensor]:
        """Probe ``index`` of the cell (``length``, ``depths[depth_index]``): the same on every rank and evaluation."""
        rng = probe_rng(self.seed, length, depth_index, index)
        needle, question, answer = self._needle.draw(rng)
        bos = RetrievalTask.BOS if isinstance(self._needle, KeyValueNeedle) else None
        filler = self._filler(rng, length - (bos is not None), index)
        return probe_sample(filler, needle, question, answer, depth=self.depths[depth_index], bos=bos)

    def evaluate(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> LongContextScores:
        """The scores of every cell (collective). Each data-parallel group runs every ``dp_size``-th probe, all in the
        same number of forwards (the parameters' all-gathers span the groups), a short last share padded with
        repeats that count for nothing."""
        strategy = trainer.strategy
        sp_size = int(getattr(strategy, "sequence_parallel_size", 1))
        sp_rank = int(getattr(strategy, "sequence_parallel_rank", 0))
        sp_group = strategy.sequence_parallel_group if sp_size > 1 else None
        dp_size, dp_rank = data_parallel(strategy, trainer, sp_size)
        device = strategy.root_device
        cells = len(self.lengths), len(self.depths)
        sums = torch.zeros(*cells, 3, dtype=torch.float64, device=device)  # answer log-prob, exact matches, probes
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad(), _as_validation(trainer), _keep_batch_plan(strategy):
                for i, length in enumerate(self.lengths):
                    everything = [(j, k) for j in range(cells[1]) for k in range(self.probes_per_cell)]
                    share = everything[dp_rank::dp_size]
                    per_group = math.ceil(len(everything) / dp_size)
                    weights = [1.0] * len(share) + [0.0] * (per_group - len(share))
                    share = share + [everything[0]] * (per_group - len(share))
                    for start in range(0, per_group, self.batch_size):
                        chosen = share[start:start + self.batch_size]
                        samples = [self.probe(length, j, k) for j, k in chosen]
                        batch = {key: torch.stack([s[key] for s in samples]) for key in ("input_ids", "labels")}
                        batch = strategy.batch_to_device(batch)
                        per_probe = probe_sums(pl_module.model_logits(batch), _targets(batch))  # (b, 3)
                        if sp_group is not None:
                            dist.all_reduce(per_probe, group=sp_group)
                        if sp_rank == 0:  # the group's ranks hold the same sums: one of them counts them
                            exact = (per_probe[:, 1] == 0) & (per_probe[:, 2] > 0)
                            weight = torch.tensor(weights[start:start + len(chosen)], dtype=torch.float64,
                                                  device=device)
                            for (j, _), w, logprob, hit in zip(chosen, weight, per_probe[:, 0], exact):
                                sums[i, j] += w * torch.stack([logprob, hit.double(), torch.ones_like(logprob)])
        finally:
            pl_module.train(was_training)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(sums)
        sums = sums.cpu()
        probes = sums[..., 2]
        return LongContextScores(step=trainer.global_step, lengths=tuple(self.lengths), depths=self.depths,
                                 exact_match=sums[..., 1] / probes.clamp(min=1),
                                 answer_logprob=sums[..., 0] / probes.clamp(min=1), probes=probes)

    # ---- logging ------------------------------------------------------------------------------------------------
    def _log(self, trainer: pl.Trainer, scores: LongContextScores) -> None:
        metrics = scores.metrics(self.prefix)
        image = labelled_heatmap(scores.exact_match, scores.lengths, scores.depths)  # (3, H, W) uint8
        tag = f"{self.prefix}/heatmap"
        without_images = []
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(tag, image, global_step=trainer.global_step, dataformats="CHW")
            elif callable(getattr(logger, "log_image", None)):
                logger.log_image(key=tag, images=[image.permute(1, 2, 0).numpy()], step=trainer.global_step)
            else:
                without_images.append(type(logger).__name__)
        if without_images and not self._image_note_shown:
            self._image_note_shown = True
            rank_zero_info(f"LongContextEval: {', '.join(without_images)} takes no images; the heatmap goes to "
                           f"TensorBoard and loggers with log_image only (the scalars are logged)")
        rank_zero_info(f"LongContextEval at step {scores.step}: exact match {metrics[f'{self.prefix}/exact_match']:.3f}"
                       f", answer log-prob {metrics[f'{self.prefix}/answer_logprob']:.3f} over "
                       f"{len(scores.lengths)} lengths x {len(scores.depths)} depths")


def probe_sums(logits: Tensor, targets: Tensor) -> Tensor:
    """Per probe of this rank's tokens: the answer tokens' summed log-probability, how many are not the argmax,
    and how many there are, ``(B, 3)`` float64 (sums: the sequence-parallel group adds them up)."""
    scored = targets != IGNORE_INDEX  # (B, S/P)
    target = targets.clamp(min=0)
    logprob = F.log_softmax(logits.float(), dim=-1).gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, S/P)
    wrong = (logits.argmax(dim=-1) != target) & scored
    return torch.stack([(logprob * scored).sum(1).double(), wrong.sum(1).double(), scored.sum(1).double()], dim=1)


def _targets(batch: dict[str, Tensor]) -> Tensor:
    """The strategy's ``shift_labels`` (shifted before sharding), else the labels shifted here (one process)."""
    return batch["shift_labels"] if "shift_labels" in batch else shift_labels(batch["labels"])


def data_parallel(strategy: Any, trainer: pl.Trainer, sp_size: int) -> tuple[int, int]:
    """``(dp_size, dp_rank)``: the groups that hold different samples, and this rank's."""
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        return mesh["data_parallel"].size(), mesh["data_parallel"].get_local_rank()
    return trainer.world_size // sp_size, trainer.global_rank // sp_size


@contextmanager
def _as_validation(trainer: pl.Trainer) -> Iterator[None]:
    """The probes go through the batch hooks as validation batches (a length schedule crops training batches only)."""
    stage = trainer.state.stage
    trainer.state.stage = RunningStage.VALIDATING
    try:
        yield
    finally:
        trainer.state.stage = stage


@contextmanager
def _keep_batch_plan(strategy: Any) -> Iterator[None]:
    """The strategy's record of the training batch stays that of the training batch."""
    plan = getattr(strategy, "batch_plan", None)
    try:
        yield
    finally:
        if plan is not None:
            strategy.batch_plan = plan


def validation_stream(datamodule: Any, needed: int) -> Tensor:
    """The validation data's ``input_ids`` end to end, at least ``needed`` tokens where there are that many."""
    pieces, total = [], 0
    for batch in datamodule.val_dataloader():
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        pieces.append(ids.reshape(-1).long().cpu())
        total += pieces[-1].numel()
        if total >= needed:
            break
    if not pieces:
        raise ValueError("LongContextEval(filler='validation'): the validation loader yields nothing; give validation "
                         "data or filler='synthetic'")
    return torch.cat(pieces)
