"""The memory a run may use and the configuration it runs in: the GPU memory this process may take, the host memory
the processes of this host may hold, the fastest configuration of the ``"auto"`` options that fits both
(``lightning_fpdt.planner``'s search, the one ``lightning-fpdt plan`` runs), and the refusal of a run that fits
neither, before any pinned buffer exists (pinned-memory exhaustion takes the machine down, not just the job)."""

from __future__ import annotations

import shutil
import sys
import warnings
from typing import Any, Literal, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_fpdt.integrations import supports_head_groups
from lightning_fpdt.memory.surgery import find_model
from lightning_fpdt.planner import plan_memory, resolve_geometry
from lightning_fpdt.planner.arguments import python_arguments
from lightning_fpdt.planner.components import MemoryPlan, expandable_segments, plannable_gpu_bytes
from lightning_fpdt.planner.host import gib
from lightning_fpdt.planner.options import MemoryFeatures
from lightning_fpdt.offload.disk import DiskTier, SpillDirectory, check_free_space, stale_directories
from lightning_fpdt.offload.host_memory import HostAllocator, HostMemoryGuard, available_host_memory, resident_bytes
from lightning_fpdt.offload.host_stash import StashFactory
from lightning_fpdt.sequence.options import ResolvedOptions
from lightning_fpdt.sequence.ring_rules import ring_refusal

HOST_RESERVE_FRACTION = 0.03
"""Share of the host's memory no plan may take (at least :data:`HOST_RESERVE_MIN_BYTES`): the kernel, page cache, other
processes' growth."""
HOST_RESERVE_MIN_BYTES = 2 * 2**30
RUNTIME_GROWTH_BYTES = 7 * 2**28
"""Host memory a process takes in its first step beyond what it holds at setup: the kernels cuDNN, cuBLAS and NCCL
load when first called, autograd's and the optimizer's own (0.9 to 1.5 GiB traced on an H100 for a Hugging Face
Llama, states on the GPU or the host)."""


def usable_total_bytes(device: torch.device) -> int:
    """The GPU memory this process may use: the card's, times ``torch.cuda.set_per_process_memory_fraction``."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * torch.cuda.get_per_process_memory_fraction(device))


def plannable_bytes(device: torch.device) -> int:
    """The GPU memory a plan may fill: the usable memory less the CUDA context and the allocator's fragmentation."""
    return plannable_gpu_bytes(usable_total_bytes(device), expandable_segments=expandable_segments())


def usable_free_bytes(device: torch.device) -> int:
    """Free GPU memory for planning: what the card has free, and no more than the process's cap leaves."""
    free = torch.cuda.mem_get_info(device)[0]
    return max(0, min(free, usable_total_bytes(device) - torch.cuda.memory_reserved(device)))


def host_reserve_bytes() -> int:
    """What a plan leaves free on the host: :data:`HOST_RESERVE_FRACTION` of its memory, at least 2 GiB."""
    total = None
    try:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return max(HOST_RESERVE_MIN_BYTES, int(HOST_RESERVE_FRACTION * total) if total else 0)


def host_state_bytes(optimizers: list[Any], model: torch.nn.Module) -> int:
    """Bytes of optimizer states and gradients already in host memory (resident now, counted by the plan too)."""
    seen: set[int] = set()
    total = 0

    def count(t: Any) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()

    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                count(value)
    for parameter in model.parameters():
        count(parameter.grad)
    return total


def known_length(trainer: Any) -> Optional[tuple[int, int]]:
    """``(seq_len, batch_size)`` when the data module says it before the first batch, else ``None``."""
    datamodule = getattr(trainer, "datamodule", None)
    seq_len = getattr(datamodule, "seq_len", None)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool):
        return None
    batch_size = getattr(datamodule, "batch_size", 1)
    return seq_len, batch_size if isinstance(batch_size, int) else 1


def register_host_states(model: torch.nn.Module, *, pin: bool) -> HostAllocator:
    """Page-lock FSDP2's host-resident parameter shards, each exactly its size (FSDP2's own pinning goes through the
    caching host allocator, which rounds every shard up to a power of two; ``parallelize.py`` turns it off)."""
    allocator = HostAllocator(pin=pin)
    for parameter in model.parameters():
        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        if local.device.type == "cpu":
            allocator.register(local.detach())
    return allocator


