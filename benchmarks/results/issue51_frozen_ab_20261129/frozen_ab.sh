#!/usr/bin/env bash
# 5,000 tensors with one frozen parameter in every optimizer (bench_hook_cost.py --frozen 1), before
# vs after alternating, the order swapped every round; this checkout's script on both sides (the
# before side's package through PYTHONPATH; its own script has no --frozen).
#   BEFORE=/tmp/before2 bash frozen_ab.sh OUT_DIR
set -u
OUT=$1; BEFORE=${BEFORE:-/tmp/before2}; AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
mkdir -p "$OUT/t5000_frozen"
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ $side = before ]; then root=$BEFORE; else root=$AFTER; fi
    (cd "$AFTER/benchmarks" && PYTHONPATH=$root timeout 900 python bench_hook_cost.py --tensors 5000 --numel-per-tensor 4096 \
      --window 4 --repeats 9 --frozen 1 --json "$OUT/t5000_frozen/${side}_$r.json" > "$OUT/t5000_frozen/${side}_$r.txt" 2>&1)
    echo "$(date +%T) t5000_frozen $side $r rc=$?"
  done
done
