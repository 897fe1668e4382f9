"""The systems: ``fpdt``, ``fpdt-hf`` and ``modelparallel`` through Lightning's Trainer, ``ring`` as a plain PyTorch
loop, ``alst`` as DeepSpeed's loop (bench/peers/alst.py; DeepSpeed and transformers are imported when it runs).

Each trains ``args.steps`` steps of the same model on the same data and fills ``info`` with every step's time, loss
and peak GPU memory as the run goes, so an out-of-memory error still leaves the steps done.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from bench.host_readings import plan_fields
from bench.peers.ballast import ON_OFF_AUTO, count_option, layers_run, ring_size_option, sequence_parallel_option
from bench.peers.common import RandomTokens, append_step, prime_adam_states, reset_peaks, sdpa_backend, step_profiler
from bench.peers.hf_llama import named_vocab
from lightning_fpdt import ActivationOffload, FPDTStrategy, MFUMonitor, TiledLoss, TiledMLP
from lightning_fpdt.models.llama import LlamaForCausalLM, sdpa_attention
from lightning_fpdt.models.module import LlamaLM
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from bench.step_profile import StepProfiler

SYSTEMS = ("fpdt", "fpdt-hf", "modelparallel", "ring", "alst")
FPDT_SYSTEMS = ("fpdt", "fpdt-hf")
"""The systems trained by this project's strategy: the reference Llama and the Hugging Face Llama."""


# ---- shared pieces of the systems ------------------------------------------------------------------------------------
def mixed_precision(precision: str) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for ``--precision``: the one ``FPDTPrecision`` uses, so all three systems compute alike."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return None


def shard_with_checkpointing(
    model: LlamaForCausalLM, mesh: DeviceMesh, *, mp_policy: Optional[MixedPrecisionPolicy], cpu_offload: bool,
) -> LlamaForCausalLM:
    """The baselines' parallelization, as torchtitan and Lightning's FSDP2 guide write it: each block wrapped in torch's
    non-reentrant ``checkpoint_wrapper`` and sharded as its own FSDP2 unit, then the root (embedding, norm, lm_head)."""
    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(),
                  offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    layers = model.model.layers
    for index, layer in enumerate(layers):
        # checkpointing inside the FSDP unit (torchtitan's order): the recompute runs with the block's weights gathered
        layers[index] = checkpoint_wrapper(layer)
        fully_shard(layers[index], **kwargs)
    fully_shard(model, **kwargs)  # last: the root unit takes what the blocks left
    return model


def sdpa_expanded_kv(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, scale: Optional[float] = None) -> Tensor:
    """``sdpa_attention`` with ``k, v`` repeated to the query heads and no ``enable_gqa``, for a ring-attention kernel
    that refuses grouped-query attention (``--ring-kv-heads expand``; costs 4x the kv traffic for Llama-3-8B)."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)  # (B, S, Hkv, D) -> (B, S, H, D)
    v = v.repeat_interleave(groups, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=scale)  # (B, H, S, D)
    return out.transpose(1, 2)


# ---- the Lightning systems: fpdt and modelparallel -----------------------------------------------------------------
class ModelParallelLlamaLM(LlamaLM):
    """The reference Llama as a Lightning user parallelizes it for ``ModelParallelStrategy``: FSDP2 and activation
    checkpointing per block in ``configure_model`` (:func:`shard_with_checkpointing`), SDPA, untiled loss."""

    def __init__(self, name: str, *, precision: str, cpu_offload_params: bool, **kwargs: Any) -> None:
        super().__init__(name, **kwargs)
        self.bench_precision, self.bench_cpu_offload = precision, cpu_offload_params

    def configure_model(self) -> None:
        if isinstance(self.model, FSDPModule):
            return
        shard_with_checkpointing(self.model, self.device_mesh["data_parallel"],
                                 mp_policy=mixed_precision(self.bench_precision), cpu_offload=self.bench_cpu_offload)


class _KeepOffloadedParams(ModelParallelStrategy):
    """``ModelParallelStrategy`` moves the whole module to the GPU after ``configure_model`` (``model_to_device``),
    which would undo FSDP2's ``CPUOffloadPolicy``; FSDP2 has already put every parameter where it belongs."""

    def model_to_device(self) -> None:
        pass


