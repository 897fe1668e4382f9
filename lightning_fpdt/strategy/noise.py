"""Lightning's output that says nothing about a run, silenced where this package's runs produce it: from the
construction of a fpdt strategy on (:func:`quiet_lightning`; importing the package changes nothing), and at its setup
for the progress bar (:func:`steps_only_epochs`).

- Lightning's advertising (``💡 Tip: ... try installing litlogger`` / ``litmodels``) on every Trainer: dropped from
  Lightning's rank-zero logger, other messages untouched.
- ``isinstance(treespec, LeafSpec)`` is deprecated: Lightning 2.6's ``CombinedLoader`` builds a ``LeafSpec``, which
  torch 2.13 (what ``scripts/install.sh`` installs) deprecates; every rank printed it once per fit. Ignored by its
  message.
- ``Epoch 0/-2`` in Lightning's rich progress bar when ``max_steps`` alone bounds training (``max_epochs`` is then
  -1): the bar shows ``Epoch 0``.
"""

from __future__ import annotations

import logging
import warnings
from functools import partial
from typing import Any

from lightning.pytorch.callbacks import RichProgressBar

from lightning_fpdt.lightning_private import set_train_description

ADVERTISING = "💡 Tip:"
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _NoAdvertising(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTISING)


def quiet_lightning() -> None:
    """Drop Lightning's tips and its LeafSpec deprecation in this process (once; idempotent)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoAdvertising) for f in logger.filters):
            logger.addFilter(_NoAdvertising())
    warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)


def steps_only_epochs(trainer: Any) -> None:
    """With no epoch limit (``max_epochs`` -1), Lightning's rich progress bar prints ``Epoch 0/-2``: give the bars
    of this Trainer a description without the limit."""
    if trainer.max_epochs is not None and trainer.max_epochs >= 0:
        return
    for callback in trainer.callbacks:
        if isinstance(callback, RichProgressBar):
            set_train_description(callback, partial(_epoch_description, callback))


def _epoch_description(bar: RichProgressBar, current_epoch: int) -> str:
    description = f"Epoch {current_epoch}"
    # padded to the validation bar's description, as Lightning pads it, so the bars do not flicker
    return f"{description:{len(bar.validation_description)}}"
