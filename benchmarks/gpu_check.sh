#!/usr/bin/env bash
# shellcheck disable=SC2329  # the stage functions are called through `timeout bash -c`
# One command for a lent GPU machine (issue 11): build the extension for this GPU, run the whole
# test suite on CUDA, time the window and training benchmarks and the GPT-2 step a user runs, run
# compute-sanitizer on the kernels, and write a summary with everything into OUTDIR. See
# benchmarks/README.md.
#
#   bash benchmarks/gpu_check.sh OUTDIR              # on the GPU machine: bash benchmarks/gpu_check.sh $OUT
#   bash benchmarks/gpu_check.sh --dry-run OUTDIR    # CPU, tiny sizes, no build, no sanitizer (CI)
#
# OUTDIR gets at most 8 flat files of at most 16 MiB (what the device tool brings back):
# summary.md, gpu_check.json (with the model, FSDP2 and parity stages' results), junit.xml, bench.json, bench.png,
# train.json, logs.txt.
# Each stage runs under `timeout` with a share of one deadline (GPU_CHECK_BUDGET_S, default 540 s:
# the device tool's 10-minute command limit less a margin), so a stage that runs long cannot eat
# the next; every stage runs whatever failed before it, summary.md is always written, and the
# exit status is non-zero when any stage failed or timed out.
# Overrides: PYTHON, GPU_CHECK_BUDGET_S, GPU_CHECK_PYTEST_ARGS, GPU_CHECK_BENCH_ARGS, GPU_CHECK_XDIST=0.
set -uo pipefail

usage() { echo "usage: $0 [--dry-run] OUTDIR" >&2; exit 2; }
DRY_RUN=0
[ "${1:-}" = "--dry-run" ] && { DRY_RUN=1; shift; }
[ $# -eq 1 ] || usage

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1" || exit 2
OUTDIR="$(cd "$1" && pwd)"
# Work files live outside OUTDIR: only the gathered files may come back.
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cd "$ROOT" || exit 2

# The GPU image's Python with torch is python3 (plain `python` may be missing there); CI's is the
# active venv's python.
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  command -v python >/dev/null && python -c 'import torch' 2>/dev/null && PYTHON=python
fi
PY_BIN_DIR="$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')"
# ninja (pip's wrapper script) and pytest sit beside that interpreter, maybe not on PATH.
export PATH="$PY_BIN_DIR:$PATH"
# The checkout, built in place, is what every stage and every test subprocess imports.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Real Triton on the GPU, not its CPU interpreter (CI sets TRITON_INTERPRET=1 for the suite).
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export PYTHON WORK DRY_RUN ROOT
export GPU_CHECK_RUNNING=1  # tests/test_gpu_check.py skips itself inside a run
REPORT="$ROOT/benchmarks/gpu_check_report.py"
export REPORT

START=$SECONDS
# The dry run (CI) has no device lease to fit: generous limits, so that a loaded 2-core machine
# only makes it slower (its train stage took >60 s beside a busy test suite).
DEFAULT_BUDGET=540; [ "$DRY_RUN" = 1 ] && DEFAULT_BUDGET=2400
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-$DEFAULT_BUDGET}))
REPORT_RESERVE=15  # seconds kept for the report at the end

# ------------------------------------------------------------------------------------ stages
# Each stage is a function run by `timeout` in a child bash; exit 0 = ok, 3 = skipped (said why),
# anything else = failed (124/137 = ran out of its budget).

stage_env() {
  nvidia-smi 2>&1 || echo "nvidia-smi: not available"
  if [ "$DRY_RUN" = 1 ]; then "$PYTHON" "$REPORT" env "$WORK" --dry-run; else "$PYTHON" "$REPORT" env "$WORK"; fi
}

