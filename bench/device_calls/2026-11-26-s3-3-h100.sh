#!/bin/bash
# session 3 GPU call 3 (one GPU): GPU tests, the tiled loss/MLP memory with the new loss tiles (planner calibration),
# fpdt at 1M tokens on one GPU (issue 8 #7)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t tests; timeout -s KILL 150 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -8
t tiles; timeout -s KILL 90 python3 bench/memory_tiles.py --skip-untiled-mlp > $OUT/memory_tiles.txt 2>&1; tail -12 $OUT/memory_tiles.txt
t fpdt-1M; timeout -s KILL 300 python3 bench/peers.py --system fpdt --model llama3-8b --ballast auto --check-host --cpu-offload-params --layers 2 --seq-len 1048576 --steps 1 --recompute-attention --out $OUT/peers-1gpu-fpdt.jsonl > $OUT/fpdt-1gpu-1m.txt 2>&1; grep "RESULT\|Error" $OUT/fpdt-1gpu-1m.txt | tail -2
t done
