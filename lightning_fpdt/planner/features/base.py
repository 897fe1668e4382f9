"""What a memory feature is to the planner: its options, the values the search tries, its memory terms, its cost,
and the arguments a user writes for it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

from lightning_fpdt.planner.components import Component, MemoryPlan
from lightning_fpdt.planner.step_sizes import StepSizes


def auto_or_int(value: str) -> Union[str, int]:
    """``auto`` or an int, from the command line."""
    return value if value == "auto" else int(value)


def switch(value: str) -> Union[str, bool]:
    """``auto``, ``on`` or ``off``, from the command line."""
    choices = {"auto": "auto", "on": True, "off": False}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"choose auto, on or off, not {value!r}")
    return choices[value]


def all_or_count(what: str) -> Callable[[str], Any]:
    """A parser of ``auto``, ``all`` or a number of ``what``."""
    def parse(value: str) -> Union[str, int]:
        if value in ("auto", "all"):
            return value
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"choose auto, all or a number of {what}, not {value!r}") from None
    return parse


@dataclass(frozen=True, kw_only=True)
class Flag:
    """One option of a feature on the command line (``lightning-fpdt plan``, the benchmarks): ``--option-name``,
    parsed into the value ``plan_memory`` takes under the option's own name."""

    option: str
    """The option's name, as the user writes it (``plan_memory``'s keyword, the callback's or the strategy's)."""
    parse: Optional[Callable[[str], Any]]
    """Text to value; ``None``: a switch given without a value (``store_true``)."""
    default: Any
    """The value when the flag is absent (``"auto"`` where the planner may choose)."""
    help: str
    """What it sets, for ``--help``."""
    bare: Any = None
    """The value of the flag given without a value (``None``: a value is required)."""

    @property
    def name(self) -> str:
        return "--" + self.option.replace("_", "-")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.parse is None:
            parser.add_argument(self.name, dest=self.option, action="store_true", help=self.help)
        elif self.bare is None:
            parser.add_argument(self.name, dest=self.option, type=self.parse, default=self.default, help=self.help)
        else:
            parser.add_argument(self.name, dest=self.option, type=self.parse, nargs="?", const=self.bare,
                                default=self.default, help=self.help)


class MemoryFeature:
    """One memory feature, held in one module of this package (see the package docstring).

    Subclasses set ``fields`` (the fields of :class:`~lightning_fpdt.planner.plan_options.PlanOptions` it owns) and
    override what applies to them; the defaults contribute nothing.
    """

    fields: tuple[str, ...] = ()
    """The plan options this feature owns."""
    label: str = ""
    """The feature in words, as a plan's step estimate names it."""
    neutral: dict[str, Any] = {}
    """Each option's value before the search resolves its ``"auto"`` (and where nothing fits): the feature off, or
    at its cheapest."""
    flags: tuple[Flag, ...] = ()
    """The options' command-line flags."""

    def choices(self, field: str, s: StepSizes) -> tuple[Any, ...]:
        """The values the search tries for ``field``, cheapest first (``s``: the sizes of the run as given); by default
        a switch off, then on."""
        return (False, True)

    def normalise(self, changes: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The candidate ``changes`` (all plan options) as the feature sees them: a value that has no effect in this
        combination set to its neutral value (so the search does not try the same run twice), or ``None`` for a
        combination that cannot run."""
        return changes

    def components(self, s: StepSizes) -> list[Component]:
        """The memory terms this feature owns."""
        return []

    def extra_seconds(self, s: StepSizes) -> float:
        """Step time this feature adds (an estimate for ranking the runs that fit; see :mod:`..cost`)."""
        return 0.0

    def describe_cost(self, s: StepSizes) -> str:
        """What the time of :meth:`extra_seconds` pays for, in words (by default the feature's label)."""
        return self.label or type(self).__name__

    def relieve(self, plan: MemoryPlan, s: StepSizes) -> Optional[dict[str, Any]]:
        """For a plan that does not fit: changes of this feature's options that make it need less of the memory it
        overshoots at more step time, computed from the plan (``s``: its sizes), or ``None``. The search plans them
        in their turn of cost (:func:`~lightning_fpdt.planner.search.fastest_fitting`): an option whose value follows
        from how much memory is missing is resolved this way instead of trying every value."""
        return None

    def arguments(self, s: StepSizes) -> dict[str, dict[str, Any]]:
        """How a user asks for these options: ``{"FPDTStrategy": {...}, "ActivationOffload": {...}}``; a class named
        with no arguments (``{"TiledMLP": {}}``) is a callback to add."""
        return {}
