#!/bin/bash
# session 3 GPU call 2 (4 GPUs): fpdt vs ring at 64K again after the TiledLoss change (profiled), then
# examples/configs/llama3_8b_512k_4gpu.yaml at full depth for 2 steps (issue 7; issue 8's full-depth 512K MFU)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; free -g | head -2
clean() { pkill -9 -f lightning_fpdt.cli; pkill -9 -f bench/peers.py; sleep 2; }
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
C="--model llama3-8b --ballast auto --check-host"
for s in fpdt ring; do t "profile $s"; timeout -s KILL 80 torchrun --standalone --nproc_per_node 4 bench/peers.py --system $s $C --layers 2 --seq-len 65536 --steps 3 --profile-step 2 --out $OUT/peers-4gpu-profile.jsonl > $OUT/profile-$s.txt 2>&1; t "rc=$?"; clean; grep RESULT $OUT/profile-$s.txt | tail -1; grep -A12 "profiled step" $OUT/profile-$s.txt | head -13; done
t config
(while true; do echo "$(( $(date +%s) - T0 )) $(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | tr '\n' ' ') host_used_gib=$(free -g | awk '/Mem:/{print $3}')"; sleep 5; done) > $OUT/config_memory.txt &
MON=$!
timeout -s KILL 455 python3 -m lightning_fpdt.cli fit --config examples/configs/llama3_8b_512k_4gpu.yaml --trainer.max_steps 2 --trainer.logger.init_args.save_dir /tmp/tb 2>&1 | while IFS= read -r l; do echo "[$(( $(date +%s) - T0 )) s] $l"; done > $OUT/config_4gpu_full.txt
t "config done"; kill $MON; clean
grep -v "^\s*$" $OUT/config_4gpu_full.txt | grep -iv "warn" | grep -i "fpdt\|MFU\|loss\|fit done\|Error\|Total\|Epoch 0: .*2/" | tail -14
sort -k2 -n -r $OUT/config_memory.txt | head -2; tail -3 $OUT/config_memory.txt
t done
