#!/usr/bin/env bash
# The test command: installs what is missing, checks the code with ruff (pyproject.toml's rules), then runs the unit
# and multi-process CPU tests (GPU tests skip without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
"${PYTHON:-python3}" -m ruff check .
exec "${PYTHON:-python3}" -m pytest -q --durations=20 "$@"
