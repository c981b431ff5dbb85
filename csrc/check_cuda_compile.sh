#!/usr/bin/env bash
# Compile checks for the CUDA side of the extension, for machines without a GPU or a CUDA build
# of torch (CI): a compile error in a kernel or in the CUDA half of the binding fails the run.
#   1. every csrc/**/*.cu with nvcc alone (the kernels are torch-free), into a temp dir;
#   2. csrc/bindings.cpp with WITH_CUDA, syntax only (-fsyntax-only), against the installed
#      torch's headers and the CUDA toolkit's; skipped, saying so, when python cannot import
#      torch. CPU wheels of torch lack one generated header, c10/cuda/impl/cuda_cmake_macros.h;
#      a stub with its one macro is supplied from the temp dir when it is missing.
# Usage: csrc/check_cuda_compile.sh            (sm_90)
#        CUDA_ARCHS="80 90" csrc/check_cuda_compile.sh
# Flags match the real build: setup.py's nvcc flags (-O3, -fmad=false, C++17) plus the defines
# torch's BuildExtension always adds (no implicit half/bfloat16 conversions or operators), and
# C++20 for the binding as BuildExtension compiles it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nvcc_bin="${NVCC:-nvcc}"
python_bin="${PYTHON:-python}"
command -v "$nvcc_bin" >/dev/null || { echo "check_cuda_compile: nvcc not found (set NVCC=...)" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
count=0
for arch in ${CUDA_ARCHS:-90}; do
  while IFS= read -r -d '' src; do
    echo "nvcc sm_$arch: ${src#"$here"/}"
    if ! "$nvcc_bin" -std=c++17 -O3 -fmad=false -arch="sm_$arch" -Werror all-warnings -Xcompiler -Wall \
        -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
        -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr \
        -I"$here" -c "$src" -o "$out/$(basename "$src").sm_$arch.o"; then
      status=1
    fi
    count=$((count + 1))
  done < <(find "$here" -name '*.cu' -print0 | sort -z)
done
[ "$count" -gt 0 ] || { echo "check_cuda_compile: no .cu files under $here" >&2; exit 1; }

if includes="$("$python_bin" -c '
import sysconfig
from torch.utils.cpp_extension import include_paths
print(" ".join(["-I" + p for p in include_paths()] + ["-I" + sysconfig.get_paths()["include"]]))' 2>/dev/null)"; then
  cuda_include="$(dirname "$(command -v "$nvcc_bin")")/../include"
  [ -f "$cuda_include/cuda_runtime_api.h" ] || cuda_include="${CUDA_HOME:-/usr/local/cuda}/include"
  mkdir -p "$out/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  echo "c++ -fsyntax-only -DWITH_CUDA: bindings.cpp"
  # shellcheck disable=SC2086  # $includes is a list of -I flags
  if ! "${CXX:-c++}" -std=c++20 -fsyntax-only -Wall -Wno-unknown-pragmas -DWITH_CUDA -DTORCH_EXTENSION_NAME=_C \
      -DTORCH_API_INCLUDE_EXTENSION_H -I"$here" $includes -I"$cuda_include" -idirafter "$out/stub" \
      "$here/bindings.cpp"; then
    status=1
  fi
  count=$((count + 1))
else
  echo "check_cuda_compile: $python_bin cannot import torch; skipped the WITH_CUDA syntax check of bindings.cpp"
fi
[ "$status" -eq 0 ] && echo "check_cuda_compile: $count check(s) OK"
exit "$status"
