"""What a plan is asked for: the machine's limits (:class:`Machine`) and the run (:class:`PlanRequest`), each checked
once, when it is made. :func:`~lightning_fpdt.planner.plan_memory` takes a request, or its fields as keywords
(:meth:`PlanRequest.of`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from lightning_fpdt.flops import ModelGeometry, is_count
from lightning_fpdt.memory.block_schedule import check_checkpoint_blocks, check_keep_inputs
from lightning_fpdt.planner.components import GIB
from lightning_fpdt.planner.cost import inter_host_rate
from lightning_fpdt.planner.features.disk_tier import DISK_GBPS
from lightning_fpdt.planner.geometry import OPTIMIZER_STATES, PRECISIONS, resolve_geometry
from lightning_fpdt.planner.plan_options import MemoryFeatures
from lightning_fpdt.planner.rates import StepRates
from lightning_fpdt.sequence.options import check_switch

Switch = Union[Literal["auto"], bool]
Size = Union[Literal["auto"], int]


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The GPUs a run has and the memories a plan may fill (:func:`~lightning_fpdt.planner.machine.machine_limits`
    reads them on the machine a run is on)."""

    num_gpus: int
    """All GPUs ``W`` (FSDP2 shards the states over all of them)."""
    gpus_per_node: Optional[int] = None
    """GPUs of one host (``None``: all of them, one host); host memory and disk are needed per host."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU a plan may fill, in GiB (about 79 for an H100 80GB, 139 for an H200)."""
    host_memory_gib: Optional[float] = None
    """Memory the processes of one host may hold (pinned and pageable); ``None``: not checked."""
    host_baseline_gib: Optional[float] = None
    """Resident memory of one process before the step's buffers; ``None``: the planner's estimate
    (:data:`~lightning_fpdt.planner.phases.PROCESS_BASELINE_BYTES`)."""
    disk_memory_gib: Optional[float] = None
    """Free space of the disk tier's directory on one host (``FPDTStrategy(offload_dir=...)``); ``None``: no disk
    tier."""
    disk_gbps: float = DISK_GBPS
    """The disk's read and write rate in GB/s, shared by the GPUs of a host."""
    inter_host_gbps: Optional[float] = None
    """GB/s one GPU sends to GPUs of other hosts (``None``: :data:`~lightning_fpdt.planner.rates.INTER_HOST_BYTES`, a
    400 Gb/s InfiniBand link per GPU): the step-time estimate charges the traffic that leaves a host at it, and a
    sequence-parallel group spanning hosts takes the layout (``ring_size="auto"``) that estimate ranks fastest among
    those that fit (:mod:`lightning_fpdt.planner.cost`)."""
    rates: Optional[StepRates] = None
    """The rates a step is timed at: a calibration of the GPU (:mod:`lightning_fpdt.planner.calibration`);
    ``None``: the built-in table (:mod:`lightning_fpdt.planner.rates`)."""

    def __post_init__(self) -> None:
        if not is_count(self.num_gpus):
            raise ValueError(f"num_gpus ({self.num_gpus!r}) must be a positive int")
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", self.num_gpus)
        if not is_count(self.gpus_per_node) or self.num_gpus % self.gpus_per_node:
            raise ValueError(f"gpus_per_node ({self.gpus_per_node}) must divide num_gpus ({self.num_gpus})")
        if self.gpu_memory_gib <= 0 or (self.host_memory_gib is not None and self.host_memory_gib <= 0):
            raise ValueError(f"gpu_memory_gib ({self.gpu_memory_gib}) and host_memory_gib ({self.host_memory_gib}) "
                             f"must be positive")
        inter_host_rate(self.inter_host_gbps)  # a ValueError naming the fix for a rate that is not one
        if self.disk_memory_gib is not None and (self.disk_memory_gib < 0 or self.disk_gbps <= 0):
            raise ValueError(f"disk_memory_gib ({self.disk_memory_gib}) must be >= 0 and disk_gbps "
                             f"({self.disk_gbps}) positive")

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)

    @property
    def host_memory_bytes(self) -> Optional[int]:
        return None if self.host_memory_gib is None else int(self.host_memory_gib * GIB)

    @property
    def host_baseline_bytes(self) -> Optional[int]:
        return None if self.host_baseline_gib is None else int(self.host_baseline_gib * GIB)

    @property
    def disk_memory_bytes(self) -> Optional[int]:
        return None if self.disk_memory_gib is None else int(self.disk_memory_gib * GIB)