def plan_for(strategy: Any, seq_len: int, batch_size: int) -> Optional[MemoryPlan]:
    """The plan of a ``seq_len`` run of the fpdt ``strategy``: its sizes, its explicit options, the callbacks'
    features, the ``"auto"`` options resolved by the search for this GPU's and this host's memory. ``None`` where
    nothing can be planned (no CUDA, no readable model config)."""
    device = strategy.root_device
    network = find_model(strategy.model)
    config = getattr(network, "config", None)
    if device.type != "cuda" or config is None:
        return None
    try:
        geometry = resolve_geometry(config)
    except ValueError:
        return None  # a config the planner cannot read: nothing to check against
    options = strategy.options
    head_chunks = strategy.memory.head_chunks_for_planning(strategy)
    available = available_host_memory()
    rss = resident_bytes() or 0
    local = strategy.num_processes
    host_limit = None
    if available is not None:
        # the processes of this host hold their resident memory already, outside what the host has available
        host_limit = available + local * rss - host_reserve_bytes()
    already = strategy.pinned_host_bytes + host_state_bytes(strategy.optimizers, strategy.model)
    trainer = strategy.lightning_module.trainer
    features = MemoryFeatures.declared(trainer.callbacks)
    disk = strategy.memory.disk_free_bytes()
    return plan_memory(
        geometry=geometry, seq_len=seq_len, batch_size=batch_size, chunks=options.chunks, offload=options.offload,
        offload_dq=options.offload_dq, num_gpus=strategy.world_size, gpus_per_node=local,
        sequence_parallel_size=strategy.sequence_parallel_size, ring_size=strategy.ring_size,
        precision=strategy.precision_plugin.precision, cpu_offload_params=strategy.cpu_offload_params,
        head_chunks=head_chunks, gpu_memory_gib=plannable_bytes(device) / 2**30,
        host_memory_gib=None if host_limit is None else max(host_limit, 1) / 2**30,
        host_baseline_gib=(max(0, rss - already) + RUNTIME_GROWTH_BYTES) / 2**30,
        disk_memory_gib=None if disk is None else disk / 2**30,
        accumulate_grad_batches=getattr(trainer, "accumulate_grad_batches", 1),
        sync_every_batch=strategy.sync_every_batch, trainable_parameters=trainable_parameters(network),
        **features.plan_kwargs(),
    )


def trainable_parameters(model: torch.nn.Module) -> Optional[int]:
    """The parameters of ``model`` that train (LoRA's adapters, what is not frozen), counted whole (a sharded
    parameter's global size); ``None`` when every one trains."""
    parameters = list(model.parameters())
    trainable = sum(p.numel() for p in parameters if p.requires_grad)
    return None if trainable == sum(p.numel() for p in parameters) else trainable


def refusal(plan: Optional[MemoryPlan], offload_dir: Optional[str] = None) -> Optional[ValueError]:
    """The error refusing a run whose plan fits the GPU, the host or the disk not, naming what binds and the change
    that fits; ``None`` when it fits or nothing was planned. ``offload_dir``: the disk tier's directory, named."""
    if plan is None or plan.fits:
        return None
    limit = {"gpu memory": "GPU", "disk space": "disk"}.get(plan.binding_limit, "host")
    fix = plan.recommendation
    if plan.recommended is not None:
        fix += "; that is\n" + python_arguments(plan.recommended)
    return ValueError(
        f"fpdt: this run does not fit the {limit} memory: S = {plan.seq_len:,} tokens needs "
        f"{gib(plan.peak_gpu_bytes)} GiB per GPU (of {gib(plan.gpu_memory_bytes)}) and "
        f"{gib(plan.host_resident_bytes_per_node)} GiB of host memory per host, {gib(plan.host_bytes_per_node)} of "
        f"it pinned (of {gib(plan.host_memory_bytes)} GiB the host can give)"
        + (f", {gib(plan.disk_bytes_per_node)} GiB per host on disk in {offload_dir!r} (of "
           f"{gib(plan.disk_memory_bytes)} GiB free)" if plan.disk_bytes_per_node or offload_dir else "")
        + f", with {plan.options.describe()}. Fix: {fix}. The plan: `lightning-fpdt plan` prints it; FPDTStrategy(check_memory=False) runs it anyway."
    )


def choice_message(plan: MemoryPlan) -> str:
    """What the run was planned to, in a few lines: the options, the peaks against the limits, what binds."""
    binding = "nothing binds" if plan.binding_limit == "fits" else plan.binding_limit
    host = "unchecked" if plan.host_memory_bytes is None else f"of {gib(plan.host_memory_bytes)}"
    disk = ("" if plan.disk_memory_bytes is None else
            f"disk {gib(plan.disk_bytes_per_node)} GiB per host of {gib(plan.disk_memory_bytes)} free; ")
    return (
        f"fpdt: S = {plan.seq_len:,} planned with {plan.options.describe()}\n"
        f"  predicted peak {gib(plan.peak_gpu_bytes)} GiB per GPU of {gib(plan.gpu_memory_bytes)}; host "
        f"{gib(plan.host_resident_bytes_per_node)} GiB per host ({gib(plan.host_bytes_per_node)} pinned) {host}; "
        f"{disk}{binding}\n  as arguments:\n" + "\n".join("    " + line for line in python_arguments(plan).splitlines())
    )


