"""``python3 -m bench.report``: see bench/report/__init__.py."""

import sys

from bench.report.page import main

if __name__ == "__main__":
    sys.exit(main())
