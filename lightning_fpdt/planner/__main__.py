"""``python -m lightning_fpdt.planner ...``: the same as ``lightning-fpdt plan ...``."""

import sys

from lightning_fpdt.planner.commands import main

sys.exit(main())
