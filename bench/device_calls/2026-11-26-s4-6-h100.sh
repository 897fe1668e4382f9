#!/bin/bash
# session 4 GPU call 6 (one GPU): tests/gpu after the merge of the one-GPU memory cuts (recomputed block output freed,
# TiledMLP's skipped value a broadcast zero); fpdt at 1M with recompute and 4 head groups again (73.1 GiB before the
# cuts; the CPU count predicts 62.9 GiB, about 65 with its 3.7% shortfall)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t tests; timeout -s KILL 80 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -6
t fpdt-1m-g4; timeout -s KILL 300 python3 bench/peers.py --system fpdt --model llama3-8b --ballast auto --check-host --cpu-offload-params --layers 2 --steps 1 --seq-len 1048576 --recompute-attention --head-chunks 4 --out $OUT/peers-1gpu-fpdt.jsonl > $OUT/fpdt-1m.txt 2>&1; pkill -9 -f bench/peers.py; grep "RESULT\|Error" $OUT/fpdt-1m.txt | tail -3
t done
