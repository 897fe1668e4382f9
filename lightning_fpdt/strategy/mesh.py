"""The ("data_parallel", "sequence_parallel") device mesh (DESIGN.md §5)."""

from __future__ import annotations

from typing import Optional, Union

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fpdt.sequence.fpdt import check_heads

MESH_AXES = ("data_parallel", "sequence_parallel")


def resolve_sizes(
    *,
    world_size: int,
    devices_per_node: int,
    data_parallel_size: Union[str, int],
    sequence_parallel_size: Union[str, int],
    heads: Optional[tuple[int, int]] = None,
) -> tuple[int, int]:
    """``(dp, sp)`` from the options; ``"auto"`` sequence parallelism is the largest size within one node that the
    heads allow (the all-to-all wants NVLink), ``"auto"`` data parallelism takes the rest."""
    for name, value in (("data_parallel_size", data_parallel_size), ("sequence_parallel_size", sequence_parallel_size)):
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be 'auto' or a positive int, got {value!r}")
    if sequence_parallel_size == "auto":
        if data_parallel_size != "auto":
            if world_size % data_parallel_size:
                raise ValueError(
                    f"data_parallel_size ({data_parallel_size}) does not divide the world size {world_size}"
                )
            sequence_parallel_size = world_size // data_parallel_size
        else:
            candidates = [p for p in range(devices_per_node, 0, -1) if world_size % p == 0 and devices_per_node % p == 0]
            sequence_parallel_size = next((p for p in candidates if heads is None or _heads_allow(heads, p)), 1)
    if data_parallel_size == "auto":
        if world_size % sequence_parallel_size:
            raise ValueError(
                f"sequence_parallel_size ({sequence_parallel_size}) does not divide the world size {world_size}"
            )
        data_parallel_size = world_size // sequence_parallel_size
    if data_parallel_size * sequence_parallel_size != world_size:
        raise ValueError(
            f"sequence_parallel_size ({sequence_parallel_size}) * data_parallel_size ({data_parallel_size}) = "
            f"{sequence_parallel_size * data_parallel_size} != world size {world_size}"
        )
    if heads is not None:
        check_heads(*heads, sequence_parallel_size)
    return data_parallel_size, sequence_parallel_size


def _heads_allow(heads: tuple[int, int], sp_size: int) -> bool:
    try:
        check_heads(*heads, sp_size)
    except ValueError:
        return False
    return True


def build_mesh(device_type: str, data_parallel_size: int, sequence_parallel_size: int) -> DeviceMesh:
    """2-D mesh, row-major, so the ranks of a sequence-parallel group are consecutive (inside one host)."""
    return init_device_mesh(device_type, (data_parallel_size, sequence_parallel_size), mesh_dim_names=MESH_AXES)


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every rank that FSDP2 shards parameters across (data × sequence)."""
    return mesh[MESH_AXES]._flatten("data_sequence")
