#!/bin/bash
# session 4 GPU call 1 (one GPU): fpdt at 256K with 2 and then 4 layers (depth independence, same code, same call);
# tests/gpu after the RoPE/norm changes; ModelParallelStrategy's maximum length on one GPU; the 1-GPU example config
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
C="--model llama3-8b --ballast auto --check-host --cpu-offload-params --steps 1 --seq-len 262144"
for L in 2 4; do
  t depth-$L; timeout -s KILL 110 python3 bench/peers.py --system fpdt $C --layers $L --out $OUT/peers-1gpu-depth.jsonl > $OUT/depth-$L.txt 2>&1; pkill -9 -f bench/peers.py; grep "RESULT\|Error" $OUT/depth-$L.txt | tail -2
done
t tests; timeout -s KILL 90 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -6
t mp-max; timeout -s KILL 170 python3 bench/peers.py --max-length --gpus 1 --system modelparallel --model llama3-8b --ballast auto --check-host --cpu-offload-params --layers 2 --steps 1 --seq-len 32768 --deadline-s 160 --out $OUT/peers-1gpu-max.jsonl > $OUT/mp-max.txt 2>&1; pkill -9 -f bench/peers.py; grep "RESULT\|MAX\|Error" $OUT/mp-max.txt | tail -6
t config-1b; timeout -s KILL 130 python3 -m lightning_fpdt.cli fit --config examples/configs/llama3_1b_128k_1gpu.yaml --trainer.max_steps 3 --trainer.logger.init_args.save_dir /tmp/tb > $OUT/config_1gpu_1b.txt 2>&1; t "rc=$?"; pkill -9 -f lightning_fpdt.cli; sed 's/\r/\n/g' $OUT/config_1gpu_1b.txt | grep "fpdt:\|MFUMonitor\|fit done\|Error" | tail -4
t done