stage_build() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: no build; checking the installed package instead"
    "$PYTHON" "$REPORT" check-build
    return
  fi
  # --no-build-isolation needs the build requirements (pyproject.toml) present: no network there.
  "$PYTHON" -c 'import setuptools, wheel' || { echo "FAIL: setuptools/wheel missing: cannot build offline"; return 1; }
  command -v ninja >/dev/null || echo "warning: ninja not found: torch falls back to the slow serial build"
  if [ -z "${CUDA_HOME:-}" ] && ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda /usr/local/cuda-13.0; do [ -x "$d/bin/nvcc" ] && export CUDA_HOME="$d" && break; done
  fi
  TORCH_CUDA_ARCH_LIST="$("$PYTHON" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')" \
    || { echo "FAIL: torch sees no CUDA device"; return 1; }
  MAX_JOBS="$(nproc)"
  # (the CUDA kernels or a failed stage: a toolkit the build would skip is what this check must see)
  ACCUM_FUSED_REQUIRE_CUDA=1
  export TORCH_CUDA_ARCH_LIST MAX_JOBS ACCUM_FUSED_REQUIRE_CUDA
  unset ACCUM_FUSED_NO_EXTENSION ACCUM_FUSED_NO_CUDA
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-<from nvcc on PATH>}"
  rm -rf build accum_fused/_C*.so
  "$PYTHON" setup.py build_ext --inplace || return 1
  # setup.py silently builds CPU kernels only when it finds no CUDA: fail loudly here instead.
  "$PYTHON" "$REPORT" check-build --cuda || return 1
  # What the build holds: the torch it was compiled against, its fast paths (issue 43).
  "$PYTHON" -m accum_fused info
}

stage_tests() {
  local args=(-q -p no:cacheprovider -rfE --junitxml="$WORK/junit.xml")
  if [ "$DRY_RUN" = 1 ]; then
    # A tiny slice (never this script's own test): the junit and summary path, not the suite.
    read -r -a sel <<<"${GPU_CHECK_PYTEST_ARGS:-tests/test_install.py tests/test_kernels.py::test_empty_calls}"
  else
    # The CUDA cases only: every CPU test runs in CI, and on the first H100 run (2026-11-26) the
    # whole suite did not finish in 180 s on 8 workers (64 %). The CUDA cases are the ones marked
    # `cuda` (kernels against the reference, the CUDA paths, the fused Linear's CUDA GEMM).
    local cuda_sel="tests --ignore=tests/upstream --ignore=tests/test_gpu_check.py -m cuda"
    read -r -a sel <<<"${GPU_CHECK_PYTEST_ARGS:-$cuda_sel}"
    # 16 cores: workers compile Triton kernels and run the CPU half of the suite in parallel.
    if [ "${GPU_CHECK_XDIST:-1}" = 1 ] && "$PYTHON" -c 'import xdist' 2>/dev/null; then
      args+=(-n "$(( $(nproc) / 2 > 8 ? 8 : ($(nproc) / 2 > 1 ? $(nproc) / 2 : 1) ))")
    fi
    "$PYTHON" -c 'import pytest_timeout' 2>/dev/null && args+=(--timeout 180)
  fi
  "$PYTHON" -m pytest "${args[@]}" "${sel[@]}"
}

bench_args() {
  if [ "$DRY_RUN" = 1 ]; then
    echo "--device cpu --shapes uniform --sizes 64k --dtypes fp32 bf16 --k 2 --clip both --repeats 1 --warmup 1 --copy-size 1M"
  else
    # The issue's grid: 64M and 256M elements and GPT-2-124M's shapes, fp32 and bf16; k=8 (mostly
    # the accumulate kernel) and k=1 (clip off: the boundary kernel alone); every backend.
    echo "--device cuda --shapes uniform gpt2 --sizes 64M 256M --dtypes fp32 bf16 --k 1 8 --clip both --repeats 20 --warmup 3 --copy-size 256M"
  fi
}

stage_bench() {
  read -r -a args <<<"${GPU_CHECK_BENCH_ARGS:-$(bench_args)}"
  "$PYTHON" -m accum_fused bench "${args[@]}" --output-dir "$WORK/bench" --no-progress
}

