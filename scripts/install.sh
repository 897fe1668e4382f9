#!/usr/bin/env bash
# Installs lightning_fpdt and what its tests need into the current Python. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    # the pinned CPU build; an unpinned torch would pull a multi-GB CUDA build
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev,hf]"
