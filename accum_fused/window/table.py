"""Plain mode's step table and the update plan: the window's per-parameter lists, kept so that
the host does no Python work per parameter when nothing changed.

Owns: ``StepTable`` (csrc/step_table.cpp through backends.cpp_backend: every parameter of the
optimizer in order, its buffer, whether it is live; a plain-mode micro-batch in one extension
call, ``take_with_table``, and the window's closing one, ``StepTable.close``) and
``UpdatePlan`` (per param group, the lists of one update spec's ``update`` call, kept between closes
while they stand: the step table's close and the in-backward modes' alike). Both are true to
the Window they were built for and rebuilt on what makes them stale; plain.py's
add_micro_batch (plain mode's Python path) is the spec they are tested against.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .. import backends
from ..backends._kernel_args import device_scalar
from ..layout import ELEMENTWISE_STATE, KERNEL_DTYPES, adopts, conform_state, fits, kernel_view
from .close import clip_for

if TYPE_CHECKING:
    from .state import Window


def conform_optimizer_state(opt, params: list[Tensor]) -> None:
    """layout.conform_state of ``params``' optimizer state, named and typed by the optimizer's
    update spec (the state follows its parameter, or the error names it)."""
    spec = opt.update_spec
    conform_state(opt.state, params, lambda p: spec.name(opt, p), spec.state_dtype)


class Route(NamedTuple):
    """What the fast paths (the step table, the extension's hooks) do with one parameter's
    gradients, decided by ``route`` once per layout epoch and executed, not decided again, by
    csrc/step_table.cpp and csrc/hooks.cpp: whether they may take them at all (``takes``),
    whether a window's first one may become the buffer (``adopts``; the gradient's own side,
    layout.adoptable, is asked of each), and whether they go in by torch's ops rather than the
    kernels (``torch_ops``)."""

    takes: bool
    adopts: bool
    torch_ops: bool


def route(opt, win: Window, p: Tensor, torch_ops: bool = False) -> Route:
    """``p``'s route (see Route). ``torch_ops``: its gradients go in by torch's ops, whatever
    the backend (in_backward.by_torch_ops: on a GPU); else the cpp backend's kernels must be
    its backend. Either way only a plain tensor (no DTensor, no complex view) of a dtype the
    extension takes (its per-gradient checks, kernel_grad, refuse the others)."""
    takes = (kernel_view(p) is p and p.dtype in KERNEL_DTYPES
             and (torch_ops or opt.update_spec.backend_for(opt, p) is backends.extension()))
    return Route(takes, takes and win.may_adopt and adopts(p), torch_ops)


def row_lists(win: Window, params: list[Tensor], routes: list[Route], buffers: list[Tensor | None]) -> dict:
    """The table's rows of ``params`` as the extension builds them (csrc/ops.h's Row, for the
    step table and the hooks alike): each one's route and the window's state of it."""
    return dict(takes=[r.takes for r in routes], may_adopt=[r.adopts for r in routes],
                torch_ops=[r.torch_ops for r in routes], buffers=buffers, live=[p in win.live for p in params],
                adopted=[p in win.adopted for p in params])


class StepTable:
    """The extension's table of plain mode's micro-batches (csrc/step_table.cpp: every
    parameter of the optimizer that requires grad, in order, its buffer, whether it is live; the
    frozen ones only looked at for a gradient, which is Python's to take), with what the window
    needs back: the parameters by index and as a set, the set of those with buffers, the device,
    and the window's layout ``epoch`` it is true to (Mirrors)."""

    def __init__(self, cpp, params: list[Tensor], buffered: set, device: torch.device, epoch: int) -> None:
        self.cpp, self.params, self.buffered, self.device, self.epoch = cpp, params, buffered, device, epoch
        self.param_set = frozenset(params)  # (what the closing micro-batch's update plan covers)
        self.state_conformed = False  # conform_state ran since it was built (what moves state makes it stale)

    def current(self, win) -> bool:
        """Whether the table is true to ``win``'s buffers and live set."""
        return self.epoch == win.caches.epoch

    @staticmethod
    def build(opt, win: Window) -> StepTable | None:
        """None where the table cannot stand in for add_micro_batch: parameters on several
        devices or not plain tensors (DTensor, complex), a parameter the cpp backend does not
        run, fused=True groups (torch's device checks), a live buffer that must follow its
        parameter first (Window.conform), a parameter frozen since it joined the window. A stale
        buffer that no longer fits its parameter is dropped here, as Window.conform drops it: the
        table then vouches for every buffer."""
        cpp = backends.extension_paths(opt.backend, table=True)
        params, frozen = [], []
        for p in opt.update_spec.params(opt):
            (params if p.requires_grad else frozen).append(p)
        if cpp is None or not params or any(group.get("fused") for group in opt.param_groups):
            return None
        if frozen and not win.live.isdisjoint(frozen):
            return None  # (frozen since its gradients joined the window: the window still updates it)
        device = params[0].device
        buffers, routes = [], []
        for p in params:
            routed = route(opt, win, p)
            if p.device != device or not routed.takes:
                return None
            routes.append(routed)
            buf = win.buffers.get(p)
            if buf is not None and not fits(buf, p):
                if p in win.live or win.sync is not None:
                    return None  # (Window.conform carries it along, or raises)
                del win.buffers[p]  # stale: as Window.conform does, the next gradient allocates a fresh one
                win.changed()
                buf = None
            buffers.append(buf)
        table = cpp.StepTable(params, **row_lists(win, params, routes, buffers), frozen=frozen)
        return StepTable(table, params, {p for p, buf in zip(params, buffers) if buf is not None}, device, win.caches.epoch)

    def closing_plan(self, opt, win: Window, present: int) -> UpdatePlan | None:
        """How the window's closing micro-batch and the update run with no Python loop over the
        parameters (the table's check found ``present`` gradients): the case training loops
        give, where every parameter of the table has a gradient in the closing micro-batch, all
        of them live in the window (or none: accumulation_steps=1), each param group of one
        dtype and one call key (Adam's step count). None, with nothing changed, where
        add_micro_batch must close it. Validates first, as add_micro_batch does: every buffer
        fits (the table's check), the state is conformed."""
        n = len(self.params)
        if present != n or self.cpp.live_count not in (0, n) or not opt.update_spec.has_lists:
            return None
        if self.cpp.missing_buffers():  # (a closing micro-batch without live buffers: Window.buffer allocates)
            return None
        if not self.cpp.conforms():
            return None
        if not self.state_conformed:
            conform_optimizer_state(opt, self.params)
            self.state_conformed = True
        plan = UpdatePlan.for_window(opt, win, build=True, cover=self.param_set)
        return plan if plan is not None and plan.uniform(opt) else None

    def close(self, opt, win: Window, plan: UpdatePlan, weight: float, grad_scale: Tensor | None) -> None:
        """Take the closing micro-batch (counted by the caller) and close ``win`` with ``plan``."""
        clear = opt.accumulation_steps > 1
        last = norms = None
        if win.folds_last(opt):  # (no ranks: take_with_table)
            last = dict(grads=self.cpp.present_grads(), weight=weight, overwrite=self.cpp.live_count == 0,
                        grad_scale=grad_scale)
            self.cpp.release(clear)  # (the list keeps the gradients for the update pass)
        else:
            norm_weight_sum = win.weight_sum if opt.max_grad_norm is not None else None
            # (every buffer is live at closing: none given, so no return but the norms matters)
            norms = self.cpp.take(weight, device_scalar(grad_scale, self.device), clear, norm_weight_sum)[1]
        win.live.update(self.buffered)

        def update(weight_sum: float) -> None:
            clip_coef = None if norms is None else clip_for(win, opt, torch.linalg.vector_norm(norms))
            # (buffers read now, not kept with the plan: adopted buffers are new each window)
            plan.update(opt, self.cpp.buffers(), weight_sum, clip_coef, last)
        win.close(opt, (), weight, grad_scale, update=update)


def _layout_stands(spec, params: list[Tensor], lists: dict[str, list], layout: tuple) -> bool:
    """Whether ``params`` are all still of ``layout`` (dtype, device)."""
    dtype, device = layout
    first = params[0]
    if first.dtype != dtype or first.device != device:
        return False
    # (elementwise state follows its parameter, moved by conform_state: a kept state tensor
    # replaced fails lists_stand; lists without any are checked here, one parameter at a time)
    witnessed = any(lists[name] and lists[name][0] is not None
                    for name, key in spec.kept_state_entries.items() if key in ELEMENTWISE_STATE)
    return witnessed or all(p.dtype == dtype and p.device == device for p in params)


class UpdatePlan:
    """Per param group, the arguments of one ``update`` call of the optimizer's update spec
    besides the buffers and the window's scalars (the spec's ``state_lists``), so that a window
    updates each group in one call, with no Python loop over its parameters: the step table's
    closing micro-batch (plain mode: the table's parameters, every one that requires grad) and
    the close of a window from its live parameters (the in-backward modes', the spec's) alike.
    One extension call checks that the buffers and state fit their parameters (``conforms``,
    instead of Window.conform's loop). Kept on the window between closes while it stands: the
    param groups are the same, the groups' list-shaping flags stand
    (``state_key``) and every kept state tensor is still the one its entry holds
    (the spec's ``lists_stand``: a state loaded, or replaced by hand, is read anew, as
    torch.optim reads it). Built only where each group is of one dtype and one device and its
    parameters are plain tensors, and stands while they still are of it (``layouts``: a
    parameter moved or cast is witnessed by its state, which conform_state moves with it, or
    where the lists hold none, SGD's without momentum, checked one by one); kept only where no
    state is missing (SGD's momentum buffers exist after its first update)."""

    def __init__(self, calls: list, key: tuple, complete: bool, layouts: list, groups: int) -> None:
        self.calls, self.key, self.complete = calls, key, complete  # calls: (group, params, lists, backend, span)
        self.layouts = layouts  # per call, the (dtype, device) of its parameters
        self.groups = groups  # how many param groups the optimizer had
        self.params = frozenset(p for _, params, _, _, _ in calls for p in params)

    @staticmethod
    def for_window(opt, win: Window, build: bool, cover: frozenset | None = None) -> UpdatePlan | None:
        """The plan of the parameters in ``cover`` (by default the window's live ones; the step
        table's closing micro-batch: the table's), when it stands; else built anew where
        ``build`` (the update creates the state it holds) and it can be. (A set compared with a
        set compares the hashes it holds: no Tensor.__hash__ per parameter.)"""
        spec = opt.update_spec
        if not spec.has_lists or win.shards is not None:
            return None
        cover = win.live if cover is None else cover
        plan = win.caches.update_plan
        if plan is not None and plan.params == cover and plan.stand(opt):
            return plan
        win.caches.update_plan = None
        if not build or not cover:
            return None
        calls, start, complete, layouts = [], 0, True, []
        for group in opt.param_groups:
            # (no state is created for a parameter the window leaves alone: a frozen one, say)
            params = [p for p in group["params"] if p in cover]
            if not params:
                continue
            first = params[0]
            if any(p.dtype != first.dtype or p.device != first.device or kernel_view(p) is not p for p in params):
                return None
            lists = spec.state_lists(opt, group, params)
            complete &= spec.lists_complete(group, lists)
            calls.append((group, params, lists, spec.backend_for(opt, first), slice(start, start + len(params))))
            layouts.append((first.dtype, first.device))
            start += len(params)
        plan = UpdatePlan(calls, UpdatePlan.state_key(opt), complete, layouts, len(opt.param_groups))
        if plan.params != cover:
            return None  # (a parameter outside the param groups: not the plan's to update)
        if complete:  # (state that the update creates: read again at the next close)
            win.caches.update_plan = plan
        return plan

    @staticmethod
    def state_key(opt) -> tuple:
        """What the kept lists' shape depends on beyond the parameters: the group flags that add
        lists (amsgrad, momentum). Their tensors are checked by identity (the spec's ``lists_stand``)."""
        return tuple((group.get("amsgrad"), group.get("momentum", 0) != 0) for group in opt.param_groups)

    def stand(self, opt) -> bool:
        """(The parameters themselves are base.py's check, _wiring_stands, which every entry
        point runs first: a change drops the plan.)"""
        groups = opt.param_groups
        spec = opt.update_spec
        return (self.key == UpdatePlan.state_key(opt) and len(groups) == self.groups
                and all(any(group is kept_group for group in groups)
                        and spec.lists_stand(opt, params, lists)
                        and _layout_stands(spec, params, lists, layout)
                        for (kept_group, params, lists, _, _), layout in zip(self.calls, self.layouts)))

    def uniform(self, opt) -> bool:
        """Whether each group's parameters share one call key (Adam's step count): one call each."""
        return all(opt.update_spec.uniform_call_key(opt, lists) for _, _, lists, _, _ in self.calls)

    def conforms(self, opt, win: Window) -> bool:
        """Whether Window.conform and conform_state would change nothing for the window's live
        parameters (all of them): one extension call per group."""
        cpp = backends.extension()
        if cpp is None:
            return False
        for _, params, lists, _, _ in self.calls:
            tensors = [list(map(win.buffers.__getitem__, params))]
            tensors += [lists[name] for name, key in opt.update_spec.kept_state_entries.items()
                        if key in ELEMENTWISE_STATE and lists[name] and lists[name][0] is not None]
            if not cpp.state_fits(params, tensors):
                return False
        return True

    def update(self, opt, buffers: list[Tensor], weight_sum: float, clip_coef: Tensor | None,
               last: dict | None = None) -> None:
        """Window.close's update (``uniform`` holds): one update spec ``update`` per group. ``buffers``
        and ``last["grads"]`` (a last micro-batch folded into the update pass) are aligned with
        the plan's parameters, group after group."""
        spec = opt.update_spec
        for group, params, lists, backend, span in self.calls:
            fold = {} if last is None else {**last, "grads": last["grads"][span]}
            spec.update(opt, backend, group, params, buffers[span], lists=lists, weight_sum=weight_sum,
                        clip_coef=clip_coef, **fold)

    def buffers_of(self, win: Window) -> list[Tensor]:
        return [win.buffers[p] for _, params, _, _, _ in self.calls for p in params]
