"""``alst``: DeepSpeed's Arctic Long Sequence Training recipe (DeepSpeed 0.19.8) on the Hugging Face Llama.

The recipe as DeepSpeed's ALST tutorial (docs/_tutorials/ulysses-alst-sequence-parallelism.md) and Snowflake's
ArcticTraining (projects/sequence-parallelism, its H100 Llama-8B configs, trainer and SFT loss) put it together:

- Ulysses sequence parallelism over all GPUs: ``UlyssesSPAttentionHF.register_with_transformers`` (``sdpa`` core
  attention) and ``UlyssesSPDataLoaderAdapter``, which shards each sample over the GPUs and pre-shifts its labels;
  the HF mask function of ``sdpa`` returns ``None`` under sequence parallelism (ArcticTraining: no ``(S, S)`` mask).
- DeepSpeed's ``TiledMLP`` in place of ``LlamaMLP.forward`` (``ceil(S/P / hidden)`` tiles, the ranks' maximum).
- The logits and loss tiled with ``TiledFusedLogitsLoss`` (about 1 GiB of fp32 logits per tile, losses summed, the
  token mean over the sequence group by a differentiable ``all_gather``), as ArcticTraining's SFT loss does without
  Liger-Kernel.
- Activation checkpointing per decoder layer with its input offloaded to pinned host memory: HF's non-reentrant
  checkpointing under DeepSpeed's ``get_checkpoint_hidden_states_offloading_ctx_manager``.
- ZeRO stage 3; ``--cpu-offload-params``: ``offload_optimizer`` to the CPU with ``DeepSpeedCPUAdam`` (AdamW mode),
  plus ``offload_param`` on one GPU (ArcticTraining's ``run-h100-sp1-llama-8b.yml``; its multi-GPU configs offload
  the optimizer only). bf16 with fp32 master weights (``bf16.enabled``).
- ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, set by whoever launches the run (it must precede CUDA's
  start); the option check refuses alst without it.

Departures, so the run trains what the other systems train:

- The model is built from the reference geometry at random (transformers' init, seeded), not loaded pretrained; data
  are the benchmark's random tokens (sample ``i`` at step ``i``), not an SFT dataset.
- AdamW, lr ``--lr``, no weight decay, no schedule, no clipping. GPU-resident states use ``torch.optim.AdamW``
  (``optimizer.params.torch_adam``) where ArcticTraining uses DeepSpeed's ``FusedAdam``: the same update, and no
  CUDA extension to compile. Its moments are created before the first step, as in the other systems.
- Gradients are reduced in fp32 (``communication_data_type``), as FSDP2's ``reduce_dtype`` does in the other systems;
  DeepSpeed's default reduces bf16 gradients in bf16. The Ulysses all-to-alls stay bf16
  (``seq_parallel_communication_data_type``, as the recipe sets it).
- No Liger-Kernel (not part of DeepSpeed; the tutorial's fallback without it is the tiled logits and loss used here),
  SDPA rather than flash-attn 2 as the core attention (``attn_implementation: flash_attention_2`` in the recipe's
  configs; flash-attn is not a dependency here).
- Checkpoint offload through DeepSpeed's context manager for non-reentrant checkpointing, where ArcticTraining patches
  torch's reentrant ``CheckpointFunction`` to copy the layer input to the CPU synchronously: both keep one layer input
  per layer in host memory.
- As in the recipe, ``TiledFusedLogitsLoss`` takes the head's gradient inside its forward, from the tiles' loss sums
  (``output_reduction="sum"``), and scales only the hidden states' gradient by the division by the target count that
  follows: the head's weight gradient is the target count times the token mean's (tests/bench/test_bench_deepspeed.py
  checks both). AdamW without clipping is invariant to that constant factor, so the step it takes is the same.
- One GPU: the tiled loss runs as on several (ArcticTraining's one-GPU runs use Liger's fused loss instead), with the
  labels shifted as the adapter shifts them; the adapter and the Ulysses attention are not used (they are off at
  sequence-parallel size 1 in DeepSpeed too).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from bench.peers.ballast import layers_run
from bench.peers.common import RandomTokens, append_step, prime_adam_states, reset_peaks, sdpa_backend, step_profiler
from bench.peers.hf_llama import build_hf_llama
from lightning_fpdt.models.llama import LlamaConfig
from lightning_fpdt.sequence.layout import SequenceLayout
from lightning_fpdt.sequence.loss import IGNORE_INDEX

LOGITS_TILE_BYTES = 2**30
"""fp32 logits per tile of the loss: ArcticTraining's ``slice_size_in_gb = 1``."""


