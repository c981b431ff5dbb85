"""Opt-in model-side helpers that work with an accum_fused optimizer.

- ``fuse_linear_gradients(model, opt)``: ``nn.Linear`` weight (and bias) gradients computed
  straight into the optimizer's window buffers (linear.py).
- ``window_batchnorm(model, opt)``: BatchNorm running statistics updated once per window with
  the big batch's statistics, not once per micro-batch (batchnorm.py).
"""
from .batchnorm import WindowBatchNorm, window_batchnorm
from .linear import FusedLinearHandle, fuse_linear_gradients

__all__ = ["FusedLinearHandle", "fuse_linear_gradients", "WindowBatchNorm", "window_batchnorm"]
