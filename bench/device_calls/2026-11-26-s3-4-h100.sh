#!/bin/bash
# session 3 GPU call 4 (one GPU): fpdt at 768K tokens on one H100 (issue 8 #7), GPU memory bound
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t fpdt-768K; timeout -s KILL 260 python3 bench/peers.py --system fpdt --model llama3-8b --ballast auto --check-host --cpu-offload-params --layers 2 --seq-len 786432 --steps 1 --recompute-attention --out $OUT/peers-1gpu-fpdt.jsonl > $OUT/fpdt-1gpu-768k.txt 2>&1; grep "RESULT\|Error" $OUT/fpdt-1gpu-768k.txt | tail -2
t done
