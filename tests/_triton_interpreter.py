"""Whether Triton's CPU interpreter (TRITON_INTERPRET=1, how the suite runs the Triton kernels on
CPU) runs this package's kernels as a GPU does, so that checking them on CPU means something.

Triton 3.6's interpreter (the one torch 2.11's CUDA wheels pin) fails it twice, both fixed in
later interpreters (3.9's, which CI runs):
- ``tl.fma`` is computed as ``x * y + z`` in numpy, rounding twice where a GPU rounds once; the
  kernels fuse exactly where torch's kernels do (``_triton_kernels``' module notes), so the
  results drift from torch's by an ulp a step (20 of the suite's comparisons with torch.optim);
- a loop bound loaded from memory becomes a Python int through ``int()`` of a one-element array,
  which numpy deprecated in 1.25 (a DeprecationWarning, an error where a test turns warnings
  into errors) and refuses from 2.4 (every Triton case fails).
Neither is the kernels' doing, and a GPU compiles them as it should. Where the probe finds one, the
Triton backend's CPU cases are skipped with its reason (``_helpers.cpu_skip_reason``), and
``test_install`` fails once naming it, so such a run is not green by skipping.
"""
from __future__ import annotations

import os
import warnings

import torch

# fp32 x, y, z with x * y + z = 2^-24 exactly, which a product rounded first loses:
# (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24, whose last term is half an ulp: rounded first, the tie goes to
# even, 1 + 2^-11, and the sum is 0.
_FMA_INPUTS = [1 + 2 ** -12, 1 + 2 ** -12, -(1 + 2 ** -11)]
_FMA_EXACT = 2.0 ** -24


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(bounds, fma_inputs, out, BLOCK: tl.constexpr):
        for off in range(tl.load(bounds), tl.load(bounds + 1), BLOCK):
            tl.store(out + off + tl.arange(0, BLOCK), 1.0)
        tl.store(out + 8, tl.fma(tl.load(fma_inputs), tl.load(fma_inputs + 1), tl.load(fma_inputs + 2)))

    return probe


def problem() -> str | None:
    """Why the interpreter does not run the kernels as a GPU would (naming the fix), or None (it
    does, or the suite does not run it: no TRITON_INTERPRET=1, or no Triton)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import numpy
        import triton
        kernel = _probe_kernel()
    except ImportError:
        return None
    which = f"Triton {triton.__version__}'s CPU interpreter (TRITON_INTERPRET=1, numpy {numpy.__version__})"
    fix = ("The Triton kernels are checked on CPU only with an interpreter that does (Triton 3.9's does; "
           "on a GPU they run compiled, unaffected): its CPU cases are skipped here.")
    out = torch.zeros(9)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kernel[(1,)](torch.tensor([0, 8]), torch.tensor(_FMA_INPUTS, dtype=torch.float32), out, BLOCK=4)
    except Exception as exc:  # the interpreter wraps the numpy error or warning in its own
        return f"{which} cannot run a loop over bounds loaded from memory ({type(exc).__name__}: {exc}). {fix}"
    if out[:8].tolist() != [1.0] * 8:
        return f"{which} ran a loop over bounds loaded from memory wrongly ({out[:8].tolist()}). {fix}"
    if out[8].item() != _FMA_EXACT:
        return (f"{which} rounds tl.fma twice (got {out[8].item()!r} where one rounding gives {_FMA_EXACT!r}), "
                f"as a GPU does not. {fix}")
    return None
