"""accum_fused with Hugging Face accelerate (tested with accelerate 1.15).

Use this module's ``Accelerator`` (a subclass of accelerate's) in place of accelerate's, keep
accelerate's own accumulation off (``gradient_accumulation_steps=1``) and let the optimizer hold
the window::

    from accum_fused.integrations.accelerate import Accelerator

    accelerator = Accelerator()                      # mixed_precision="bf16" works too
    opt = accum_fused.AdamW(model.parameters(), lr=3e-4, accumulation_steps=4, max_grad_norm=1.0)
    scheduler = get_linear_schedule_with_warmup(opt, warmup, total_updates)   # counts updates
    model, opt, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
    for batch in loader:
        loss = model(**batch).loss                   # the micro-batch's token mean
        accelerator.backward(loss)
        opt.step(weight=tokens_in(batch))            # updates on every 4th call and at the loader's end
        scheduler.step()                             # advances only when an update was applied
        opt.zero_grad()

What it changes, and why:

- ``prepare`` returns an ``AcceleratedAccumFusedOptimizer`` for an accum_fused optimizer: its
  ``step`` takes ``weight=`` (accelerate's rejects it), it closes a partial window at the last
  batch of a prepared dataloader (as accelerate's own accumulation does with
  ``sync_with_dataloader``), it exposes ``flush``/``updated``/``update_count``/``micro_step``/
  ``last_grad_norm``, and its ``step_was_skipped`` is True while the window is open, so
  accelerate's ``AcceleratedScheduler`` steps once per applied update instead of per micro-batch.
- ``clip_grad_norm_`` on the parameters of an accum_fused optimizer that accumulates
  (``accumulation_steps > 1`` or ``in_backward``) would clip one micro-batch's ``.grad`` (or, in
  in_backward mode, find no ``.grad`` at all): it is routed into the optimizer's window clip
  (``max_grad_norm``) and returns the last window's pre-clip norm, as accelerate does for
  DeepSpeed, which also clips inside its step.
- Double accumulation (accelerate's ``gradient_accumulation_steps > 1`` with the optimizer's
  ``accumulation_steps > 1``), ``weight=`` under accelerate's accumulation, an accum_fused
  optimizer stepped directly inside accelerate's window, and a scheduler that would step per
  micro-batch raise ``ValueError``/``RuntimeError`` naming the fix.

Several processes (``accelerate launch``): accelerate wraps the model in DistributedDataParallel
in ``prepare``; the accum_fused optimizer takes DDP's gradient sync over at the model's first
forward (accum_fused/ddp.py) and all-reduces its window once per update. DeepSpeed, Megatron-LM,
XLA and accelerate's FSDP plugin are refused at ``prepare``.

``in_backward=True`` with ``accumulation_steps=1`` (mode A) fits accelerate's own accumulation
unchanged (``Accelerator(gradient_accumulation_steps=k)`` + ``accelerator.accumulate``):
accelerate keeps its scheduler and partial-window logic, and the loss weighting is then yours
(accelerate divides each loss by k).
"""
from __future__ import annotations

import accelerate
import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType

from accum_fused import SGD, Adam, AdamW, GradientAccumulator

__all__ = ["Accelerator", "AcceleratedAccumFusedOptimizer", "unwrap"]

_OURS = (SGD, Adam, AdamW, GradientAccumulator)
# accelerate wraps the model in DistributedDataParallel for these; the accum_fused optimizer then
# takes DDP's gradient sync over (one weighted all-reduce per update; accum_fused/ddp.py).
_ONE_PROCESS_OR_DDP = {DistributedType.NO, *(t for t in DistributedType if t.name.startswith("MULTI_"))}


def unwrap(optimizer):
    """The optimizer behind accelerate's wrapper(s): the accum_fused optimizer itself."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _accumulates(inner) -> bool:
    """Whether ``.grad`` holds less than the window when accelerate's loop looks at it."""
    return inner.accumulation_steps > 1 or getattr(inner, "in_backward", False)


def _check_single_accumulation(accelerate_steps: int, inner) -> None:
    if accelerate_steps > 1 and inner.accumulation_steps > 1:
        raise ValueError(
            f"accelerate's gradient_accumulation_steps={accelerate_steps} together with the optimizer's "
            f"accumulation_steps={inner.accumulation_steps} accumulates twice (one update per "
            f"{accelerate_steps * inner.accumulation_steps} micro-batches). Use one of them: "
            "Accelerator(gradient_accumulation_steps=1) with accumulation_steps=k and opt.step(weight=...) "
            "(the recipe), or accumulation_steps=1 (e.g. in_backward=True) under accelerate's accumulation"
        )


