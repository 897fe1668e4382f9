"""``lightning-fpdt``: the LightningCLI of the project (``fit``, ``validate``, ``test``, ``--print_config``), the
memory planner (``plan``) and the calibration of a GPU's rates for its step-time model (``calibrate``).

    lightning-fpdt fit --config examples/configs/demo_cpu.yaml
    python -m lightning_fpdt.cli fit --config examples/configs/demo_cpu.yaml --trainer.max_steps 100
    lightning-fpdt plan --model llama3-8b --seq-len 1048576 --gpus 8 --callbacks all
    lightning-fpdt calibrate --model llama3-3b --seq-len 65536

It imports the package (so ``trainer.strategy: fpdt`` works) and the project's models, data modules and callbacks,
so YAML can name them by their short class name (``model: LlamaLM``, ``data: RetrievalDataModule``,
``trainer.callbacks: [MFUMonitor]``) as well as by ``class_path``. See docs/cli.md.
"""

from __future__ import annotations

import os
import re
import statistics
import sys
import traceback
from typing import Any, Optional

from jsonargparse import ArgumentParser
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI

import lightning_fpdt  # noqa: F401  (registers the "fpdt" strategy)
from lightning_fpdt.callbacks import (  # noqa: F401  (short names for YAML)
    ActivationOffload,
    GradientCheck,
    LongContextEval,
    MFUMonitor,
    SequenceLengthCurriculum,
    StepProgress,
    TiledLoss,
    TiledMLP,
)
from lightning_fpdt.data import RetrievalDataModule, TokenFileDataModule  # noqa: F401  (short names for YAML)
from lightning_fpdt.models.module import HFCausalLM, LlamaLM  # noqa: F401  (short names for YAML)
from lightning_fpdt.planner import main as plan_main
from lightning_fpdt.planner.commands import calibrate_main

PLAN_HELP = "Predict a run's GPU peak and pinned host memory, and what to change when it does not fit."
CALIBRATE_HELP = "Measure this GPU's rates for the planner's step-time model, once (cached)."


class FPDTCLI(LightningCLI):
    """LightningCLI with any LightningModule / LightningDataModule as ``model`` / ``data`` (subclass mode), the
    project's classes importable by short name, the config saved next to the logs (overwritten on a rerun), and a
    closing summary after ``fit``: validation metrics, the task's chance accuracy if it has one, and throughput."""

    def __init__(self, args: ArgsType = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        super().__init__(args=args, **kwargs)

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """Lightning's subcommands, and ``plan`` and ``calibrate`` listed beside them (:func:`main` runs them before any
        parsing)."""
        super()._add_subcommands(parser, **kwargs)
        subcommands = getattr(parser, "_subcommands_action", None)
        if subcommands is not None:
            for name, text in (("plan", PLAN_HELP), ("calibrate", CALIBRATE_HELP)):
                subcommands.add_subcommand(name, ArgumentParser(description=text),
                                           help=f"{text} (its options: lightning-fpdt {name} --help)")

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print(fit_summary(self.trainer, self.datamodule), flush=True)


def fit_summary(trainer: Any, datamodule: Optional[Any] = None) -> str:
    """The closing lines of a fit: validation accuracy (next to the chance level when the data module knows it),
    validation loss and perplexity, and the median tokens/s of the steps after the first (from ``MFUMonitor``)."""
    metrics = trainer.callback_metrics
    lines = [f"fit done: {trainer.global_step} optimizer steps on {trainer.world_size} "
             f"{trainer.strategy.root_device.type} processes"]
    accuracy, chance = metrics.get("val/accuracy"), getattr(datamodule, "chance_accuracy", None)
    if accuracy is not None:
        line = f"  validation accuracy {100 * float(accuracy):.1f}%"
        if chance is not None:
            line += f"   (chance: {100 * chance:.1f}%, a guess among {round(1 / chance)} values)"
        lines.append(line)
    if "val/loss" in metrics:
        loss, perplexity = float(metrics["val/loss"]), float(metrics["val/perplexity"])
        lines.append(f"  validation loss {loss:.4f}, perplexity {perplexity:.3f}")
    monitor = next((cb for cb in trainer.callbacks if isinstance(cb, MFUMonitor)), None)
    if monitor is not None and monitor.step_records:
        steps = monitor.step_records[1:] or monitor.step_records  # the first step warms up
        tokens_per_sec = statistics.median(r.tokens / r.step_time_s for r in steps)
        lines.append(f"  {tokens_per_sec:,.0f} tokens/s (median of {len(steps)} steps)")
    return "\n".join(lines)


def main(args: ArgsType = None) -> None:
    """Entry point of the ``lightning-fpdt`` console script and of ``python -m lightning_fpdt.cli``; ``plan`` runs the
    memory planner (lightning_fpdt.planner) and ``calibrate`` measures this GPU's rates, instead of a LightningCLI
    subcommand."""
    argv = sys.argv[1:] if args is None else args
    commands = {"plan": plan_main, "calibrate": calibrate_main}
    if isinstance(argv, (list, tuple)) and argv[:1] and argv[0] in commands:
        raise SystemExit(commands[argv[0]](list(argv[1:])))
    try:
        FPDTCLI(args=args)
    except ValueError as error:
        mistake = package_error(error)
        if mistake is None or os.environ.get(TRACEBACK_VARIABLE):
            raise
        print(f"lightning-fpdt: error: {mistake}\n(the whole traceback: {TRACEBACK_VARIABLE}=1)", file=sys.stderr)
        raise SystemExit(2) from None


TRACEBACK_VARIABLE = "FPDT_TRACEBACK"
"""Set (to anything) to see a user mistake's whole traceback instead of its message."""


def package_error(error: BaseException) -> Optional[str]:
    """What to tell of a ``ValueError`` a class of a config raised for a user mistake (an option out of range, a batch
    the strategy cannot shard): the innermost such error this package raised behind ``error``, or, where jsonargparse
    kept only the messages (a class given for a union type: "Does not validate against any of the Union subtypes"
    beside "Expected a <class 'str'>" and the whole namespace), the class's own message with its ``class_path``;
    ``None`` when it holds neither."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    seen: set[int] = set()
    current: Optional[BaseException] = error
    found = None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames = traceback.extract_tb(current.__traceback__)
        if isinstance(current, ValueError) and frames and os.path.abspath(frames[-1].filename).startswith(package):
            found = str(current)  # the innermost such error says it best
        current = current.__cause__ or current.__context__
    if found is not None:
        return found
    text = str(error)
    if "\nErrors:" not in text:
        return None
    listed = text.split("\nErrors:", 1)[1].split("\nGiven value", 1)[0]
    reasons = [line.strip()[2:] for line in listed.splitlines()
               if line.strip().startswith("- ") and not line.strip().startswith("- Expected a ")]
    if not reasons:
        return None
    where = re.search(r"class_path='([^']+)'", text)
    return (f"{where.group(1)}: " if where else "") + "; ".join(reasons)


if __name__ == "__main__":
    main()
