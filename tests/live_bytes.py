"""Live tensor bytes on the CPU, op by op: a dispatch mode that stands in for ``torch.cuda.max_memory_allocated`` in
tests without a GPU, and says what was alive at the peak."""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_OWN_CODE = ("lightning_fpdt", "tests")


def _call_site(depth: int = 4) -> str:
    """The innermost ``depth`` frames of the package's or the tests' code, outermost first: ``file:line fn`` (not the
    dispatch modes' own ``__torch_dispatch__``)."""
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < depth:
        path = frame.f_code.co_filename
        own = any(f"/{part}/" in path for part in _OWN_CODE)
        if own and not path.endswith("live_bytes.py") and frame.f_code.co_name != "__torch_dispatch__":
            frames.append(f"{path.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(frames) or "?"


def _input_storages(args: Any, kwargs: Any) -> set[int]:
    """The storages of an op's tensor arguments, alone or in lists (``TensorList``), tuples and the keywords: what
    ``tree_flatten`` would find in them, without its cost on every op of a step."""
    ptrs, pending = set(), [args, kwargs]
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                ptrs.add(value.untyped_storage().data_ptr())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.values())
    return ptrs


@dataclass
class Allocation:
    """One storage counted by :class:`LiveBytes`: its bytes, the op that made it, where, and the tensor's shape."""

    nbytes: int
    op: str
    site: str
    shape: tuple[int, ...]
    dtype: torch.dtype


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage an op allocates under the mode until the storage is freed (a weakref
    finaliser on it); ``peak`` is the most alive at once, ``at_peak`` the allocations alive then, largest first.

    Only fresh outputs count: a view or an in-place result (an output the op's schema aliases to an input) and an
    output sharing an input's storage are the input's bytes. Storages alive before the mode are not counted.
    ``untracked()`` leaves out what is allocated inside it (host buffers, which a GPU's count would not see).
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.at_peak: list[Allocation] = []
        self.peak_op = self.peak_site = ""
        self._live: dict[int, Allocation] = {}
        self._paused = 0

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset_peak(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: the peak restarts from what is alive now."""
        self.peak, self.at_peak = self.current, sorted(self._live.values(), key=lambda a: -a.nbytes)

    def _free(self, ptr: int) -> None:
        self.current -= self._live.pop(ptr).nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        inputs = _input_storages(args, kwargs)
        returns = func._schema.returns
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for index, t in enumerate(outputs):
            aliased = index < len(returns) and returns[index].alias_info is not None
            if not isinstance(t, torch.Tensor) or aliased or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in inputs or ptr in self._live:
                continue
            self._live[ptr] = Allocation(nbytes, str(func), _call_site(), tuple(t.shape), t.dtype)
            weakref.finalize(storage, self._free, ptr)
            self.current += nbytes
            if self.current > self.peak:
                self.peak = self.current
                self.at_peak = sorted(self._live.values(), key=lambda a: -a.nbytes)
                self.peak_op, self.peak_site = str(func), self._live[ptr].site
        return out

    def report(self, top: int = 12, unit: int = 2**20) -> str:
        """The peak, the op that reached it and the largest allocations alive then (in MiB by default)."""
        lines = [f"peak {self.peak / unit:.1f} at {self.peak_op} ({self.peak_site})"]
        for a in self.at_peak[:top]:
            lines.append(f"  {a.nbytes / unit:8.1f}  {a.op:42s} {tuple(a.shape)} {a.dtype}  {a.site}")
        rest = sum(a.nbytes for a in self.at_peak[top:])
        if rest:
            lines.append(f"  {rest / unit:8.1f}  ({len(self.at_peak) - top} more)")
        return "\n".join(lines)
