#!/usr/bin/env bash
# The oldest supported torch, built and run (README "Set up": 2.6 to 2.15), not only compiled
# against: a fresh venv with torch==VERSION (PyPI's Linux build is its CUDA build; its CUDA
# libraries load without a GPU), the extension built against it (CPU kernels: the CUDA half is
# compile-checked by csrc/check_cuda_compile.sh) from a clean copy of the checkout, and the test
# files whose code depends on torch's Python side (optimizers, autograd hooks, the step table,
# state dicts, nn, the backends' loading). Python-side breaks that only running shows, found
# this way: torch < 2.7's Adam had no decoupled_weight_decay, < 2.10 no register_effect, < 2.8
# no addmm(out_dtype=), Triton < 3.4 (torch 2.6's pin) no triton.knobs.
# Usage: .ci/oldest_torch.sh CHECKOUT [VERSION]   (VERSION: 2.6.0)
set -euo pipefail
checkout="$(cd "$1" && pwd)"
version="${2:-2.6.0}"
python_bin="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A copy of its own: an editable install builds the extension into the source tree, and the
# checkout's belongs to the pinned torch.
mkdir -p "$work/src"
(cd "$checkout" && git ls-files -z | xargs -0 -I{} cp --parents {} "$work/src")
"$python_bin" -m venv "$work/venv"
# pip's configuration is ignored: a machine's cap on the torch it installs must not pick another.
# No cache: the CUDA build's wheels (~3 GB) would stay on the disk beside the venv they fill.
export PIP_CONFIG_FILE=/dev/null PIP_NO_CACHE_DIR=1
"$work/venv/bin/pip" install -q "torch==$version" numpy setuptools wheel ninja
(cd "$work/src" && ACCUM_FUSED_NO_CUDA=1 "$work/venv/bin/pip" install -q --no-build-isolation -e . &&
  "$work/venv/bin/pip" install -q "pytest>=7" "pytest-xdist>=3.5" expecttest)
"$work/venv/bin/python" -c "import torch, accum_fused; assert torch.__version__.startswith('$version'), torch.__version__"
cd "$work/src"
"$work/venv/bin/python" -m accum_fused info
# No TRITON_INTERPRET: the Triton that torch pins here is checked only where it runs compiled
# (tests/_triton_interpreter.py: 3.2's interpreter does not run the kernels as a GPU does).
"$work/venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadfile \
  tests/test_install.py tests/test_accumulation.py tests/test_in_backward.py tests/test_fast_hooks.py \
  tests/test_step_table.py tests/test_state_dict.py tests/test_torch_parity.py tests/test_validation.py \
  tests/test_recovery.py tests/test_host_work.py tests/test_nn_linear.py tests/test_nn_batchnorm.py \
  tests/test_triton_backend.py tests/test_amp_clip.py tests/test_autograd_edges.py tests/test_bf16_update.py
