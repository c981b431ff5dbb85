"""Plain mode's micro-batches (step() reads ``.grad``): the spec, ``add_micro_batch``, a Python
loop over the parameters grouped into backend calls, and its fast path, ``take_with_table``,
the same micro-batch in one extension call (table.py's StepTable), which takes only what it
takes exactly as the spec would and hands everything else back to it.
"""
from __future__ import annotations

from collections import defaultdict

from torch import Tensor

from .. import backends
from ..backends._kernel_args import device_scalar
from ..layout import kernel_view, readable_grad
from .table import StepTable, conform_optimizer_state


def collect_grads(opt) -> list[tuple[Tensor, Tensor]]:
    """step()'s micro-batch: (param, grad) for every parameter of ``opt`` with a gradient,
    validated: no sparse gradient, and fused=True groups on a device and dtype torch's fused
    kernels support, as torch checks at step() (fused=True is accepted: every backend call is
    one fused pass)."""
    pairs = [(p, p.grad) for p in opt.update_spec.params(opt) if p.grad is not None]
    for _, grad in pairs:
        if grad.is_sparse:
            raise RuntimeError(
                f"{type(opt).__name__} does not support sparse gradients (a parameter has "
                "one); use torch.optim.SparseAdam or nn.Embedding(sparse=False)"
            )
    pairs = [(p, readable_grad(grad)) for p, grad in pairs]
    fused = {p for group in opt.param_groups if group.get("fused") for p in group["params"]}
    if fused:
        from torch.optim.optimizer import _device_dtype_check_for_fused  # torch's own message
        for p, _ in pairs:
            if p in fused:
                _device_dtype_check_for_fused(p)
    return pairs


