#!/usr/bin/env bash
# Before/after issue 20's changes on the hot paths (the DDP watch during the first window, one
# attribute check per step() and per window close): the previous main (502c73f, a git worktree
# at /tmp/base with this tree's built extension copied in) against this branch, alternated
# A B A B in one run. Results beside this script.
set -u
. /work/main/.venv/bin/activate
out=/work/main/benchmarks/results/ddp_ab
cd /tmp
for round in ${ROUNDS:-1 2}; do
  for side in before after; do
    if [ $side = before ]; then tree=/tmp/base; export PYTHONPATH=/tmp/base; else tree=/work/main; unset PYTHONPATH; fi
    python -c "import accum_fused; print('$side uses', accum_fused.__file__)"
    python $tree/benchmarks/bench_backward.py --repeats 10 --json $out/backward_${side}_${round}.json > $out/backward_${side}_${round}.txt 2>&1
    python $tree/benchmarks/bench_window.py --json $out/window_${side}_${round}.json > $out/window_${side}_${round}.txt 2>&1
  done
done
echo ab-done
