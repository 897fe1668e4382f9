#!/bin/bash
# session 3 GPU call 1 (4 GPUs): fpdt at 2M with recompute_attention capped to 79 GiB per GPU (issue 8 #1), then step
# profiles of fpdt and ring at 64K (the throughput gap)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1; free -g | head -2
clean() { pkill -9 -f lightning_fpdt.cli; pkill -9 -f bench/peers.py; sleep 2; }
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
C="--model llama3-8b --ballast auto --check-host"
t fpdt-2M; timeout -s KILL 330 torchrun --standalone --nproc_per_node 4 bench/peers.py --system fpdt $C --layers 2 --seq-len 2097152 --steps 1 --recompute-attention --gpu-memory-gib 79 --out $OUT/peers-4gpu-fpdt-2m.jsonl > $OUT/fpdt-2m.txt 2>&1; t "rc=$?"; clean; grep "RESULT\|Error" $OUT/fpdt-2m.txt | tail -2
for s in fpdt ring; do t "profile $s"; timeout -s KILL 100 torchrun --standalone --nproc_per_node 4 bench/peers.py --system $s $C --layers 2 --seq-len 65536 --steps 3 --profile-step 2 --out $OUT/peers-4gpu-profile.jsonl > $OUT/profile-$s.txt 2>&1; t "rc=$?"; clean; grep RESULT $OUT/profile-$s.txt | tail -1; done
python3 - <<'PY'
import json, os
for line in open(os.path.join(os.environ["OUT"], "peers-4gpu-profile.jsonl")):
    r = json.loads(line); p = r.get("profile") or {}
    print(r["system"], r["step_time_s"], {k: (round(v, 3) if isinstance(v, float) else v) for k, v in p.items() if k != "top_kernels"})
    for k in (p.get("top_kernels") or [])[:8]: print("   ", k)
PY
t done