def deepspeed_config(args: argparse.Namespace, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config of the run: ZeRO-3, Ulysses over all ``world_size`` GPUs, AdamW, bf16 with fp32 master
    weights and fp32 gradient reduction; with ``--cpu-offload-params`` the optimizer (and on one GPU the parameters)
    offloaded to the CPU."""
    zero: dict[str, Any] = {"stage": 3}
    if args.cpu_offload_params:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if world_size == 1:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 2**31 - 1,  # the benchmark prints its own record
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            # DeepSpeedCPUAdam in AdamW mode when offloaded, else torch's AdamW (see the module's docstring)
            "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                       "torch_adam": not args.cpu_offload_params},
        },
        "sequence_parallel_size": world_size,
    }
    if args.precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
        config["communication_data_type"] = "fp32"
        config["seq_parallel_communication_data_type"] = "bf16"
    return config


def tiled_mlp_shards(seq_len: int, hidden_size: int) -> int:
    """The recipe's MLP tile count for ``seq_len`` tokens of this rank: ``ceil(seq_len / hidden_size)``."""
    return math.ceil(seq_len / hidden_size)


def logits_loss_shards(tokens: int, vocab_size: int) -> int:
    """The recipe's loss tile count: about :data:`LOGITS_TILE_BYTES` of fp32 logits per tile."""
    return max(1, math.ceil(tokens * vocab_size * 4 / LOGITS_TILE_BYTES))


def prime_optimizer_states(optimizer: torch.optim.Optimizer) -> None:
    """Create the AdamW moments of ZeRO's inner optimizer now, as its first step would (``DeepSpeedCPUAdam``: fp32
    zeros on the CPU, step 0; ``torch.optim.AdamW``: :func:`bench.peers.common.prime_adam_states`), so the first
    step's peak memory is the steady state's."""

    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        prime_adam_states(optimizer)
        return
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        raise TypeError(f"prime_optimizer_states: expected AdamW or DeepSpeedCPUAdam, got {type(optimizer).__name__}")
    state_dtype = torch.float32 if optimizer.fp32_optimizer_states else None
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state or not p.requires_grad:
                continue
            state["step"] = 0  # DeepSpeedCPUAdam.step's own initialisation
            state["exp_avg"] = torch.zeros_like(p, dtype=state_dtype or p.dtype, device="cpu")
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=state_dtype or p.dtype, device="cpu")


class _WithPositions(Dataset):
    """The benchmark's random tokens with ``position_ids``, which ``UlyssesSPDataLoaderAdapter`` requires."""

    def __init__(self, samples: Dataset) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        sample = dict(self.samples[index])
        sample["position_ids"] = torch.arange(sample["input_ids"].shape[0])
        return sample


def rank_samples(dataset: Dataset, *, rank: int, world_size: int) -> Subset:
    """Rank ``r``'s samples ``r, r + W, ...``: the adapter gathers one sample of each rank and trains them one after
    the other on all ranks, so step ``i`` trains sample ``i`` (as ``DistributedSampler`` feeds ArcticTraining)."""
    return Subset(dataset, range(rank, len(dataset), world_size))


@contextmanager
def _replaced(owner: Any, name: str, value: Any, *, item: bool = False) -> Iterator[None]:
    """``owner.name`` (or ``owner[name]``) set to ``value`` for the block: the recipe's patches are process-wide."""
    original = owner[name] if item else getattr(owner, name)
    if item:
        owner[name] = value
    else:
        setattr(owner, name, value)
    try:
        yield
    finally:
        if item:
            owner[name] = original
        else:
            setattr(owner, name, original)