class AcceleratedAccumFusedOptimizer(AcceleratedOptimizer):
    """accelerate's ``AcceleratedOptimizer`` for an accum_fused optimizer (``Accelerator.prepare``
    returns it): ``step(weight=)``, the window's counters, and a window that closes at the end of
    a prepared dataloader."""

    # Set by Accelerator.prepare_optimizer from Accelerator(require_weight=...).
    require_weight = True

    def step(self, closure=None, *, weight=None):
        inner = self.optimizer
        _check_single_accumulation(self.gradient_state.num_steps, inner)
        if (weight is None and self.require_weight and inner.accumulation_steps > 1
                and inner.micro_batch_weight is None and closure is None):
            raise RuntimeError(
                f"opt.step() without weight= while {type(inner).__name__} accumulates (accumulation_steps="
                f"{inner.accumulation_steps}): every micro-batch would count equally, not by what its loss averages "
                "over. Pass opt.step(weight=<its token count>) (the recipe), or call opt.set_micro_batch_weight(w) "
                "first; to weight micro-batches equally on purpose, build Accelerator(require_weight=False)"
            )
        if weight is not None:
            if self.gradient_state.num_steps > 1:
                raise ValueError(
                    "opt.step(weight=...) under accelerate's gradient_accumulation_steps="
                    f"{self.gradient_state.num_steps}: accelerate sums the micro-batches' .grad and steps once per "
                    "window, so a per-micro-batch weight cannot reach them. Use Accelerator("
                    "gradient_accumulation_steps=1) with the optimizer's accumulation_steps instead"
                )
            # Read by the inner step(), also when accelerate goes through GradScaler.step.
            inner.set_micro_batch_weight(weight)
        loss = super().step(closure)
        # accelerate closes its own windows at a prepared dataloader's last batch
        # (sync_with_dataloader); the optimizer's window closes there too, so the last partial
        # window of an epoch is applied, not carried into the next epoch or dropped.
        if (inner.accumulation_steps > 1 and inner.micro_step > 0 and not getattr(inner, "in_backward", False)
                and self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader):
            inner.flush()
        return loss

    def run(self, batch, loss_fn, *, weight=None, split=None):
        """``opt.run`` (out-of-memory recovery) in the recipe's loop: the micro-batch is taken by
        this wrapper's ``step`` (its checks, and the window closed at a prepared dataloader's
        last batch). bf16 autocast (``mixed_precision="bf16"``) needs nothing more; fp16's
        GradScaler is not supported by ``run`` yet."""
        from accum_fused import recovery
        from accum_fused.base import check_weight, window_of
        inner = self.optimizer
        if self.scaler is not None:
            raise NotImplementedError("opt.run() under accelerate's fp16 GradScaler is not supported yet: use "
                                      "mixed_precision='bf16', or the recipe's backward + step")
        win = window_of(inner, "run()")
        if weight is not None:
            weight = check_weight(weight)
        step = None if getattr(inner, "in_backward", False) else self.step
        return recovery.run_micro_batch(inner, win, batch, loss_fn, weight, split, step=step)

    @property
    def step_was_skipped(self) -> bool:
        """True when the last step() applied no update (the window is still open, or GradScaler
        skipped it): accelerate's scheduler and ``optimizer_step_was_skipped`` read this."""
        return self._is_overflow or not self.optimizer.updated

    def flush(self) -> bool:
        return self.optimizer.flush()

    def set_micro_batch_weight(self, weight) -> None:
        self.optimizer.set_micro_batch_weight(weight)

    updated = property(lambda self: self.optimizer.updated, doc="Whether the last step()/flush() updated.")
    update_count = property(lambda self: self.optimizer.update_count, doc="Updates applied.")
    micro_step = property(lambda self: self.optimizer.micro_step, doc="Micro-batches in the open window.")
    last_grad_norm = property(lambda self: self.optimizer.last_grad_norm, doc="Pre-clip norm of the last window.")
    accumulation_steps = property(lambda self: self.optimizer.accumulation_steps)
    recovery = property(lambda self: self.optimizer.recovery, doc="Out-of-memory recovery's state (opt.run).")
    max_grad_norm = property(lambda self: self.optimizer.max_grad_norm)


