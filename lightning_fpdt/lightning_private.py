"""Lightning's private names this package uses, in this one place, each with what it is and where it is used.

None is Lightning's public API: a Lightning release that renames or moves one breaks here, and only here. Beside
these, ``FPDTStrategy`` reads and sets state it inherits from ``ModelParallelStrategy``: ``_setup_distributed()``
(process group init, in ``setup_environment``), ``_data_parallel_size`` and ``_device_mesh`` (the mesh it builds in
place of the parent's), ``_precision_plugin`` (its ``precision_plugin`` property) and
``_save_distributed_checkpoint`` (the constructor's option, in ``save_checkpoint``); and it overrides
``Strategy._setup_model``, the hook of ``Strategy.setup`` where a strategy wraps the model (its FPDT steps:
``apply_fpdt``, a meta model allocated, the host guard and the disk tier). ``FPDTFabricStrategy`` likewise reads and
sets what it inherits from Fabric's ``ModelParallelStrategy``: ``_setup_distributed()`` (in ``setup_environment``),
``_data_parallel_size`` and ``_device_mesh`` (its own mesh), ``_precision`` (its ``precision`` property) and
``_save_distributed_checkpoint`` (in ``save_checkpoint``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

# allocates a module's meta parameters on a device and runs each submodule's reset_parameters
# (strategy/materialize.py, for models without a reset_parameters of their own)
from lightning.fabric.utilities.init import _materialize_distributed_module  # noqa: F401

# "meta.pt": the file of a distributed checkpoint that holds its non-tensor state
# (strategy/checkpoint.py checks it is there; export.py reads it)
from lightning.fabric.utilities.load import _METADATA_FILENAME  # noqa: F401


def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning gives the metrics logged in the current batch (``callbacks/mfu.py`` logs at it, so its
    curves line up with the losses)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def wrapped_closure(precision: Any, model: Any, optimizer: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """The precision plugin's closure around ``closure`` (gradient clipping, the backward's hooks), which
    ``Precision.optimizer_step`` builds before stepping: the in-backward host step runs it itself
    (``strategy/trainer.py``)."""
    return partial(precision._wrap_closure, model, optimizer, closure)


def set_train_description(bar: Any, describe: Callable[[int], str]) -> None:
    """Replace how Lightning's rich progress bar names the training epoch (``strategy/noise.py``)."""
    bar._get_train_description = describe


def evaluate_under_no_grad(trainer: Any) -> None:
    """Run the Trainer's evaluation and prediction loops (Lightning's private loop classes) under ``no_grad`` instead
    of ``inference_mode``, where DTensor parameters do not work (``strategy/trainer.py``, at setup)."""
    loops = (trainer.validate_loop, trainer.test_loop, trainer.predict_loop, trainer.fit_loop.epoch_loop.val_loop)
    for loop in loops:
        loop.inference_mode = False
