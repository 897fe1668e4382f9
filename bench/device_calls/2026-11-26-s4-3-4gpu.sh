#!/bin/bash
# session 4 GPU call 3 (4 GPUs): a profiled 512K step as the full-depth config runs it (2 layers + ballast, chunks 8,
# offload on); fpdt and ring at 128K capped to 79 GiB (issue 8 #5); ModelParallelStrategy's maximum length on 4 GPUs
# capped to 79 GiB (#3)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; free -g | head -2
clean() { pkill -9 -f bench/peers.py; sleep 2; }
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
C="--model llama3-8b --ballast auto --check-host"
t "fpdt 512K profiled"; timeout -s KILL 150 torchrun --standalone --nproc_per_node 4 bench/peers.py --system fpdt $C --layers 2 --seq-len 524288 --chunks 8 --offload on --steps 3 --profile-step 2 --out $OUT/peers-4gpu-profile.jsonl > $OUT/prof-512k.txt 2>&1; t "rc=$?"; clean; grep RESULT $OUT/prof-512k.txt | tail -1; grep -A24 "profiled step" $OUT/prof-512k.txt | head -26
for s in ring fpdt; do
  t "$s 128K capped"; timeout -s KILL 90 torchrun --standalone --nproc_per_node 4 bench/peers.py --system $s $C --layers 2 --seq-len 131072 --steps 3 --gpu-memory-gib 79 --out $OUT/peers-4gpu-eq.jsonl > $OUT/eq128-$s.txt 2>&1; t "rc=$?"; clean; grep "RESULT\|Error" $OUT/eq128-$s.txt | tail -2
done
t mp-max; timeout -s KILL 170 python3 bench/peers.py --max-length --gpus 4 --system modelparallel $C --layers 2 --steps 1 --seq-len 32768 --gpu-memory-gib 79 --deadline-s 160 --out $OUT/peers-4gpu-max.jsonl > $OUT/mp-max4.txt 2>&1; clean; grep "RESULT\|MAX\|Error" $OUT/mp-max4.txt | tail -6
t done