stage_train() {
  # Then peak memory of one window: native loop, plain, in_backward mode A and B (issue 12); its
  # table lands in this stage's log (logs.txt).
  if [ "$DRY_RUN" = 1 ]; then
    "$PYTHON" benchmarks/bench_train.py --device cpu --vocab 128 --ctx 16 --d-model 32 --layers 1 --heads 2 \
      --micro-batches 2,1 --windows 1 --warmup 0 --json "$WORK/train.json" &&
    "$PYTHON" benchmarks/bench_memory.py --device cpu --vocab 128 --ctx 16 --d-model 32 --layers 1 --heads 2 \
      --batch 1 --seq 8 --k 2 --dtypes fp32 --threads 1 --json "$WORK/memory.json"
  else
    # GPT-2-small, bf16 autocast. 6 + 2 windows per contender: 13 rounds took ~80 s on the H100;
    # bench_memory on bf16 only (the GPU's training dtype): fp32 and bf16 took ~10 s per contender.
    "$PYTHON" benchmarks/bench_train.py --device cuda --windows 6 --warmup 2 --json "$WORK/train.json" &&
    "$PYTHON" benchmarks/bench_memory.py --device cuda --preset gpt2 --dtypes bf16 --json "$WORK/memory.json"
  fi
}

# Every contender of the model stage: the native loop, each accum_fused mode on each kernel backend,
# and forward + backward alone (the floor the optimizer side is measured from). The reference
# backend too, in plain mode and mode B: Python's hooks and torch's ops, what `auto` is measured
# against on a device where the extension has no CUDA kernels (plain:torch against plain:triton
# says which `auto` should take there; mode B's per-gradient adds are torch's on a GPU for every
# backend now, in the extension's C++ hooks except on the reference backend).
MODEL_CONTENDERS=native,plain:cpp,plain:triton,plain:torch,mode_a:cpp,mode_a:triton,mode_b:cpp,mode_b:triton,mode_b:torch,fb_only
export MODEL_CONTENDERS

stage_model() {
  # The GPT-2 step that users run (issue 43 item 4): nanoGPT's GPT-2 small, bf16 autocast, 8 x 1024
  # tokens per micro-batch, k=4, clip 1.0; the native loop against every mode x backend, window
  # ms, ratio to native, optimizer-side ms (- fb_only) and peak memory; its table goes into
  # summary.md. A backend that cannot run here is reported skipped, with why.
  if [ "$DRY_RUN" = 1 ]; then
    # Tiny sizes, the same flags otherwise. On CPU Triton runs only in its interpreter, which this
    # script unsets for the real GPU run: set it again for this stage alone (~0.2 s a window).
    TRITON_INTERPRET=1 "$PYTHON" benchmarks/bench_transformer.py --preset gpt2 --device cpu --autocast bf16 \
      --layers 1 --d-model 32 --heads 2 --vocab 128 --seq 16 --micro-batch 2 --k 2 --warmup 1 --repeats 2 \
      --threads 1 --contenders "$MODEL_CONTENDERS" --no-plot --json "$WORK/model.json"
  else
    # 1 warm-up round (Triton compiles, cuBLAS and SDPA pick their kernels) + the reference's 6.
    "$PYTHON" benchmarks/bench_transformer.py --preset gpt2 --device cuda --autocast bf16 --warmup 1 --repeats 6 \
      --contenders "$MODEL_CONTENDERS" --no-plot --json "$WORK/model.json"
  fi
}

stage_fsdp() {
  # FSDP2 (fully_shard) on one rank through torchrun: native loop and accum_fused's patterns a/b/c
  # (bytes per collective, peak memory, ms per window); its table goes into summary.md.
  if [ "$DRY_RUN" = 1 ]; then
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_fsdp.py --device cpu \
      --vocab 128 --ctx 16 --d-model 32 --layers 1 --heads 2 --seq 8 -k 2 --windows 1 --json "$WORK/fsdp.json"
  else
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_fsdp.py --device cuda \
      --layers 2 --windows 3 --json "$WORK/fsdp.json"
  fi
}

