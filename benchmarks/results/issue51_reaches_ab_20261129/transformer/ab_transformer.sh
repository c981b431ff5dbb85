# bench_transformer.py --clip on, before (a built worktree of d80635e at /tmp/beforeS) vs after
# (this checkout), alternating run by run, the order swapped every round.
#   OUT=DIR PATH=.venv/bin:$PATH bash ab_transformer.sh
set -u
OUT=${OUT:-/tmp/abS/transformer}; mkdir -p $OUT
AFTER=$(cd "$(dirname "$0")/../../../.." && pwd)
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ $side = before ]; then root=/tmp/beforeS; else root=$AFTER; fi
    (cd $root/benchmarks && PYTHONPATH=$root timeout 900 python bench_transformer.py --clip on --layers 2 --d-model 256 --heads 4 --vocab 4096 --seq 64 --k 4 --repeats 6 --warmup 1 --no-plot --json $OUT/${side}_$r.json > $OUT/${side}_$r.txt 2>&1)
    echo "$(date +%T) transformer $side $r rc=$?"
  done
done
