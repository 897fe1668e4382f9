#!/bin/bash
# session 4 GPU call 4 (4 GPUs, warm): the profiled 512K step with 4 chunks instead of 8 (fewer, larger attention
# calls: does the attention kernel time fall?)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
clean() { pkill -9 -f bench/peers.py; sleep 2; }
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
C="--model llama3-8b --ballast auto --check-host"
t "fpdt 512K chunks 4 profiled"; timeout -s KILL 150 torchrun --standalone --nproc_per_node 4 bench/peers.py --system fpdt $C --layers 2 --seq-len 524288 --chunks 4 --offload on --steps 3 --profile-step 2 --out $OUT/peers-4gpu-profile.jsonl > $OUT/prof-512k-c4.txt 2>&1; t "rc=$?"; clean; grep RESULT $OUT/prof-512k-c4.txt | tail -1; grep -A10 "profiled step" $OUT/prof-512k-c4.txt | head -10
t done
