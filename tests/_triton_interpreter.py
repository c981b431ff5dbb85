"""Whether Triton's CPU interpreter (TRITON_INTERPRET=1, how the suite runs the Triton kernels on
CPU) can run this package's kernels with the numpy installed.

Triton 3.6's interpreter (the one torch 2.11's CUDA wheels pin) turns a loop bound loaded from
memory into a Python int with ``int()`` of a one-element array, which numpy 2.4 refuses ("only
0-dimensional arrays can be converted to Python scalars"); later interpreters squeeze it first.
Every kernel here loops over a tensor's range so, and the suite would report hundreds of
failures that are the interpreter's, not the kernels'. The probe runs that one construct.
"""
from __future__ import annotations

import os

import torch


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def loop_over_loaded_bounds(bounds, out, BLOCK: tl.constexpr):
        for off in range(tl.load(bounds), tl.load(bounds + 1), BLOCK):
            tl.store(out + off + tl.arange(0, BLOCK), 1.0)

    return loop_over_loaded_bounds


def problem() -> str | None:
    """Why the interpreter cannot run the kernels here (naming the fix), or None (it can, or the
    suite does not run it: no TRITON_INTERPRET=1, or no Triton)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return None
    try:
        import numpy
        import triton
        kernel = _probe_kernel()
    except ImportError:
        return None
    out = torch.zeros(8)
    try:
        kernel[(1,)](torch.tensor([0, 8]), out, BLOCK=4)
    except Exception as exc:  # the interpreter wraps the TypeError in its own error
        return (f"Triton {triton.__version__}'s CPU interpreter (TRITON_INTERPRET=1) cannot run this "
                f"package's kernels with numpy {numpy.__version__}: a loop bound loaded from memory fails "
                f"with {type(exc).__name__}: {exc}. Install numpy<2.4 (`pip install 'numpy<2.4'`), or run "
                f"without TRITON_INTERPRET=1 (the Triton backend's CPU tests are then skipped).")
    if out.tolist() != [1.0] * 8:
        return f"Triton {triton.__version__}'s CPU interpreter ran a loop over loaded bounds wrongly: {out.tolist()}"
    return None
