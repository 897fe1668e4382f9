"""Every option of the two fpdt strategies, documented once (docs/design.md §5).

``FPDTStrategy`` and ``FPDTFabricStrategy`` take the same options where both front doors can honour them, each with
its flat keyword signature (LightningCLI reads it). Their ``Args:`` sections are built from :data:`OPTION_DOCS` by
:func:`documented` from each constructor's keyword options, so an option both take reads the same under either;
where the front doors differ in what it does, its one text says so.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Sequence
from typing import TypeVar

OPTION_DOCS: dict[str, str] = {
    "sequence_parallel_size": (
        "ranks that share one sequence; ``\"auto\"``: the devices of a node, capped by what the model's head counts "
        "allow (under Fabric the mesh is built at the first ``fabric.setup``, where the heads are known)."),
    "data_parallel_size": "groups that see different samples; ``\"auto\"``: world size / sequence_parallel_size.",
    "chunks": (
        "FPDT chunks per rank ``u``; ``1`` is plain Ulysses. ``\"auto\"`` (this, ``offload``, ``offload_dq``, "
        "``head_chunks`` and the memory callbacks' ``\"auto\"`` options): on a GPU, for a model whose config the "
        "planner reads, the fastest configuration that fits the GPU and the host memory, chosen per sequence length "
        "by the planner's search (docs/planner.md) and logged with its predicted peaks; elsewhere at most 65,536 "
        "global tokens per chunk and nothing offloaded."),
    "offload": (
        "keep the attention's q/k/v/out/lse chunks in pinned host memory between forward and backward; ``\"auto\"``: "
        "as ``chunks``."),
    "offload_dq": (
        "keep the backward's partial dQ sums (fp32, twice q's size) in host memory too; ``\"auto\"``: as ``chunks``."),
    "ring_size": (
        "ring ranks ``R`` of a Ulysses × ring sequence mesh (``sequence_parallel_size = U·R``, docs/ring.md), for "
        "more ranks than the heads allow; ``\"auto\"``: 1 when the heads allow ``sequence_parallel_size``, else the "
        "smallest ``R`` that works. With ``R > 1`` chunks are 1."),
    "attention_backend": "block attention kernel: ``\"auto\"``, ``\"cudnn\"``, ``\"flash\"`` or ``\"math\"``.",
    "head_chunks": (
        "head groups ``G``: each attention layer runs ``H/G`` query heads (and their kv heads) at a time, so its "
        "full-width q/k/v/out never exist at once (docs/head_chunks.md); ``G`` must divide the kv heads. ``1``: all "
        "heads at once. ``\"auto\"``: chosen at setup with the other ``\"auto\"`` options when the sequence length is "
        "known then (a data module's ``seq_len``) and the model's attention can be grouped, else 1 (always 1 under "
        "Fabric, whose groups are installed at ``fabric.setup``, before any length is known)."),
    "layer_classes": "class names of the transformer blocks (FSDP2 units); ``None``: the largest ``ModuleList``.",
    "memory_callbacks": (
        "``ActivationOffload``, ``TiledMLP``, ``TiledLoss``: their transforms applied in ``apply_fpdt``'s fixed "
        "order, before FSDP2; options left ``\"auto\"`` take the planner's choice for each length. Pass them here, "
        "not to ``Fabric(callbacks=...)``."),
    "cpu_offload_params": (
        "keep sharded parameters, gradients and optimizer state in host memory (FSDP2 ``CPUOffloadPolicy``), for "
        "models whose states do not fit the GPUs."),
    "host_step_in_backward": (
        "with ``cpu_offload_params``, step each parameter on the host as soon as its gradient lands there, during "
        "the backward (``strategy/host_optimizer.py``); with gradient clipping, several optimizers or one other than "
        "Adam, AdamW or SGD the step runs after the backward (a note says why)."),
    "device_step_in_backward": (
        "with the states on the GPU (no ``cpu_offload_params``), step each parameter as soon as FSDP2 has "
        "reduce-scattered its gradient, on that reduce-scatter's stream, beside the backward of the layers below; "
        "the same update, under the same conditions as ``host_step_in_backward``, from the second optimizer step on "
        "(the first allocates the optimizer's states and steps after the backward)."),
    "pad_to_multiple": (
        "right-pad sequences to a multiple of sequence_parallel_size × chunks (labels -100); ``False`` raises "
        "instead."),
    "nonfinite_loss": (
        "``\"raise\"`` stops training on every rank at the first NaN/inf loss, naming the step; ``\"ignore\"`` trains "
        "on (no check, no extra collective)."),
    "pad_token_id": "the token id used for that padding.",
    "save_distributed_checkpoint": (
        "save one shard per rank (DCP), with the checksums of its files, which a load verifies; ``False``: one "
        "consolidated file."),
    "process_group_backend": "``\"nccl\"``, ``\"gloo\"``, …; default by device.",
    "timeout": "collective timeout.",
    "heartbeat_timeout": (
        "seconds a rank's heartbeat may stand still before the rank counts as dead or frozen; the others then name "
        "it and end the job (``strategy/watchdog.py``). A long step never stops a heartbeat. ``None``: no watch (a "
        "frozen rank then holds the others for the collective ``timeout``)."),
    "check_memory": (
        "refuse, at setup (where the length is known then) or at a new sequence length, before anything of it is "
        "allocated, a run whose plan does not fit the GPU or the host, naming the change that fits; ``False`` warns "
        "instead and runs."),
    "preemption": (
        "on SIGTERM (and SLURM's requeue signal under ``SLURMEnvironment(auto_requeue=True)``) every rank stops after "
        "the same optimizer step, saves ``hpc_ckpt_<N>.ckpt`` in ``default_root_dir`` and exits with status ``128 + "
        "signal`` (``strategy/preemption.py``); ``False``: Lightning's own handling."),
    "preemption_timeout": (
        "seconds a rank may make no progress after a stop signal, beyond its longest step and checkpoint save so "
        "far, before it exits without a checkpoint (a peer hangs outside the collective)."),
    "offload_dir": (
        "a directory on a local disk for the disk tier (docs/design.md §4.4): the checkpointed block inputs of "
        "``ActivationOffload`` (and the attention's chunks when ``offload`` is on) that the host's memory cannot hold "
        "go to files there, written behind and read ahead; the planner counts its free space and its time and uses "
        "it only where host memory does not suffice. Each process writes under "
        "``<offload_dir>/fpdt-<host>-<pid>-rank<r>/``, removed at the end of training (under Fabric at "
        "``fabric.strategy.teardown()``) and at exit; directories a crash left are named at setup, not removed. A "
        "directory that cannot be created or written, or that has less free space than the plan puts there, is "
        "refused with the bytes; without a GPU, where nothing plans and nothing spills, one that cannot be used is a "
        "warning. ``None``: no disk tier."),
    "sync_every_batch": (
        "with ``Trainer(accumulate_grad_batches > 1)``: ``True`` reduce-scatters the gradients after every batch, "
        "into their shards (the memory of a step without accumulation, ``A - 1`` more reduce-scatters per optimizer "
        "step); ``False`` only after a window's last batch, the batches before it adding into every parameter's "
        "unsharded gradient, which waits on every GPU in the reduce dtype (fp32 under ``bf16-mixed``: 4 bytes per "
        "parameter, 32 GB for an 8B model, whatever the GPU count). ``\"auto\"``: the planner's choice per sequence "
        "length, the faster that fits by its cost model (``False`` where the unsharded gradients fit beside the rest "
        "as it is); ``False`` where nothing plans (no GPU, no model config the planner reads)."),
    "fused_ops": (
        "run the RMSNorms, RoPE and the gated MLPs' SiLU product (the reference Llama's, a Hugging Face family's "
        "norms and SiLU-gated MLPs), and the tiled loss's softmax and its gradient over each tile's logits, as one "
        "fused kernel per pass, compiled by ``torch.compile`` (``lightning_fpdt.fused``): the same formulas, several "
        "times fewer trips through device memory. ``\"auto\"``: on CUDA devices; ``False``: the eager forms. Where "
        "compiling fails the ops run eager, with one warning. Under the Trainer, unless ``False``, Adam and AdamW "
        "whose ``fused`` and ``foreach`` the module left unset step with torch's fused CUDA kernel where their "
        "parameters are on the GPU (the same update in one pass per tensor)."),
    "predict_outputs": (
        "what ``trainer.predict`` returns: ``\"sequence\"``, on every rank the outputs of the whole sequence, as one "
        "process returns them (each tensor of shape ``(B, S/P, …)`` that ``predict_step`` returns gathered from the "
        "sequence group into ``(B, S, …)``, the padding dropped); ``\"rank\"``, each rank's own shard, in the "
        "layout's token order (docs/design.md §3), padding included."),
    "plan_trial": (
        "where the fastest configurations that fit a new sequence length are within 10% of each other by the "
        "planner's step-time model, train its first steps on each in turn (one untimed step and two timed ones each) "
        "and keep the fastest for the rest of the run (``lightning_fpdt.planner.trial``, docs/planner.md); the choice "
        "is logged and kept with checkpoints. Every candidate computes the same gradients. On a GPU, for a model "
        "whose config the planner reads; ``False``: the planner's fastest estimate runs."),
}
"""Each option's meaning, by its keyword, whichever strategy takes it."""

T = TypeVar("T", bound=type)


def args_section(names: Sequence[str], width: int = 120) -> str:
    """The ``Args:`` section of a docstring (Google style, as LightningCLI reads it) for ``names``, in that order."""
    entries = [textwrap.fill(f"{name}: {OPTION_DOCS[name]}", width=width, initial_indent="    ",
                             subsequent_indent="        ", break_on_hyphens=False) for name in names]
    return "Args:\n" + "\n".join(entries)


def documented(cls: T) -> T:
    """A class decorator: the class's docstring followed by the ``Args:`` of every keyword option its constructor
    takes (:func:`args_section`); an option without a text in :data:`OPTION_DOCS` fails the import."""
    cls.__doc__ = inspect.cleandoc(cls.__doc__ or "") + "\n\n" + args_section(constructor_options(cls))
    return cls


def constructor_options(cls: type) -> list[str]:
    """The keyword options of ``cls``'s constructor, in their order (``**`` catch-alls left out)."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