class _PerUpdateGuardScheduler(AcceleratedScheduler):
    """accelerate's scheduler with ``step_scheduler_with_optimizer=False``: it steps on every
    call. Stepping it while an accum_fused window is open would count micro-batches."""

    def step(self, *args, **kwargs):
        if not self.step_with_optimizer:
            for opt in self.optimizers:
                inner = unwrap(opt)
                if isinstance(inner, _OURS) and inner.accumulation_steps > 1 and not inner.updated:
                    raise RuntimeError(
                        "scheduler.step() while the accum_fused window is open: with "
                        "Accelerator(step_scheduler_with_optimizer=False) it would advance per micro-batch. "
                        "Step it only `if opt.updated:`, or keep step_scheduler_with_optimizer=True (it then "
                        "steps once per applied update)"
                    )
        return super().step(*args, **kwargs)


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator, made correct for accum_fused optimizers (see the module docstring).

    ``require_weight`` (default True): a prepared accum_fused optimizer that accumulates
    (``accumulation_steps > 1``) refuses ``step()`` without ``weight=`` (or a weight given by
    ``set_micro_batch_weight``), which would weight every micro-batch equally where the recipe
    weights them by tokens; False weights them equally on purpose."""

    def __init__(self, *args, require_weight: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.require_weight = bool(require_weight)

    def _accum_fused(self) -> list:
        """The prepared accum_fused optimizers (inner objects)."""
        return [unwrap(o) for o in self._optimizers if isinstance(unwrap(o), _OURS)]

    def prepare_optimizer(self, optimizer, device_placement=None):
        inner = unwrap(optimizer)
        if isinstance(inner, _OURS):
            if self.distributed_type not in _ONE_PROCESS_OR_DDP:
                raise NotImplementedError(
                    f"accum_fused's accelerate recipe supports one process and DDP (accelerate launch with "
                    f"several processes); not distributed_type={self.distributed_type}: DeepSpeed and Megatron "
                    "own the optimizer step, XLA is untested, and accelerate runs its FSDP plugin on GPUs only, where "
                    "it has not run with accum_fused (the optimizer's side of its prepare, the parameters swapped for "
                    "their shards, is tested); for FSDP2 call torch's fully_shard yourself: accum_fused supports it "
                    "without accelerate"
                )
            _check_single_accumulation(self.gradient_accumulation_steps, inner)
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if isinstance(inner, _OURS) and type(prepared) is AcceleratedOptimizer:
            # The same object accelerate registered (save_state, its scheduler), with our methods.
            prepared.__class__ = AcceleratedAccumFusedOptimizer
            prepared.require_weight = self.require_weight
        return prepared

    def prepare_scheduler(self, scheduler):
        prepared = super().prepare_scheduler(scheduler)
        if type(prepared) is AcceleratedScheduler:
            prepared.__class__ = _PerUpdateGuardScheduler
        return prepared

    def backward(self, loss, **kwargs):
        seen = self.__dict__.setdefault("_accum_fused_seen", {})
        for inner in self._accum_fused():
            _check_single_accumulation(self.gradient_accumulation_steps, inner)
            # An update between two backward passes of one accelerate window: the accum_fused
            # optimizer was stepped directly (the prepared one waits for the window's end), and
            # the un-zeroed .grad would be counted again by every later step.
            before = seen.get(id(inner))
            if before is not None and before[1] is False and inner.update_count != before[0]:
                raise RuntimeError(
                    "the accum_fused optimizer applied an update inside accelerate's accumulation window "
                    f"(gradient_accumulation_steps={self.gradient_accumulation_steps}): it was stepped directly, "
                    "not through the prepared optimizer, so .grad (not zeroed mid-window) is counted again. Call "
                    "the prepared optimizer's step(), or use gradient_accumulation_steps=1 with the optimizer's "
                    "accumulation_steps"
                )
        super().backward(loss, **kwargs)
        for inner in self._accum_fused():
            seen[id(inner)] = (inner.update_count, self.sync_gradients)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """accelerate's clip_grad_norm_, except on the parameters of an accum_fused optimizer that
        accumulates: there it sets the optimizer's window clip (``max_grad_norm``), applied to
        the window's averaged gradient at the update, and returns the pre-clip norm of the last
        applied window (None before the first), as accelerate does for DeepSpeed."""
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        wanted = {id(p) for p in parameters}
        owners = [inner for inner in self._accum_fused() if _accumulates(inner)
                  and wanted & {id(p) for g in inner.param_groups for p in g["params"]}]
        if not owners:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        inner = owners[0]
        owned = {id(p) for g in inner.param_groups for p in g["params"]}
        if len(owners) > 1 or wanted != owned:
            raise ValueError(
                "clip_grad_norm_ over parameters that are not exactly one accum_fused optimizer's: its window clip "
                "(max_grad_norm) spans all of that optimizer's parameters; pass them all "
                "(model.parameters()) or give each optimizer its own max_grad_norm and drop this call"
            )
        if float(norm_type) != 2.0:
            raise ValueError(f"accum_fused's max_grad_norm clips the L2 norm; norm_type={norm_type} is not supported")
        if inner.max_grad_norm is None:
            inner.max_grad_norm = float(max_norm)
        elif inner.max_grad_norm != float(max_norm):
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) but the optimizer clips its window at "
                f"max_grad_norm={inner.max_grad_norm}: drop this call or make them agree"
            )
        return inner.last_grad_norm
