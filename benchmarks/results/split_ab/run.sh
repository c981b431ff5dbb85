#!/usr/bin/env bash
# Before/after in one run: the previous main (/work/baseline) and this branch (/work/main),
# alternated A B A B so drift in machine load hits both alike. Results in /tmp/ab/*.json.
set -u
. /work/main/.venv/bin/activate
cd /tmp
for round in 1 2; do
  for side in before after; do
    if [ $side = before ]; then tree=/work/baseline; export PYTHONPATH=/work/baseline; else tree=/work/main; unset PYTHONPATH; fi
    python -c "import accum_fused; print('$side uses', accum_fused.__file__)"
    python $tree/benchmarks/bench_window.py --json /tmp/ab/window_${side}_${round}.json > /tmp/ab/window_${side}_${round}.txt 2>&1
    python $tree/benchmarks/bench_backward.py --repeats 10 --json /tmp/ab/backward_${side}_${round}.json > /tmp/ab/backward_${side}_${round}.txt 2>&1
  done
done
echo ab-done
