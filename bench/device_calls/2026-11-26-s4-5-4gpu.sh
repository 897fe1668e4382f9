#!/bin/bash
# session 4 GPU call 5 (4 GPUs): ring at 64K capped to 79 GiB (its capped maximum: 128K ran out of memory capped)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t "ring 64K capped"; timeout -s KILL 100 torchrun --standalone --nproc_per_node 4 bench/peers.py --system ring --model llama3-8b --ballast auto --check-host --layers 2 --seq-len 65536 --steps 1 --gpu-memory-gib 79 --out $OUT/peers-4gpu-ring-capped.jsonl > $OUT/ring64-capped.txt 2>&1; t "rc=$?"; pkill -9 -f bench/peers.py; grep "RESULT\|Error" $OUT/ring64-capped.txt | tail -2
t done
