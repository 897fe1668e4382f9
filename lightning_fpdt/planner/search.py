"""The fastest configuration that fits the GPU and the host: what ``"auto"`` resolves to, and what the planner
recommends when the options given do not fit.

Each memory feature (:mod:`lightning_fpdt.planner.features`) names the values its options may take, cheapest first,
and what they cost in step time. The search ranks every combination of the free options by that cost
(:func:`step_seconds`) and plans them in that order until one fits: the first that fits is the fastest that fits.
Options a user gave explicitly stay fixed when ``"auto"`` is resolved; for a recommendation they are free too, each
change of one costing :data:`CHANGE_PENALTY` of the step, so that the fewest changes that fit come first.

The ring size changes which values the other options may take (a ring runs without FPDT chunks), so where the search
may choose it (a sequence-parallel group spanning hosts) each ring size is searched on its own, and the fastest of the
layouts that fit is taken; the plan keeps each layout's estimate (``MemoryPlan.layouts``) to say why.

An option whose value follows from how much memory a plan misses (the disk tier's ``disk_inputs``) is not tried value
by value: a plan that does not fit is handed to each feature (``relieve``), and the changed options it returns join
the queue at their cost. Since they cost at least what the plan they relieve costs, the plans still come in the order
of their cost, and the first that fits is still the fastest that fits.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

from lightning_fpdt.flops import ModelGeometry
from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.planner.cost import base_parts, base_seconds
from lightning_fpdt.planner.features import FEATURES
from lightning_fpdt.planner.phases import PROCESS_BASELINE_BYTES, build_plan, plan_sizes, run_sizes
from lightning_fpdt.planner.plan_options import MemoryFeatures, PlanOptions
from lightning_fpdt.planner.rates import BUILTIN_RATES, INTER_HOST_BYTES, StepRates
from lightning_fpdt.planner.step_sizes import StepSizes
from lightning_fpdt.sequence.planning import MAX_CHUNK_TOKENS
from lightning_fpdt.sequence.ring_rules import RING_RULES

SEARCHED = tuple(field for feature in FEATURES for field in feature.fields)
"""Every option the search can change, feature by feature."""
CALLBACK_CHOICES = tuple(name for feature in FEATURES for name in feature.neutral
                         if name in MemoryFeatures.__dataclass_fields__)
"""The options the memory callbacks declare (:class:`MemoryFeatures`) that may be ``"auto"``: a plan's values of them
are what the callbacks' ``apply_memory_choice`` takes."""
CHANGE_PENALTY = 0.1
"""Step time charged, as a share of the step, for each option a recommendation changes from what the user gave."""
MAX_PLANS = 16000
"""Plans the search builds at most before it says that nothing fits (the largest spaces hold about that many: a
recommendation for a model whose every option is free, with the kept block inputs' four values)."""


@dataclass(frozen=True)
class Run:
    """What a plan is made for besides its options: the model, the sequence, the GPUs and the memories."""

    geometry: ModelGeometry
    model: str
    seq_len: int
    batch_size: int
    num_gpus: int
    gpus_per_node: int
    gpu_memory_bytes: int
    host_memory_bytes: Optional[int]
    host_baseline_bytes: int = PROCESS_BASELINE_BYTES
    disk_memory_bytes: Optional[int] = None
    """Free space of the disk tier's directory per host; ``None``: no disk tier."""
    disk_bytes_per_second: float = 0.0
    """The disk's read and write rate per host."""
    inter_host_bytes_per_second: float = INTER_HOST_BYTES
    """The rate one GPU sends to GPUs of other hosts at."""
    rates: StepRates = BUILTIN_RATES
    """The rates its steps are timed at (:mod:`lightning_fpdt.planner.cost`)."""

    def sizes(self, options: PlanOptions) -> StepSizes:
        return run_sizes(self.geometry, options, seq_len=self.seq_len, batch_size=self.batch_size,
                         num_gpus=self.num_gpus, gpus_per_node=self.gpus_per_node,
                         disk_bytes_per_second=self.disk_bytes_per_second,
                         inter_host_bytes_per_second=self.inter_host_bytes_per_second, rates=self.rates)

    def plan(self, options: PlanOptions) -> MemoryPlan:
        return build_plan(self.geometry, self.model, seq_len=self.seq_len, batch_size=self.batch_size,
                          num_gpus=self.num_gpus, gpus_per_node=self.gpus_per_node, options=options,
                          gpu_memory_bytes=self.gpu_memory_bytes, host_memory_bytes=self.host_memory_bytes,
                          host_baseline_bytes=self.host_baseline_bytes, disk_memory_bytes=self.disk_memory_bytes,
                          disk_bytes_per_second=self.disk_bytes_per_second,
                          inter_host_bytes_per_second=self.inter_host_bytes_per_second, rates=self.rates)


