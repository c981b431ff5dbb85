"""In-backward accumulation (``in_backward=True``): gradients taken inside backward.

Owns: the post-accumulate-grad hooks on the parameters (registered when a group is added,
removed when the optimizer is collected), the life of one backward pass (begin at the first
hook, one arrival per parameter, end queued on the autograd engine), mode A (the caller's loop
owns the window: backward passes are summed, ``step()`` applies) and mode B (one backward = one
micro-batch, the k-th applies the update inside backward), adopting autograd's fresh gradient
as the buffer, and the trigger of the overlapped bucketed reduction (``sync.grad_ready``).

Must not: change the window's buffers or counters itself: a micro-batch begins, its gradients
go in and it ends (closing the window on its last) through the window's verbs
(``begin_micro_batch``, ``accumulate_one``, ``adopt``, ``finish_micro_batch``); it only reads
whether a parameter is live, and keeps its own records on the window (``pending_weight``, the
weight opt.backward gives its pass; ``backward_pass``). The update math of a folded parameter
is the optimizer's ``_update``.

Each hook holds its optimizer weakly: when the optimizer is collected, its hooks go with it.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
from torch import Tensor

from .layout import is_dtensor, kernel_view, state_dtype


class BackwardPass:
    """The micro-batch a running backward pass is adding."""

    def __init__(self, weight: float, weight_sum: float, closing: bool, fold: bool):
        self.weight, self.weight_sum = weight, weight_sum  # in the window's units, sum including this one
        self.closing = closing  # the window's last micro-batch
        self.fold = fold  # update each parameter inside its hook
        self.seen: set[Tensor] = set()
        self.done: set[Tensor] = set()


def _make_grad_hook(optimizer_ref: weakref.ref) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        optimizer = optimizer_ref()
        if optimizer is not None:
            take_grad(optimizer, param)
    return hook


def install(opt) -> None:
    """Hooks on every parameter of ``opt`` (construction); ``add_param_group`` adds more."""
    register_hooks(opt, opt._all_params())
    # Hooks hold the optimizer weakly; when it is collected they go with it.
    weakref.finalize(opt, remove_hooks, opt._hook_handles)


def register_hooks(opt, params) -> None:
    """A post-accumulate-grad hook on each of ``params`` that requires grad."""
    hook = _make_grad_hook(weakref.ref(opt))
    for p in params:
        if p.requires_grad:
            opt._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
    opt._group_of = {p: group for group in opt.param_groups for p in group["params"]}


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def check_step(opt, weight: float) -> None:
    """What step() may mean with in_backward: apply mode A's summed window, nothing else."""
    if getattr(opt, "found_inf", None) is not None or getattr(opt, "grad_scale", None) is not None:
        raise RuntimeError(
            f"{type(opt).__name__}(in_backward=True) cannot be driven by torch.amp.GradScaler: GradScaler "
            "finds non-finite gradients by reading .grad, which in_backward frees inside backward. Use bf16 "
            "autocast (no scaler needed), or in_backward=False with GradScaler"
        )
    if opt.accumulation_steps > 1:
        raise RuntimeError(
            f"{type(opt).__name__}(in_backward=True, accumulation_steps={opt.accumulation_steps}) applies the "
            "update inside the window's last backward pass: call opt.backward(loss, weight=...) per "
            "micro-batch and no step() (or use accumulation_steps=1 and step() where your loop updates)"
        )
    if weight != 1.0:
        raise ValueError(
            "step(weight=...) has no meaning with in_backward=True and accumulation_steps=1: the gradients "
            "were summed during backward, as autograd sums .grad; scale the loss instead"
        )
    if opt._window.backward_pass is not None:
        raise RuntimeError("step() was called inside a backward pass; call it after backward returns")