MACHINE_FIELDS = frozenset(field.name for field in dataclasses.fields(Machine))
FEATURE_FIELDS = frozenset(field.name for field in dataclasses.fields(MemoryFeatures))
REQUIRED_KEYWORDS = ("geometry", "seq_len", "num_gpus", "activation_offload", "tiled_mlp", "tiled_loss")
"""What :meth:`PlanRequest.of` cannot default: the model, the length, the GPUs, and whether each memory callback is
on."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """One run to plan: the model, the sequence, the machine, the memory callbacks' features and ``FPDTStrategy``'s
    options as the user gave them (``"auto"`` resolved by the planner's search). Checked when made: a value that
    cannot be planned is a ``ValueError`` naming it."""

    geometry: Any
    """A :class:`ModelGeometry`, a ``LlamaConfig`` or Hugging Face config, a named size (``"llama3-8b"``) or the path
    of a Hugging Face ``config.json``; a :class:`ModelGeometry` once made."""
    seq_len: int
    """Global tokens of one sequence ``S`` (padded as the strategy pads it, to a multiple of ``P·u``)."""
    machine: Machine
    features: MemoryFeatures
    """What the memory callbacks ask (``ActivationOffload``, ``TiledMLP``, ``TiledLoss``)."""
    batch_size: int = 1
    """Sequences per data-parallel group per step."""
    sequence_parallel_size: Size = "auto"
    ring_size: Size = "auto"
    """As ``FPDTStrategy`` takes it; ``"auto"``: the smallest ring the heads need."""
    chunks: Size = "auto"
    offload: Switch = "auto"
    offload_dq: Switch = "auto"
    head_chunks: Size = 1
    cpu_offload_params: bool = False
    """``FPDTStrategy``'s options (``"auto"`` resolved by the search, as the strategy resolves it on a GPU)."""
    precision: str = "bf16-mixed"
    """``"bf16-mixed"``, ``"bf16-true"`` or ``"32-true"``."""
    optimizer: str = "adamw"
    """``"adamw"``, ``"adam"`` (two moments) or ``"sgd"`` (none)."""
    disk_inputs: Size = "auto"
    """Block inputs per GPU on disk (0 allowed); ``"auto"``: as many as the host's memory needs, when it needs them
    and that is the fastest way to fit (:mod:`lightning_fpdt.planner.features.disk_tier`)."""
    accumulate_grad_batches: int = 1
    """``Trainer(accumulate_grad_batches=...)``: batches per optimizer step."""
    sync_every_batch: Switch = "auto"
    """With ``accumulate_grad_batches > 1``, ``FPDTStrategy(sync_every_batch=...)``; ``"auto"``: the faster that fits
    (:mod:`lightning_fpdt.planner.features.accumulation`)."""
    trainable_parameters: Optional[int] = None
    """The parameters that train (LoRA's adapters, a model with frozen parts): only they have gradients and optimizer
    states; ``None``: all."""
    other_parameters: int = 0
    """Parameters outside the planned model (a frozen reference model, a value head): their weights are counted."""
    other_trainable_parameters: int = 0
    """Those of ``other_parameters`` that train: their gradients and optimizer states are counted too."""

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, ModelGeometry):
            object.__setattr__(self, "geometry", resolve_geometry(self.geometry))
        layers = self.geometry.num_layers
        for name in ("seq_len", "batch_size", "accumulate_grad_batches"):
            value = getattr(self, name)
            if not is_count(value):
                raise ValueError(f"{name} ({value!r}) must be a positive int")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not planned for; use one of {sorted(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(f"optimizer {self.optimizer!r} is not planned for; use one of "
                             f"{sorted(OPTIMIZER_STATES)}")
        features = self.features  # its own values checked when made (MemoryFeatures.__post_init__)
        check_switch("sync_every_batch", self.sync_every_batch)
        if self.disk_inputs != "auto":
            if not is_count(self.disk_inputs, least=0) or self.disk_inputs > layers:
                raise ValueError(f"disk_inputs must be 'auto' or a number of block inputs from 0 to the {layers} "
                                 f"layers, got {self.disk_inputs!r}")
            if self.disk_inputs and (self.machine.disk_memory_gib is None or not features.activation_offload):
                raise ValueError(f"disk_inputs={self.disk_inputs} puts block inputs on disk: it needs "
                                 f"activation_offload=True and a disk (disk_memory_gib)")
        check_keep_inputs(features.keep_inputs, layers)
        check_checkpoint_blocks(features.checkpoint_blocks, layers)
        # every block (every input) as a count is "all"
        if features.checkpoint_blocks == layers:
            features = dataclasses.replace(features, checkpoint_blocks="all")
        if features.keep_inputs == layers:
            features = dataclasses.replace(features, keep_inputs="all")
        if features.checkpoint_blocks not in ("all", "auto") and not (features.activation_offload or
                                                                      features.activation_checkpointing):
            raise ValueError(f"checkpoint_blocks={features.checkpoint_blocks!r} chooses which blocks "
                             f"ActivationOffload checkpoints: it needs activation_offload=True (or "
                             f"activation_checkpointing=True)")
        object.__setattr__(self, "features", features)

    @classmethod
    def of(cls, **keywords: Any) -> "PlanRequest":
        """The request of ``plan_memory``'s keywords: :class:`Machine`'s fields (``num_gpus``, ``gpus_per_node``,
        ``gpu_memory_gib``, ``host_memory_gib``, ``host_baseline_gib``, ``disk_memory_gib``, ``disk_gbps``),
        :class:`MemoryFeatures`' (the memory callbacks' options under their own names: ``activation_offload``,
        ``tiled_mlp``, ``tiled_loss``, ``activation_checkpointing``, ``recompute_attention``, ``keep_inputs``, ...) and
        this class's own. ``activation_checkpointing=None`` is ``activation_offload``'s."""
        missing = [name for name in REQUIRED_KEYWORDS if name not in keywords]
        if missing:
            raise TypeError(f"plan_memory() missing required keyword arguments: {', '.join(missing)}")
        machine = {name: keywords.pop(name) for name in MACHINE_FIELDS & keywords.keys()}
        features = {name: keywords.pop(name) for name in FEATURE_FIELDS & keywords.keys()}
        if features.get("activation_checkpointing", False) is None:
            del features["activation_checkpointing"]
        return cls(machine=Machine(**machine), features=MemoryFeatures(**features), **keywords)