def step_seconds(s: StepSizes) -> float:
    """The estimated step time of one configuration: the work every configuration does and each feature's own."""
    return base_seconds(s) + sum(feature.extra_seconds(s) for feature in FEATURES)


def step_estimate(plan: MemoryPlan) -> list[tuple[str, float]]:
    """What the plan's step costs by the cost model (:mod:`~lightning_fpdt.planner.cost`): the work every
    configuration does, part by part, then each feature that adds time, in words (``partial residency: 14 block
    forwards regenerated``), with its seconds."""
    s = plan_sizes(plan)
    parts = [(what, seconds) for what, seconds in base_parts(s) if seconds]
    for feature in FEATURES:
        seconds = feature.extra_seconds(s)
        if seconds:  # the network's is below 0 where it outruns NVLink
            parts.append((feature.describe_cost(s), seconds))
    return parts


def estimated_step_seconds(plan: MemoryPlan) -> float:
    """The cost model's seconds of one batch of the plan (:func:`step_estimate`'s total): a prediction where the
    plan's rates were measured on its GPU (``plan.rates.calibrated``), a ranking otherwise."""
    return sum(seconds for _, seconds in step_estimate(plan))


def batch_tokens(plan: MemoryPlan) -> int:
    """Global tokens one batch of the plan trains: ``B·S`` for each data-parallel group, the groups side by side (the
    time :func:`step_estimate` adds up is one batch's; the padding to the layout's multiple is not counted)."""
    return plan.batch_size * plan.seq_len * plan.options.data_parallel_size


def seconds_per_million_tokens(plan: MemoryPlan) -> float:
    """The cost model's seconds for a million global tokens: :func:`step_estimate`'s total per :func:`batch_tokens`.
    Like the step estimate, a figure that ranks configurations, not a prediction."""
    return estimated_step_seconds(plan) * 1e6 / batch_tokens(plan)


def candidates(run: Run, base: PlanOptions, free: Iterable[str]) -> list[PlanOptions]:
    """Every combination of the ``free`` options' values (the others as in ``base``) that can run, once each."""
    s = run.sizes(base)
    owners = {field: feature for feature in FEATURES for field in feature.fields}
    axes = [(field, owners[field].choices(field, s)) for field in SEARCHED if field in set(free)]
    given = {field.name: getattr(base, field.name) for field in dataclasses.fields(base)}  # values, not copies
    names = [field for field, _ in axes]
    # each combination's values once normalised, whether the options took them or refused them: most combinations
    # normalise to one already seen, and comparing values costs less than making (and checking) the options again
    seen: set[tuple[Any, ...]] = set()
    found = []
    for values in itertools.product(*(choices for _, choices in axes)):
        changes: Optional[dict[str, Any]] = {**given, **dict(zip(names, values))}
        for feature in FEATURES:
            changes = feature.normalise(changes)
            if changes is None:
                break
        if changes is None:
            continue
        key = tuple(map(changes.__getitem__, given))
        if key in seen:
            continue
        seen.add(key)
        try:
            found.append(PlanOptions(**changes))
        except ValueError:
            continue  # a combination the options refuse (a ring with chunks, say)
    return found