def _tiled_mlp_forward(tiled_mlp: Any) -> Callable[..., Tensor]:
    """``LlamaMLP.forward`` through DeepSpeed's ``TiledMLP``, tiles as the recipe counts them."""

    def forward(self: Any, x: Tensor) -> Tensor:
        shards = tiled_mlp_shards(x.shape[-2], x.shape[-1])
        if dist.is_initialized() and dist.get_world_size() > 1:
            # every rank must run as many tiles, or ZeRO-3's gathers deadlock (the recipe takes the maximum)
            count = torch.tensor(shards, device=x.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            shards = int(count.item())

        def mlp(module: Any, x_tile: Tensor) -> Tensor:
            return module.down_proj(module.act_fn(module.gate_proj(x_tile)) * module.up_proj(x_tile))

        return tiled_mlp.apply(mlp, self, x, shards, [self.down_proj.weight, self.gate_proj.weight,
                                                      self.up_proj.weight])

    return forward


def tiled_loss(model: Any, hidden_states: Tensor, shift_labels: Tensor, *, sp_group: Any, sp_size: int) -> Tensor:
    """The sequence's token-mean cross-entropy from this rank's ``(1, S/P, h)`` hidden states and pre-shifted labels:
    ``TiledFusedLogitsLoss`` over the rank's tokens (sum of the tiles' loss sums), then the ranks' means weighted by
    their target counts through a differentiable ``all_gather`` (ArcticTraining's SFT loss)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    vocab_size = model.config.vocab_size

    def loss_sum(module: Any, hidden: Tensor, labels: Tensor) -> Tensor:
        logits = module.lm_head(hidden)
        if bool((labels == IGNORE_INDEX).all()):
            return (logits.sum() * 0.0).float()  # a tile without targets still sets the head's gradient
        targets = (labels != IGNORE_INDEX).sum()
        return module.loss_function(logits=logits, labels=None, vocab_size=vocab_size, shift_labels=labels) * targets

    shards = logits_loss_shards(shift_labels.numel(), vocab_size)
    total = TiledFusedLogitsLoss.apply(loss_sum, model, hidden_states, shift_labels, None, shards,
                                       [model.lm_head.weight], "sum")
    targets = (shift_labels != IGNORE_INDEX).sum()
    loss = total / targets.clamp(min=1)
    if sp_size == 1:
        return loss
    import torch.distributed.nn.functional as dist_nn

    losses = dist_nn.all_gather(loss, group=sp_group)
    counts = dist_nn.all_gather(targets, group=sp_group)
    return sum(losses[r] * counts[r] for r in range(sp_size)) / sum(counts)


def train_alst(args: argparse.Namespace, *, device: torch.device, world_size: int, gpus_per_node: int,
               info: dict[str, Any], peak: Optional[float]) -> None:
    """``alst``: ``args.steps`` steps of the recipe on all GPUs, one sequence of ``args.seq_len`` tokens per step."""
    import deepspeed
    import transformers.masking_utils as masking
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama


    # DeepSpeed reads torchrun's variables (zero.Init: LOCAL_RANK); a one-GPU run started with python3 has none
    for name, value in (("LOCAL_RANK", device.index or 0), ("RANK", dist.get_rank()), ("WORLD_SIZE", world_size)):
        os.environ.setdefault(name, str(value))
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = deepspeed_config(args, world_size)
    # each patch is undone when the run ends: the recipe applies them to the process
    with _replaced(modeling_llama.LlamaMLP, "forward", _tiled_mlp_forward(TiledMLP)), \
            _replaced(ALL_ATTENTION_FUNCTIONS, "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"], item=True), \
            _replaced(masking.ALL_MASK_ATTENTION_FUNCTIONS, "sdpa", masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"],
                      item=True):
        if world_size > 1:
            # no (S, S) causal mask: Ulysses drops masks and SDPA runs is_causal (ArcticTraining, SP > 1 with sdpa)
            masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] = lambda *_args, **_kwargs: None
        keep_zero3 = HfDeepSpeedConfig(config)  # noqa: F841 - transformers builds the model inside zero.Init
        model = build_hf_llama(args.model, num_layers=layers_run(args), max_seq_len=args.seq_len, seed=args.seed)
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=world_size,
            micro_batch_size=1, seq_length=args.seq_len, seq_length_is_variable=True,
        )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # ArcticTraining's make_model_gradient_checkpointing_compatible
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                               mpu=mpu)
        prime_optimizer_states(engine.optimizer.optimizer)
        info.update(optimizer=type(engine.optimizer.optimizer).__name__,
                    offload_param="offload_param" in config["zero_optimization"],
                    gradient_reduction=config.get("communication_data_type", "fp32"))
        _train_steps(args, engine, device=device, world_size=world_size, info=info,
                     profiler=step_profiler(args, device, info),
                     offload=get_checkpoint_hidden_states_offloading_ctx_manager(), backend=sdpa_backend)


def _batches(args: argparse.Namespace, engine: Any, world_size: int) -> Iterator[dict[str, Tensor]]:
    """This rank's shard of sample ``i`` at step ``i``: ``input_ids``, ``position_ids``, ``shift_labels``, each
    ``(1, S/P)``."""

    vocab = LlamaConfig.from_name(args.model).vocab_size
    num_samples = math.ceil(args.steps / world_size) * world_size
    dataset = _WithPositions(RandomTokens(vocab, args.seq_len, num_samples))
    if world_size == 1:
        for index in range(args.steps):
            sample = {k: v[None] for k, v in dataset[index].items()}
            labels = sample.pop("labels")
            yield {**sample, "shift_labels": SequenceLayout.shift_labels(labels)}  # as the adapter shifts them
        return
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from deepspeed.utils import groups

    loader = DataLoader(rank_samples(dataset, rank=dist.get_rank(), world_size=world_size), batch_size=1)
    yield from UlyssesSPDataLoaderAdapter(loader, sp_rank=groups._get_sequence_parallel_rank(),
                                          sp_group=groups._get_sequence_parallel_group(),
                                          sp_world_size=groups._get_sequence_parallel_world_size(),
                                          device=engine.device)


def _train_steps(args: argparse.Namespace, engine: Any, *, device: torch.device, world_size: int,
                 info: dict[str, Any], profiler: Any, offload: Any, backend: Callable[[str], Any]) -> None:

    sp_group = None
    if world_size > 1:
        from deepspeed.utils import groups

        sp_group = groups._get_sequence_parallel_group()
    info.update(sequence_parallel_size=world_size, data_parallel_size=1, tokens_per_step=args.seq_len)
    model = engine.module
    with backend(args.attention_backend):
        for step, batch in zip(range(args.steps), _batches(args, engine, world_size)):
            batch = {k: v.to(device) for k, v in batch.items()}
            reset_peaks(device, info)
            profiler.start(step)
            start = time.perf_counter()
            with offload:  # backward must run inside the context that saw the forward
                hidden = model.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).last_hidden_state
                loss = tiled_loss(model, hidden, batch["shift_labels"], sp_group=sp_group, sp_size=world_size)
                engine.backward(loss)
            engine.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - start
            profiler.stop(step)
            append_step(info, device, seconds, loss.detach().float().item())