stage_parity() {
  # The update against torch.optim.AdamW's on the same gradients from the same start, torch's own
  # variants beside it, and the trajectory (issue 43 item 3): its table lands in logs.txt.
  if [ "$DRY_RUN" = 1 ]; then
    "$PYTHON" benchmarks/gpu_parity.py --device cpu --tiny --windows 2 --json "$WORK/parity.json"
  else
    "$PYTHON" benchmarks/gpu_parity.py --device cuda --json "$WORK/parity.json"
  fi
}

stage_oom() {
  # A real CUDA out-of-memory error in a micro-batch, recovered by opt.run (issue 30).
  [ "$DRY_RUN" = 1 ] && { echo "dry run: the out-of-memory check needs a GPU"; return 3; }
  "$PYTHON" benchmarks/gpu_oom_check.py --json "$WORK/oom.json"
}

find_sanitizer() {
  local c
  for c in "$(command -v compute-sanitizer)" "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" \
           /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
           /opt/nvidia/compute-sanitizer/compute-sanitizer; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return 0; }
  done
  return 1
}

# run_sanitized TOOL PYTEST-K: a small CUDA slice of tests/test_kernels.py under compute-sanitizer.
run_sanitized() {
  [ "$DRY_RUN" = 1 ] && { echo "dry run: compute-sanitizer $1 skipped"; return 3; }
  local san
  san="$(find_sanitizer)" || { echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin, /usr/local/cuda/bin): $1 skipped"; return 3; }
  echo "$san --tool $1 on tests/test_kernels.py -m cuda -k '$2'"
  # Without torch's caching allocator every tensor is its own cudaMalloc, so an access past a
  # tensor's end is outside any allocation, where memcheck sees it.
  # --error-exitcode 86: a sanitizer finding is told apart from a failing test (pytest: 1).
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$san" --tool "$1" --error-exitcode 86 --print-limit 50 \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_kernels.py -m cuda -k "$2"
  local rc=$?
  [ "$rc" = 86 ] && echo "FAIL: compute-sanitizer $1 reported errors (above)"
  return "$rc"
}

# Under memcheck a test case took ~10 s on the H100 (startup and Triton compiles included): the
# slices are sized to ~12 cases for memcheck and ~4 for racecheck. (The 300 small tensors of
# test_windows_many_small_tensors did not finish in 70 s under memcheck, 2026-11-27: whole windows
# are checked on the odd sizes instead.)
stage_memcheck() {
  run_sanitized memcheck "(test_accumulate and float32-unscaled-add) or test_window_norms or (test_windows_every_dtype and float32-float32-adamw-amsgrad-maximize)"
}

stage_racecheck() {
  # The norm kernels are the ones that share memory between threads (block reductions).
  run_sanitized racecheck "test_window_norms"
}

export -f stage_env stage_build stage_tests bench_args stage_bench stage_train stage_model stage_fsdp stage_parity \
  stage_oom find_sanitizer run_sanitized stage_memcheck stage_racecheck

# run_stage NAME CAP FLOOR_OF_LATER_STAGES: at most CAP seconds, and never so long that the later
# stages lose their floors or the report its reserve.
run_stage() {
  local name=$1 cap=$2 later=$3 now budget rc status note=""
  now=$SECONDS
  budget=$((DEADLINE - now - REPORT_RESERVE - later))
  [ "$budget" -gt "$cap" ] && budget=$cap
  if [ "$budget" -lt 5 ]; then
    printf '%s\tskipped\t0\t0\t0\tno time left before the deadline\n' "$name" >>"$WORK/stages.tsv"
    echo "[gpu_check] $name: skipped (no time left)"
    return
  fi
  echo "[gpu_check] $name: running (budget ${budget}s)"
  timeout --kill-after=10 "$budget" bash -c "stage_$name" >"$WORK/$name.log" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    3) status=skipped; note="$(tail -n 1 "$WORK/$name.log")" ;;
    124 | 137) status=timeout; note="stopped after its ${budget}s budget" ;;
    *) status=failed; note="exit $rc" ;;
  esac
  note="${note//$'\t'/ }"
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - now))" "$budget" "$note" >>"$WORK/stages.tsv"
  echo "[gpu_check] $name: $status ($((SECONDS - now))s)"
  if [ "$status" = failed ] || [ "$status" = timeout ]; then
    tail -n 25 "$WORK/$name.log" | sed "s/^/[$name] /"
  fi
}

