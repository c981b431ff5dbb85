"""Compiled backend "cpp": the C++/CUDA extension ``accum_fused._C`` (csrc/).

Same keyword-only functions as ``reference.py``, which is their specification. Each call runs
one multi-tensor kernel over all tensors of the call: on CPU one parallel region over chunks of
every tensor, on CUDA one launch (plus one for norms) whatever the number of tensors.

What this module adds to the kernels: the scalar coefficients, computed here with the very
expressions and types the reference uses (Python floats, or fp32 tensor arithmetic for a tensor
``lr``), so that the kernels, which round each coefficient to float once as torch's kernels do,
see the same values; fp32 1-element tensors for GradScaler's scale and the clip coefficient
(CUDA kernels read them on the device, without a host synchronisation); and new momentum
buffers for SGD.

Every tensor a call writes in place gets its autograd version counter bumped (in the binding),
as torch's in-place ops do.

Differences from the reference, none visible through the optimizers:
- with a fused last micro-batch (``grads``), the update does not write the accumulation buffer
  back (the window is closing and the next window overwrites it): 4 bytes/param saved;
- all ``grads`` of one call share one dtype (the front groups calls by gradient dtype);
- kernels walk memory in order, so a tensor whose layout differs from its buffer's (a contiguous
  gradient of a transposed parameter, say; never the case for autograd's gradients) is copied
  into the buffer's layout first, and copied back after the kernel if the kernel writes it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..layout import KERNEL_DTYPES
from ._kernel_args import adam_scalars, device_scalar, host_value, sgd_scalars
from .reference import BF16_UPDATES
from .reference import write_window_grads  # noqa: F401  (torch's foreach ops on every backend)

try:
    from .. import _C
except ImportError as exc:
    # The registry (backends/__init__.py) adds the command that fixes it to every report.
    raise ImportError(f"the compiled extension accum_fused._C does not load ({exc})") from exc

name = "cpp"

# The extension's host-side parts, for the front (window/table.py's step table and plan, in_backward.py's
# hooks, optim.py, ``info``): this module is the only door to accum_fused._C.
with_cuda = bool(_C.with_cuda)
fast_paths = _C.fast_paths
torch_headers = getattr(_C, "torch_headers", "unknown")
StepTable, same_objects = _C.StepTable, _C.same_objects  # csrc/step_table.cpp
HookState, FastHook, install_hook, remove_hook = _C.HookState, _C.FastHook, _C.install_hook, _C.remove_hook  # hooks.cpp
state_fits = _C.state_fits
equal_scalars = _C.equal_scalars



def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32/bf16/fp16 parameters on CPU, and on CUDA when the extension was built with CUDA.
    fp64 parameters go to the reference."""
    if dtype not in KERNEL_DTYPES:
        return False
    device = torch.device(device)
    return device.type == "cpu" or (device.type == "cuda" and _C.with_cuda)


class _Layout:
    """Presents every tensor of a call in its buffer's memory layout (see module docstring)."""

    def __init__(self, buffers: list[Tensor]):
        self.buffers = buffers
        self.copy_back: list[tuple[Tensor, Tensor]] = []

    def _relayout(self, tensors: list[Tensor], write_back: bool) -> list[Tensor]:
        tensors = list(tensors)
        for i in _C.layout_mismatches(tensors=tensors, buffers=self.buffers):
            staged = torch.empty_like(self.buffers[i], dtype=tensors[i].dtype).copy_(tensors[i])
            if write_back:
                self.copy_back.append((tensors[i], staged))
            tensors[i] = staged
        return tensors

    def read(self, tensors: list[Tensor]) -> list[Tensor]:
        return self._relayout(tensors, write_back=False)

    def read_write(self, tensors: list[Tensor]) -> list[Tensor]:
        return self._relayout(tensors, write_back=True)

    def finish(self) -> None:
        for t, staged in self.copy_back:
            t.copy_(staged)


