#!/bin/bash
# session GPU call 4 (one GPU): GPU tests after the merges, head chunking, packed documents, attention recompute
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
t tests; timeout -s KILL 110 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1; grep -E "passed|failed|FAILED|Error" $OUT/gpu_tests.txt | tail -8
t heads; timeout -s KILL 150 python3 bench/head_chunks.py --seq-len 262144 --head-chunks 1,2,4,8 --repeats 1 --out $OUT/head_chunks.json > $OUT/head_chunks.txt 2>&1; tail -14 $OUT/head_chunks.txt
t packed; timeout -s KILL 60 python3 bench/packed.py --seq-lens 131072 --doc-lens 0,8192 --chunk-tokens 32768 --repeats 2 --out $OUT/packed.jsonl > $OUT/packed.txt 2>&1; tail -5 $OUT/packed.txt
t recompute; timeout -s KILL 100 python3 bench/peers.py --system fpdt --model llama3-8b --ballast auto --check-host --cpu-offload-params --layers 2 --seq-len 262144 --steps 2 --recompute-attention --out $OUT/peers-1gpu-recompute.jsonl > $OUT/recompute.txt 2>&1; grep RESULT $OUT/recompute.txt | tail -1
t done