class _StepLog(L.Callback):
    """Primes AdamW's moments, and keeps each step's time, loss and peak GPU memory in ``info`` as the run goes (an
    out-of-memory error then still leaves the steps done). Placed after ``MFUMonitor``, whose step times it copies.
    ``at_first_batch`` runs once before the first step (``--ballast full``: takes the disk ballast's blocks)."""

    def __init__(self, info: dict[str, Any], monitor: MFUMonitor, seq_len: int, profiler: StepProfiler,
                 at_first_batch: Optional[Callable[[], None]] = None) -> None:
        self.info, self.monitor, self.seq_len, self.profiler = info, monitor, seq_len, profiler
        self.at_first_batch = at_first_batch
        self._primed = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        if not self._primed:
            # here, not at on_train_start: the fpdt strategy measures the free GPU memory its "auto" options plan
            # with when it shards the first batch (batch_to_device, just before this hook), without the moments, as
            # in any run of it
            self._primed = True
            for optimizer in trainer.optimizers:
                prime_adam_states(optimizer)
            self.info.update(_layout(trainer, self.seq_len))
            if self.at_first_batch is not None:
                self.at_first_batch()
        reset_peaks(trainer.strategy.root_device, self.info)
        self.profiler.start(idx)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self.profiler.stop(idx)
        record = self.monitor.step_records[-1] if self.monitor.step_records else None
        # the strategy's loss (under fpdt the sequence group's token mean); callbacks run before the module's own hook
        loss = outputs["loss"].detach().float().item() * trainer.accumulate_grad_batches
        append_step(self.info, trainer.strategy.root_device, record and record.step_time_s, loss,
                     strategy=trainer.strategy)
        self.info["tokens_per_step"] = record.tokens if record else None
        if isinstance(trainer.strategy, FPDTStrategy):
            self.info.update(plan_fields(trainer.strategy))


def _layout(trainer: L.Trainer, seq_len: int) -> dict[str, Any]:
    """How the run split the work: fpdt's resolved chunks, offload and mesh; modelparallel's data parallelism."""
    strategy = trainer.strategy
    if not isinstance(strategy, FPDTStrategy):
        return dict(sequence_parallel_size=1, data_parallel_size=trainer.world_size)
    resolved = strategy.resolved_options(seq_len)
    return dict(chunks=resolved.chunks, offload=resolved.offload, offload_dq=resolved.offload_dq,
                sequence_parallel_size=strategy.sequence_parallel_size, data_parallel_size=strategy.data_parallel_size)


def _lightning_parts(args: argparse.Namespace, world_size: int) -> tuple[L.LightningModule, Any, list[L.Callback], str]:
    """``(module, strategy, callbacks, precision)`` of ``fpdt``, ``fpdt-hf`` or ``modelparallel``."""
    layers = layers_run(args)
    if args.system in FPDT_SYSTEMS:
        if args.system == "fpdt":
            module = LlamaLM(args.model, lr=args.lr, seed=args.seed, num_layers=layers)
        else:
            from bench.peers.hf_llama import HFLlamaLM  # transformers is imported when the model is built

            module = HFLlamaLM(args.model, num_layers=layers, max_seq_len=args.seq_len, seed=args.seed, lr=args.lr)
        planned = getattr(args, "full_depth_arguments", None)  # --ballast full: the full depth's plan, explicit
        if planned is not None:
            memory = {k: v for k, v in planned["FPDTStrategy"].items()
                      if k not in ("sequence_parallel_size", "ring_size", "cpu_offload_params")}
            blocks = dict(planned["ActivationOffload"])
        elif getattr(args, "auto_options", False):  # the strategy chooses every memory option but a count given
            memory: dict[str, Any] = dict(chunks=args.chunks, offload="auto", offload_dq="auto", head_chunks="auto")
            blocks: dict[str, Any] = dict(recompute_attention="auto", reload_input="auto", prefetch="auto",
                                          keep_inputs=count_option(args, "keep_inputs"),
                                          checkpoint_blocks=count_option(args, "checkpoint_blocks"))
        else:
            memory = dict(chunks=args.chunks, offload=ON_OFF_AUTO[args.offload],
                          offload_dq=ON_OFF_AUTO[args.offload_dq], head_chunks=args.head_chunks)
            blocks = dict(recompute_attention=args.recompute_attention, reload_input=args.reload_input,
                          prefetch=args.prefetch, keep_inputs=count_option(args, "keep_inputs"),
                          checkpoint_blocks=count_option(args, "checkpoint_blocks"))
        # --sequence-parallel-size: the GPUs of one sequence (the full depth's plan was made with it too)
        strategy = FPDTStrategy(**memory, sequence_parallel_size=sequence_parallel_option(args),
                                ring_size=ring_size_option(args),
                                attention_backend=args.attention_backend,
                                cpu_offload_params=args.cpu_offload_params, offload_dir=args.offload_dir,
                                host_step_in_backward=not args.host_step_after_backward,
                                device_step_in_backward=not args.device_step_after_backward,
                                plan_trial=getattr(args, "plan_trial", False))
        offload = ActivationOffload(**blocks)
        callbacks: list[L.Callback] = [offload, TiledMLP(), TiledLoss()]
        return module, strategy, callbacks, args.precision  # FPDTPrecision: FSDP2 MixedPrecisionPolicy, no autocast
    module = ModelParallelLlamaLM(args.model, precision=args.precision, cpu_offload_params=args.cpu_offload_params,
                                  lr=args.lr, seed=args.seed, num_layers=layers)
    strategy_class = _KeepOffloadedParams if args.cpu_offload_params else ModelParallelStrategy
    strategy = strategy_class(data_parallel_size=world_size, tensor_parallel_size=1)
    return module, strategy, [], "32-true"  # bf16 comes from FSDP2's MixedPrecisionPolicy in configure_model