# Caps (s) for a real run on an H100 (expected: build ~1.5 min, CUDA tests ~1.5 min, benchmarks
# ~3 min with the model step, FSDP2 ~0.5 min, the out-of-memory check ~0.5 min, sanitizers ~2 min).
# The third number is what the stages after it are guaranteed.
# The sanitizers run last: the slowest per finding, they take the time that is left.
if [ "$DRY_RUN" = 1 ]; then
  run_stage env 120 0; run_stage build 300 0; run_stage tests 300 0; run_stage bench 300 0; run_stage train 300 0
  run_stage model 300 0
  run_stage fsdp 300 0
  run_stage parity 300 0
  run_stage oom 30 0
  run_stage memcheck 30 0; run_stage racecheck 30 0
else
  # Measured on the H100 (2026-11-26/27): env 5 s, build 71-76 s, tests 73 s, bench 38-41 s, train 107 s,
  # fsdp 18-20 s; memcheck's slice did not finish in 80 s (2026-11-27), racecheck's took 20 s.
  # model: not yet measured on a GPU. Estimate 30-60 s: 9 contenders x 7 windows of 32,768 tokens at
  # ~0.2 s (bench_train's GPT-2 windows of 37,888 tokens took 155-265 ms on the H100, 2026-11-27) is
  # ~12 s, plus the first window's setup (native's took 3.1 s there; the tests stage has compiled
  # most of Triton's kernels into its cache), startup and 9 copies of GPT-2 small. Cap 90 s; on the
  # 2026-11-27 times it starts at ~300 s and gets 73. Its time comes out of the floors kept for the
  # stages after it (200 s -> 150: fsdp 30, parity 25, oom 25, memcheck 50, racecheck 20), each at or
  # above its measured time (parity's is not measured) but memcheck's, which takes what is left:
  # ~90 s on those times instead of ~135 s.
  run_stage env     30  430
  run_stage build   150 350
  run_stage tests   120 230
  run_stage bench   60  170
  run_stage train   120 200
  run_stage model   90  150
  run_stage fsdp    40  120
  run_stage parity  30  95  # (not yet measured on a GPU: 3 backends x 3 windows of a 1M-parameter MLP)
  run_stage oom     60  70
  run_stage memcheck 150 20
  run_stage racecheck 60 0
fi

"$PYTHON" "$REPORT" report "$WORK" "$OUTDIR" >"$WORK/report.log" 2>&1 || {
  # The report itself broke: still leave a summary with the stage table and the error.
  { echo "# accum_fused GPU check: the report failed"; echo; echo '```'; cat "$WORK/stages.tsv";
    cat "$WORK/report.log"; echo '```'; } >"$OUTDIR/summary.md"
  echo "report	failed	1	0	0	gpu_check_report.py report failed" >>"$WORK/stages.tsv"
}

# The device tool brings back at most 8 files of at most 16 MiB: say so if that is broken.
files=$(find "$OUTDIR" -type f | wc -l)
big=$(find "$OUTDIR" -type f -size +16M | wc -l)
if [ "$files" -gt 8 ] || [ "$big" -gt 0 ]; then
  echo "**OUTDIR limit broken: $files files, $big over 16 MiB (the device tool returns 8 of at most 16 MiB)**" \
    >>"$OUTDIR/summary.md"
  echo "limits	failed	1	0	0	$files files, $big over 16 MiB" >>"$WORK/stages.tsv"
fi

cat "$OUTDIR/summary.md"
echo "[gpu_check] $((SECONDS - START))s in all; files in $OUTDIR: $(find "$OUTDIR" -type f -printf '%f ')"
if cut -f2 "$WORK/stages.tsv" | grep -qE '^(failed|timeout)$'; then
  exit 1
fi
exit 0
