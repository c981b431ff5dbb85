"""Opt-in model-side helpers that work with an accum_fused optimizer.

- ``fuse_linear_gradients(model, opt)``: ``nn.Linear`` weight gradients computed by the GEMM
  straight into the optimizer's window buffers (linear.py).
"""
from .linear import FusedLinearHandle, fuse_linear_gradients

__all__ = ["FusedLinearHandle", "fuse_linear_gradients"]