class InOrder(L.LightningDataModule):
    """The samples in order over the data-parallel ranks: data-parallel rank ``r`` of ``D`` trains samples ``r,
    r + D, ...``, so a system whose GPUs share one sequence (``D = 1``) trains sample ``i`` at step ``i``, as ``ring``
    and ``alst`` do. (Lightning's own sampler would shuffle the training samples.)"""

    def __init__(self, dataset: Dataset) -> None:
        super().__init__()
        self.dataset = dataset

    def train_dataloader(self) -> DataLoader:
        # the strategy's data-parallel axis: num_replicas and rank (a DistributedSampler already set is kept)
        sampler = DistributedSampler(self.dataset, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(self.dataset, batch_size=1, sampler=sampler)


def train_lightning(args: argparse.Namespace, *, device: torch.device, world_size: int, gpus_per_node: int,
                    info: dict[str, Any], peak: Optional[float]) -> None:
    """``fpdt``, ``fpdt-hf`` or ``modelparallel``: ``args.steps`` steps of ``Trainer.fit``."""
    module, strategy, callbacks, precision = _lightning_parts(args, world_size)
    monitor = MFUMonitor(peak_flops=peak)
    trainer = L.Trainer(
        strategy=strategy, accelerator="gpu" if device.type == "cuda" else "cpu", devices=gpus_per_node,
        num_nodes=world_size // gpus_per_node, precision=precision, max_steps=args.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, monitor, _StepLog(info, monitor, args.seq_len, step_profiler(args, device, info),
                                                 at_first_batch=getattr(args, "at_first_batch", None))],
    )
    vocab = named_vocab(args.model)
    data = InOrder(RandomTokens(vocab, args.seq_len, args.steps * world_size))
    with sdpa_backend(args.attention_backend if args.system not in FPDT_SYSTEMS else "auto"):
        trainer.fit(module, datamodule=data)


# ---- the ring system: a plain PyTorch loop ---------------------------------------------------------------------------
def _ring_model(args: argparse.Namespace, mesh: DeviceMesh) -> LlamaForCausalLM:
    """The Lightning systems' init, SDPA attention the context-parallel dispatcher can intercept, sharded per block."""
    model = LlamaLM(args.model, seed=args.seed, num_layers=layers_run(args)).model
    for module in model.modules():
        if hasattr(module, "attention_fn"):
            # sdpa_attention calls F.scaled_dot_product_attention(..., is_causal=True) on (B, H, S, D): the call the
            # context_parallel dispatcher intercepts
            module.attention_fn = sdpa_expanded_kv if args.ring_kv_heads == "expand" else sdpa_attention
    return shard_with_checkpointing(model, mesh, mp_policy=mixed_precision(args.precision),
                                    cpu_offload=args.cpu_offload_params)


def train_ring(args: argparse.Namespace, *, device: torch.device, world_size: int, gpus_per_node: int,
               info: dict[str, Any], peak: Optional[float]) -> None:
    """``ring``: ``args.steps`` steps of context-parallel training on a 1-D mesh of all GPUs (torchtitan's recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("cp",))
    model = _ring_model(args, mesh)
    # LlamaLM's optimizer, with torchtitan's default implementation (fused) on the GPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    prime_adam_states(optimizer)
    set_rotate_method(args.rotate_method)
    info.update(sequence_parallel_size=world_size, data_parallel_size=1, tokens_per_step=args.seq_len)
    profiler = step_profiler(args, device, info)
    dataset = RandomTokens(named_vocab(args.model), args.seq_len, args.steps)
    global_targets = args.seq_len - 1  # the last token has nothing to predict
    with sdpa_backend(args.attention_backend):
        for step in range(args.steps):
            input_ids = dataset[step]["input_ids"][None].to(device)  # (1, S), sample `step` as in the other systems
            position_ids = torch.arange(args.seq_len, device=device)[None]  # (1, S)
            targets = SequenceLayout.shift_labels(input_ids)  # (1, S): shifted on the whole sequence, then sharded
            buffers = [input_ids, position_ids, targets]
            reset_peaks(device, info)
            profiler.start(step)
            start = time.perf_counter()
            with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
                # the buffers are now this rank's (1, S/W) load-balanced shards
                local_mean = model(input_ids, position_ids=position_ids, shift_labels=targets)
                count = (targets != IGNORE_INDEX).sum()
                # FSDP2 averages gradients over the W ranks: scaled so the average is the global token mean's gradient
                (local_mean * count * world_size / global_targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            profiler.stop(step)
            loss_sum = (local_mean.detach().float() * count).reshape(1)
            dist.all_reduce(loss_sum)
            append_step(info, device, seconds, loss_sum.item() / global_targets)


def train_alst(args: argparse.Namespace, **kwargs: Any) -> None:
    """``alst``: DeepSpeed's recipe (bench/peers/alst.py), imported here so DeepSpeed is needed only to run it."""
    from bench.peers.alst import train_alst as train

    train(args, **kwargs)


SYSTEM_FUNCTIONS: dict[str, Callable[..., None]] = {
    "fpdt": train_lightning, "fpdt-hf": train_lightning, "modelparallel": train_lightning, "ring": train_ring,
    "alst": train_alst,
}
"""The function that trains each ``--system``; every one takes ``(args, *, device, world_size, gpus_per_node, info,
peak)``."""
