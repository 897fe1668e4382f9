"""Memory transforms without Lightning and without model knowledge: tiled MLP, tiled cross-entropy, block
checkpointing with host offload, and the helpers that find blocks and MLPs (docs/design.md §6)."""

from lightning_fpdt.memory.block_offload import BlockCheckpoints, apply_block_offload, mlp_value_unused
from lightning_fpdt.memory.block_schedule import BlockOffloadOptions
from lightning_fpdt.memory.surgery import find_blocks, find_mlps, find_model, has_parameters
from lightning_fpdt.memory.tiled_loss import tiled_cross_entropy
from lightning_fpdt.memory.tiled_mlp import apply_tiled_mlp, tiled_mlp
from lightning_fpdt.memory.tiling import auto_loss_tiles, auto_mlp_tiles, check_num_tiles, tile_bounds

__all__ = [
    "BlockCheckpoints",
    "BlockOffloadOptions",
    "apply_block_offload",
    "apply_tiled_mlp",
    "auto_loss_tiles",
    "auto_mlp_tiles",
    "check_num_tiles",
    "find_blocks",
    "find_mlps",
    "find_model",
    "has_parameters",
    "mlp_value_unused",
    "tile_bounds",
    "tiled_cross_entropy",
    "tiled_mlp",
]
