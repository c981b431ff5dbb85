"""Scalar arguments as the kernel backends ("cpp", "triton") hand them to their kernels."""
from __future__ import annotations

import torch
from torch import Tensor


def host_value(x: float | Tensor) -> float:
    """A Python number; a 0-dim tensor lr (or a coefficient computed from one) gives its value."""
    return x.item() if isinstance(x, Tensor) else float(x)


def device_scalar(t: Tensor | None, device: torch.device) -> Tensor | None:
    """GradScaler's scale or the clip coefficient as a 1-element fp32 tensor on ``device``, so a
    CUDA kernel reads it from device memory (no host synchronisation); the reference does the
    same ``.to(buf.device, buf.dtype)``."""
    return None if t is None else t.detach().to(device=device, dtype=torch.float32).reshape(1)


def sgd_scalars(*, lr, momentum, dampening, weight_decay, nesterov, maximize) -> dict:
    """The scalar arguments of an SGD update (``_C.sgd_update``, triton's ``sgd_kernel``, and what
    in_backward's extension hooks fold a parameter's update with)."""
    return dict(neg_lr=-host_value(lr), momentum=float(momentum), one_minus_dampening=1 - dampening,
                weight_decay=float(weight_decay), nesterov=bool(nesterov), maximize=bool(maximize))


def adam_scalars(*, step, lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled_weight_decay) -> dict:
    """The scalar arguments of an Adam update after ``step`` steps (``_C.adam_update``, triton's
    ``adam_kernel``, and what in_backward's extension hooks fold a parameter's update with): the
    reference's expressions, evaluated with the reference's types (a tensor lr gives fp32 tensor
    arithmetic), then read as numbers: each kernel rounds each to fp32 once."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    decay_factor = 1 - lr * weight_decay if decoupled_weight_decay and weight_decay != 0 else 1.0
    return dict(decay_factor=host_value(decay_factor), weight_decay=float(weight_decay), lerp_weight=1 - beta1,
                beta2=float(beta2), one_minus_beta2=1 - beta2, bc2_sqrt=bias_correction2**0.5, eps=float(eps),
                neg_step_size=-host_value(step_size), decoupled=bool(decoupled_weight_decay), amsgrad=bool(amsgrad),
                maximize=bool(maximize))
