"""A plan's options as the arguments a user writes: ``FPDTStrategy(...)`` and the callbacks, in Python and in a
LightningCLI YAML (each memory feature names its own, :meth:`MemoryFeature.arguments`)."""

from __future__ import annotations

from typing import Any

from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.phases import plan_sizes

CALLBACK_ORDER = ("ActivationOffload", "TiledMLP", "TiledLoss")


def arguments(plan: MemoryPlan) -> dict[str, dict[str, Any]]:
    """``{"FPDTStrategy": {...}, "ActivationOffload": {...}, "TiledMLP": {}, ...}`` of the plan's options."""
    s = plan_sizes(plan)
    chosen: dict[str, dict[str, Any]] = {"FPDTStrategy": {"sequence_parallel_size": s.o.sequence_parallel_size}}
    for feature in FEATURES:
        for owner, kwargs in feature.arguments(s).items():
            chosen.setdefault(owner, {}).update(kwargs)
    return chosen


def _python(value: Any) -> str:
    return repr(value)


def python_arguments(plan: MemoryPlan) -> str:
    """``strategy=FPDTStrategy(...)`` and ``callbacks=[...]`` lines."""
    chosen = arguments(plan)

    def call(name: str) -> str:
        return f"{name}(" + ", ".join(f"{k}={_python(v)}" for k, v in chosen[name].items()) + ")"

    callbacks = [call(name) for name in CALLBACK_ORDER if name in chosen]
    return f"strategy=FPDTStrategy({', '.join(f'{k}={_python(v)}' for k, v in chosen['FPDTStrategy'].items())})\n" \
        f"callbacks=[{', '.join(callbacks)}]"


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def yaml_arguments(plan: MemoryPlan) -> str:
    """The ``trainer:`` part of a ``lightning-fpdt fit`` config."""
    chosen = arguments(plan)
    lines = ["trainer:", "  strategy:", "    class_path: lightning_fpdt.FPDTStrategy", "    init_args:"]
    lines += [f"      {k}: {_yaml(v)}" for k, v in chosen["FPDTStrategy"].items()]
    lines.append("  callbacks:")
    for name in CALLBACK_ORDER:
        if name in chosen:
            lines.append(f"    - class_path: {name}")
            if chosen[name]:
                values = ", ".join(f"{k}: {_yaml(v)}" for k, v in chosen[name].items())
                lines.append("      init_args: {" + values + "}")
    return "\n".join(lines)
