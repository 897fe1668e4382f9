#!/bin/bash
# session 3 GPU call 5 (4 GPUs): fpdt with the strategy's own choice at 64K (offload off) vs ring, profiled; fpdt at
# 1.5M tokens, capped to 79 GiB, the longest whose full depth the planner fits in this host (issue 8 #1, #5)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; free -g | head -2
clean() { pkill -9 -f bench/peers.py; sleep 2; }
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
C="--model llama3-8b --ballast auto --check-host"
t "fpdt 64K offload off"; timeout -s KILL 80 torchrun --standalone --nproc_per_node 4 bench/peers.py --system fpdt $C --layers 2 --seq-len 65536 --steps 3 --offload off --profile-step 2 --out $OUT/peers-4gpu-eq.jsonl > $OUT/eq-fpdt-off.txt 2>&1; t "rc=$?"; clean; grep RESULT $OUT/eq-fpdt-off.txt | tail -1; grep -A9 "profiled step" $OUT/eq-fpdt-off.txt | head -9
t "ring 64K"; timeout -s KILL 80 torchrun --standalone --nproc_per_node 4 bench/peers.py --system ring $C --layers 2 --seq-len 65536 --steps 3 --profile-step 2 --out $OUT/peers-4gpu-eq.jsonl > $OUT/eq-ring.txt 2>&1; t "rc=$?"; clean; grep RESULT $OUT/eq-ring.txt | tail -1; grep -A9 "profiled step" $OUT/eq-ring.txt | head -9
t fpdt-1.5M; timeout -s KILL 210 torchrun --standalone --nproc_per_node 4 bench/peers.py --system fpdt $C --layers 2 --seq-len 1572864 --steps 1 --recompute-attention --gpu-memory-gib 79 --out $OUT/peers-4gpu-fpdt-1.5m.jsonl > $OUT/fpdt-1.5m.txt 2>&1; t "rc=$?"; clean; grep "RESULT\|Error" $OUT/fpdt-1.5m.txt | tail -2
python3 -c "
import json,os
r=json.loads(open(os.environ['OUT']+'/peers-4gpu-fpdt-1.5m.jsonl').readline()); print('host_check', r['host_check'])"
t done