def accumulate(
    *,
    grads: list[Tensor],
    buffers: list[Tensor],
    weight: float,
    overwrite: bool,
    grad_scale: Tensor | None = None,
    norm_weight_sum: float | None = None,
) -> Tensor | None:
    if not buffers:
        return None if norm_weight_sum is None else torch.zeros(0)
    if _C.layout_mismatches(tensors=grads, buffers=buffers):
        grads = _Layout(buffers).read(grads)
    # Positional: called once per parameter per micro-batch by the in-backward hooks, where
    # keyword parsing costs ~0.4 us of the call's ~1.1.
    return _C.accumulate(grads, buffers, float(weight), bool(overwrite), device_scalar(grad_scale, buffers[0].device),
                         None if norm_weight_sum is None else float(norm_weight_sum))


def window_norms(*, buffers: list[Tensor], weight_sum: float) -> Tensor:
    if not buffers:
        return torch.zeros(0)
    return _C.window_norms(buffers=list(buffers), weight_sum=float(weight_sum))


def sgd_update(
    *,
    params: list[Tensor],
    buffers: list[Tensor],
    momentum_buffers: list[Tensor | None],
    weight_sum: float,
    clip_coef: Tensor | None,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    grads: list[Tensor] | None = None,
    weight: float = 1.0,
    overwrite: bool = False,
    grad_scale: Tensor | None = None,
    bf16_update: str = "nearest",
    rounding_keys: list[int] | None = None,
    compensations: list[Tensor] | None = None,
) -> None:
    if not params:
        return
    device = buffers[0].device
    layout = _Layout(buffers)
    first_momentum: list[bool] = []
    live_buffers: list[Tensor] = []
    if momentum != 0:
        for i, momentum_buf in enumerate(momentum_buffers):
            first_momentum.append(momentum_buf is None)
            if momentum_buf is None:
                # The kernel writes b <- g into it (the reference's grad.clone()).
                momentum_buf = momentum_buffers[i] = torch.empty_like(buffers[i])
            live_buffers.append(momentum_buf)
    _C.sgd_update(
        params=layout.read_write(params), buffers=list(buffers), momentum_buffers=layout.read_write(live_buffers),
        first_momentum=first_momentum, weight_sum=float(weight_sum), clip_coef=device_scalar(clip_coef, device),
        **sgd_scalars(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                      maximize=maximize),
        grads=None if grads is None else layout.read(grads), weight=float(weight), overwrite=bool(overwrite),
        grad_scale=device_scalar(grad_scale, device), **_rounding(layout, bf16_update, rounding_keys, compensations),
    )
    layout.finish()


def _rounding(layout: _Layout, bf16_update: str, rounding_keys, compensations) -> dict:
    """The rounding arguments of ``_C.sgd_update`` / ``_C.adam_update`` (the binding checks them)."""
    return dict(rounding=BF16_UPDATES.index(bf16_update), rounding_keys=list(rounding_keys or ()),
                compensations=layout.read_write(compensations) if bf16_update == "kahan" else [])


def adam_update(
    *,
    params: list[Tensor],
    buffers: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step: int,
    weight_sum: float,
    clip_coef: Tensor | None,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    grads: list[Tensor] | None = None,
    weight: float = 1.0,
    overwrite: bool = False,
    grad_scale: Tensor | None = None,
    bf16_update: str = "nearest",
    rounding_keys: list[int] | None = None,
    compensations: list[Tensor] | None = None,
) -> None:
    if not params:
        return
    device = buffers[0].device
    layout = _Layout(buffers)
    _C.adam_update(
        params=layout.read_write(params), buffers=list(buffers), exp_avgs=layout.read_write(exp_avgs),
        exp_avg_sqs=layout.read_write(exp_avg_sqs),
        max_exp_avg_sqs=layout.read_write(max_exp_avg_sqs) if amsgrad else [], weight_sum=float(weight_sum),
        clip_coef=device_scalar(clip_coef, device),
        **adam_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                       amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled_weight_decay),
        grads=None if grads is None else layout.read(grads), weight=float(weight), overwrite=bool(overwrite),
        grad_scale=device_scalar(grad_scale, device), **_rounding(layout, bf16_update, rounding_keys, compensations),
    )
    layout.finish()
