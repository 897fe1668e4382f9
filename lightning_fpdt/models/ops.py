"""The fused ops' former place: ``lightning_fpdt.models.ops`` is :mod:`lightning_fpdt.fused.ops` itself (the same
module object), kept for the benchmark scripts that still import it by this name. Nothing in the package does."""

import sys

from lightning_fpdt.fused import ops

sys.modules[__name__] = ops
