"""The ("data_parallel", "sequence_parallel") device mesh (DESIGN.md §5), and its 2-D sequence form for the ring.

With ``ring_size = R > 1`` (more sequence-parallel ranks than the heads allow, docs/ring.md) the mesh is
``("data_parallel", "ring", "ulysses")``, row-major, so each Ulysses group (the bandwidth-heavy all-to-all) is ``U``
consecutive ranks inside a host and the ring (point-to-point, overlapped with compute) takes every ``U``-th rank;
``("ring", "ulysses")`` flattened is the sequence-parallel axis (:func:`sequence_mesh`; ring-major, as
:class:`SequenceLayout` numbers its ranks), so everything that reads that axis works unchanged.
"""

from __future__ import annotations

from typing import Optional, Union

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_fpdt.sequence.fpdt import check_heads
from lightning_fpdt.sequence.head_chunks import check_head_groups

MESH_AXES = ("data_parallel", "sequence_parallel")
RING_MESH_AXES = ("data_parallel", "ring", "ulysses")


def resolve_sizes(
    *,
    world_size: int,
    devices_per_node: int,
    data_parallel_size: Union[str, int],
    sequence_parallel_size: Union[str, int],
    heads: Optional[tuple[int, int]] = None,
    ring_size: Union[str, int] = "auto",
) -> tuple[int, int]:
    """``(dp, sp)`` from the options; ``"auto"`` sequence parallelism is the largest size within one node that the
    heads allow (the all-to-all wants NVLink) with ``ring_size`` ring ranks (``"auto"``: without a ring, so "auto"
    never turns the ring on by itself), ``"auto"`` data parallelism takes the rest. An explicit size is checked
    against the heads by :func:`resolve_ring_size`."""
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
            ring = ring_size if isinstance(ring_size, int) else 1
            candidates = [p for p in range(devices_per_node, 0, -1)
                          if world_size % p == 0 and devices_per_node % p == 0 and p % ring == 0]
            if not candidates:
                raise ValueError(
                    f"ring_size ({ring}) divides no sequence_parallel_size that divides both the world size "
                    f"{world_size} and the devices per node {devices_per_node}: give sequence_parallel_size "
                    f"explicitly (a ring may span hosts) or another ring_size"
                )
            sequence_parallel_size = next(
                (p for p in candidates if heads is None or _heads_allow(heads, p // ring)), candidates[-1]
            )
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
    resolve_ring_size(sequence_parallel_size=sequence_parallel_size, ring_size=ring_size, heads=heads)
    return data_parallel_size, sequence_parallel_size


def resolve_sequence_sizes(
    *,
    world_size: int,
    devices_per_node: int,
    data_parallel_size: Union[str, int],
    sequence_parallel_size: Union[str, int],
    ring_size: Union[str, int],
    heads: Optional[tuple[int, int]],
    head_chunks: int = 1,
) -> tuple[int, int, int]:
    """``(dp, sp, R)`` as the strategy runs them, and as the planner plans them: with ``head_chunks`` G > 1 each head
    group's ``H/G`` query and ``Hkv/G`` kv heads split over the ranks, so the sizes are resolved for one group's
    heads (:func:`check_head_groups` names the valid G first), and G is refused with a ring (not composed yet)."""
    if heads is not None and head_chunks > 1:
        explicit = sequence_parallel_size if isinstance(sequence_parallel_size, int) else 1
        check_head_groups(*heads, head_chunks, explicit)
        heads = (heads[0] // head_chunks, heads[1] // head_chunks)
    dp, sp = resolve_sizes(world_size=world_size, devices_per_node=devices_per_node,
                           data_parallel_size=data_parallel_size, sequence_parallel_size=sequence_parallel_size,
                           heads=heads, ring_size=ring_size)
    ring = resolve_ring_size(sequence_parallel_size=sp, ring_size=ring_size, heads=heads)
    if ring > 1 and head_chunks > 1:
        raise ValueError(f"head_chunks ({head_chunks}) is not composed with a ring (ring_size {ring}) yet: set "
                         f"head_chunks=1, or a sequence_parallel_size the head groups allow without a ring")
    return dp, sp, ring


def resolve_ring_size(
    *, sequence_parallel_size: int, ring_size: Union[str, int], heads: Optional[tuple[int, int]] = None
) -> int:
    """``R``: ring ranks of the 2-D sequence mesh (``P = U·R``, docs/ring.md).

    ``"auto"``: ``1`` (plain Ulysses/FPDT) when the heads allow ``P`` Ulysses ranks, else the smallest ``R`` whose
    ``U = P/R`` they allow (``H % U == 0`` and ``Hkv``, ``U`` dividing one another, as :func:`check_heads` says).
    An int is checked: it must divide ``P`` and leave a ``U`` the heads allow.
    """
    P = sequence_parallel_size
    if ring_size == "auto":
        if heads is None:
            return 1
        ring = next((r for r in range(1, P + 1) if P % r == 0 and _heads_allow(heads, P // r)), None)
        if ring is None:  # only when num_heads % num_kv_heads != 0: let check_heads say so
            check_heads(*heads, 1)
        return ring
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 1:
        raise ValueError(f"ring_size must be 'auto' or a positive int, got {ring_size!r}")
    if P % ring_size:
        raise ValueError(
            f"ring_size ({ring_size}) does not divide sequence_parallel_size ({P}): the sequence-parallel ranks are "
            f"ring_size x ulysses ranks; use a ring_size in {[r for r in range(1, P + 1) if P % r == 0]}"
        )
    if heads is not None:
        try:
            check_heads(*heads, P // ring_size)
        except ValueError as error:
            allowed = [r for r in range(1, P + 1) if P % r == 0 and _heads_allow(heads, P // r)]
            raise ValueError(
                f"sequence_parallel_size ({P}) / ring_size ({ring_size}) = {P // ring_size} Ulysses ranks: {error}; "
                f"ring sizes the heads allow: {allowed} (or ring_size='auto')"
            ) from error
    return ring_size


def _heads_allow(heads: tuple[int, int], sp_size: int) -> bool:
    try:
        check_heads(*heads, sp_size)
    except ValueError:
        return False
    return True


def build_mesh(
    device_type: str, data_parallel_size: int, sequence_parallel_size: int, ring_size: int = 1
) -> DeviceMesh:
    """2-D mesh, row-major, so the ranks of a sequence-parallel group are consecutive (inside one host); with a ring,
    the 3-D ``(data_parallel, ring, ulysses)`` mesh (:func:`sequence_mesh` gives its sequence-parallel axis)."""
    if ring_size == 1:
        return init_device_mesh(device_type, (data_parallel_size, sequence_parallel_size), mesh_dim_names=MESH_AXES)
    shape = (data_parallel_size, ring_size, sequence_parallel_size // ring_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=RING_MESH_AXES)


def sequence_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D sequence-parallel mesh: the ``"sequence_parallel"`` axis, or ``("ring", "ulysses")`` flattened
    (ring-major, the rank order of :class:`SequenceLayout`; torch returns the same mesh on every call)."""
    if ring_size_of(mesh) == 1:
        return mesh["sequence_parallel"]
    return mesh[RING_MESH_AXES[1:]]._flatten("sequence_parallel")


def ring_size_of(mesh: DeviceMesh) -> int:
    """``R`` of a mesh :func:`build_mesh` made (1 without a ring axis)."""
    return mesh["ring"].size() if "ring" in (mesh.mesh_dim_names or ()) else 1


def attention_group(mesh: DeviceMesh) -> Union[ProcessGroup, tuple[ProcessGroup, ProcessGroup]]:
    """What the attention takes as ``group``: the sequence-parallel group, or ``(ulysses_group, ring_group)``."""
    if ring_size_of(mesh) == 1:
        return mesh["sequence_parallel"].get_group()
    return mesh["ulysses"].get_group(), mesh["ring"].get_group()


def flat_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every rank that FSDP2 shards parameters across (data × sequence)."""
    return mesh[mesh.mesh_dim_names]._flatten("data_sequence")
