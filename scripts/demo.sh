#!/usr/bin/env bash
# The demo: installs what is missing, then trains a tiny Llama with strategy "fpdt" on 2 CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec "${PYTHON:-python3}" examples/train_tiny_cpu.py
