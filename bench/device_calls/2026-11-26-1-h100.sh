#!/bin/bash
# session GPU call 1 (one GPU): GPU tests, attention-op recalibration, three-system smoke
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -c "import pytest" 2>/dev/null || { pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
C="--model llama3-8b --ballast auto --check-host --cpu-offload-params"
( timeout 150 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -4 ) > $OUT/gpu_tests.txt 2>&1; tail -2 $OUT/gpu_tests.txt
timeout 150 python3 bench/attention.py --seq-lens 131072,1048576 --chunk-tokens 32768 --offload on --repeat 1 --out $OUT/attn1.jsonl > $OUT/attn1.txt 2>&1; tail -4 $OUT/attn1.txt
for sys in ring modelparallel; do timeout 90 python3 bench/peers.py --system $sys $C --layers 2 --seq-len 16384 --steps 2 --out $OUT/smoke1.jsonl > $OUT/smoke-$sys.txt 2>&1; echo "$sys rc=$?"; tail -3 $OUT/smoke-$sys.txt; done
timeout 150 python3 bench/peers.py --system fpdt $C --layers 2 --seq-len 262144 --steps 2 --out $OUT/smoke1.jsonl > $OUT/smoke-fpdt.txt 2>&1; echo "fpdt rc=$?"; tail -3 $OUT/smoke-fpdt.txt
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/smoke1.jsonl"):
    r = json.loads(line); print(r.get("system"), r.get("seq_len"), r.get("status"), r.get("median_step_s"), r.get("mfu"), (r.get("peak_gpu_bytes") or 0) / 2**30, r.get("error"))
PY
