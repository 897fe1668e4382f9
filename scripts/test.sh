#!/usr/bin/env bash
# The test command: installs what is missing, then runs the unit and multi-process CPU tests (GPU tests skip
# without CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" -m pytest -q --durations=20 "$@"
