"""Where tensors wait off the GPU: page-locked host memory and its guard (``host_memory``), the chunk stashes and their
buffer pools (``host_stash``), and the disk tier under them (``disk/``). Plain PyTorch, no Lightning, nothing of the
package below it: the sequence-parallel core and the memory transforms put their chunks here (docs/design.md §2)."""
