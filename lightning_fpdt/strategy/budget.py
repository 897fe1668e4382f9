"""The memory a run may use and the configuration it runs in: the GPU memory this process may take, the host memory
the processes of this host may hold, the fastest configuration of the ``"auto"`` options that fits both
(``lightning_fpdt.planner``'s search, the one ``lightning-fpdt plan`` runs), and the refusal of a run that fits
neither, before any pinned buffer exists (pinned-memory exhaustion takes the machine down, not just the job)."""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_fpdt.flops import is_count
from lightning_fpdt.integrations import supports_head_groups
from lightning_fpdt.integrations.discovery import other_parameters, planned_model
from lightning_fpdt.offload.disk import DiskTier, SpillDirectory, check_free_space, stale_directories
from lightning_fpdt.offload.host_memory import HostAllocator, HostMemoryGuard
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.planner import plan_memory, resolve_geometry
from lightning_fpdt.planner.components import MemoryPlan
from lightning_fpdt.planner.machine import disk_free_bytes, host_reserve_bytes, machine_limits, usable_free_bytes
from lightning_fpdt.planner.plan_options import MemoryFeatures
from lightning_fpdt.planner.request import PlanRequest
from lightning_fpdt.planner.search import CALLBACK_CHOICES
from lightning_fpdt.planner.trial import trial_candidates
from lightning_fpdt.sequence.attention import FPDTAttention
from lightning_fpdt.sequence.options import FPDTOptions, ResolvedOptions
from lightning_fpdt.sequence.planning import AttentionGeometry
from lightning_fpdt.sequence.ring_rules import ring_refusal
from lightning_fpdt.strategy.host_states import host_state_bytes, register_host_states, trainable_parameters
from lightning_fpdt.strategy.memory_callbacks import DeclaresMemory, HoldsStashes, TakesMemoryChoice
from lightning_fpdt.strategy.plan_messages import choice_message, host_shortfall_advice, refusal
from lightning_fpdt.strategy.plan_trial import CHOICES_KEY, TrialSteps
from lightning_fpdt.strategy.run_rates import RunRates

Switch = Union[Literal["auto"], bool]


@dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a run's memory is planned from, as the strategy set it up: the model, the mesh, the options and the
    callbacks. The strategy builds it once its mesh exists (``FPDTStrategy.setup``, ``FPDTFabricStrategy.setup_module``)
    and binds the budget to it (:meth:`MemoryBudget.bind`)."""

    model: Optional[torch.nn.Module]
    """The module that trains: its planned model's config is planned (:func:`planned_model`), its parameters
    counted, and the parameters beside it (a frozen reference model, a head) counted too (``None``: no model yet,
    nothing planned)."""
    device: torch.device
    world_size: int
    local_processes: int
    """Processes of this host (GPUs per host)."""
    sequence_parallel_size: int
    ring_size: int
    precision: str
    cpu_offload_params: bool = False
    sync_every_batch: Switch = "auto"
    callbacks: Sequence[Any] = ()
    """The memory callbacks of the run (the Trainer's callbacks, or Fabric's ``memory_callbacks``)."""
    accumulate_grad_batches: int = 1
    agree: Callable[[bool], bool] = bool
    """Whether every rank says yes (collective), for refusals every rank takes together."""
    global_rank: int = 0
    share: Callable[[Any], Any] = lambda value: value
    """Rank 0's value on every rank (collective): the calibration and a trial's choice, so that every rank plans the
    same."""
    sequence_group: Any = None
    """The sequence-parallel process group (its all-to-all is calibrated); ``None``: one process."""

    @property
    def network(self) -> Optional[torch.nn.Module]:
        return None if self.model is None else planned_model(self.model)


def checked_offload_dir(offload_dir: Any) -> Optional[str]:
    """The disk tier's directory as a string (``None``: no disk tier); ``ValueError`` for anything but a path."""
    if offload_dir is not None and not isinstance(offload_dir, (str, os.PathLike)):
        raise ValueError(f"offload_dir must be a directory path (str or os.PathLike) or None, got "
                         f"{type(offload_dir).__name__} {offload_dir!r}")
    return None if offload_dir is None else os.fspath(offload_dir)


