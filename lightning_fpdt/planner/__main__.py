"""``python -m lightning_fpdt.planner ...``: the same as ``lightning-fpdt plan ...``."""

import sys

from lightning_fpdt.planner.cli import main

sys.exit(main())
