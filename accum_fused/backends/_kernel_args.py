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
