"""Every attribute lightning_fpdt sets on a user's modules, listed once.

The strategy changes a user's model in place (docs/design.md §5). These are all the names it writes, who writes them
and on which module; nothing else of a user module is touched. ``forward`` is replaced on the modules named in
:data:`FORWARD`'s docstring, always by :func:`lightning_fpdt.memory.forwards.replace_forward`, which keeps the original
as ``__wrapped__``. The memory transforms below this
package define their one marker themselves (:data:`TILED_MLP`); it is listed here with the rest.
"""

from lightning_fpdt.memory.tiled_mlp import TILED_MLP  # noqa: F401  (marks an MLP whose forward runs over token tiles)

ATTENTION_FN = "attention_fn"
"""The reference Llama's ``LlamaAttention`` hook, pointed at a ``LayerAttention`` (reference_llama.py)."""
ATTENTION_HANDLE = "_fpdt_attention"
"""The installed attention handle (``LayerAttention`` or ``HeadGroupedAttention``) of a Hugging Face attention
module, of a head-grouped attention module, or of a block whose SDPA calls are intercepted; read back by
:func:`lightning_fpdt.integrations.context.installed_attentions`."""
REDUCE_LOSS = "fpdt_reduce_loss"
"""On the causal LM (reference Llama, Hugging Face): ``reduce(local_mean, num_valid) -> group mean``, which the
installed loss and a tiled loss call."""
LOCAL_LOSS = "fpdt_local_loss"
"""On the reference Llama: its local token-mean loss (the model's own ``loss``, or the tiled one under TiledLoss),
looked up at call time by the installed ``loss``."""
LOSS = "loss"
"""The reference Llama's loss method, replaced by one that reduces ``fpdt_local_loss`` over the group."""
LOSS_FUNCTION = "loss_function"
"""A Hugging Face model's loss function, replaced by the sequence-parallel token mean of pre-shifted labels."""
ROUTER_LOSS = "fpdt_router_loss"
"""On a Hugging Face mixture of experts: ``loss(router_logits)``, its load-balancing loss over the sequence group,
which its installed forward and a tiled loss call (families/router_loss.py)."""
LABELS_ARE_SHIFTED = "labels_are_shifted"
"""The reference Llama's own switch, set True: the strategy shifts labels on the global sequence."""
DOCUMENTS_FROM_POSITIONS = "documents_from_positions"
"""The reference Llama's own switch, set False: the strategy finds packed documents on the global batch."""
FORWARD = "forward"
"""Replaced on: head-grouped attention modules (head_groups.py), blocks whose SDPA calls are intercepted (sdpa.py),
a Hugging Face causal LM under TiledLoss or with a mixture of experts' load-balancing loss, its RMSNorms and its
SiLU-gated MLPs (huggingface.py), an untied output head under TiledLoss
(head_loss.py), checkpointed blocks
(``lightning_fpdt.memory.block_offload``) and tiled MLPs (``lightning_fpdt.memory.tiled_mlp``)."""
TILED_LOSS = "_fpdt_tiled_loss"
"""Marks a causal LM whose loss TiledLoss switched (idempotence: fit then validate)."""
HEAD_LOSS = "_fpdt_head_loss"
"""Marks an untied output head (``lm_head``) whose forward computes the tiled loss when given targets
(head_loss.py); under ``cpu_offload_params`` the strategy makes it an FSDP2 unit of its own."""
TILED_NORM = "_fpdt_tiled_norm"
"""Marks a Hugging Face RMSNorm whose forward runs over token tiles."""
FUSED_MLP = "_fpdt_fused_mlp"
"""Marks a Hugging Face SiLU-gated MLP whose product runs through ``lightning_fpdt.fused.ops.swiglu``."""
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
"""Replaced on a LightningModule that holds the network's parts itself (nanoGPT style) and so is FSDP2's root unit:
wrapped by ``torch.distributed.fsdp.register_fsdp_forward_method``, so each step gathers the root's parameters as a
forward would (``lightning_fpdt.strategy.parallelize``)."""
LOCAL_ATTENTION = "_fpdt_local_attention"
"""Marks a module the user declared to attend within each rank's tokens on purpose
(``lightning_fpdt.allow_local_attention``): the attention check (audit.py) skips it and what it holds."""
ATTENTION_AUDIT = "_fpdt_attention_audit"
"""On the LightningModule (or Fabric's model): the :class:`~lightning_fpdt.integrations.audit.AttentionAudit` that
checks the first forward of its blocks and attention-like modules."""
APPLIED = "_fpdt_applied"
"""Marks the LightningModule ``apply_fpdt`` made sequence-parallel (idempotence)."""
DEVICE_MESH = "_device_mesh"
"""Lightning's own attribute of a LightningModule (``self.device_mesh``), set to the strategy's mesh."""