def layout_bases(run: Run, base: PlanOptions, free: Iterable[str]) -> list[PlanOptions]:
    """``base`` once for each ring size the search may try (``ring_size`` free: the layout feature's choices), with
    the values a ring takes of the options it does not compose with (FPDT chunks, dQ offload, head groups) where those
    are free (and without a ring, free chunks from where "auto" starts them); a ring they are given otherwise for is
    left out. Just ``base`` where the ring is not free."""
    if "ring_size" not in free:
        return [base]
    owner = next(feature for feature in FEATURES if "ring_size" in feature.fields)
    bases = []
    for ring in owner.choices("ring_size", run.sizes(base)):
        changes: dict[str, Any] = {"ring_size": ring}
        if ring == 1 and base.ring_size > 1 and "chunks" in free:
            # the chunks "auto" starts from without a ring (a ring's base has 1): the search doubles them from there
            changes["chunks"] = max(1, math.ceil(run.seq_len / MAX_CHUNK_TOKENS))
        if ring > 1:
            for option in ("chunks", "offload_dq", "head_chunks"):
                with_ring = RING_RULES[option].with_ring
                if getattr(base, option) != with_ring:
                    changes[option] = with_ring if option in free else None
        if None in changes.values():
            continue  # an option given that the ring does not compose with
        try:
            bases.append(dataclasses.replace(base, **changes))
        except ValueError:
            continue
    return bases or [base]


@dataclass
class SearchMemo:
    """What several searches of one run share where only the disk's free space differs between them (a refusal
    searches again for the least disk any configuration fits with: :func:`~lightning_fpdt.planner.plan.plan_memory`):
    the ranked candidates of each search and the plan of each configuration. The disk's space changes neither, only
    whether a plan fits it (and so what :meth:`~.features.base.MemoryFeature.relieve` offers, which each search
    asks again)."""

    run: Run
    """The run the searches are of, its disk space aside."""
    queues: dict[tuple[Any, ...], list[tuple[float, int, PlanOptions]]] = dataclasses.field(default_factory=dict)
    """The ranked candidates of each base, free options and explicit options."""
    plans: dict[PlanOptions, MemoryPlan] = dataclasses.field(default_factory=dict)
    """Each configuration planned so far."""

    def plan(self, run: Run, options: PlanOptions) -> MemoryPlan:
        """``run.plan(options)``, planned once for all the disk spaces."""
        plan = self.plans.get(options)
        if plan is None:
            plan = self.plans[options] = run.plan(options)
        elif plan.disk_memory_bytes != run.disk_memory_bytes:
            plan = dataclasses.replace(plan, disk_memory_bytes=run.disk_memory_bytes)
        return plan


def fastest_fitting(run: Run, base: PlanOptions, free: Iterable[str],
                    explicit: Optional[Mapping[str, Any]] = None, *,
                    memo: Optional[SearchMemo] = None) -> Optional[MemoryPlan]:
    """The plan of the fastest combination of the ``free`` options that fits the run's GPU and host memory, or
    ``None``. ``explicit``: options the user gave, each change of which costs :data:`CHANGE_PENALTY`. Where the ring
    size is free and has several values (:func:`layout_bases`), each layout's fastest plan that fits is found, and
    the fastest of them is returned with every layout's estimate in ``layouts``. ``memo``: the work of earlier
    searches of the same run with another disk space, reused (the same plan as without it)."""
    explicit = explicit or {}
    free = set(free)
    if memo is not None and dataclasses.replace(run, disk_memory_bytes=memo.run.disk_memory_bytes) != memo.run:
        raise ValueError(f"a SearchMemo serves the searches of one run, its disk space aside: made for {memo.run}, "
                         f"asked for {run}")
    bases = layout_bases(run, base, free)
    if len(bases) == 1:
        return _fastest_fitting(run, bases[0], free - {"ring_size"}, explicit, memo)
    found = [(options.ring_size, _fastest_fitting(run, options, free - {"ring_size"}, explicit, memo))
             for options in bases]
    fitting = [plan for _, plan in found if plan is not None]
    if not fitting:
        return None
    ranked = {id(plan): _ranked(run, plan.options, explicit) for plan in fitting}
    fastest = min(fitting, key=lambda plan: ranked[id(plan)])
    layouts = tuple((ring, None if plan is None else step_seconds(run.sizes(plan.options))) for ring, plan in found)
    return dataclasses.replace(fastest, layouts=layouts)


