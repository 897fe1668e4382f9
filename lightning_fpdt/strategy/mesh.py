"""The ("data_parallel", "sequence_parallel") device mesh (docs/design.md §5), and its 2-D sequence form for the ring.

With ``ring_size = R > 1`` (more sequence-parallel ranks than the heads allow, docs/ring.md) the mesh is
``("data_parallel", "ring", "ulysses")``, row-major, so each Ulysses group (the bandwidth-heavy all-to-all) is ``U``
consecutive ranks inside a host and the ring (point-to-point, overlapped with compute) takes every ``U``-th rank;
``("ring", "ulysses")`` flattened is the sequence-parallel axis (:func:`sequence_mesh`; ring-major, as
:class:`SequenceLayout` numbers its ranks), so everything that reads that axis works unchanged. The sizes come from
:mod:`lightning_fpdt.sequence.sizes`.
"""

from __future__ import annotations

from typing import Union

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES = ("data_parallel", "sequence_parallel")
RING_MESH_AXES = ("data_parallel", "ring", "ulysses")


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


class MeshSizes:
    """The sizes, rank and groups a strategy reads from its ``device_mesh`` (:func:`build_mesh`): the Trainer's and
    Fabric's strategies alike."""

    device_mesh: DeviceMesh

    @property
    def sequence_parallel_size(self) -> int:
        return sequence_mesh(self.device_mesh).size()

    @property
    def ring_size(self) -> int:
        """``R``: ring ranks of the sequence mesh (1: plain Ulysses/FPDT)."""
        return ring_size_of(self.device_mesh)

    @property
    def data_parallel_size(self) -> int:
        return self.device_mesh["data_parallel"].size()

    @property
    def sequence_parallel_rank(self) -> int:
        return sequence_mesh(self.device_mesh).get_local_rank()

    @property
    def sequence_parallel_group(self) -> ProcessGroup:
        return sequence_mesh(self.device_mesh).get_group()
