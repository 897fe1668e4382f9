#!/bin/bash
# session GPU call 3 (4 GPUs): the 4-GPU example config at 8 of 32 layers (issue 7), fpdt vs ring at equal length,
# ring's maximum length, one fpdt attempt at 1M (issue 8)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; free -g | head -2
clean() { pkill -9 -f lightning_fpdt.cli; pkill -9 -f bench/peers.py; sleep 2; }
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t config; timeout -s KILL 215 python3 -m lightning_fpdt.cli fit --config examples/configs/llama3_8b_512k_4gpu.yaml --model.init_args.config_overrides '{num_layers: 8}' --trainer.max_steps 3 --trainer.logger.init_args.save_dir /tmp/tb > $OUT/config_4gpu_8layers.txt 2>&1; t "config rc=$?"; clean
grep "MFUMonitor\|fit done\|Error" $OUT/config_4gpu_8layers.txt | tail -3
C="--model llama3-8b --ballast auto --check-host"
for s in ring fpdt; do t "eq $s"; timeout -s KILL 85 torchrun --standalone --nproc_per_node 4 bench/peers.py --system $s $C --layers 2 --seq-len 65536 --steps 3 --out $OUT/peers-4gpu-eq.jsonl > $OUT/eq-$s.txt 2>&1; clean; grep RESULT $OUT/eq-$s.txt | tail -1; done
t ring-max; timeout -s KILL 100 python3 bench/peers.py --max-length --gpus 4 --system ring $C --layers 2 --seq-len 131072 --steps 1 --deadline-s 95 --out $OUT/peers-4gpu-ring.jsonl > $OUT/ring-max.txt 2>&1; clean; grep "RESULT\|max_length" $OUT/ring-max.txt | tail -4
t fpdt-1M; timeout -s KILL 110 torchrun --standalone --nproc_per_node 4 bench/peers.py --system fpdt $C --layers 2 --seq-len 1048576 --steps 1 --out $OUT/peers-4gpu-fpdt.jsonl > $OUT/fpdt-1m.txt 2>&1; clean; grep RESULT $OUT/fpdt-1m.txt | tail -1
t done
