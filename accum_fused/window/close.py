"""The window's close: sync -> found-inf -> clip -> update, for plain, synchronised and sharded
windows alike, and the listeners told that a window ended.

Owns: ``close`` (a Window's, with its optimizer: the update is its update spec's ``apply``
(update.py), or the step table's plan), the agreement with the other ranks (``agree``:
distributed.WindowSync, ShardSync), the clip coefficient (``clip_coefficient``, ``clip_for``),
and the window's listeners: whoever must learn that a window ended (accum_fused.nn's BatchNorm
statistics, ddp.py's watch for a DDP module) registers on the window's ``listeners``
(``WindowListeners``): close and Window.abandon tell them, and opt.run() tells them when a pass
it may retry begins and when it failed (``tell_transaction``).
Must not: keep state of its own (the window is the state) or do per-element math (backends do).
"""
from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from ..layout import kernel_view


class WindowListeners(list):
    """A window's ``listeners``: objects told, in order, when the window ends.
    ``window_closed(opt, applied)``: the window closed (``applied``: an update was applied;
    False: skipped for non-finite gradients, or empty); with a process_group every rank closes
    it together, so a listener may run a collective there. ``window_discarded(opt)``: a window
    that held micro-batches was emptied without closing (a failed backward pass that cannot be
    taken back out, mode A's ``zero_grad()``). A copy of the window (the optimizer's deepcopy,
    pickle) starts with none: listeners belong to a model or a process, and a copy must not carry
    them along."""


def close(win, opt, last_pairs=(), last_weight: float = 1.0, grad_scale: Tensor | None = None,
          norms: dict | None = None, flushing: bool = False, update=None, updated_in_hooks: set = frozenset()) \
        -> bool:
    """Close the window: agree with the other ranks (sums, weight total, non-finite flags),
    skip it if a micro-batch was non-finite or no parameter received a gradient, otherwise
    clip and update. ``last_pairs`` is the last micro-batch, not yet accumulated (folded into
    the update pass); ``norms`` the per-parameter window-gradient norms already computed.
    ``update(weight_sum)``: the step table's close updates instead of the spec's ``apply`` (the
    last micro-batch and the norms are then its own). ``updated_in_hooks``: parameters mode B's
    last pass already updated inside their hooks (folds_last: no ranks, no clipping); the
    window's other live parameters (no gradient in that pass) are updated here. Sets and
    returns ``updated``."""
    win.transaction.closings += 1
    weight_sum, skip, clip_coef = agree(win, opt, flushing)
    win.live -= updated_in_hooks
    # An empty window (no gradient anywhere: no micro-batch on any rank, or only None grads)
    # is not an update, as torch.optim's step without gradients changes nothing.
    applied = not skip and weight_sum > 0 and bool(win.live or last_pairs or updated_in_hooks)
    closed = False
    try:
        if applied and update is not None:
            update(weight_sum)
        elif applied and (win.live or last_pairs):
            if opt.max_grad_norm is not None and clip_coef is None:
                clip_coef = clip_coefficient(win, opt, weight_sum, norms or {})
            opt.update_spec.apply(opt, win, dict(last_pairs), last_weight, grad_scale, weight_sum, clip_coef)
        win.update_count += applied
        closed = True
    finally:
        win.discard()
        # (set before the listeners run: one that raises must not leave the last window's value)
        win.updated = closed and applied
        tell_listeners(win, opt, closed, applied)  # (an update that raised: the window is lost)
    return applied


def agree(win, opt, flushing: bool) -> tuple[float, bool, Tensor | None]:
    """(the window's divisor, skip it, clip coefficient when already known)."""
    if win.sync is not None:
        weight_sum, skip, live = win.sync.reduce_window(
            opt.update_spec.params(opt), win.live, win.weight_sum, win.weight_shift, win.found_inf, flushing)
        win.live.clear()
        win.live.update(live)
        return weight_sum, skip, None
    if win.shards is not None:
        return agree_sharded(win, opt, flushing)
    return win.weight_sum, win.found_inf is not None and bool(win.found_inf.item() > 0), None


def agree_sharded(win, opt, flushing: bool) -> tuple[float, bool, Tensor | None]:
    """FSDP2 (distributed.ShardSync.agree): (the divisor W / N, skip, clip coefficient or
    None). The window's global norm is measured whether or not it clips, so that a
    non-finite value in any rank's shard skips the window on every rank instead of updating
    some shards and not others."""
    spec = opt.update_spec
    params = spec.params(opt)
    divisor, total_norm = win.shards.agree(
        [p for p in params if p in win.live], win.buffers, lambda p: spec.backend_for(opt, p), params[0].device, win.weight_sum,
        flushing, win.late_weights, win.grads_held, opt.accumulation_steps)
    if divisor <= 0:
        return divisor, False, None
    if not math.isfinite(total_norm.item()):
        return divisor, True, None
    if opt.max_grad_norm is None:
        return divisor, False, None
    win.last_grad_norm = total_norm
    return divisor, False, torch.clamp(opt.max_grad_norm / (total_norm + 1e-6), max=1.0)


def clip_coefficient(win, opt, weight_sum: float, norms: dict | list) -> Tensor:
    """min(max_grad_norm / (||g|| + 1e-6), 1) on the device, as clip_grad_norm_ computes
    it. ``norms`` has the per-parameter norms the last accumulate pass produced, by parameter
    or aligned with the spec's ``params(opt)`` (None: not measured); the window's other
    parameters (no gradient in that micro-batch) are measured here."""
    spec = opt.update_spec
    params = spec.params(opt)
    if isinstance(norms, dict):
        norms = list(map(norms.get, params))
    else:
        norms = list(norms)
    if len(win.live) == len(params):  # (every parameter is live: no lookup per parameter)
        live = range(len(params))
    else:
        live = [i for i, p in enumerate(params) if p in win.live]
    missing = defaultdict(list)
    for i in [i for i in live if norms[i] is None]:
        missing[(params[i].device, params[i].dtype)].append(i)
    for indices in missing.values():
        measured = spec.backend_for(opt, params[indices[0]]).window_norms(
            buffers=[kernel_view(win.buffers[params[i]]) for i in indices], weight_sum=weight_sum)
        for i, norm in zip(indices, measured.unbind()):
            norms[i] = norm
    values = [norms[i] for i in live]
    device = params[live[0]].device
    try:
        stacked = torch.stack(values)  # (one device, the common case: no .to per parameter)
    except RuntimeError:  # (parameters spread over several devices)
        stacked = None
    if stacked is None or stacked.device != device:
        stacked = torch.stack([norm.to(device) for norm in values])
    return clip_for(win, opt, torch.linalg.vector_norm(stacked))


def clip_for(win, opt, total_norm: Tensor) -> Tensor:
    """The clip coefficient for the window's gradient norm (kept as ``last_grad_norm``)."""
    win.last_grad_norm = total_norm
    return torch.clamp(opt.max_grad_norm / (total_norm + 1e-6), max=1.0)


def tell_transaction(win, opt, event: str) -> None:
    """recovery.py: a pass of opt.run() begins ("transaction_begins") or failed
    ("transaction_failed"); listeners that record per forward (accum_fused.nn) take it back."""
    for listener in list(win.listeners):
        told = getattr(listener, event, None)
        if told is not None:
            told(opt)


def tell_listeners(win, opt, closed: bool, applied: bool = False) -> None:
    """The window ended: closed (``applied`` or not) or given up; see WindowListeners."""
    for listener in list(win.listeners):
        if closed:
            listener.window_closed(opt, applied)
        else:
            listener.window_discarded(opt)