def backward(opt, loss: Tensor, weight: float, backward_kwargs: dict) -> None:
    """opt.backward(loss, weight=) with in_backward: one backward pass as one micro-batch of
    ``weight`` (mode B; the window's last applies the update) or summed into mode A's window."""
    win = opt._window
    if opt.accumulation_steps == 1 and weight != 1.0:
        raise ValueError("with in_backward=True and accumulation_steps=1 the backward passes are summed: "
                         "weight must be 1 (scale the loss instead), or set accumulation_steps")
    if win.backward_pass is not None:
        raise RuntimeError("opt.backward() was called inside another backward pass")
    win.pending_weight = weight
    try:
        torch.autograd.backward(loss, **backward_kwargs)
        if win.pending_weight is not None:
            # No parameter of this optimizer received a gradient (FSDP2 may hold them back
            # for a later backward): still one micro-batch.
            win.hold_grads()
            begin_pass(opt)
            end_pass(opt)
    finally:
        win.pending_weight = None
        win.backward_pass = None


@torch.no_grad()
def take_grad(opt, p: Tensor) -> None:
    """The post-accumulate-grad hook's work for ``p``: its fresh gradient into the window (or,
    on the window's last micro-batch without clipping or ranks, straight into its update);
    ``.grad`` is freed."""
    grad = p.grad
    if grad is None:
        return
    if grad.is_sparse:
        raise RuntimeError(f"{type(opt).__name__}(in_backward=True) does not support sparse gradients; "
                           "use nn.Embedding(sparse=False)")
    win = opt._window
    mb = win.backward_pass
    if mb is None:
        mb = begin_pass(opt)
        torch.autograd.Variable._execution_engine.queue_callback(functools.partial(end_pass, opt))
    if p in mb.seen:
        raise RuntimeError(
            f"{opt._param_name(p)} received two gradients in one backward pass (its post-accumulate-grad hook "
            "fired twice, e.g. under compiled autograd or a reentrant checkpoint): in_backward cannot tell "
            "its micro-batches apart; use in_backward=False"
        )
    mb.seen.add(p)
    p.grad = None
    if mb.fold:
        opt._update(opt._backend_for(p), opt._group_of[p], [p], [kernel_view(win.buffer(p))], weight_sum=mb.weight_sum,
                    clip_coef=None, grads=[kernel_view(grad)], weight=mb.weight, overwrite=p not in win.live,
                    grad_scale=None)
        mb.done.add(p)
    elif p not in win.live and _can_adopt(win, p, grad, mb.weight):
        win.adopt(p, grad)
    else:
        win.accumulate_one(p, grad, mb.weight, opt._backend_for(p))
    if mb.closing and win.sync is not None:
        win.sync.grad_ready(p)  # may launch its bucket's all-reduce while backward goes on


def _can_adopt(win, p: Tensor, grad: Tensor, weight: float) -> bool:
    """Whether the first gradient of a window can be the buffer itself: the same dtype and
    layout, weight 1, nothing else holding it (a view may be DDP's bucket), no flat buffers."""
    return (weight == 1.0 and win.sync is None and grad.dtype == state_dtype(p) and grad.device == p.device
            and grad._base is None and grad.is_contiguous() and p.is_contiguous()
            and not is_dtensor(grad))  # FSDP2's shards are views of one reduce-scatter output


def begin_pass(opt) -> BackwardPass:
    """The first gradient of a backward pass arrived (or opt.backward saw none): open its
    micro-batch in the window."""
    win = opt._window
    closing = opt.accumulation_steps > 1 and win.micro_step + 1 >= opt.accumulation_steps
    weight, weight_sum = win.begin_micro_batch(opt, win.take_pending_weight(), closing)
    fold = closing and opt.max_grad_norm is None and not win.spans_ranks
    # With FSDP2, opt.backward scaled the loss by the weight: the gradients carry it.
    grad_weight = 1.0 if win.shards is not None else weight
    win.backward_pass = BackwardPass(grad_weight, weight_sum, closing, fold)
    return win.backward_pass


@torch.no_grad()
def end_pass(opt) -> None:
    """Queued on the autograd engine by the first hook: runs once the backward pass is done.
    The window counts the micro-batch and, on its last, closes."""
    win = opt._window
    mb, win.backward_pass = win.backward_pass, None
    if mb is not None:
        win.finish_micro_batch(opt, mb.weight, mb.weight_sum, mb.closing, mb.done if mb.fold else None)
