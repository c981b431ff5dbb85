#!/usr/bin/env bash
# The release check: build accum_fused's sdist, install it into a fresh virtual environment the
# way a user would (torch pinned first, then the sdist built against it, the C++ extension
# compiled from the sdist's csrc/), and run a smoke test from outside any source tree, so it
# imports the installed package: import, available_backends(), and one AdamW window
# (accumulation_steps=2, two micro-batches of other sizes) on each available backend against
# torch.optim.AdamW on the weighted mean gradient.
#
# Usage: PYTHON=/path/to/venv/bin/python bash .ci/sdist_smoke.sh [SOURCE_DIR]
#   PYTHON      a python with torch, setuptools, wheel, ninja and `build` installed (the tests
#               job's venv: `pip install -e ".[test]"` brings `build`); default: python3
#   SOURCE_DIR  the tree to build the sdist from (default: this checkout). The build writes
#               accum_fused.egg-info there; .ci/run passes its throwaway copy.
# Most of its time is compiling the extension (about 3 CPU-minutes) and installing torch; measured:
# 15.5 minutes on a 2-core VM shared with other builds and test runs (load 5-8), not idle.
set -euo pipefail
PYTHON=${PYTHON:-python3}
SRC=$(cd "${1:-$(dirname "$0")/..}" && pwd)
TORCH_PIN="torch==2.13.0"   # the README's pin; never let pip choose a torch

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
version=$(cd "$SRC" && "$PYTHON" -c 'exec(open("accum_fused/version.py").read()); print(__version__)')
sdist="$work/dist/accum_fused-$version.tar.gz"

echo "::: sdist: building accum_fused $version from $SRC"
(cd "$SRC" && "$PYTHON" -m build --sdist --no-isolation --outdir "$work/dist" .)
[ -f "$sdist" ] || { echo "no $sdist after the build" >&2; ls "$work/dist" >&2; exit 1; }

# What the sdist must hold to build and to be a release: the extension's sources and headers,
# the metadata files, and no compiled objects carried over from the source tree.
listing=$(tar tzf "$sdist")
root="accum_fused-$version"
missing=()
for f in setup.py pyproject.toml README.md LICENSE CHANGELOG.md accum_fused/__init__.py \
         $(cd "$SRC" && find csrc -type f \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.sh' \) | sort); do
  grep -qx "$root/$f" <<<"$listing" || missing+=("$f")
done
[ ${#missing[@]} -eq 0 ] || { echo "the sdist lacks: ${missing[*]}" >&2; exit 1; }
if grep -E '\.(so|pyd|o)$' <<<"$listing"; then echo "the sdist carries compiled files (above)" >&2; exit 1; fi
tar xzf "$sdist" -O "$root/PKG-INFO" | grep -E '^(Version|License-Expression|License-File): ' \
  | tee "$work/pkg-info"
grep -qx "License-Expression: BSD-3-Clause" "$work/pkg-info" || { echo "PKG-INFO has no BSD-3-Clause license" >&2; exit 1; }

echo "::: sdist: built in $SECONDS s; installing into a fresh venv"
"$PYTHON" -m venv "$work/venv"
VPY="$work/venv/bin/python"
"$VPY" -m pip install -q "$TORCH_PIN" numpy setuptools wheel ninja
"$VPY" -m pip install --no-build-isolation "$sdist"

echo "::: sdist: installed at $SECONDS s; smoke test"
mkdir "$work/outside"
cd "$work/outside"   # no accum_fused/ here: the import must find the installed package
"$VPY" - <<'EOF'
import os
import sys

import torch

import accum_fused

site = os.path.dirname(os.path.dirname(os.path.abspath(accum_fused.__file__)))
assert site.startswith(sys.prefix), f"imported {accum_fused.__file__}, not the installed package"
backends = accum_fused.available_backends()
print("accum_fused", accum_fused.__version__, "from", accum_fused.__file__)
print("available backends:", backends)
assert "torch" in backends and "cpp" in backends, "the sdist's extension did not build or load"

for backend in backends:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ref = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, accumulation_steps=2,
                            backend=backend)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    batches = [(torch.randn(3, 8), torch.randn(3, 1)), (torch.randn(5, 8), torch.randn(5, 1))]
    total = sum(len(x) for x, _ in batches)
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step(weight=len(x))
        opt.zero_grad()
    assert opt.updated and opt.update_count == 1, (backend, opt.updated, opt.update_count)
    # The reference: one AdamW step on the weighted mean of the micro-batches' mean-loss gradients.
    loss = 0
    for x, y in batches:
        out = torch.tanh(x @ ref[0].T + ref[1]) @ ref[2].T + ref[3]
        loss = loss + torch.nn.functional.mse_loss(out, y) * (len(x) / total)
    loss.backward()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    print(f"backend {backend!r}: one window matches torch.optim.AdamW on the summed gradient")
print("sdist smoke test passed")
EOF
