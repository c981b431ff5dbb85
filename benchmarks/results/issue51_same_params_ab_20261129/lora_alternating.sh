#!/usr/bin/env bash
# LoRA shapes only, 8 rounds, the order swapped every round (before = a built worktree at $BEFORE).
#   BEFORE=/tmp/before bash lora_alternating.sh OUT_DIR
set -u
OUT=$1; BEFORE=${BEFORE:-/tmp/before}; AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
mkdir -p "$OUT/lora"
for r in 1 2 3 4 5 6 7 8; do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ $side = before ]; then root=$BEFORE; else root=$AFTER; fi
    (cd "$root/benchmarks" && PYTHONPATH=$root timeout 900 python bench_hook_cost.py --shapes-of lora --window 8 \
      --repeats 15 --json "$OUT/lora/${side}_$r.json" > "$OUT/lora/${side}_$r.txt" 2>&1)
    echo "$(date +%T) lora $side $r rc=$?"
  done
done
