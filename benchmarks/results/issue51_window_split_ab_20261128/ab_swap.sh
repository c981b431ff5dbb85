#!/usr/bin/env bash
set -u
. /work/main/.venv/bin/activate
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
OUT=/tmp/ab_swap; mkdir -p $OUT
run() {
  local name=$1 rounds=$2 script=$3; shift 3
  mkdir -p $OUT/$name
  for r in $(seq 1 $rounds); do
    for side in after before; do
      if [ $side = before ]; then root=/tmp/before; else root=/work/main; fi
      (cd $root/benchmarks && PYTHONPATH=$root timeout 900 python $script "$@" --json $OUT/$name/${side}_$r.json > $OUT/$name/${side}_$r.txt 2>&1)
      echo "$(date +%T) $name $side $r rc=$?"
    done
  done
}
run t5000 3 bench_hook_cost.py --tensors 5000 --numel-per-tensor 4096 --window 4 --repeats 9
run gpt_clip 3 bench_hook_cost.py --shapes-of gpt --window 8 --clip 1.0 --repeats 9
run lora 3 bench_hook_cost.py --shapes-of lora --window 8 --repeats 15
echo done
