"""The optimizer step on host-resident states (``cpu_offload_params=True``).

FSDP2's ``CPUOffloadPolicy`` keeps the sharded fp32 parameters, their gradients and the optimizer states in host
memory, so the optimizer step runs on the CPU. Two defaults make that step slow:

- torch's Adam and AdamW run their per-tensor loop on CPU tensors (``foreach`` is the default on CUDA only): about ten
  passes over memory per parameter tensor, one for each elementwise op;
- ``torchrun`` starts every process with ``OMP_NUM_THREADS=1``, so those passes run on one core.

:func:`fuse_host_optimizers` switches Adam and AdamW to torch's fused CPU kernel (one vectorised pass per tensor, the
same update), where the user left both ``fused`` and ``foreach`` unset; with states on the GPU the strategy does the
same with the CUDA kernel (:func:`fuse_optimizers`, unless ``fused_ops=False``). :func:`host_step` runs the
optimizer's own arithmetic on every core of this rank's share of the host (:func:`host_threads`), and the closure it
calls (forward and backward, which only launch GPU work) with the thread count it had.

:class:`InBackwardStep` goes further: it steps each parameter on the host as soon as FSDP2 has reduce-scattered its
gradient and copied it to host memory, during the backward, on a worker thread, while the GPU computes the gradients
of the layers below. After the backward only the parameters whose gradients came last (the embedding's) are left to
step. It needs an update that treats every parameter on its own (Adam, AdamW, SGD) and nothing that changes the
gradients after the backward: :func:`in_backward_refusal` names what stands in the way.

With the states where the model trains (the GPU) the same class steps each parameter inside FSDP2's gradient hook, on
the stream that hook runs on: the reduce-scatter's, after the gradient and before the event the backward's end waits
for. The update then runs beside the backward of the layers below instead of after the last reduce-scatter
(:func:`prepare_device_step`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_pre_hooks  # torch.optim.register_optimizer_step_pre_hook's
from torch.utils.hooks import RemovableHandle

FUSABLE = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers with a fused CPU kernel in torch whose update is the per-tensor loop's."""
PER_PARAMETER = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""Optimizers whose update of a parameter reads only that parameter, its gradient and its state: a step over some of
the parameters, then over the others, is one step over all of them."""


def host_threads(local_world_size: int) -> int:
    """Cores this rank may use: the process's CPU affinity shared by the ranks of its host (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world_size))


def fuse_optimizers(optimizers: Iterable[torch.optim.Optimizer], device_type: str) -> list[str]:
    """Turn on ``fused`` in the groups of Adam and AdamW whose parameters are all floating point on ``device_type``
    (``"cpu"``: host-resident states; ``"cuda"``) and that left ``fused`` and ``foreach`` unset; return a description
    of each optimizer left as it was. torch's fused kernel makes one pass over a tensor's parameter, gradient and two
    moments where the per-tensor loop makes about ten and ``foreach`` about eight (one per elementwise op)."""
    left: list[str] = []
    for optimizer in optimizers:
        name = type(optimizer).__name__
        if type(optimizer) not in FUSABLE:
            left.append(f"{name} (torch has no fused step for it)")
            continue
        for index, group in enumerate(optimizer.param_groups):
            if group.get("fused") is not None or group.get("foreach") is not None:
                left.append(f"{name} group {index} (fused={group.get('fused')}, foreach={group.get('foreach')} set)")
                continue
            if group.get("differentiable") or group.get("capturable"):
                left.append(f"{name} group {index} (differentiable or capturable)")
                continue
            if any(p.device.type != device_type or not p.is_floating_point() for p in group["params"]):
                left.append(f"{name} group {index} (parameters not all floating point on {device_type})")
                continue
            group["fused"] = True
    return left


def fuse_host_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> list[str]:
    """:func:`fuse_optimizers` of the groups whose parameters are all in host memory."""
    return fuse_optimizers(optimizers, "cpu")


