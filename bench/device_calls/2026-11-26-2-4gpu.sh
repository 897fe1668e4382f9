#!/bin/bash
# session GPU call 2 (4 GPUs): the demo's GPU branch, then examples/configs/llama3_8b_512k_4gpu.yaml for 2 steps (issue 7)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
start=$(date +%s)
timeout 110 python3 -m lightning_fpdt.cli fit --config examples/configs/demo_cpu.yaml --trainer.accelerator gpu --trainer.devices -1 --trainer.precision bf16-mixed --trainer.logger.init_args.save_dir /tmp/tb > $OUT/demo_gpu.txt 2>&1
echo "demo rc=$? $(( $(date +%s) - start )) s"; grep -i "accuracy\|chance\|MFUMonitor" $OUT/demo_gpu.txt | tail -4
start=$(date +%s)
timeout 450 python3 -m lightning_fpdt.cli fit --config examples/configs/llama3_8b_512k_4gpu.yaml --trainer.max_steps 2 --trainer.logger.init_args.save_dir /tmp/tb > $OUT/llama3_8b_512k_4gpu.txt 2>&1
echo "8b rc=$? $(( $(date +%s) - start )) s"; grep -v "^\s*$" $OUT/llama3_8b_512k_4gpu.txt | grep -iv "warn" | tail -25
free -g | head -2
