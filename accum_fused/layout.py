"""What accum_fused keeps per parameter, and what a backend sees of it.

Owns: the dtype of accumulation buffers and optimizer state (``state_dtype``, and
``conform_state``: state that follows its parameters' dtype and device), the view a
backend gets of a parameter, gradient, buffer or state tensor (``kernel_view``: a DTensor's
local shard, a complex tensor as real), and the way back (``like_param``).
Must not: know about optimizers, windows or process groups; it depends on torch alone, so
every other module may use it.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor

# Optimizer state entries that hold one value per parameter element (everything but "step").
ELEMENTWISE_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

# The parameter (and gradient) dtypes the kernel backends take (cpp, triton; csrc/ops.h's
# kernel_dtype is the extension's copy, compared in tests): fp64 and complex go to the reference.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_COMMON_STATE_DTYPES = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32,
                        torch.float64: torch.float64}


def state_dtype(param: Tensor) -> torch.dtype:
    """Buffers and optimizer state: fp64 for fp64 parameters, fp32 for every other real dtype;
    complex64 / complex128 for complex parameters (torch.optim's state layout for them)."""
    common = _COMMON_STATE_DTYPES.get(param.dtype)  # (asked per parameter per step)
    if common is not None:
        return common
    if param.is_complex():
        return torch.complex128 if param.dtype == torch.complex128 else torch.complex64
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def fits(t: Tensor, param: Tensor) -> bool:
    """Whether ``t``, a window buffer or a state tensor of ``param``, still fits it: its state
    dtype, device and shape. What does not is conformed or refused (Window.conform,
    conform_state); the extension's copy is csrc/ops.h's ``fits``, compared in tests."""
    return t.dtype == state_dtype(param) and t.device == param.device and t.shape == param.shape


def adopts(param: Tensor) -> bool:
    """The parameter's side of ``adoptable``, known before any gradient arrives (the fast paths'
    routes, window.table.route): its buffer would be of its own dtype (fp32, fp64) and layout."""
    return param.dtype == state_dtype(param) and param.is_contiguous()


def adoptable(grad: Tensor, param: Tensor) -> bool:
    """Whether a window's first gradient of ``param`` can become its buffer itself (zero-copy):
    of the buffer's dtype and device, contiguous as its parameter, and no view (a view may be
    DDP's bucket; FSDP2's shards are views of one reduce-scatter output, and DTensors). Whether
    anything else holds it is the caller's (the extension asks autograd's own test)."""
    return (grad.dtype == state_dtype(param) and grad.device == param.device and grad._base is None
            and grad.is_contiguous() and param.is_contiguous() and not is_dtensor(grad))


def conform_state(state, params, name_of, dtype_of=state_dtype) -> None:
    """Optimizer ``state`` (torch's per-parameter dicts) follows its parameters: elementwise
    entries are moved to ``dtype_of(p)`` (None: the entry keeps its dtype) and ``p``'s device
    after a ``model.to(...)``; an entry of another shape came from another model's checkpoint
    and raises (``name_of(p)`` names the parameter)."""
    for p in params:
        p_state = state.get(p, {})
        for key in ELEMENTWISE_STATE:
            value = p_state.get(key)
            if not isinstance(value, Tensor):
                continue
            if value.shape != p.shape:
                raise ValueError(
                    f"{name_of(p)} does not match its optimizer state {key!r} of shape {tuple(value.shape)}: either "
                    "the parameter changed shape after the optimizer's last update (build a new optimizer for a "
                    "resized model: its state cannot follow), or the loaded state_dict belongs to another model "
                    "(load one saved from this model's optimizer)"
                )
            dtype = dtype_of(p) or value.dtype
            if value.dtype != dtype or value.device != p.device:
                p_state[key] = value.to(device=p.device, dtype=dtype)


def is_dtensor(t: Tensor) -> bool:
    # Only FSDP2 / tensor-parallel users have DTensors, and they have imported the module.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def kernel_view(t: Tensor) -> Tensor:
    """What a backend sees of a parameter, gradient, buffer or state tensor: a DTensor's local
    shard (FSDP2: every operation of the window is elementwise, so each rank updates its own
    shard), complex tensors as real ones with a trailing dimension of 2, as torch.optim's own
    implementations do (torch.view_as_real). Views: writes reach the original."""
    if type(t) in _PLAIN_TYPES and not t.is_complex():
        return t  # the common case, asked per parameter per micro-batch by the in-backward hooks
    if is_dtensor(t):
        t = t.to_local()
    return torch.view_as_real(t) if t.is_complex() else t


def readable_grad(grad: Tensor) -> Tensor:
    """``grad`` as memory a backend can read. Autograd may hand a ZeroTensor (no memory behind it:
    ``torch._efficientzerotensor``) or a view whose negation or conjugation is a flag on the
    tensor (its raw memory has the other sign); AccumulateGrad stores either as ``.grad``. Rare,
    and materialized here; every other gradient is returned as it is. (The extension declines
    them, and its ops refuse them, so that they come this way.)"""
    if grad._is_zerotensor():
        return torch.zeros_like(grad)
    if grad.is_neg() or grad.is_conj():
        return grad.resolve_conj().resolve_neg()
    return grad


def like_param(local: Tensor, param: Tensor) -> Tensor:
    """A state tensor a backend created from local shards, given the parameter's global layout
    back (a DTensor for a DTensor parameter, complex for a complex one), as torch.optim's own
    state would have it."""
    if param.is_complex() and not local.is_complex():
        local = torch.view_as_complex(local)
    if is_dtensor(param) and not is_dtensor(local):
        from torch.distributed.tensor import DTensor
        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return local