def add_micro_batch(win, opt, pairs, weight: float, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
    """step(): take one micro-batch, ``pairs`` of (param, grad), with ``weight``; on the
    window's last micro-batch, close the window. Validates before anything changes."""
    in_loss = win.backward_done and win.shards is not None
    closing = win.closes_with(opt)
    # The buffers this call writes, and at closing every buffer the update reads, fit their
    # parameters (a current step table vouches for all of them in one call), and at closing
    # the optimizer state too (once per table: what changes it makes the table stale).
    table = win.caches.step_table
    if table is not None and table.current(win) and table.cpp.conforms():
        if closing and not table.state_conformed:
            params = [p for p, _ in pairs]
            conform_optimizer_state(opt, params + list(win.live.difference(params)))
            table.state_conformed = True
    elif closing and not pairs:  # (in_backward mode A's step(): the window is in the buffers)
        win.conform_live(opt)
    else:
        params = [p for p, _ in pairs]
        win.conform(opt, params + list(win.live.difference(params)) if closing else params, closing)
    found_inf = win.running_found_inf(found_inf)
    weight = win.enter_weight(weight)
    grad_weight = 1.0 if in_loss else weight  # FSDP2: opt.backward scaled the loss by it
    # Nothing above changed the window's meaning; from here on the micro-batch is taken.
    win.count_micro_batch(opt, weight, found_inf)
    if win.shards is not None and not opt.in_backward:  # (in_backward mode A sums: no weights)
        win.late_weights.append(None if in_loss else weight)
        if not pairs:
            win.hold_grads()
    if not closing:
        accumulate(win, pairs, grad_weight, grad_scale, opt)
        win.updated = False
    elif win.folds_last(opt):
        win.close(opt, pairs, grad_weight, grad_scale)  # the last micro-batch folded into the update pass
    else:
        # Clipping needs the whole window's norm first: the last accumulate pass returns it
        # (across ranks the norms are measured on the reduced sums instead).
        local_norms = opt.max_grad_norm is not None and not win.spans_ranks
        norms = accumulate(win, pairs, grad_weight, grad_scale, opt,
                                norm_weight_sum=win.weight_sum if local_norms else None)
        win.close(opt, (), grad_weight, None, norms)


def take_with_table(win, opt, weight: float, grad_scale: Tensor | None, found_inf: Tensor | None) -> bool:
    """step() in plain mode, on a micro-batch that does not close the window: what
    add_micro_batch does, in one extension call (StepTable) instead of a Python loop over the
    parameters. False, with nothing changed, where the table cannot take it exactly so
    (add_micro_batch then does, and is the spec this is tested against)."""
    if opt.in_backward or win.shards is not None or win.transaction.parts_left:
        return False
    closing = win.closes_with(opt)
    if closing and win.sync is not None:
        return False
    table = table_for(win, opt)
    if table is None:
        return False
    present = table.cpp.check()
    if present <= 0:  # (none: add_micro_batch warns; -1: something it must check, conform or raise)
        if present < 0:
            win.caches.step_table = None
        return False
    plan = None
    if closing:
        try:
            plan = table.closing_plan(opt, win, present)
        finally:
            if plan is None:  # (refused, or raised: the table must not keep the gradients alive)
                table.cpp.drop_checked()
        if plan is None:
            return False
    found_inf = win.running_found_inf(found_inf)
    weight = win.enter_weight(weight)
    win.count_micro_batch(opt, weight, found_inf)
    if closing:
        table.close(opt, win, plan, weight, grad_scale)
        return True
    newly_live, _, given, given_buffers, adopted = table.cpp.take(
        weight, device_scalar(grad_scale, table.device), opt.accumulation_steps > 1)
    if given:
        gave_buffers(win, table, given, given_buffers, adopted)
    if newly_live:
        if not win.live and len(newly_live) == len(table.buffered):
            win.live.update(table.buffered)  # (set to set: no tensor hashed again)
        else:
            win.live.update(table.params[i] for i in newly_live)
    win.updated = False
    return True


def gave_buffers(win, table: StepTable, given: list[int], buffers: list[Tensor], adopted: int) -> None:
    """The table gave these parameters buffers (their first ``adopted`` are autograd's
    gradients, taken zero-copy and let go of when the window ends, as the in-backward hooks
    adopt them; the rest fresh ones, kept): ``buffers`` follows, the table stays current."""
    params = [table.params[i] for i in given]
    win.buffers.update(zip(params, buffers))
    if adopted:
        win.adopted.update(params[:adopted])
    table.buffered.update(params)


def table_for(win, opt) -> StepTable | None:
    """The step table, true to ``buffers`` and ``live``; built (once per window at most)
    when there is none or it went stale; None where plain mode's loop stays Python's."""
    table = win.caches.step_table
    if table is not None and table.current(win):
        return table
    win.caches.step_table = None
    if win.caches.table_blocked or backends.extension_paths(opt.backend, table=True) is None:
        return None
    win.caches.table_blocked = True
    win.caches.step_table = StepTable.build(opt, win)
    return win.caches.step_table


def accumulate(win, pairs, weight: float, grad_scale: Tensor | None, opt,
               norm_weight_sum: float | None = None) -> dict[Tensor, Tensor]:
    """Add one micro-batch into the buffers. With ``norm_weight_sum``, also return
    {param: ||acc / norm_weight_sum||} for the parameters accumulated here."""
    calls = defaultdict(list)
    for p, grad in pairs:
        overwrite = p not in win.live
        calls[(p.device, p.dtype, grad.dtype, overwrite)].append((p, grad))
    norms = {}
    for (_, _, _, overwrite), items in calls.items():
        call_norms = opt.update_spec.backend_for(opt, items[0][0]).accumulate(
            grads=[kernel_view(g) for _, g in items],
            buffers=[kernel_view(win.buffer(p)) for p, _ in items],
            weight=weight,
            overwrite=overwrite,
            grad_scale=grad_scale,
            norm_weight_sum=norm_weight_sum,
        )
        if call_norms is not None:
            norms.update(zip([p for p, _ in items], call_norms.unbind()))
    win.live.update(p for p, _ in pairs)
    table = win.caches.step_table
    if table is not None and table.epoch == win.caches.epoch:
        table.cpp.mark_live([p for p, _ in pairs])
    return norms