def head_groups_possible(strategy: Any) -> bool:
    """Whether ``head_chunks="auto"`` may choose head groups for the strategy's model."""
    return supports_head_groups(find_model(strategy.model)) and ring_refusal(strategy.ring_size, head_chunks=2) is None


class MemoryBudget:
    """The memory side of one fpdt strategy: the plan of each sequence length it trains (the ``"auto"`` options
    resolved, the callbacks told their part), the guard every host buffer pool asks before it grows, and the
    page-locked host-resident states.

    Args:
        check: refuse a length whose plan fits neither memory (else warn and run it).
        offload_dir: the disk tier's directory (``FPDTStrategy(offload_dir=...)``); ``None``: no disk tier.
    """

    def __init__(self, *, check: bool, offload_dir: Optional[str] = None) -> None:
        self.check = check
        self.offload_dir = offload_dir
        self.disk: Optional[SpillDirectory] = None
        """This process's spill files once set up (:meth:`open_disk`)."""
        self._tiered: list[StashFactory] = []  # the factories given a disk tier
        self.plans: dict[tuple[int, int], Optional[MemoryPlan]] = {}  # (seq_len, batch) -> the plan it runs on
        self.plan: Optional[MemoryPlan] = None
        """The plan of the last length planned; ``None`` where nothing plans (no GPU, no config the planner reads)."""
        self.guard = HostMemoryGuard(reserve_bytes=host_reserve_bytes(), describe=self.advice)
        self._states: Optional[HostAllocator] = None  # page-locks FSDP2's host-resident shards

    # ---- setup --------------------------------------------------------------------------------------------------
    def head_chunks_at_setup(self, strategy: Any, trainer: Any) -> int:
        """``head_chunks`` for the attention about to be installed: the option, or for ``"auto"`` the search's
        choice for the length known at setup (1 when none is known, or the model's attention cannot be grouped)."""
        if strategy.options.head_chunks != "auto":
            return strategy.options.head_chunks
        known = known_length(trainer)
        if known is None or not head_groups_possible(strategy):
            return 1
        plan = plan_for(strategy, *known)
        return 1 if plan is None else plan.options.head_chunks

    def head_chunks_for_planning(self, strategy: Any) -> Union[Literal["auto"], int]:
        """Head groups as the planner may take them: those installed once the attention is, before that the option
        (``"auto"`` only where the model's attention can be grouped)."""
        context = getattr(strategy, "_context", None)
        if context is not None:
            return context.attention.head_chunks
        if strategy.options.head_chunks == "auto" and not head_groups_possible(strategy):
            return 1
        return strategy.options.head_chunks

    def guard_host_memory(self, strategy: Any) -> None:
        """Once the model is sharded: page-lock its host-resident shards exactly (with ``cpu_offload_params``), and
        make every host buffer pool of the run ask the guard before it grows."""
        if strategy.cpu_offload_params and self._states is None:
            self._states = register_host_states(strategy.model, pin=strategy.root_device.type == "cuda")
        for factory in self.factories(strategy):
            factory.guard = self.guard

    @staticmethod
    def factories(strategy: Any) -> list[StashFactory]:
        """The host buffer pools of the run: the attention's and the memory callbacks'."""
        context = getattr(strategy, "_context", None)
        found = [] if context is None else [context.attention.stashes]
        trainer = getattr(strategy.lightning_module, "_trainer", None)
        callbacks = trainer.callbacks if trainer is not None else []
        return found + [c.stashes for c in callbacks if isinstance(getattr(c, "stashes", None), StashFactory)]

    def pinned_bytes(self, strategy: Any) -> int:
        """Host memory the process holds page-locked: the pools' buffers of a CUDA run, the disk tier's staging
        buffers and the states."""
        states = self._states.allocated_bytes if self._states is not None and self._states.pin else 0
        staging = self.disk.staging.allocated_bytes if self.disk is not None and self.disk.staging.allocator.pin else 0
        return states + staging + sum(factory.pinned_bytes for factory in self.factories(strategy))

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
        return shutil.disk_usage(self.disk.root).free + self.disk.bytes_on_disk

    def configure_disk(self, strategy: Any, plan: Optional[MemoryPlan]) -> None:
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
        context = getattr(strategy, "_context", None)
        budgets = []
        if context is not None and plan.options.offload:
            budgets.append((context.attention.stashes, plan.component("attention stash").host_bytes + spare))
        if plan.options.activation_offload:
            inputs = plan.component("checkpointed block inputs").host_bytes
            trainer = getattr(strategy.lightning_module, "_trainer", None)
            for callback in trainer.callbacks if trainer is not None else []:
                features = getattr(callback, "fpdt_memory_features", None)
                if features is not None and features.activation_offload and isinstance(
                        getattr(callback, "stashes", None), StashFactory):
                    budgets.append((callback.stashes, inputs))
        for factory, host_budget in budgets:
            if factory.disk is None:
                factory.disk = DiskTier(self.disk, host_budget_bytes=host_budget)
                self._tiered.append(factory)
            else:
                factory.disk.files, factory.disk.host_budget_bytes = self.disk, host_budget

    # ---- per sequence length ------------------------------------------------------------------------------------
    def plan_length(self, strategy: Any, seq_len: int, batch_size: int, *, collective: bool) -> None:
        """Plan ``seq_len``: free the buffers of other lengths, resolve the ``"auto"`` options (:func:`plan_for`),
        refuse a plan that fits neither memory (every rank together when ``collective``), hand the memory callbacks
        their part and log the choice."""
        for factory in self.factories(strategy):
            factory.trim()  # the buffers of another length: freed, not kept beside this length's
        plan = plan_for(strategy, seq_len, batch_size)
        error = refusal(plan, self.offload_dir) if self.check else None
        if collective and not strategy.reduce_boolean_decision(error is None, all=True):
            raise error or ValueError("fpdt: another rank refused the run: it does not fit its memory (see its log)")
        if error is not None:
            raise error
        self.plans[(seq_len, batch_size)] = plan
        self.configure_disk(strategy, plan)
        if plan is None:
            return
        if not plan.fits:
            rank_zero_warn(f"fpdt: S = {seq_len:,} does not fit as planned (check_memory=False runs it anyway): "
                           f"{refusal(plan, self.offload_dir)}")
        self._run_on(strategy, plan)
        rank_zero_info(choice_message(plan))

    def _run_on(self, strategy: Any, plan: MemoryPlan) -> None:
        """Make ``plan`` the one the next steps run on: the memory callbacks take its choice."""
        self.plan = plan
        o = plan.options
        for callback in strategy.lightning_module.trainer.callbacks:
            if hasattr(callback, "apply_memory_choice"):
                callback.apply_memory_choice(recompute_attention=o.recompute_attention, reload_input=o.reload_input,
                                             prefetch=o.prefetch, keep_inputs=o.keep_inputs,
                                             checkpoint_blocks=o.checkpoint_blocks)

    def return_to(self, strategy: Any, seq_len: int, batch_size: int) -> None:
        """A batch of a length planned before: where another length's plan ran since (an evaluation at other lengths,
        a curriculum going back), free that length's buffers and run on this length's plan again."""
        plan = self.plans[(seq_len, batch_size)]
        if plan is None or plan is self.plan:
            return
        for factory in self.factories(strategy):
            factory.trim()
        self.configure_disk(strategy, plan)
        self._run_on(strategy, plan)

    def planned(self, seq_len: int, batch_size: int) -> bool:
        return (seq_len, batch_size) in self.plans

    def plan_of(self, seq_len: int, batch_size: int) -> Optional[MemoryPlan]:
        """The plan this length runs on, or ``None`` where nothing planned it."""
        return self.plans.get((seq_len, batch_size))

    def resolved(self, seq_len: int, batch_size: int) -> Optional[ResolvedOptions]:
        """The attention options the plan of this length chose, or ``None`` where nothing planned it."""
        plan = self.plan_of(seq_len, batch_size)
        if plan is None:
            return None
        o = plan.options
        return ResolvedOptions(chunks=o.chunks, offload=o.offload, offload_dq=o.offload_dq)

    def advice(self) -> str:
        """What the error of a host that ran short says: the plan the run was accepted on and how to need less."""
        plan = self.plan
        if plan is None:
            return "No plan was made for this run (no GPU or no model config): plan it with `lightning-fpdt plan`."
        return (f"The run was accepted on this plan: {gib(plan.host_resident_bytes_per_node)} GiB per host "
                f"({gib(plan.host_bytes_per_node)} pinned), {plan.options.describe()}. The host had less than "
                f"planned (another process took memory, or the plan is short for this model): free memory on the "
                f"host, or need less: ActivationOffload(recompute_attention=True), fewer GPUs per host, a shorter "
                f"sequence. `lightning-fpdt plan --host-memory-gib auto` shows what fits.")

    def close(self) -> None:
        """End the states' registration (the end of a fit; the memory stays FSDP2's); remove the disk tier's files
        and directory (a later fit plans its lengths again, with a directory of its own)."""
        if self._states is not None:
            self._states.close()
            self._states = None
        if self.disk is not None:
            self.disk.close()  # the tiers stay with their factories; the next fit's plans point them at its directory
            self.plans.clear()
