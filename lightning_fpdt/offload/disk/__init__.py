"""A disk tier under the host stash: entries spill to files once the host memory given to the stash is spoken for.

The life cycle is :class:`~lightning_fpdt.offload.host_stash.ChunkStash`'s (``put``, ``prefetch``, ``get``,
``release``, ``free``; misuse raises ``RuntimeError``). A :class:`DiskStash` keeps an entry in the host buffer pool
while the pool's bytes stay within :attr:`DiskTier.host_budget_bytes` (an idle buffer of the entry's size is reused
at no cost); past that, the entry goes to a file:

- ``put`` hands the tensor to a writer thread and returns. The thread streams it to the file through its staging
  buffers, a piece at a time: the device-to-host copy of a piece (on the copy stream, after a CUDA event of the compute
  stream recorded by ``put``) overlaps the write of the piece before (``os.pwrite``; each piece's pages are pushed to
  the disk and dropped from the page cache, ``sync_file_range`` and ``POSIX_FADV_DONTNEED``: the spilled bytes must
  not stay in host memory, the memory the tier exists to spare). The write holds the tensor until its last piece is
  copied; a ``put`` to disk first waits for the write before it, so a written-behind tensor outlives its block's
  forward only where the disk is slower than that forward (the time the planner counts), never into the next one.
- ``prefetch`` allocates the device copy (on the host-to-device stream, as :class:`HostStash`) and hands the entry to
  a reader thread, which reads the file a piece at a time into its staging buffers (``os.preadv``) and issues each
  piece's host-to-device copy on that stream, recording an event; the read of a piece overlaps the copy of the piece
  before. ``get`` waits for the read and makes the compute stream wait for the last event.
- ``free`` removes the file: its space is free again at once.

Staging buffers (:class:`StagingBuffers`) are each thread's own: :data:`STAGING_DEPTH` buffers of
``min(piece_bytes, the largest entry)`` (anonymous mappings registered with CUDA, ``host_memory.HostAllocator``), so
the tier's host memory does not grow with the entry: a 12 GiB block input streams through four 256 MiB buffers
(:data:`STAGING_PIECE_BYTES`), not two copies of itself. On CPU the same threads, files and buffers run with plain
tensors and no streams, so the tests cover the logic.

Files. One file per entry (``<serial>.bin``) in one directory per process, ``<offload_dir>/fpdt-<host>-<pid>-rank<r>/``
(:class:`SpillDirectory`): freeing an entry unlinks its file, so the space comes back at once without bookkeeping of
holes, and a file's size says whether it is whole. Every entry is freed by the end of a step (and a stash's ``clear``
frees what is left); the directory is removed at exit (``atexit``) and by the strategy's teardown. A crash leaves it:
:func:`stale_directories` finds the directories of processes of this host that are no longer alive, for the
strategy to name; nothing removes them but the user (a pid test cannot prove that a directory on a shared file system
is unused, and removing a live process's files would corrupt its step).

Errors. A failed write, a file shorter or longer than what was written, or a short read raise :class:`DiskTierError`
naming the file and the bytes, never garbage. A background failure is kept and raised again by the next ``put``,
``prefetch``, ``get`` or ``clear`` of any stash on the directory: once a write failed, nothing the tier holds is
trusted.
"""

from lightning_fpdt.offload.disk.directory import (
    DIRECTORY_PATTERN,
    DiskTierError,
    StaleDirectory,
    check_free_space,
    directory_name,
    prepare_offload_dir,
    stale_directories,
)
from lightning_fpdt.offload.disk.files import SpillDirectory
from lightning_fpdt.offload.disk.staging import (
    STAGING_DEPTH,
    STAGING_PIECE_BYTES,
    STAGING_THREADS,
    Staging,
    StagingBuffers,
    staging_bytes,
)
from lightning_fpdt.offload.disk.stash import DiskStash, DiskTier

__all__ = [
    "DIRECTORY_PATTERN",
    "DiskStash",
    "DiskTier",
    "DiskTierError",
    "STAGING_DEPTH",
    "STAGING_PIECE_BYTES",
    "STAGING_THREADS",
    "SpillDirectory",
    "Staging",
    "StagingBuffers",
    "StaleDirectory",
    "check_free_space",
    "directory_name",
    "prepare_offload_dir",
    "staging_bytes",
    "stale_directories",
]
