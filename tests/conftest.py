"""Shared fixtures.

``backend``: every core test constructs its optimizers with ``backend=backend``, so the whole
suite reruns on each compiled backend that loads on the machine; the others are skipped.

``tolerances``: per-dtype (rtol, atol) for comparisons that cannot be bit-exact (kernel backends
against the reference, reduced-precision parameters). Kernel tests look their dtype up here.
"""
from __future__ import annotations

import pytest
import torch

from _helpers import cpu_skip_reason

BACKENDS = ["torch", "cpp", "triton"]

# dtype -> (rtol, atol)
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (1e-3, 1e-5),
}


# Kernel backends against the reference backend on the same inputs (tests/test_kernels.py):
# - torch.float32: (rtol, atol as a fraction of the tensor's largest magnitude) for fp32
#   parameters, buffers and state after a few windows: a few roundings (CPU kernels are
#   bit-exact for updates; norms are summed in another order, and CUDA rounds some ops apart).
# - torch.bfloat16 / torch.float16: ulps by which the kernel's error against an fp64 run may
#   exceed the reference backend's own error, element by element.
KERNEL_TOLERANCES: dict[torch.dtype, tuple[float, float] | int] = {
    torch.float32: (2e-6, 1e-6),
    torch.bfloat16: 1,
    torch.float16: 1,
}


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: runs on a CUDA device where there is one (benchmarks/gpu_check.sh runs these)")


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    reason = cpu_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    return request.param


@pytest.fixture
def tolerances() -> dict[torch.dtype, tuple[float, float]]:
    return dict(TOLERANCES)