def attached_trainer(module: Any) -> Any:
    """The Trainer ``module`` is attached to, or ``None`` (no module, or one not attached yet)."""
    try:
        return None if module is None else module.trainer
    except RuntimeError:  # a LightningModule not attached to a Trainer
        return None


def known_length(trainer: Any) -> Optional[tuple[int, int]]:
    """``(seq_len, batch_size)`` when the data module says it before the first batch, else ``None``."""
    datamodule = getattr(trainer, "datamodule", None)
    seq_len = getattr(datamodule, "seq_len", None)
    if not is_count(seq_len, least=0):
        return None
    batch_size = getattr(datamodule, "batch_size", 1)
    return seq_len, batch_size if isinstance(batch_size, int) else 1


def plan_for(memory: "MemoryBudget", seq_len: int, batch_size: int) -> Optional[MemoryPlan]:
    """The plan of a ``seq_len`` run: its sizes, its explicit options, the callbacks' features, the ``"auto"`` options
    resolved by the search for this GPU's and this host's memory (:func:`machine_limits`). ``None`` where nothing can
    be planned (no CUDA, no readable model config)."""
    request = memory.request(seq_len, batch_size)
    return None if request is None else plan_memory(request)


def head_groups_possible(network: torch.nn.Module, ring_size: Any) -> bool:
    """Whether ``head_chunks="auto"`` may choose head groups for ``network``'s attention under this ring."""
    return supports_head_groups(network) and ring_refusal(ring_size, head_chunks=2) is None


