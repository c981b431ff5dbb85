"""The per-tensor rules of accum_fused/layout.py (the spec) against the extension's copies
(csrc/ops.h: ``kernel_dtype``/``kernel_grad``, ``fits``, ``adoptable``), which plain mode's step
table and the in-backward hooks ask instead of deciding again: the same answer for every
dtype pair, device, shape, memory layout and view. Where the extension does not know a dtype
(complex) it must say no, handing the tensor to Python, never yes."""
from __future__ import annotations

import itertools

import pytest
import torch

from accum_fused import backends, layout

from _helpers import built_without_extension

pytestmark = pytest.mark.skipif(built_without_extension(), reason="the extension's rules")

REAL = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
OTHER = (torch.complex64, torch.int64)


def _rules():
    return backends._load("cpp")._C


def _tensors(dtype, device="cpu"):
    """One tensor of each shape and memory layout a buffer, state or gradient comes in."""
    base = torch.zeros(6, 4, dtype=dtype, device=device)
    return {
        "contiguous": torch.zeros(4, 6, dtype=dtype, device=device),
        "transposed": base.t(),  # (4, 6), not contiguous, a view
        "slice": torch.zeros(5, 6, dtype=dtype, device=device)[1:],  # (4, 6), contiguous, a view
        "other shape": torch.zeros(6, 4, dtype=dtype, device=device),
        "empty": torch.zeros(0, dtype=dtype, device=device),
    }


def _params():
    for dtype in REAL + OTHER:
        for layout_name, p in _tensors(dtype).items():
            if layout_name in ("contiguous", "transposed", "empty"):
                yield f"{dtype}-{layout_name}", p


def _others():
    """Every tensor a rule is asked about beside a parameter: each dtype, device and layout."""
    for dtype, device in itertools.product(REAL + OTHER, ("cpu", "meta")):
        for name, t in _tensors(dtype, device).items():
            yield (dtype, device, name), t


@pytest.mark.parametrize("param_id,param", list(_params()))
def test_fits_is_layout_fits(param_id, param):
    rules = _rules()
    for case, t in _others():
        expected = layout.fits(t, param) and param.dtype in REAL
        assert rules.fits(t, param) == expected, (param_id, case)
        # (state_fits: the same rule over lists; a parameter of a dtype it does not know: no)
        assert rules.state_fits([param], [[t]]) == expected, (param_id, case)


@pytest.mark.parametrize("param_id,param", list(_params()))
def test_adoptable_is_layout_adoptable(param_id, param):
    rules = _rules()
    for case, grad in _others():
        expected = layout.adoptable(grad, param) and param.dtype in REAL
        assert rules.adoptable(grad, param) == expected, (param_id, case)


def test_kernel_grad_takes_the_kernel_dtypes_with_readable_memory():
    rules = _rules()
    for dtype in REAL + OTHER:
        g = torch.ones(3, dtype=dtype)
        assert rules.kernel_grad(g) == (dtype in layout.KERNEL_DTYPES), dtype
        assert rules.kernel_grad(g.t() if g.dim() == 2 else g[1:]) == (dtype in layout.KERNEL_DTYPES), dtype
    g = torch.ones(3)
    # Memory that does not hold the values (layout.readable_grad materializes these first).
    assert not rules.kernel_grad(torch._efficientzerotensor(3))
    assert not rules.kernel_grad(torch._neg_view(g))
    assert not rules.kernel_grad(torch.ones(3).to_sparse())
    assert layout.readable_grad(torch._neg_view(g)).is_neg() is False


@pytest.mark.parametrize("param_id,param", list(_params()))
def test_adopts_is_the_parameters_side_of_adoptable(param_id, param):
    """The fast paths' routes (window.table.route) ask layout.adopts once per layout epoch,
    before any gradient arrives: it must say yes exactly where a gradient as autograd makes it
    (the parameter's dtype and shape, contiguous, fresh) is adoptable, and where it says no, no
    gradient may be."""
    fresh = torch.zeros(param.shape, dtype=param.dtype)
    assert layout.adopts(param) == layout.adoptable(fresh, param), param_id
    if not layout.adopts(param):
        assert not any(layout.adoptable(g, param) for (dtype, _, _), g in _others() if dtype == param.dtype), param_id
