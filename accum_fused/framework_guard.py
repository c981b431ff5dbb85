"""At an accumulating optimizer's first ``step()``: a framework loop that drives it without
accum_fused's integration for that framework, found on the call stack, is refused.

Frameworks drive ``optimizer.step()`` from their own loops, and two of them train silently
wrong around an optimizer that holds the window unless accum_fused's integration is in the loop:

- ``transformers.Trainer`` without ``AccumFusedCallback``: in in_backward mode ``.grad`` is
  freed inside backward, so the Trainer's ``max_grad_norm`` (1.0 by default) clips nothing
  (26% off the big batch in issue 20's measurement), and nothing checks that the Trainer owns the window;
- ``accelerate.Accelerator`` (accelerate's own, not ``accum_fused.integrations.accelerate``'s):
  its prepared optimizer rejects ``step(weight=)``, steps its scheduler per micro-batch and drops
  the partial last window (73% off in issue 20's measurement).

Only optimizers that accumulate (``accumulation_steps > 1`` or ``in_backward``) are checked:
with neither, an accum_fused optimizer is a plain torch.optim one, which both loops drive right.
Imports no framework: only what the process has imported already is looked for, once per
optimizer, a few frames up. The same walk up the stack gives every warning of the package its
stack level (``user_stacklevel``): the user's line, past torch's frames and ours.
"""
from __future__ import annotations

import os
import sys

import torch

_FRAMES = 12  # step()'s decorators <- GradScaler.step <- AcceleratedOptimizer.step <- the Trainer's loop


def check_first_step(opt) -> None:
    if opt.accumulation_steps == 1 and not opt.in_backward:
        return
    trainer_type = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)  # not the lazy top level
    wrapper_type = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", None)
    if trainer_type is None and wrapper_type is None:
        return
    frame, stepped_by_accelerate = sys._getframe(2), False
    for _ in range(_FRAMES):
        if frame is None:
            break
        caller = frame.f_locals.get("self")
        # The Trainer steps through accelerate's wrapper too: the Trainer's rule decides.
        if trainer_type is not None and isinstance(caller, trainer_type):
            names = {type(cb).__name__ for cb in caller.callback_handler.callbacks}
            if "AccumFusedCallback" not in names:
                raise RuntimeError(
                    f"{type(opt).__name__} (in_backward or accumulation_steps > 1) under transformers.Trainer "
                    "without AccumFusedCallback: the Trainer's max_grad_norm would clip the .grad that in_backward "
                    "has freed (nothing), and nothing checks who owns the window. Add "
                    "callbacks=[accum_fused.integrations.transformers.AccumFusedCallback()] to the Trainer"
                )
            return
        stepped_by_accelerate |= wrapper_type is not None and type(caller) is wrapper_type
        frame = frame.f_back
    if stepped_by_accelerate:
        raise _accelerate_error(opt, "is stepped by")


def check_wrapped(opt) -> None:
    """From ``state_dict()``: accelerate's own ``prepare`` reads it while wrapping the optimizer
    (AcceleratedOptimizer's device placement). Refused there, before the loop's first
    ``opt.step(weight=n)`` meets accelerate's ``TypeError`` about an unexpected keyword, which
    names nothing of accum_fused. (With ``device_placement=False`` the first step() says it.)"""
    if opt.accumulation_steps == 1 and not opt.in_backward:
        return
    wrapper_type = getattr(sys.modules.get("accelerate.optimizer"), "AcceleratedOptimizer", None)
    if wrapper_type is None:
        return
    frame = sys._getframe(2)
    if type(frame.f_locals.get("self")) is not wrapper_type:
        return
    # accum_fused's Accelerator lets accelerate build the wrapper, then gives it our class; the
    # Trainer prepares through accelerate's own, and its rule (check_first_step) decides there.
    allowed = tuple(t for t in (
        getattr(sys.modules.get("accum_fused.integrations.accelerate"), "Accelerator", None),
        getattr(sys.modules.get("transformers.trainer"), "Trainer", None)) if t is not None)
    for _ in range(40):  # the Trainer's loop is ~10 frames above prepare's; asked once per prepare
        frame = frame.f_back
        if frame is None:
            break
        if allowed and isinstance(frame.f_locals.get("self"), allowed):
            return
    raise _accelerate_error(opt, "was prepared by")


def _accelerate_error(opt, how: str) -> RuntimeError:
    return RuntimeError(
        f"{type(opt).__name__} (accumulating) {how} accelerate's own Accelerator: it rejects step(weight=), steps a "
        "prepared scheduler on every micro-batch and drops the partial last window. Use "
        "accum_fused.integrations.accelerate.Accelerator (a subclass of accelerate's) in its place"
    )


def user_stacklevel() -> int:
    """warnings.warn's stacklevel (from the function calling this one) of the first frame in
    neither accum_fused nor torch: the user's line, through however many wrappers torch puts
    around step() (its profiling hook, dynamo's disable, no_grad: they differ between versions)
    and however a warning's code is reached (an entry point, or a hook inside the user's
    ``loss.backward()``). No such frame (a hook on autograd's device thread, whose stack holds
    only the hook): the caller's, 2."""
    frame, level = sys._getframe(1).f_back, 2
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)
