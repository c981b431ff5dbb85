"""Shared fixtures.

``backend``: every core test constructs its optimizers with ``backend=backend``, so the whole
suite reruns on each compiled backend that loads on the machine; the others are skipped.

``tolerances``: per-dtype (rtol, atol) for comparisons that cannot be bit-exact (kernel backends
against the reference, reduced-precision parameters). Kernel tests look their dtype up here.
"""
from __future__ import annotations

import pytest
import torch

import accum_fused

BACKENDS = ["torch", "cpp", "triton"]

# dtype -> (rtol, atol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    name = request.param
    available = accum_fused.available_backends()
    if name not in available:
        pytest.skip(f"backend {name!r} not available here (available: {available})")
    return name


@pytest.fixture
def tolerances() -> dict[torch.dtype, tuple[float, float]]:
    return dict(TOLERANCES)