def prepare_host_optimizers(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    """:func:`fuse_host_optimizers`, with a warning (rank 0) naming what keeps torch's per-tensor loop."""
    left = fuse_host_optimizers(optimizers)
    if left:
        rank_zero_warn(f"fpdt: cpu_offload_params: the optimizer step on the host runs torch's per-tensor loop for "
                       f"{', '.join(left)}; Adam or AdamW with `fused` and `foreach` unset step with the fused CPU "
                       "kernel, several times faster")


@contextmanager
def num_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``count`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def host_step(step: Callable[[Optional[Callable[[], Any]]], Any], closure: Optional[Callable[[], Any]],
              threads: int) -> Any:
    """``step(closure)`` with ``threads`` intra-op threads for the optimizer's arithmetic; the closure, which the
    optimizer calls first (forward and backward), runs with the count the process had."""
    before = torch.get_num_threads()
    if threads == before:
        return step(closure)
    if closure is None:
        with num_threads(threads):
            return step(closure)

    def closure_as_before() -> Any:
        with num_threads(before):
            return closure()

    with num_threads(threads):
        return step(closure_as_before)


def prepare_host_step(optimizers: Sequence[torch.optim.Optimizer], trainer: Any, *, in_backward: bool,
                      threads: int, replaces: Optional["InBackwardStep"] = None) -> Optional["InBackwardStep"]:
    """Fuse what can be fused (:func:`prepare_host_optimizers`); with ``in_backward``, the :class:`InBackwardStep`
    of the one optimizer, its worker on all but one of ``threads`` (the other feeds the GPU), or ``None`` with a
    note naming what keeps the step after the backward. ``replaces``: the one of an earlier fit, closed first."""
    if replaces is not None:
        replaces.close()
    prepare_host_optimizers(optimizers)
    return _in_backward_step(optimizers, trainer, in_backward, threads - 1, "cpu_offload_params: ")


def prepare_device_step(optimizers: Sequence[torch.optim.Optimizer], trainer: Any, *, in_backward: bool,
                        replaces: Optional["InBackwardStep"] = None) -> Optional["InBackwardStep"]:
    """With the states on the device the model trains on: the :class:`InBackwardStep` of the one optimizer, stepping
    each parameter in FSDP2's gradient hook, or ``None`` (``in_backward`` off, or a note naming what keeps the step
    after the backward). ``replaces``: the one of an earlier fit, closed first."""
    if replaces is not None:
        replaces.close()
    return _in_backward_step(optimizers, trainer, in_backward, None, "")


def _in_backward_step(optimizers: Sequence[torch.optim.Optimizer], trainer: Any, in_backward: bool,
                      threads: Optional[int], where: str) -> Optional["InBackwardStep"]:
    if not in_backward:
        return None
    refusal = in_backward_refusal(optimizers, trainer)
    if refusal is not None:
        rank_zero_info(f"fpdt: {where}the parameters step after the backward, not during it: {refusal}")
        return None
    return InBackwardStep(optimizers[0], threads)


def in_backward_refusal(optimizers: Sequence[torch.optim.Optimizer], trainer: Any) -> Optional[str]:
    """Why the parameters cannot step during the backward (``None``: they can): the step must be one per-parameter
    update of one optimizer, and nothing may read all gradients before it (clipping) or change them."""
    if len(optimizers) != 1:
        return f"{len(optimizers)} optimizers (it steps one)"
    optimizer, module = optimizers[0], trainer.lightning_module
    if type(optimizer) not in PER_PARAMETER:
        return f"{type(optimizer).__name__} (it steps {', '.join(c.__name__ for c in PER_PARAMETER)})"
    if any(group.get("differentiable") or group.get("capturable") for group in optimizer.param_groups):
        return "a differentiable or capturable optimizer"
    if not module.automatic_optimization:
        return "manual optimization (the backward runs outside the optimizer step)"
    if trainer.gradient_clip_val or is_overridden("configure_gradient_clipping", module):
        return "gradient clipping (it needs every gradient before any parameter steps)"
    readers = [type(c).__name__ for c in [module, *trainer.callbacks] if is_overridden("on_before_optimizer_step", c)]
    if readers:
        return f"on_before_optimizer_step of {', '.join(readers)} (it may change gradients that have already stepped)"
    if optimizer._optimizer_step_pre_hooks or _global_optimizer_pre_hooks:
        return "an optimizer step pre-hook (it may change gradients that have already stepped)"
    return None


def copy_done_event() -> Optional[torch.cuda.Event]:
    """An event on the current CUDA stream: recorded in FSDP2's gradient hook, it completes when the gradient's copy
    to host memory, queued on that stream, has landed; ``None`` without CUDA (CPU copies are synchronous)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_stream().record_event()
    return None


@contextmanager
def hidden_grads(params: Sequence[Tensor]) -> Iterator[None]:
    """``params`` without gradients inside (an optimizer step skips them), their gradients back after."""
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


class InBackwardStep:
    """Steps one optimizer's parameters during the backward, each as its gradient arrives.

    FSDP2 calls a sharded parameter's post-accumulate-grad hooks once its gradient is reduce-scattered (and, with
    host-resident states, queued for the copy to host memory). While a step runs (:meth:`run`) the hook steps that
    parameter alone: a shallow copy of the optimizer (the same state, no step hooks) whose groups hold just it. With
    host-resident states (``threads``: the worker's intra-op threads) a worker thread takes the parameter, waits for
    the copy and steps it; with the states on the device (``threads=None``) the hook steps it itself, on the stream
    FSDP2 runs the hook on: after the reduce-scatter that made the gradient, before the event the backward's end
    waits for. After the backward :meth:`run` waits for the worker and calls the optimizer's own step, with its hooks,
    over the parameters the backward did not hand over, the others' gradients hidden from it. Outside :meth:`run`
    (validation, the batches of an accumulation window before its last, which reduce-scatter only with
    ``sync_every_batch`` and then add into the gradients) the hooks do nothing; so they do in a step whose optimizer
    has no state yet (the first), which then steps after the backward: its states are allocated on the default
    stream, not on the reduce-scatter's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, threads: Optional[int]) -> None:
        self.optimizer = optimizer
        self._executor = None if threads is None else ThreadPoolExecutor(
            1, thread_name_prefix="fpdt-host-step", initializer=torch.set_num_threads, initargs=(max(1, threads),))
        self._pending: list[Future] = []
        self._landed: list[Tensor] = []
        self._shadow: Optional[torch.optim.Optimizer] = None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]  # frozen: none
        self._handles: list[RemovableHandle] = [p.register_post_accumulate_grad_hook(self._hand_over) for p in params]

    @property
    def stepped_in_backward(self) -> int:
        """Parameters the last step updated during its backward."""
        return len(self._landed)

    def run(self, closure: Callable[[], Any], threads: int) -> Any:
        """``closure()`` (forward, backward, and what runs before the optimizer step) with the parameters stepping
        as their gradients land, then the optimizer's step over the rest with ``threads`` intra-op threads."""
        self._landed, self._pending = [], []
        if self._executor is not None or self.optimizer.state:
            self._shadow = copy.copy(self.optimizer)  # shares the state; Optimizer.__getstate__ leaves the hooks out
        try:
            with torch.enable_grad():  # as the optimizer's own step runs its closure
                result = closure()
        finally:
            self._shadow = None  # the hooks stop handing over; the queued steps hold their own reference
            for future in self._pending:
                future.result()  # re-raises the worker's error
        with hidden_grads(self._landed), num_threads(threads):
            self.optimizer.step()
        return result

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def _hand_over(self, param: Tensor) -> None:
        if self._shadow is None or param.grad is None:
            return
        self._landed.append(param)
        if self._executor is None:
            self._step(self._shadow, param, None)
        else:
            self._pending.append(self._executor.submit(self._step, self._shadow, param, copy_done_event()))

    def _step(self, shadow: torch.optim.Optimizer, param: Tensor, copied: Optional[torch.cuda.Event]) -> None:
        if copied is not None:
            copied.synchronize()
        shadow.param_groups = [{**group, "params": [p for p in group["params"] if p is param]}
                               for group in self.optimizer.param_groups]
        shadow.step()
