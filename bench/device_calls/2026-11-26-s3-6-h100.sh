#!/bin/bash
# session 3 GPU call 6 (one GPU): tests/gpu after the head-group backward and RMSNorm changes; head chunking at 256K
# again; fpdt at 256K with 4 layers (the depth check against the 2-layer runs); the 1-GPU example config
# (Llama-3-1B at 128K) for 3 steps, last because the budget may end it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t tests; timeout -s KILL 80 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -6
t heads; timeout -s KILL 100 python3 bench/head_chunks.py --seq-len 262144 --head-chunks 1,4 --repeats 1 --out $OUT/head_chunks.json > $OUT/head_chunks.txt 2>&1; tail -8 $OUT/head_chunks.txt
t depth; timeout -s KILL 100 python3 bench/peers.py --system fpdt --model llama3-8b --ballast auto --check-host --cpu-offload-params --steps 1 --layers 4 --seq-len 262144 --out $OUT/peers-1gpu-depth.jsonl > $OUT/depth.txt 2>&1; pkill -9 -f bench/peers.py; grep "RESULT\|Error" $OUT/depth.txt | tail -2
t config-1b; timeout -s KILL 110 python3 -m lightning_fpdt.cli fit --config examples/configs/llama3_1b_128k_1gpu.yaml --trainer.max_steps 3 --trainer.logger.init_args.save_dir /tmp/tb > $OUT/config_1gpu_1b.txt 2>&1; t "rc=$?"; pkill -9 -f lightning_fpdt.cli; sed 's/\r/\n/g' $OUT/config_1gpu_1b.txt | grep "fpdt:\|MFUMonitor\|fit done\|Error" | tail -4
t done
