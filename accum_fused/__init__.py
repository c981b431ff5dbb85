"""accum_fused: gradient accumulation inside the optimizer.

Call ``opt.step(weight=...)`` after every micro-batch's backward; the optimizer adds the
gradients into fp32 buffers and applies the update every ``accumulation_steps`` calls (and on
``opt.flush()`` for a partial last window). ``process_group=`` synchronises data-parallel ranks
once per window; ``GradientAccumulator`` gives any torch.optim optimizer the same accumulation.
Importing this package loads no extension and touches no GPU.
"""
from .backends import available_backends
from .checkpoint_files import CheckpointCorruptError, load_checkpoint, save_checkpoint
from .optim import SGD, Adam, AdamW, GradientAccumulator
from .version import __version__

__all__ = ["SGD", "Adam", "AdamW", "GradientAccumulator", "available_backends", "save_checkpoint", "load_checkpoint",
           "CheckpointCorruptError", "__version__"]
