#!/usr/bin/env bash
# Compile check of the extension's C++ against another torch's headers, without installing it:
# every csrc/*.cpp and csrc/cpu/*.cpp, syntax only (-fsyntax-only), with the flags setup.py and
# torch's BuildExtension use, against the torch/include of a torch wheel (unpacked: a wheel is a
# zip, and its headers need none of its CUDA dependencies). The torch version is read from the
# headers themselves (torch/version.h), so each source's version guards are what that torch's
# build would see. A second pass adds -DWITH_CUDA to bindings.cpp with the CUDA toolkit's headers
# when nvcc is found (the CUDA half of the binding, as csrc/check_cuda_compile.sh does).
#
# Wheels of Python 3.11 and this platform are what pip picks; the headers do not depend on either.
# Usage: csrc/check_torch_headers.sh VERSION...         download each torch==VERSION wheel (no
#                                                       deps), unpack its headers, check
#        TORCH_INCLUDE=/x/torch/include csrc/check_torch_headers.sh   check against that tree
# Wheels and headers are kept under ${ACCUM_FUSED_WHEEL_CACHE:-~/.cache/accum_fused/torch-headers}.
# pip's configuration is ignored for the download (PIP_CONFIG_FILE=/dev/null): a machine's
# constraint on the torch it installs must not stop a download of headers only.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python_bin="${PYTHON:-python3}"
cache="${ACCUM_FUSED_WHEEL_CACHE:-$HOME/.cache/accum_fused/torch-headers}"
py_include="$("$python_bin" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"

check_tree() {  # $1: a torch/include directory
  local inc="$1" status=0 version
  version="$(printf '#include <torch/version.h>\nTORCH_VERSION_MAJOR.TORCH_VERSION_MINOR.TORCH_VERSION_PATCH\n' |
    "${CXX:-c++}" -E -P -x c++ -I"$inc" -I"$inc/torch/csrc/api/include" - 2>/dev/null | tr -d ' ' | tail -1)" || true
  [[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "check_torch_headers: no torch/version.h under $inc" >&2; return 1; }
  # The C++ standard that torch's BuildExtension compiles extensions with (c++17 up to 2.12,
  # c++20 from 2.13): read from the cpp_extension.py beside the headers, so each torch is checked
  # the way its own build would compile us.
  local std
  std="$(grep -o "cpp_flag_prefix + 'c++[0-9]*'" "$inc/../utils/cpp_extension.py" 2>/dev/null | grep -o 'c++[0-9]*' | head -1)" || true
  [ -n "$std" ] || { echo "check_torch_headers: no torch/utils/cpp_extension.py beside $inc (its -std)" >&2; return 1; }
  local flags=(-std="$std" -fsyntax-only -Wall -Wno-unknown-pragmas -fopenmp -DTORCH_EXTENSION_NAME=_C
               -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1 -I"$here" -I"$inc"
               -I"$inc/torch/csrc/api/include" -I"$py_include")
  local src
  for src in "$here"/*.cpp "$here"/cpu/*.cpp; do
    if "${CXX:-c++}" "${flags[@]}" "$src"; then
      echo "torch $version ($std): ${src#"$here"/} OK"
    else
      echo "torch $version: ${src#"$here"/} FAILED" >&2
      status=1
    fi
  done
  if command -v nvcc >/dev/null; then
    local cuda_include stub
    cuda_include="$(dirname "$(command -v nvcc)")/../include"
    [ -f "$cuda_include/cuda_runtime_api.h" ] || cuda_include="${CUDA_HOME:-/usr/local/cuda}/include"
    stub="$(mktemp -d)"
    mkdir -p "$stub/c10/cuda/impl"
    echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
    if "${CXX:-c++}" "${flags[@]}" -DWITH_CUDA -I"$cuda_include" -idirafter "$stub" "$here/bindings.cpp"; then
      echo "torch $version: bindings.cpp -DWITH_CUDA OK"
    else
      echo "torch $version: bindings.cpp -DWITH_CUDA FAILED" >&2
      status=1
    fi
    rm -rf "$stub"
  fi
  return "$status"
}

status=0
if [ -n "${TORCH_INCLUDE:-}" ]; then
  check_tree "$TORCH_INCLUDE" || status=1
fi
for version in "$@"; do
  dir="$cache/$version"
  if [ ! -d "$dir/torch/include/torch" ]; then
    mkdir -p "$dir/wheel"
    PIP_CONFIG_FILE=/dev/null "$python_bin" -m pip download -q --disable-pip-version-check --no-deps \
      "torch==$version" -d "$dir/wheel"
    "$python_bin" - "$dir" <<'EOF'
import glob, sys, zipfile
dest = sys.argv[1]
(wheel,) = glob.glob(f"{dest}/wheel/torch-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("torch/include/") or n == "torch/utils/cpp_extension.py"])
EOF
    rm -rf "$dir/wheel"  # (0.5-0.9 GB; the headers are ~30 MB)
  fi
  check_tree "$dir/torch/include" || status=1
done
[ "$status" -eq 0 ] && echo "check_torch_headers: OK"
exit "$status"
