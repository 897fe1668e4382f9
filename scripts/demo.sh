#!/usr/bin/env bash
# The demo: installs what is missing, then trains a tiny Llama on long-context key-value retrieval with strategy
# "fpdt" (examples/configs/demo_cpu.yaml): the sequence split over 2 CPU processes (gloo), 2 FPDT chunks per rank,
# TensorBoard logs in lightning_logs/demo. With CUDA GPUs it uses all of them instead (bf16-mixed).
# Extra arguments go to `lightning-fpdt fit`, e.g. --trainer.max_steps 100.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
ARGS=()
# the 2 CPU processes share the cores (oversubscribed threads only slow them); on GPUs it does not matter
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) > 3 ? $(nproc) / 2 : 1 ))}
if "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    ARGS=(--trainer.accelerator gpu --trainer.devices -1 --trainer.precision bf16-mixed)
fi
# python -m rather than the lightning-fpdt script: pip's script folder is not always on PATH
exec "$PY" -m lightning_fpdt.cli fit --config examples/configs/demo_cpu.yaml ${ARGS[@]+"${ARGS[@]}"} "$@"
