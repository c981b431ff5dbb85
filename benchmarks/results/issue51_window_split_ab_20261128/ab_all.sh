#!/usr/bin/env bash
# Before (9fb57b9, /tmp/before) vs after (/work/main HEAD), alternating run by run, one sitting.
set -u
. /work/main/.venv/bin/activate
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
OUT=/tmp/ab; mkdir -p $OUT
run() {  # name rounds script args...
  local name=$1 rounds=$2 script=$3; shift 3
  mkdir -p $OUT/$name
  for r in $(seq 1 $rounds); do
    for side in before after; do
      if [ $side = before ]; then root=/tmp/before; else root=/work/main; fi
      (cd $root/benchmarks && PYTHONPATH=$root timeout 900 python $script "$@" --json $OUT/$name/${side}_$r.json > $OUT/$name/${side}_$r.txt 2>&1)
      echo "$(date +%T) $name $side $r rc=$?"
    done
  done
}
run t5000 3 bench_hook_cost.py --tensors 5000 --numel-per-tensor 4096 --window 4 --repeats 9
run lora 2 bench_hook_cost.py --shapes-of lora --window 8 --repeats 15
run gpt_clip 2 bench_hook_cost.py --shapes-of gpt --window 8 --clip 1.0 --repeats 9
run transformer 2 bench_transformer.py --clip on --layers 2 --d-model 256 --heads 4 --vocab 4096 --seq 64 --k 4 --repeats 6 --warmup 1 --no-plot
echo done
