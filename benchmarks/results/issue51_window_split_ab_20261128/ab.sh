#!/usr/bin/env bash
# Before (a worktree of an earlier commit, built, at $BEFORE, default /tmp/before: 9fb57b9 for
# this folder, a8ffb1b for ../issue51_update_spec_ab_20261128) vs after (this checkout),
# alternating run by run in one sitting. ORDER "before after" (sitting 1) or "after before" (sitting 2).
#   bash ab.sh OUT_DIR "before after"    # sitting 1: 3 rounds of t5000, 2 of the others
#   bash ab.sh OUT_DIR "after before" 3  # sitting 2: 3 rounds of each bench_hook_cost case
set -u
OUT=$1; ORDER=$2; ROUNDS=${3:-}
BEFORE=${BEFORE:-/tmp/before}; AFTER=$(cd "$(dirname "$0")/../../.." && pwd)
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
run() {  # name rounds script args...
  local name=$1 rounds=${ROUNDS:-$2} script=$3; shift 3
  mkdir -p "$OUT/$name"
  for r in $(seq 1 "$rounds"); do
    for side in $ORDER; do
      if [ "$side" = before ]; then root=$BEFORE; else root=$AFTER; fi
      (cd "$root/benchmarks" && PYTHONPATH=$root timeout 900 python "$script" "$@" --json "$OUT/$name/${side}_$r.json" \
        > "$OUT/$name/${side}_$r.txt" 2>&1)
      echo "$(date +%T) $name $side $r rc=$?"
    done
  done
}
run t5000 3 bench_hook_cost.py --tensors 5000 --numel-per-tensor 4096 --window 4 --repeats 9
run lora 2 bench_hook_cost.py --shapes-of lora --window 8 --repeats 15
run gpt_clip 2 bench_hook_cost.py --shapes-of gpt --window 8 --clip 1.0 --repeats 9
[ -n "$ROUNDS" ] || run transformer 2 bench_transformer.py --clip on --layers 2 --d-model 256 --heads 4 --vocab 4096 \
  --seq 64 --k 4 --repeats 6 --warmup 1 --no-plot
