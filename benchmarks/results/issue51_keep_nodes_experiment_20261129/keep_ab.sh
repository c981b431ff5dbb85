set -u
MAIN=${MAIN:-/work/main}; KEEP=${KEEP:-/tmp/keep}  # this checkout, and a worktree with keep_nodes.patch applied and built
OUT=$1
export MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=4294967296
mkdir -p $OUT/t5000
for r in 1 2 3 4; do
  if [ $((r % 2)) = 1 ]; then order="before after"; else order="after before"; fi
  for side in $order; do
    if [ $side = before ]; then root=$MAIN; else root=$KEEP; fi
    (cd $root/benchmarks && PYTHONPATH=$root timeout 900 python bench_hook_cost.py --tensors 5000 --numel-per-tensor 4096 --window 4 --repeats 9 --json $OUT/t5000/${side}_$r.json > $OUT/t5000/${side}_$r.txt 2>&1)
    echo "$(date +%T) $side $r rc=$?"
  done
done