def _ranked(run: Run, options: PlanOptions, explicit: Mapping[str, Any]) -> float:
    """The step-time estimate of ``options``, with :data:`CHANGE_PENALTY` for each option changed from ``explicit``."""
    changed = sum(getattr(options, name) != value for name, value in explicit.items())
    return step_seconds(run.sizes(options)) * (1 + CHANGE_PENALTY * changed)


def _fastest_fitting(run: Run, base: PlanOptions, free: set[str], explicit: Mapping[str, Any],
                     memo: Optional[SearchMemo] = None) -> Optional[MemoryPlan]:
    """:func:`fastest_fitting` of one layout."""

    def ranked(options: PlanOptions) -> float:
        return _ranked(run, options, explicit)

    key = (base, frozenset(free), tuple(sorted(explicit.items())))
    queue = None if memo is None else memo.queues.get(key)
    if queue is None:
        # (cost, order of arrival, options): equal costs keep the order of the candidates
        queue = [(ranked(options), order, options) for order, options in enumerate(candidates(run, base, free))]
        heapq.heapify(queue)
        if memo is not None:
            memo.queues[key] = queue
    queue = list(queue)  # the memo's stays as ranked: this search pops its own
    arrived = len(queue)
    for _ in range(MAX_PLANS):
        if not queue:
            break
        _, _, options = heapq.heappop(queue)
        plan = run.plan(options) if memo is None else memo.plan(run, options)
        if plan.fits:
            return plan
        s = run.sizes(options)
        for feature in FEATURES:
            changes = feature.relieve(plan, s)
            if changes and set(changes) <= free:
                relieved = dataclasses.replace(options, **changes)
                heapq.heappush(queue, (ranked(relieved), arrived, relieved))
                arrived += 1
    return None


def fitting_near(run: Run, base: PlanOptions, free: Iterable[str], *, margin: float, limit: int,
                 memo: Optional[SearchMemo] = None) -> list[MemoryPlan]:
    """The plans that fit, fastest first, whose estimates are within ``margin`` (a share) of the fastest's, at most
    ``limit`` of them: the configurations the cost model cannot tell apart. One layout only (a ring size the search
    may choose is fixed to the fastest's first); ``[]`` where nothing fits."""
    free = set(free)
    fastest = fastest_fitting(run, base, free, memo=memo)
    if fastest is None:
        return []
    base = dataclasses.replace(base, ring_size=fastest.options.ring_size) if "ring_size" in free else base
    bound = step_seconds(run.sizes(fastest.options)) * (1 + margin)
    queue = [(step_seconds(run.sizes(options)), order, options)
             for order, options in enumerate(candidates(run, base, free - {"ring_size"}))]
    heapq.heapify(queue)
    arrived, seen = itertools.count(len(queue)), set()
    found: list[MemoryPlan] = []
    for _ in range(MAX_PLANS):
        if not queue or len(found) >= limit:
            break
        seconds, _, options = heapq.heappop(queue)
        if seconds > bound:
            break
        if options in seen:
            continue
        seen.add(options)
        plan = run.plan(options) if memo is None else memo.plan(run, options)
        if plan.fits:
            found.append(plan)
            continue
        s = run.sizes(options)
        for feature in FEATURES:
            changes = feature.relieve(plan, s)
            if changes and set(changes) <= free:
                relieved = dataclasses.replace(options, **changes)
                heapq.heappush(queue, (step_seconds(run.sizes(relieved)), next(arrived), relieved))
    return found


def changes_between(given: PlanOptions, chosen: PlanOptions) -> dict[str, Any]:
    """The options ``chosen`` sets differently from ``given``, in :data:`SEARCHED` order."""
    return {name: getattr(chosen, name) for name in SEARCHED if getattr(chosen, name) != getattr(given, name)}