class MemoryBudget:
    """The memory side of one fpdt run: the plan of each sequence length it trains (the ``"auto"`` options resolved,
    the callbacks told their part), what ``"auto"`` runs where nothing plans, the guard every host buffer pool asks
    before it grows, the page-locked host-resident states and the disk tier.

    Made with the strategy's options; bound to the run's facts once its mesh exists (:meth:`bind`), given the
    attention once it is installed (:meth:`attach`). It reads nothing of the strategy.

    Args:
        options: the attention's options (``FPDTStrategy(chunks=..., offload=..., head_chunks=...)``).
        check: refuse a length whose plan fits neither memory (else warn and run it).
        offload_dir: the disk tier's directory (``FPDTStrategy(offload_dir=...)``); ``None``: no disk tier.
        plan_trial: try the configurations the cost model cannot tell apart on a new length's first training steps
            (``lightning_fpdt.planner.trial``; ``strategy/plan_trial.py``).
    """

    def __init__(self, *, options: Optional[FPDTOptions] = None, check: bool = True,
                 offload_dir: Optional[str] = None, plan_trial: bool = False) -> None:
        self.options = options if options is not None else FPDTOptions()
        self.check = check
        self.offload_dir = offload_dir
        self.facts: Optional[RunFacts] = None
        self.attention: Optional[FPDTAttention] = None
        self.attention_geometry: Optional[AttentionGeometry] = None
        self.optimizers: Sequence[Any] = ()
        self.disk: Optional[SpillDirectory] = None
        """This process's spill files once set up (:meth:`open_disk`)."""
        self._tiered: list[StashFactory] = []  # the factories given a disk tier
        self.plans: dict[tuple[int, int], Optional[MemoryPlan]] = {}  # (seq_len, batch) -> the plan it runs on
        self.plan: Optional[MemoryPlan] = None
        """The plan of the last length planned; ``None`` where nothing plans (no GPU, no config the planner reads)."""
        self.free_bytes: Optional[int] = None
        """Free GPU memory at the first batch, what ``"auto"`` runs with where nothing plans (read once)."""
        self.guard = HostMemoryGuard(reserve_bytes=host_reserve_bytes(), describe=self.advice)
        self._states: Optional[HostAllocator] = None  # page-locks FSDP2's host-resident shards
        self.rates = RunRates(log=rank_zero_info)
        """This GPU's calibration (``strategy/run_rates.py``)."""
        self.plan_trial = plan_trial
        self.trials: Optional[TrialSteps] = None
        """The trials of the run's lengths, made at :meth:`bind` with ``plan_trial`` (a test may give its own)."""

    # ---- setup --------------------------------------------------------------------------------------------------
    def bind(self, facts: RunFacts) -> None:
        """The run's facts, once its mesh exists (again at a later fit's setup)."""
        self.facts = facts
        if self.plan_trial and self.trials is None:
            self.trials = TrialSteps(candidates=self.trial_candidates, share=facts.share, log=rank_zero_info)

    def trial_candidates(self, seq_len: int, batch_size: int) -> list[Any]:
        """The configurations of ``seq_len`` a trial tries (none where nothing plans)."""
        request = self.request(seq_len, batch_size)
        return [] if request is None else trial_candidates(request)

    def attach(self, *, attention: FPDTAttention, geometry: Optional[AttentionGeometry] = None,
               optimizers: Optional[Sequence[Any]] = None) -> None:
        """The installed attention (its head groups and its host buffer pool), the attention's geometry once the
        model is set up, the optimizers once made (their host-resident states are counted as held)."""
        self.attention = attention
        if geometry is not None:
            self.attention_geometry = geometry
        if optimizers is not None:
            self.optimizers = optimizers

    def head_chunks_at_setup(self, known: Optional[tuple[int, int]]) -> int:
        """``head_chunks`` for the attention about to be installed: the option, or for ``"auto"`` the search's
        choice for the length ``known`` at setup (1 when none is known, or the model's attention cannot be
        grouped)."""
        if self.options.head_chunks != "auto":
            return self.options.head_chunks
        if known is None or not self._head_groups_possible():
            return 1
        plan = plan_for(self, *known)
        return 1 if plan is None else plan.options.head_chunks

    def _head_groups_possible(self) -> bool:
        facts = self.facts
        return facts is not None and facts.network is not None and head_groups_possible(facts.network,
                                                                                         facts.ring_size)

    def head_chunks_for_planning(self) -> Union[Literal["auto"], int]:
        """Head groups as the planner may take them: those installed once the attention is, before that the option
        (``"auto"`` only where the model's attention can be grouped)."""
        if self.attention is not None:
            return self.attention.head_chunks
        if self.options.head_chunks == "auto" and not self._head_groups_possible():
            return 1
        return self.options.head_chunks

    def guard_host_memory(self) -> None:
        """Once the model is sharded: page-lock its host-resident shards exactly (with ``cpu_offload_params``), and
        make every host buffer pool of the run ask the guard before it grows."""
        facts = self.facts
        if facts is not None and facts.cpu_offload_params and self._states is None:
            self._states = register_host_states(facts.model, pin=facts.device.type == "cuda")
        for factory in self.factories():
            factory.guard = self.guard

    def _callbacks(self) -> Sequence[Any]:
        return () if self.facts is None else self.facts.callbacks

    def factories(self) -> list[StashFactory]:
        """The host buffer pools of the run: the attention's and the memory callbacks'."""
        found = [] if self.attention is None else [self.attention.stashes]
        return found + [c.stashes for c in self._callbacks()
                        if isinstance(c, HoldsStashes) and isinstance(c.stashes, StashFactory)]

    def pinned_bytes(self) -> int:
        """Host memory the process holds page-locked: the pools' buffers of a CUDA run, the disk tier's staging
        buffers and the states."""
        states = self._states.allocated_bytes if self._states is not None and self._states.pin else 0
        staging = self.disk.staging.allocated_bytes if self.disk is not None and self.disk.staging.allocator.pin else 0
        return states + staging + sum(factory.pinned_bytes for factory in self.factories())

    # ---- the disk tier ------------------------------------------------------------------------------------------
    def open_disk(self, *, rank: int, local_rank: int, pin_memory: bool, planned: bool = True) -> None:
        """At setup, with ``offload_dir``: check the directory (``ValueError`` naming it when it cannot be created or
        written), name the directories a crash of this host's processes left there (not removed: a pid cannot prove
        a directory unused; docs/design.md §4.4), and make this process's own. ``planned``: whether a plan can put
        anything there (a CUDA device); where none can, a directory that cannot be used is a warning that the option
        has no effect, not an error."""
        if self.offload_dir is None or (self.disk is not None and not self.disk.closed):
            return
        try:
            self.disk = SpillDirectory(self.offload_dir, rank=rank, pin_memory=pin_memory, guard=self.guard)
        except ValueError as error:
            if planned:
                raise
            if local_rank == 0:
                warnings.warn(f"fpdt: offload_dir has no effect in this run (nothing plans it without a GPU, so "
                              f"nothing spills), and it could not be used anyway: {error}", stacklevel=2)
            return
        stale = stale_directories(self.disk.root)
        if stale and local_rank == 0:
            warnings.warn(
                f"fpdt: offload_dir {self.disk.root!r} holds {len(stale)} spill directories of processes of this host "
                f"that are no longer alive ({sum(s.nbytes for s in stale) / 2**30:.2f} GiB): "
                + ", ".join(f"{s.path} (pid {s.pid}, {s.nbytes:,} bytes)" for s in stale)
                + ". They are left as they are and their space is not planned with; remove them if no run uses "
                  "them (rm -r DIR).", stacklevel=2)

    def disk_free_bytes(self) -> Optional[int]:
        """Space the disk tier may fill: the free space of ``offload_dir``'s file system and this process's own
        files; ``None`` without a disk tier."""
        if self.disk is None or self.disk.closed:
            return None
        return disk_free_bytes(self.disk.root, self.disk.bytes_on_disk)

    def configure_disk(self, plan: Optional[MemoryPlan]) -> None:
        """Give the host buffer pools their host budgets for ``plan``: the block inputs' pool what the plan keeps in
        host memory for them (the rest spills, the last of the forward first); the attention's pool, when it
        offloads, its planned bytes and the host's room the plan leaves (it spills only beyond the plan). Refuses,
        naming the directory and the bytes, a directory whose file system has less free space than the plan puts
        there. Without a plan (no GPU, no model config) nothing spills: the pools hold what they need, as without a
        disk tier."""
        if self.disk is None:
            return
        # a tier is updated in place, never replaced: a stash made for an earlier length (the block inputs' lives as
        # long as the model) holds it
        for factory in self._tiered:
            factory.disk.host_budget_bytes = sys.maxsize
        if plan is None:
            rank_zero_info(f"fpdt: offload_dir {self.disk.root!r} is not used: nothing plans this run (no GPU, or a "
                           f"model config the planner does not read), so no host budget is known")
            return
        if plan.disk_bytes_per_node:
            check_free_space(self.disk.root, plan.disk_bytes_per_node - self.disk.bytes_on_disk,
                             what=f"the plan's {plan.options.disk_inputs} block inputs per GPU x "
                                  f"{plan.gpus_per_node} GPUs of this host")
        spare = 0
        if plan.host_memory_bytes is not None:
            spare = max(0, plan.host_memory_bytes - plan.host_resident_bytes_per_node) // plan.gpus_per_node
        budgets = []
        if self.attention is not None and plan.options.offload:
            budgets.append((self.attention.stashes, plan.component("attention stash").host_bytes + spare))
        if plan.options.activation_offload:
            inputs = plan.component("checkpointed block inputs").host_bytes
            for callback in self._callbacks():
                if isinstance(callback, DeclaresMemory) and callback.fpdt_memory_features.activation_offload and \
                        isinstance(callback, HoldsStashes) and isinstance(callback.stashes, StashFactory):
                    budgets.append((callback.stashes, inputs))
        for factory, host_budget in budgets:
            if factory.disk is None:
                factory.disk = DiskTier(self.disk, host_budget_bytes=host_budget)
                self._tiered.append(factory)
            else:
                factory.disk.files, factory.disk.host_budget_bytes = self.disk, host_budget

    # ---- per sequence length ------------------------------------------------------------------------------------
    def request(self, seq_len: int, batch_size: int) -> Optional[PlanRequest]:
        """What the planner is asked for a ``seq_len`` batch of this run on this machine; ``None`` where nothing can
        be planned (not bound, no CUDA, no model config the planner reads)."""
        facts = self.facts
        if facts is None or facts.device.type != "cuda" or facts.model is None:
            return None
        network = facts.network
        config = getattr(network, "config", None)
        if config is None:
            return None
        try:
            geometry = resolve_geometry(config)
        except ValueError:
            return None  # a config the planner cannot read: nothing to check against
        options = self.options
        others, other_trainable = other_parameters(facts.model)
        held = self.pinned_bytes() + host_state_bytes(self.optimizers, facts.model)
        machine = machine_limits(num_gpus=facts.world_size, gpus_per_node=facts.local_processes,
                                 device=facts.device, local_processes=facts.local_processes, held_host_bytes=held,
                                 disk_free=self.disk_free_bytes())
        request = PlanRequest(
            geometry=geometry, seq_len=seq_len, batch_size=batch_size, machine=machine,
            features=MemoryFeatures.declared(facts.callbacks), chunks=options.chunks, offload=options.offload,
            offload_dq=options.offload_dq, sequence_parallel_size=facts.sequence_parallel_size,
            ring_size=facts.ring_size, precision=facts.precision, cpu_offload_params=facts.cpu_offload_params,
            head_chunks=self.head_chunks_for_planning(), accumulate_grad_batches=facts.accumulate_grad_batches,
            sync_every_batch=facts.sync_every_batch, trainable_parameters=trainable_parameters(network),
            other_parameters=others, other_trainable_parameters=other_trainable,
        )
        # this GPU's rates: measured once, shared by every rank (strategy/run_rates.py)
        rates = self.rates.for_request(request, device=facts.device, global_rank=facts.global_rank,
                                       share=facts.share, group=facts.sequence_group,
                                       group_size=facts.sequence_parallel_size, offload_dir=self.offload_dir)
        return dataclasses.replace(request, machine=dataclasses.replace(machine, rates=rates))

    def plan_length(self, seq_len: int, batch_size: int, *, collective: bool) -> None:
        """Plan ``seq_len``: free the buffers of other lengths, resolve the ``"auto"`` options (:func:`plan_for`),
        refuse a plan that fits neither memory (every rank together when ``collective``), hand the memory callbacks
        their part and log the choice."""
        for factory in self.factories():
            factory.trim()  # the buffers of another length: freed, not kept beside this length's
        plan = plan_for(self, seq_len, batch_size)
        error = refusal(plan, self.offload_dir) if self.check else None
        if collective and self.facts is not None and not self.facts.agree(error is None):
            raise error or ValueError("fpdt: another rank refused the run: it does not fit its memory (see its log)")
        if error is not None:
            raise error
        self.plans[(seq_len, batch_size)] = plan
        self.configure_disk(plan)
        if plan is None:
            return
        if not plan.fits:
            rank_zero_warn(f"fpdt: S = {seq_len:,} does not fit as planned (check_memory=False runs it anyway): "
                           f"{refusal(plan, self.offload_dir)}")
        self._run_on(plan)
        rank_zero_info(choice_message(plan))

    def _run_on(self, plan: MemoryPlan) -> None:
        """Make ``plan`` the one the next steps run on: the memory callbacks take its choice."""
        self.plan = plan
        choice = {name: getattr(plan.options, name) for name in CALLBACK_CHOICES}
        for callback in self._callbacks():
            if isinstance(callback, TakesMemoryChoice):
                callback.apply_memory_choice(**choice)

    def return_to(self, seq_len: int, batch_size: int) -> None:
        """A batch of a length planned before: where another length's plan ran since (an evaluation at other lengths,
        a curriculum going back), free that length's buffers and run on this length's plan again."""
        plan = self.plans[(seq_len, batch_size)]
        if plan is None or plan is self.plan:
            return
        for factory in self.factories():
            factory.trim()
        self.configure_disk(plan)
        self._run_on(plan)

    def begin_length(self, seq_len: int, batch_size: int, *, training: bool = False) -> ResolvedOptions:
        """A batch of ``seq_len`` tokens about to run: plan the length when it is new (before its forward pins host
        memory), else run on its plan again (:meth:`return_to`); a training batch under a trial runs on the
        configuration the trial gives it (``strategy/plan_trial.py``). The attention options it runs with."""
        key = (seq_len, batch_size)
        if not self.planned(*key):
            self.plan_length(seq_len, batch_size, collective=False)
        if self.trials is not None:
            tried = self.trials.step(key) if training and self.plans[key] is not None else None
            if not training:
                self.trials.interrupt()  # an evaluation's batch: the interval is no training step's
            if tried is not None:
                self.plans[key] = tried
        self.return_to(seq_len, batch_size)
        return self.resolved(seq_len, batch_size)

    def planned(self, seq_len: int, batch_size: int) -> bool:
        return (seq_len, batch_size) in self.plans

    def plan_of(self, seq_len: int, batch_size: int) -> Optional[MemoryPlan]:
        """The plan this length runs on, or ``None`` where nothing planned it."""
        return self.plans.get((seq_len, batch_size))

    def resolved(self, seq_len: int, batch_size: int) -> ResolvedOptions:
        """Chunks and offload for global sequences of ``seq_len`` tokens: the plan's (the search's choice for
        ``"auto"``), or where nothing plans, the options with ``"auto"`` sized from the free GPU memory at the first
        batch (:meth:`FPDTOptions.resolve`)."""
        plan = self.plan_of(seq_len, batch_size)
        if plan is not None:
            o = plan.options
            return ResolvedOptions(chunks=o.chunks, offload=o.offload, offload_dq=o.offload_dq)
        facts = self.facts
        if self.free_bytes is None and facts is not None and facts.device.type == "cuda":
            self.free_bytes = usable_free_bytes(facts.device)
        sized = self.free_bytes is not None and self.attention_geometry is not None
        fixed_ring = self.options.ring_size if isinstance(self.options.ring_size, int) else 1
        return self.options.resolve(
            self.attention_geometry if sized else None, batch_size=batch_size, seq_len=seq_len,
            sp_size=facts.sequence_parallel_size if sized else 1,
            ring_size=facts.ring_size if facts is not None else fixed_ring, free_bytes=self.free_bytes)

    def syncs_every_batch(self, option: Switch, batch: Any) -> bool:
        """Whether the batches of an accumulation window reduce-scatter their gradients: ``option``, or for
        ``"auto"`` the choice of the plan of ``batch``'s length (a :class:`~lightning_fpdt.strategy.batch.BatchPlan`;
        ``False`` where nothing planned it, or before any batch)."""
        if option != "auto":
            return option
        plan = None if batch is None else self.plan_of(batch.seq_len, batch.batch_size)
        return plan is not None and plan.options.sync_every_batch

    def save_choices(self, checkpoint: dict[str, Any]) -> None:
        """Put the plan trials' choices into ``checkpoint`` (``strategy/plan_trial.py``); a checkpoint's save between
        two training steps is no step's time."""
        if self.trials is not None:
            self.trials.interrupt()
            if self.trials.state():
                checkpoint[CHOICES_KEY] = self.trials.state()

    def load_choices(self, checkpoint: dict[str, Any]) -> None:
        """Take the plan trials' choices out of a loaded ``checkpoint``: the lengths they were made for are not tried
        again."""
        choices = checkpoint.pop(CHOICES_KEY, None)
        if choices and self.trials is not None:
            self.trials.load_state(choices)

    def advice(self) -> str:
        """What the error of a host that ran short says: the plan the run was accepted on and how to need less."""
        return host_shortfall_advice(self.plan)

    def close(self) -> None:
        """End the states' registration (the end of a fit; the memory stays FSDP2's); remove the disk tier's files
        and directory (a later fit plans its lengths again, with a directory of its own)."""
        if self._states is not None:
            self._states.close()
            self._states = None
        if self.disk is not None:
            self.disk.close()  # the tiers stay with their factories; the next fit's plans point them at its directory
            self.plans.clear()
