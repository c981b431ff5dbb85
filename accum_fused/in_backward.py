"""In-backward accumulation (``in_backward=True``): gradients taken inside backward.

Owns: the post-accumulate-grad hooks on the parameters (registered when a group is added or a
frozen parameter is found unfrozen, removed by ``close()`` or when the optimizer is collected),
which live optimizer takes each parameter's gradients (a second one, or a foreign optimizer's
``step()``, is refused), the life of one backward pass (begin at the first hook, end queued on
the autograd engine, carried to the outer backward when nested, settled when it failed), mode A
(the caller's loop owns the window: backward passes are summed, ``step()`` applies) and mode B
(one backward = one micro-batch, the k-th applies the update inside backward), adopting
autograd's fresh gradient as the buffer, the trigger of the overlapped bucketed reduction
(``sync.grad_ready``), the extension's hooks (``FastPath``, csrc/hooks.cpp: armed per pass by the
Python hook, which stays the spec) and the gradients accum_fused.nn writes without
materialising them (``take_written``).

Must not: change the window's buffers or counters itself: a micro-batch begins, its gradients
go in and it ends (closing the window on its last) through the window's verbs
(``begin_micro_batch``, ``accumulate_one``, ``write_one``, ``adopt``, ``mark_written``,
``finish_micro_batch``); it only reads
whether a parameter is live, and keeps its own records on the window (``pending_weight``, the
weight opt.backward gives its pass; ``passes``, window.PassRecords). The update math of a
folded parameter is the optimizer's update spec's ``update``.

Its state of one optimizer is a ``Hooks`` record, which the optimizer holds (base.py) and hands
to the functions here; they reach the optimizer through it only for its public surface and its
update spec (never a private attribute), and its window as ``hooks.window``. Each hook holds the
record weakly, and the record its optimizer: when the optimizer is collected, its hooks go with it.
"""
from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from typing import Callable

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .framework_guard import user_stacklevel
from .layout import adoptable, kernel_view, readable_grad


# The live in_backward optimizer taking each parameter's gradients (held weakly both ways):
# a second one on the same parameters, or a foreign optimizer stepping them, would find no
# gradient, so both are refused (``claim``, ``_refuse_foreign_step``).
_owner_of = WeakIdKeyDictionary()
_foreign_check = None  # the global step pre-hook, installed with the first in_backward optimizer
_claims = 0  # bumped on every claim: optimizers checked clean before it are checked again
_checked = WeakIdKeyDictionary()  # foreign optimizer -> (_claims, its parameter count) when found clean


class BackwardPass:
    """The micro-batch a running backward pass is adding."""

    def __init__(self, weight: float, weight_sum: float, closing: bool, fold: bool, measure_norms: bool):
        self.weight, self.weight_sum = weight, weight_sum  # in the window's units, sum including this one
        self.closing = closing  # the window's last micro-batch
        self.fold = fold  # update each parameter inside its hook
        self.seen: set[Tensor] = set()
        self.done: set[Tensor] = set()
        self.done_slots: set[int] = set()  # (the extension's, by slot: ``updated``)
        # The last micro-batch of a clipped window on one rank: each accumulate pass also returns
        # its parameter's window-gradient norm (no separate norm pass over the window).
        self.norms: dict[Tensor, Tensor] | None = {} if measure_norms else None
        # What a failed pass leaves (mode B): parameters whose buffer it started (taken back out
        # exactly), and whether it added into buffers the window already held (it cannot be).
        self.started: set[Tensor] = set()
        self.added_to_live = False
        # Weakly, the callable that ends the pass (queued on the autograd engine). A graph task
        # that raises drops its callbacks unrun: a pass whose ender is gone while the pass is
        # still open belongs to a backward that failed.
        self.ender: weakref.ref | None = None
        # Parameters whose gradient of this pass is in the window (added, started or folded):
        # what a failed run() pass keeps (recovery.py).
        self.completed: set[Tensor] = set()
        # What the extension's hooks added or adopted, by slot (FastPath.take_records): seen and
        # completed too, kept as ints so that a pass costs no Python work per such parameter; and
        # the norms their additions measured (the window's last micro-batch, clipped), by slot.
        self.taken_slots: set[int] = set()
        self.slot_norms: dict[int, Tensor] = {}

    def updated(self, fast_path: FastPath | None) -> set[Tensor]:
        """The parameters updated inside their hooks in this pass."""
        if not self.done_slots:
            return self.done
        return self.done.union(map(fast_path.params.__getitem__, self.done_slots))

    def any_seen(self) -> bool:
        return bool(self.seen or self.taken_slots)

    def failed(self) -> bool:
        return self.ender is not None and self.ender() is None


class _EndPass:
    """Queued on the autograd engine by a pass's first hook; ends the pass when its backward is
    done. A backward nested inside an outer one (a reentrant checkpoint's, or one run inside a
    custom Function's backward) finishes while the outer node still runs: the micro-batch then
    goes on until the outer backward is done (one backward call = one micro-batch)."""

    def __init__(self, hooks: Hooks):
        self.hooks_ref = weakref.ref(hooks)

    def __call__(self) -> None:
        hooks = self.hooks_ref()
        if hooks is None or hooks.optimizer() is None or hooks.window.passes.current is None:
            return
        outer = torch._C._current_autograd_node()
        if outer is None:
            end_pass(hooks)
            return
        mb = hooks.window.passes.current

        def outer_done(grad_inputs, grad_outputs):
            handle.remove()
            mb.ender = _queue_end(hooks)

        handle = outer.register_hook(outer_done)
        mb.ender = weakref.ref(outer_done)


def _queue_end(hooks: Hooks) -> weakref.ref:
    ender = _EndPass(hooks)
    torch.autograd.Variable._execution_engine.queue_callback(ender)
    return weakref.ref(ender)


def _make_grad_hook(hooks_ref: weakref.ref) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        hooks = hooks_ref()
        if hooks is None or hooks.optimizer() is None:
            return
        if torch.is_grad_enabled():  # backward(create_graph=True): the window's writes join no graph
            with torch.no_grad():
                take_grad(hooks, param)
        else:  # (autograd runs hooks with grad mode off; a no_grad context costs ~1-5 us per call)
            take_grad(hooks, param)
    return hook


# What the extension's hooks (csrc/hooks.cpp) do with a parameter's gradient in a pass that
# folds (an explicit arm): fold it into the update, or what its row says.
_FOLD, _ROW = 4, 5


# Tests set it to run a GPU's per-gradient path (by_torch_ops) on CPU parameters.
TORCH_OPS_ON_CPU = False


def by_torch_ops(p: Tensor) -> bool:
    """Whether one gradient of ``p`` goes into its buffer through torch's own ops, the reference
    backend's, whatever the optimizer's backend: on a GPU, where a gradient must cost what
    autograd's AccumulateGrad makes it cost (an add launched on the gradient's stream; no kernel
    table built and uploaded, no launcher's Python), in the extension's C++ hooks
    (hooks.cpp's accumulate_into) and in Python's (``_add``) alike, so the two stay bit-identical.
    No update is folded into a hook there either (``begin_pass``): the window's close makes the
    backend's one multi-tensor update per group. On CPU the backend's kernels do both."""
    return p.device.type != "cpu" or TORCH_OPS_ON_CPU


def _one_gradient_backend(opt, p: Tensor):
    """The backend that adds one gradient of ``p`` (an in-backward hook's): see by_torch_ops."""
    from .backends import reference
    return reference if by_torch_ops(p) else opt.update_spec.backend_for(opt, p)


class FastPath:
    """The extension's hooks (csrc/hooks.cpp) and their table: one row per hooked parameter (its
    slot), holding the parameter's route, decided here once per layout epoch (``build_rows``),
    and the window's state of it (buffer, live, adopted), which every writer keeps true: the
    extension's takes, ``python_took`` for what ``take_grad`` takes, the window's end
    (``Window.discard``: HookState.new_window). At a backward pass's first gradient (which
    ``take_grad`` takes itself) ``arm`` begins the pass: each other parameter's gradient then
    does what its row says, exactly as ``take_grad`` would (add into its live buffer, overwrite
    its stale one or become it), or, on a pass that folds (the last micro-batch, no clipping, no
    ranks, the cpp backend), what the explicit arm says; the extension does it without running
    Python and hands everything else to ``take_grad``, which stays the spec. What it did is read
    back (``take_records``) before the pass's records are read or changed."""

    def __init__(self, extension) -> None:
        self.state = extension.HookState()
        self._extension = extension
        self.params: list[Tensor] = []  # by slot
        self.slot_of: dict[Tensor, int] = {}
        self.routes: list = []  # by slot: each row's route (window.table.Route), as build_rows decided it
        self.all_kernels = False  # every row's gradients go in by the cpp backend's kernels (build_rows)
        self.built = 0  # rows built by the Python loop over the parameters (tests count them)
        self._slots_of: list | None = None  # slots_of's
        self.dict_handles: list[_DictHookHandle] = []  # hooks in a dict of Python hooks (rehook_dropped)
        self._adopted_params: tuple | None = None  # (slots, their parameters, as a set): _params_of_adopted
        self._plan_slots: tuple | None = None  # (an update plan, its parameters' slots): slots_of_plan

    @staticmethod
    def for_optimizer(opt) -> FastPath | None:
        from . import backends
        cpp = backends.extension_paths(opt.backend)
        return None if cpp is None else FastPath(cpp)

    def hook(self, p: Tensor, python_hook: Callable[[Tensor], None]):
        """Hook ``p`` (``python_hook`` for what the extension does not take); returns the
        handle. The hook goes into ``p``'s post-accumulate-grad slot in C++ (no Python per
        gradient), unless Python hooks are registered on ``p`` already, which must keep running
        first: then it is registered among them, and calls into C++ from Python."""
        slot = self.slot_of.get(p)
        if slot is None:
            slot = self.slot_of[p] = len(self.params)
            self.params.append(p)
            self.state.add_slot()
            self.state.epoch = -1  # (the new slot has no row yet: built at the next pass)
            self._slots_of = None
        # (Plain tensors only: FSDP2 calls the dict of a sharded DTensor parameter's Python hooks
        # itself, and would not call a hook in the slot.)
        if type(p) in (Tensor, torch.nn.Parameter) and p.is_leaf and not p._post_accumulate_grad_hooks:
            # torch's dict of Python hooks first (torch puts its hook for it in the slot), so that
            # hooks registered later join it, and run after ours: install_hook keeps it.
            python_hooks = p._post_accumulate_grad_hooks
            if python_hooks is None:
                python_hooks = p._post_accumulate_grad_hooks = OrderedDict()
            if self._extension.install_hook(p, self.state, slot, python_hook, python_hooks):
                # (At its first gradient of each window, that hook puts one before autograd's
                # AccumulateGrad, which takes the gradient before it becomes .grad where nothing
                # else would see the difference (hooks.cpp's TakeBeforeAccumulate): what the
                # pass's other gradients mostly go through.)
                return _ExtensionHookHandle(p, self._extension.remove_hook)
        handle = _DictHookHandle(p, self._extension.FastHook(self.state, slot, python_hook))
        self.dict_handles.append(handle)
        return handle

    def build_rows(self, opt, win) -> None:
        """Every row anew, from the window (a layout epoch the rows are not true to, or a
        parameter cast or moved since they were built, which the extension finds: then their
        epoch is -1): each parameter's route (window.table.route, with by_torch_ops: decided
        there, executed by the extension) and its window state (buffer, live, adopted)."""
        from .window.table import route, row_lists
        routes = self.routes = [route(opt, win, p, by_torch_ops(p)) for p in self.params]
        self.all_kernels = all(r.takes and not r.torch_ops for r in routes)  # (_arm_folds_from_kept's)
        self.state.set_rows(self.params, **row_lists(win, self.params, routes, list(map(win.buffers.get, self.params))))
        self.state.epoch = win.caches.epoch
        self.built += 1

    def python_took(self, win, p: Tensor, epoch: int) -> None:
        """``take_grad`` took ``p``'s gradient of this pass (the window was at ``epoch`` before):
        its row follows the window, and the rows stay true to it where they were."""
        slot = self.slot_of.get(p)
        if slot is None:
            return
        self.state.python_took(slot, win.buffers.get(p), p in win.live, p in win.adopted)
        if self.state.epoch == epoch:
            self.state.epoch = win.caches.epoch

    def arm(self, hooks: Hooks, mb: BackwardPass, first: Tensor) -> None:
        opt, win = hooks.optimizer(), hooks.window
        if mb.closing and win.sync is not None and not win.transaction.active:
            return  # buckets handed to the other ranks as gradients arrive: Python's
        if self.state.epoch != win.caches.epoch:
            self.build_rows(opt, win)
        if mb.fold:
            if not win.transaction.complete and self._arm_folds_from_kept(opt, win, mb, first):
                return
            self._arm_folds(hooks, mb, first)
            return
        # (Python's: the first gradient, and those a failed run() pass already added whole)
        seen = [self.slot_of[p] for p in (first, *win.transaction.complete) if p in self.slot_of]
        self.state.begin_pass(mb.weight, mb.weight_sum if mb.norms is not None else None, mb.weight_sum, seen)

    def _arm_folds(self, hooks: Hooks, mb: BackwardPass, first: Tensor) -> None:
        """Arm a pass that folds each parameter's update into its hook, parameter by parameter:
        what ``_FoldArgs`` finds for each (its group update, state and step count); gradients
        added by torch's ops go in as their rows say (no update is folded there)."""
        opt, win = hooks.optimizer(), hooks.window
        fold = _FoldArgs(hooks.group_of)
        fold.read_step_counts(opt, self.params)
        complete = win.transaction.complete
        slots, modes, buffers = [], [], []
        for slot, p in enumerate(self.params):
            if p is first or p in complete:
                continue
            routed = self.routes[slot]  # (arm built the rows: they are true to the window)
            buf = win.buffers.get(p)
            if not routed.takes:
                mode = None
            elif routed.torch_ops:
                mode = _ROW
            else:
                mode = _FOLD if buf is not None and fold.add(opt, p, overwrite=p not in win.live) else None
            if mode is not None:
                slots.append(slot)
                modes.append(mode)
                buffers.append(buf)
                if mode != _FOLD:
                    fold.skip()
        self.state.arm(mb.weight, None, mb.weight_sum, slots, modes, buffers, fold.specs, fold.spec_of,
                       fold.overwrite, *fold.states)

    def _arm_folds_from_kept(self, opt, win, mb: BackwardPass, first: Tensor) -> bool:
        """``arm`` for a pass that folds every live parameter's update into its hook, from the
        update's kept lists (window.UpdatePlan of the live parameters, the state standing) with
        no Python loop over the parameters: what ``_FoldArgs`` would find for each, where each
        group shares one step count and every row's route sends its gradients to the cpp
        backend's kernels (``all_kernels``: the routes decide it, once per epoch). False, with
        nothing armed, where the loop must do it."""
        from .window import UpdatePlan
        spec = opt.update_spec
        # (built here once every parameter has state: a first update creates it in Python, and
        # reading Adam's lists would create it first)
        kept = UpdatePlan.for_window(opt, win, build=not spec.state_lists_create_state
                                     or len(opt.state) >= len(win.live))
        if kept is None or not kept.complete or not spec.has_lists or not self.all_kernels:
            return False
        slots = self.slots_of_plan(kept)
        if None in slots:
            return False
        specs, spec_of, states = [], [], ([], [], [], [])
        for group, group_params, lists, _, _ in kept.calls:
            n = len(group_params)
            if not _folds_in_extension(group_params[0], group) or not spec.uniform_call_key(opt, lists):
                return False
            hyper = spec.hyperparameters(group)
            adam = "beta1" in hyper
            specs.append(_fold_spec(hyper, spec.fold_count(lists["steps"][0], {}) if adam else None))
            if adam:
                columns = (lists["exp_avgs"], lists["exp_avg_sqs"], lists["max_exp_avg_sqs"] or [None] * n,
                           lists["steps"])
            else:  # SGD (kept lists exist only once its momentum buffers do)
                columns = (lists["momentum_buffers"], [None] * n, [None] * n, [None] * n)
            spec_of += [len(specs) - 1] * n
            for column, values in zip(states, columns):
                column += values
        buffers = kept.buffers_of(win)
        lists = [slots, buffers, spec_of, *states]
        first_slot = self.slot_of.get(first)
        at = slots.index(first_slot) if first_slot is not None and first_slot in slots else None
        if at is not None:  # (the first gradient is Python's)
            for values in lists:
                del values[at]
        n = len(slots)
        self.state.arm(mb.weight, None, mb.weight_sum, slots, [_FOLD] * n, buffers, specs, spec_of, [False] * n,
                       *states)
        return True

    def take_records(self, win, mb: BackwardPass, end: bool = False) -> None:
        """Record in the window and in ``mb`` what the extension did since the last call;
        ``end``: the pass is over (ended or failed), disarm. The common records (additions, with
        or without a norm, and adoptions) come as lists: set and dict updates, no Python loop."""
        if not self.state.armed:
            return
        added, normed, norms, adopted, grads, folded, written, written_norms = self.state.drain()
        if end:
            self.state.disarm()
        if added or normed:
            mb.taken_slots.update(added)
            mb.taken_slots.update(normed)
            mb.slot_norms.update(zip(normed, norms))
            mb.added_to_live = True
        if folded:
            mb.taken_slots.update(folded)
            mb.done_slots.update(folded)
        if adopted:  # (the window's first micro-batch: autograd's gradients become the buffers)
            params, param_set = self._params_of_adopted(adopted)
            mb.taken_slots.update(adopted)
            mb.started |= param_set
            win.adopt(params, grads, param_set)
        for slot, norm in zip(written, written_norms):  # (a stale buffer overwritten: the window's first gradient)
            p = self.params[slot]
            mb.seen.add(p)
            mb.completed.add(p)
            mb.started.add(p)
            win.mark_written(p)
            if norm is not None:
                mb.norms[p] = norm

    def write_linear(self, p: Tensor, grad_out: Tensor, inp: Tensor | None) -> bool:
        """``p``'s gradient of this pass (accum_fused.nn's fused Linear: grad_out^T @ inp, or
        grad_out summed over the rows for a bias) computed by the extension straight into its
        buffer, as armed (HookState.write_linear); False where take_written is to do it."""
        slot = self.slot_of.get(p)
        return slot is not None and self.state.write_linear(slot, p, grad_out, inp)

    def _params_of_adopted(self, slots: list[int]) -> tuple[list[Tensor], set[Tensor]]:
        """The parameters of ``slots`` and their set, kept while the slots are the same (every
        window's first pass adopts the same ones): a set updated from a set reuses the hashes it
        holds, where a list of tensors calls Tensor.__hash__ (Python, ~0.25 us) for each."""
        kept = self._adopted_params
        if kept is None or kept[0] != slots:
            params = list(map(self.params.__getitem__, slots))
            kept = self._adopted_params = (slots, params, set(params))
        return kept[1], kept[2]

    def slots_of(self, params: list[Tensor]) -> list[int | None]:
        """Each of the optimizer's parameters' slot (None: not hooked here), ``params`` in the
        update spec's order. Kept until a slot is added (a parameter unfrozen) or parameters are
        (a group added): a parameter replaced, or a group gone, is base.py's check
        (_wiring_stands), whose rewire builds a new FastPath."""
        kept = self._slots_of
        if kept is not None and len(kept) == len(params):
            return kept
        self._slots_of = [self.slot_of.get(p) for p in params]
        return self._slots_of

    def slots_of_plan(self, plan) -> list[int | None]:
        """The slots of an update plan's parameters, in its order (a copy): kept while the plan
        is the same object (it stands for as long as its parameters are the window's)."""
        kept = self._plan_slots
        if kept is None or kept[0] is not plan:
            kept = self._plan_slots = (plan, [self.slot_of.get(p) for _, params, _, _, _ in plan.calls for p in params])
        return list(kept[1])

    def window_norms(self, opt, mb: BackwardPass) -> list[Tensor | None]:
        """The norms the pass measured (``mb.norms``, ``mb.slot_norms``), aligned with
        the spec's ``params(opt)``: None where none was measured."""
        params = opt.update_spec.params(opt)
        norms = list(map(mb.slot_norms.get, self.slots_of(params)))
        if mb.norms:
            for i in [i for i, norm in enumerate(norms) if norm is None]:
                norms[i] = mb.norms.get(params[i])
        return norms


class _FoldArgs:
    """For a pass that updates each parameter in its hook: per parameter, which group update
    (the scalars cpp_backend computes from what the update spec's ``update`` hands the same op) and which
    state."""

    def __init__(self, group_of: dict) -> None:
        self.group_of = group_of  # each parameter's param group (Hooks.group_of)
        self.specs: list[dict] = []
        self.index: dict[tuple, int] = {}
        self.spec_of: list[int] = []
        self.overwrite: list[bool] = []
        self.states: tuple[list, ...] = ([], [], [], [])  # exp_avg or momentum_buffer, exp_avg_sq, max, step
        self.hyperparameters: dict[int, dict] = {}  # by id(group)
        self.step_counts: dict[int, int] = {}  # id(step tensor) -> its value (read_step_counts)

    def read_step_counts(self, opt, params: list[Tensor]) -> None:
        """Every Adam step count at once (one stack and one tolist: a .item() per parameter cost
        ~1 us each); ``add`` falls back to .item() for one it does not find."""
        self.step_counts = opt.update_spec.step_counts(opt, params)

    def add(self, opt, p: Tensor, overwrite: bool) -> bool:
        """Record ``p``'s fold; False when it stays Python's (an optimizer without
        per-group update lists, state that a first update creates)."""
        spec = opt.update_spec
        if not spec.has_lists:
            return False
        state = opt.state.get(p) or {}  # (SGD without momentum keeps none)
        group = self.group_of[p]
        if not _folds_in_extension(p, group):
            return False
        hyper = self.hyperparameters.get(id(group))
        if hyper is None:
            hyper = self.hyperparameters[id(group)] = spec.hyperparameters(group)
        if "beta1" in hyper:  # Adam, AdamW
            step = state.get("step")
            if step is None:  # (its first update creates the state)
                return False
            count = spec.fold_count(step, self.step_counts)
            key = (id(group), count)
            if key not in self.index:
                self._new_spec(key, _fold_spec(hyper, count))
            tensors = (state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq"), step)
        else:  # SGD
            if hyper["momentum"] != 0 and state.get("momentum_buffer") is None:
                return False
            key = (id(group),)
            if key not in self.index:
                self._new_spec(key, _fold_spec(hyper, None))
            tensors = (state.get("momentum_buffer"), None, None, None)
        self.spec_of.append(self.index[key])
        self.overwrite.append(overwrite)
        for column, t in zip(self.states, tensors):
            column.append(t)
        return True

    def skip(self) -> None:
        """A parameter of the explicit arm that does not fold: no update, no state."""
        self.spec_of.append(-1)
        self.overwrite.append(False)
        for column in self.states:
            column.append(None)

    def _new_spec(self, key: tuple, scalars: dict) -> None:
        self.index[key] = len(self.specs)
        self.specs.append(scalars)


def _folds_in_extension(p: Tensor, group) -> bool:
    """Whether the extension's hooks may fold ``p``'s update: not bf16 rounding other than
    nearest (its rounding state and keys are Python's _update)."""
    return p.dtype != torch.bfloat16 or group.get("bf16_update", "nearest") == "nearest"


def _fold_spec(hyper: dict, count: int | None) -> dict:
    """The extension's update of a folded parameter (hooks.cpp's FoldSpec): the scalars
    cpp_backend computes from the update spec's ``hyperparameters(group)``, at step ``count`` for Adam."""
    from .backends import cpp_backend
    if "beta1" in hyper:  # Adam, AdamW
        return dict(kind="adam", **cpp_backend.adam_scalars(step=count, **hyper))
    return dict(kind="sgd", **cpp_backend.sgd_scalars(**hyper))


class _ExtensionHookHandle:
    """``remove()`` of a hook the extension put in a parameter's slot (FastPath.hook), as a
    RemovableHandle's: torch's Python hooks go back in the slot, the hook before its gradient
    accumulator comes off and the extension lets go of the node. (The extension reports the hook
    dropped otherwise: ``HookState.take_dropped``.)"""

    def __init__(self, p: Tensor, remove_hook: Callable[[Tensor], bool]) -> None:
        self.param = weakref.ref(p)
        self._remove_hook = remove_hook

    def remove(self) -> None:
        p = self.param()
        if p is not None:
            self._remove_hook(p)


class _DictHookHandle:
    """A hook registered in ``p._post_accumulate_grad_hooks`` (torch's RemovableHandle), which
    can tell whether it is still there: setting that attribute drops the dict and the hook."""

    def __init__(self, p: Tensor, hook: Callable[[Tensor], None]) -> None:
        self.param = weakref.ref(p)
        self._handle = p.register_post_accumulate_grad_hook(hook)

    def remove(self) -> None:
        self._handle.remove()

    def dropped(self) -> Tensor | None:
        """The parameter, when another dict took the place of the one holding its hook. (Set to
        None, the attribute leaves the slot, and so the dict and the hook, as they were.)"""
        p = self.param()
        hooks = None if p is None else p._post_accumulate_grad_hooks
        return p if hooks is not None and self._handle.id not in hooks else None


class Hooks:
    """in_backward's state of one optimizer (``install`` makes it; the optimizer holds it, and
    hands it to the functions here): the optimizer itself (weakly: each hook holds this record
    weakly in turn), its window, torch's step hooks to run around an update inside backward
    (base.py's, weakly), the extension's hooks and their table (``fast_path``; None without the
    extension), the handles of the hooks on the parameters, the parameters not hooked yet
    (frozen), each parameter's param group, and whether a dropped hook was warned about. Also
    base.py's check that the param groups still hold the parameters hooked (``wiring_stands``)."""

    def __init__(self, opt, window, run_step_hooks: weakref.WeakMethod, wiring_stands: weakref.WeakMethod) -> None:
        self.optimizer = weakref.ref(opt)
        self.window = window
        self._run_step_hooks = run_step_hooks
        self._wiring_stands = wiring_stands
        self.fast_path = FastPath.for_optimizer(opt)
        self.handles: list = []
        self.unhooked: list[Tensor] = []
        self.group_of: dict = {}
        self.warned_dropped = False

    def run_step_hooks(self, post: bool) -> None:
        """torch's step pre- or post-hooks, around mode B's update inside backward."""
        self._run_step_hooks()(post=post)

    def wiring_stands(self) -> bool:
        """Whether the param groups still hold the parameters hooked (base.py's check)."""
        return self._wiring_stands()()


def install(opt, window, run_step_hooks: weakref.WeakMethod, wiring_stands: weakref.WeakMethod) -> Hooks:
    """Hooks on every parameter of ``opt`` (construction); ``add_param_group`` adds more. The
    hooks go when ``remove_hooks(hooks.handles)`` runs: ``close()``, or the optimizer's
    collection (base.py's finalizer)."""
    hooks = Hooks(opt, window, run_step_hooks, wiring_stands)
    if hooks.fast_path is not None:
        window.caches.hook_state = hooks.fast_path.state  # (its rows follow the window as it ends)
    register_hooks(hooks, opt.update_spec.params(opt))
    return hooks


def register_hooks(hooks: Hooks, params) -> None:
    """A post-accumulate-grad hook on each of ``params`` that requires grad; the others are
    hooked when a backward pass finds them unfrozen (``_hook_unfrozen``)."""
    params = list(params)
    opt = hooks.optimizer()
    claim(opt, params)
    hook = _make_grad_hook(weakref.ref(hooks))
    fast = hooks.fast_path
    for p in params:
        if p.requires_grad:
            hooks.handles.append(_DictHookHandle(p, hook) if fast is None else fast.hook(p, hook))
        else:
            hooks.unhooked.append(p)
    hooks.group_of = {p: group for group in opt.param_groups for p in group["params"]}


def rewire(hooks: Hooks, params: list[Tensor]) -> None:
    """The optimizer's parameters were replaced between windows (base.py's _rewire): the hooks
    of the old ones go (their gradients are no longer taken), and ``params`` are hooked anew,
    on a new table of rows."""
    opt = hooks.optimizer()
    claim(opt, params)  # (refuses, before anything changes, parameters another optimizer takes)
    kept = set(params)
    remove_hooks(hooks.handles)  # (in place: base.py's finalizer holds the list)
    for p in hooks.group_of:
        if p not in kept and _owner(p) is opt:
            del _owner_of[p]
    hooks.unhooked = []
    hooks.fast_path = FastPath.for_optimizer(opt)
    if hooks.fast_path is not None:
        hooks.window.caches.hook_state = hooks.fast_path.state
    register_hooks(hooks, params)


def rehook_dropped(hooks: Hooks, take: bool) -> None:
    """Parameters whose hook something took off since the last look: setting
    ``p._post_accumulate_grad_hooks`` to a new dict (directly, or by registering a hook after
    setting it to None) replaces torch's dict of Python hooks and the parameter's hook slot,
    ours with them. Autograd then leaves the gradient in ``.grad``, where mode B's window would
    never see it. They are hooked again (with a warning, once), and with ``take`` (a pass is
    open: ``end_pass``) the gradient the pass left in ``.grad`` joins it, as for a parameter
    unfrozen during the pass; mode A's step() collects ``.grad`` itself. The extension reports
    its dropped hooks (no scan); hooks in a dict are looked up there, one by one (parameters
    that had Python hooks first, DTensors, and every parameter without the extension)."""
    fast = hooks.fast_path
    dropped = [] if fast is None else [fast.params[slot] for slot in fast.state.take_dropped()]
    for handle in hooks.handles if fast is None else fast.dict_handles:
        p = handle.dropped()
        if p is not None:
            dropped.append(p)
    if not dropped:
        return
    dropped = list(dict.fromkeys(dropped))
    gone = set(dropped)
    # In place: base.py's finalizer and a FastPath hold these lists.
    hooks.handles[:] = [h for h in hooks.handles if h.param() not in gone]
    if fast is not None:
        fast.dict_handles[:] = [h for h in fast.dict_handles if h.param() not in gone]
    if not hooks.warned_dropped:
        hooks.warned_dropped = True
        opt = hooks.optimizer()
        warnings.warn(
            f"the post-accumulate-grad hooks of {opt.update_spec.name(opt, dropped[0])} were replaced (something set its "
            f"_post_accumulate_grad_hooks) after {type(opt).__name__}(in_backward=True) hooked it, which removed "
            f"the hook that takes its gradients ({len(dropped)} parameter(s) so far): hooked again, its gradient "
            "taken from .grad. To remove hooks of your own, use the handle that register_post_accumulate_grad_hook "
            "returned. (Warned once per optimizer.)",
            stacklevel=user_stacklevel(),
        )
    register_hooks(hooks, dropped)
    if take:
        for p in dropped:
            take_grad(hooks, p)


def claim(opt, params) -> None:
    """Record ``opt`` as the taker of ``params``' gradients, refusing (before anything is
    recorded) parameters another live in_backward optimizer takes."""
    global _foreign_check, _claims
    for p in params:
        owner = _owner(p)
        if owner is not None and owner is not opt:
            raise RuntimeError(
                f"{opt.update_spec.name(opt, p)} already has its gradients taken inside backward by a live "
                f"{type(owner).__name__}(in_backward=True) (a notebook cell re-run keeps the old optimizer alive "
                "through its LR scheduler or a variable): call old_optimizer.close() first, then build this one"
            )
    this = weakref.ref(opt)
    for p in params:
        _owner_of[p] = this
    _claims += 1
    if _foreign_check is None:
        _foreign_check = register_optimizer_step_pre_hook(_refuse_foreign_step)


def _owner(p: Tensor):
    ref = _owner_of.get(p)
    return None if ref is None else ref()


def release_claims(opt) -> None:
    for p in opt.update_spec.params(opt):
        if _owner(p) is opt:
            del _owner_of[p]


def _refuse_foreign_step(optimizer, args, kwargs) -> None:
    """Global step pre-hook: an optimizer stepping parameters whose gradients a live in_backward
    optimizer takes would see no .grad and silently do nothing for them."""
    if not _owner_of:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _checked.get(optimizer) == (_claims, len(params)):
        return
    for p in params:
        owner = _owner(p)
        if owner is not None and owner is not optimizer:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() updates a parameter (shape {tuple(p.shape)}) whose gradients "
                f"a live {type(owner).__name__}(in_backward=True) takes inside backward (.grad is freed there), so "
                "this step would see no gradient: call that optimizer's close() first (or use only one of them)"
            )
    _checked[optimizer] = (_claims, len(params))


def close(hooks: Hooks) -> None:
    """opt.close(): hooks off, parameters free for another optimizer."""
    remove_hooks(hooks.handles)
    if hooks.fast_path is not None:
        hooks.fast_path.state.disarm()
    release_claims(hooks.optimizer())
    hooks.unhooked = []


def remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def check_step(hooks: Hooks, weight: float) -> None:
    """What step() may mean with in_backward: apply mode A's summed window, nothing else."""
    opt = hooks.optimizer()
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
    check_not_in_backward(hooks, "step()")


def check_not_in_backward(hooks: Hooks | None, what: str) -> None:
    """Refuse ``what`` inside a backward pass; a pass left open by a backward that failed is
    settled first (``settle_failed_pass``), so a failure never leaves the optimizer stuck.
    ``hooks`` None: the optimizer takes no gradients inside backward."""
    if hooks is None:
        return
    settle_if_failed(hooks)
    if hooks.window.passes.current is not None:
        raise RuntimeError(f"{what} was called inside a backward pass; call it after backward returns")


def settle_if_failed(hooks: Hooks | None) -> None:
    mb = None if hooks is None else hooks.window.passes.current
    if mb is not None and mb.failed():
        settle_failed_pass(hooks)


def backward(hooks: Hooks, loss: Tensor, weight: float, backward_kwargs: dict) -> None:
    """opt.backward(loss, weight=) with in_backward: one backward pass as one micro-batch of
    ``weight`` (mode B; the window's last applies the update) or summed into mode A's window.
    In mode B, once opt.backward is used only its passes are micro-batches (another backward
    reaching the parameters leaves .grad as torch would); a pass that raises is settled at
    once (``settle_failed_pass``)."""
    opt, win = hooks.optimizer(), hooks.window
    if opt.accumulation_steps == 1 and weight != 1.0:
        raise ValueError("with in_backward=True and accumulation_steps=1 the backward passes are summed: "
                         "weight must be 1 (scale the loss instead), or set accumulation_steps")
    check_not_in_backward(hooks, "opt.backward()")
    check_resized(hooks)
    win.pending_weight = weight
    win.passes.own = True
    win.passes.owned |= opt.accumulation_steps > 1
    try:
        torch.autograd.backward(loss, **backward_kwargs)
        if win.pending_weight is not None:
            # No parameter of this optimizer received a gradient (FSDP2 may hold them back
            # for a later backward): still one micro-batch.
            win.hold_grads()
            begin_pass(hooks)
            end_pass(hooks)
    except BaseException:
        if win.passes.current is not None:
            settle_failed_pass(hooks)
        raise
    finally:
        win.pending_weight = None
        win.passes.own = False
        win.passes.current = None


def check_resized(hooks: Hooks) -> None:
    """Refuse, before opt.backward's pass begins, a parameter whose shape changed (``p.data =
    ...``) in the middle of a window: the window's ValueError (``Window.conform``), with nothing
    changed. Inside the pass it would come after other gradients were added, or updates begun
    (mode B's last micro-batch); and on the cpp backend autograd would refuse the gradient first,
    with its own error, at the node the extension keeps for the window (hooks.cpp). A plain
    ``loss.backward()`` (mode A) gives us no call before its pass: there the refusal is the
    hook's on the reference backend and autograd's on cpp (troubleshooting.md)."""
    opt, win = hooks.optimizer(), hooks.window
    if not win.live:
        return
    fast = hooks.fast_path
    if fast is None:
        win.conform(opt, list(win.live), closing=False)  # (what each gradient's hook conforms, ahead of it)
        return
    slot = fast.state.resized_slot()  # (its hooks' parameters: one extension call, no Python per parameter)
    if slot >= 0:
        win.conform(opt, [fast.params[slot]], closing=False)


def settle_failed_pass(hooks: Hooks) -> None:
    """The backward pass that opened the window's ``backward_pass`` raised before its end
    (opt.backward sees it at once; a failed loss.backward() is found at the next call).

    Mode A keeps what it summed, as autograd keeps a failed pass's partial gradients in .grad
    (``zero_grad()`` discards both). Mode B: a pass that only started buffers (the window's first
    micro-batch, say) is taken back out exactly. One that had added into sums the window already
    held cannot be: taking it out needs its gradients, and keeping them until the pass ends made
    mode B 2.7x slower on CPU (autograd then gets fresh, page-faulting storage for every
    gradient: 470 vs 171 ms per window, 33.6M parameters, k=8). Nor can a window's last
    micro-batch whose update had begun inside backward. Both discard the window, with a
    RuntimeWarning saying what was lost; the next micro-batch starts a new window."""
    opt, win = hooks.optimizer(), hooks.window
    mb, win.passes.current = win.passes.current, None
    if hooks.fast_path is not None:
        hooks.fast_path.take_records(win, mb, end=True)
    if win.transaction.active:
        # run() (recovery.py): what the pass added, it added whole; its retry skips those.
        win.transaction.complete |= mb.completed
        if mb.taken_slots:
            win.transaction.complete.update(map(hooks.fast_path.params.__getitem__, mb.taken_slots))
        return
    if opt.accumulation_steps == 1 or not mb.any_seen():
        return
    if mb.done or mb.done_slots or mb.added_to_live:
        lost = win.micro_step
        win.abandon(opt)
        updated = mb.updated(hooks.fast_path)
        how = (f"after {len(updated)} parameter(s) had been updated inside it" if updated
               else "after adding gradients to the window's sums")
        warnings.warn(
            f"{type(opt).__name__}(in_backward=True): a backward pass failed {how}, which cannot be taken back "
            f"out; the window was discarded with the {lost} micro-batch(es) it held before, and the next "
            "micro-batch starts a new window", RuntimeWarning, stacklevel=user_stacklevel())
        return
    win.changed()  # (not what the extension's rows hold: built anew)
    for p in mb.started:
        win.live.discard(p)
        if p in win.adopted:
            win.adopted.discard(p)
            del win.buffers[p]


def take_grad(hooks: Hooks, p: Tensor) -> None:
    """The post-accumulate-grad hook's work for ``p``: its fresh gradient into the window (or,
    on the window's last micro-batch without clipping or ranks, straight into its update);
    ``.grad`` is freed. Runs with grad mode off."""
    grad = p.grad
    if grad is None:
        return
    complete = hooks.window.transaction.complete
    if complete and p in complete:  # a failed run() pass already added this micro-batch's gradient
        p.grad = None
        return
    if grad.is_sparse:
        raise RuntimeError(f"{type(hooks.optimizer()).__name__}(in_backward=True) does not support sparse gradients; "
                           "use nn.Embedding(sparse=False)")
    joined = _join_pass(hooks, p)
    if joined is not None:
        p.grad = None
        _add(hooks, p, readable_grad(grad), *joined)


def take_written(hooks: Hooks, p: Tensor, writer) -> bool:
    """accum_fused.nn's fused Linear: ``p``'s gradient of this backward pass is never
    materialised; ``writer.write(buffer, weight, overwrite)`` puts weight x gradient straight
    into ``p``'s window buffer (the GEMM's output), taking the same path through the pass as a
    gradient would. False: this backward is not a micro-batch of ``opt`` (the caller hands
    autograd the gradient instead)."""
    complete = hooks.window.transaction.complete
    if complete and p in complete:  # a failed run() pass already wrote this micro-batch's gradient
        return True
    joined = _join_pass(hooks, p)
    if joined is not None:
        _add(hooks, p, writer, *joined)
    return joined is not None


def _join_pass(hooks: Hooks, p: Tensor) -> tuple[BackwardPass, bool] | None:
    """The pass ``p``'s gradient belongs to (begun by this gradient when it is the first), and
    whether ``p`` already had one in it; None when the gradient is not this optimizer's."""
    win = hooks.window
    mb = win.passes.current
    if mb is not None and mb.failed():
        settle_failed_pass(hooks)
        mb = None
    if mb is None:
        if win.passes.owned and not win.passes.own:
            return None  # not a micro-batch of this optimizer (a GAN's other loss): .grad stays, as torch leaves it
        if not hooks.wiring_stands():
            _refuse_replaced(hooks, p)
        mb = begin_pass(hooks, p)
        mb.ender = _queue_end(hooks)
        if hooks.fast_path is not None:
            hooks.fast_path.arm(hooks, mb, p)
    elif hooks.fast_path is not None:
        hooks.fast_path.take_records(win, mb)
    again = p in mb.seen or bool(mb.taken_slots and hooks.fast_path.slot_of.get(p) in mb.taken_slots)
    updated = p in mb.done or bool(mb.done_slots and hooks.fast_path.slot_of.get(p) in mb.done_slots)
    if again and (updated or (mb.closing and win.sync is not None and not win.transaction.active)):
        # (a parameter used both inside and outside a reentrant checkpoint gets two)
        opt = hooks.optimizer()
        raise RuntimeError(
            f"{opt.update_spec.name(opt, p)} received a second gradient in the backward pass of the window's last "
            "micro-batch after its update (or its cross-rank reduction) had begun inside backward: use "
            "checkpoint(use_reentrant=False), or set max_grad_norm without ranks"
        )
    mb.seen.add(p)
    return mb, again


def _refuse_replaced(hooks: Hooks, p: Tensor) -> None:
    """A param group's parameters were replaced since the hooks were put on them (base.py's
    _wiring_stands), and a backward pass begins: the new ones have no hook, so their gradients
    would stay out of the window. The hooks cannot be moved from inside one of them (this is
    ``p``'s), so the pass is refused as it begins, nothing taken; the window's entry points
    follow the new parameters between windows (base.py's _rewire)."""
    opt, win = hooks.optimizer(), hooks.window
    p.grad = None  # (this pass's, left by autograd before the hook: not taken)
    name = type(opt).__name__
    win.refuse_replaced_params(name)
    raise RuntimeError(
        f"a param group's parameters were replaced (its \"params\" list or one in it) after {name} hooked them "
        "(in_backward=True), and this backward pass would leave the new ones out: call opt.flush() once after "
        "replacing them (between windows it hooks the new parameters), or pass the loss to opt.backward(loss); "
        "this pass took no gradient (zero the others' .grad: opt.zero_grad())"
    )


def _add(hooks: Hooks, p: Tensor, grad, mb: BackwardPass, again: bool) -> None:
    """``p``'s gradient (a tensor, or a writer from take_written) into the pass's micro-batch;
    the extension's row of ``p`` follows (FastPath.python_took)."""
    win = hooks.window
    epoch = win.caches.epoch
    try:
        _add_to_window(hooks, p, grad, mb, again)
    finally:
        if hooks.fast_path is not None:
            hooks.fast_path.python_took(win, p, epoch)


def _add_to_window(hooks: Hooks, p: Tensor, grad, mb: BackwardPass, again: bool) -> None:
    opt, win = hooks.optimizer(), hooks.window
    written = not isinstance(grad, Tensor)
    if p not in win.live or not mb.closing:  # (a closing pass conformed the live buffers as it began)
        win.conform(opt, [p], closing=mb.closing)  # (a dtype or device changed since: the buffer follows)
    if mb.fold and not again and not written:
        spec = opt.update_spec
        spec.update(opt, spec.backend_for(opt, p), hooks.group_of[p], [p], [kernel_view(win.buffer(p))], weight_sum=mb.weight_sum,
                    clip_coef=None, grads=[kernel_view(grad)], weight=mb.weight, overwrite=p not in win.live,
                    grad_scale=None)
        mb.done.add(p)
        mb.completed.add(p)
        return
    # (A written gradient is not folded: its GEMM has written the buffer, which the update
    # would read back anyway, so it waits for the update at the end of the pass with the
    # window's other parameters; a fused Linear called twice per forward then gets both.)
    if p not in win.live:
        mb.started.add(p)  # a failed pass takes it back out
        if not written and _can_adopt(win, p, grad):
            if mb.weight != 1.0:  # (in place: the copying overwrite's product, g * w, bit for bit)
                _one_gradient_backend(opt, p).accumulate(grads=[kernel_view(grad)], buffers=[kernel_view(grad)],
                                               weight=mb.weight, overwrite=True)
            win.adopt([p], [grad])
            mb.completed.add(p)
            return
    else:
        mb.added_to_live |= p not in mb.started
    wants_norm = mb.norms is not None and not again  # (a second gradient: measured again at closing)
    norm_weight_sum = mb.weight_sum if wants_norm else None
    if written:
        norm = win.write_one(p, grad, mb.weight, _one_gradient_backend(opt, p), norm_weight_sum)
    else:
        norm = win.accumulate_one(p, grad, mb.weight, _one_gradient_backend(opt, p), norm_weight_sum)
    mb.completed.add(p)
    if wants_norm:
        mb.norms[p] = norm
    elif mb.norms is not None:
        mb.norms.pop(p, None)
        if mb.slot_norms:
            mb.slot_norms.pop(hooks.fast_path.slot_of.get(p), None)
    if mb.closing and win.sync is not None and not again and not win.transaction.active:
        win.sync.grad_ready(p)  # may launch its bucket's all-reduce while backward goes on


def _can_adopt(win, p: Tensor, grad: Tensor) -> bool:
    """Whether the first gradient of a window can be the buffer itself (Window.may_adopt,
    layout.adoptable). A weighted micro-batch's is scaled in place (the buffer holds w * g), so
    any weight may adopt."""
    return win.may_adopt and adoptable(grad, p)


def begin_pass(hooks: Hooks, first: Tensor | None = None) -> BackwardPass:
    """The first gradient of a backward pass arrived (``first``'s; or opt.backward saw none):
    open its micro-batch in the window. On the window's last micro-batch in mode B, the update
    happens in this pass: torch's step pre-hooks run now (``step()`` runs them in plain mode and
    mode A). Each parameter's update is folded into its hook, unless clipping or ranks need the
    whole window first, or the pass's gradients go in through torch's ops (on a GPU: one
    multi-tensor update at the pass's end, not an update launch per gradient; by_torch_ops)."""
    opt, win = hooks.optimizer(), hooks.window
    closing = opt.accumulation_steps > 1 and win.closes_with(opt)
    if closing:
        hooks.run_step_hooks(post=False)
    weight, weight_sum = win.begin_micro_batch(opt, win.take_pending_weight(), closing)
    # (a run() pass folds nothing: a failure in it must leave no parameter updated)
    fold = (closing and win.folds_last(opt) and not win.transaction.active
            and not (first is not None and by_torch_ops(first)))
    # With FSDP2, opt.backward scaled the loss by the weight: the gradients carry it.
    grad_weight = 1.0 if win.shards is not None else weight
    # Clipping on one rank: the norms come from the hooks' accumulate passes (across ranks they
    # are measured on the reduced sums instead).
    measure_norms = closing and opt.max_grad_norm is not None and not win.spans_ranks
    win.passes.current = BackwardPass(grad_weight, weight_sum, closing, fold, measure_norms)
    return win.passes.current


@torch.no_grad()
def end_pass(hooks: Hooks) -> None:
    """The backward pass is done (queued on the autograd engine by the first hook). Parameters
    unfrozen since their hooks were due join it; the window counts the micro-batch and, on its
    last, closes, and torch's step post-hooks run."""
    opt, win = hooks.optimizer(), hooks.window
    if win.passes.current is not None:
        if hooks.fast_path is not None:
            hooks.fast_path.take_records(win, win.passes.current, end=True)
        rehook_dropped(hooks, take=True)
        _hook_unfrozen(hooks)
    mb, win.passes.current = win.passes.current, None
    if mb is not None:
        norms = mb.norms
        if norms is not None and mb.slot_norms:
            norms = hooks.fast_path.window_norms(opt, mb)
        win.finish_micro_batch(opt, mb.weight, mb.weight_sum, mb.closing,
                               mb.updated(hooks.fast_path) if mb.fold else None, norms)
        if mb.closing:
            hooks.run_step_hooks(post=True)


def _hook_unfrozen(hooks: Hooks) -> None:
    """Parameters that did not require grad when hooks were registered and do now
    (``requires_grad_(True)`` later): hooked from now on, and a gradient this pass left in their
    ``.grad`` joins the pass, so that they train as with torch.optim."""
    unfrozen = [p for p in hooks.unhooked if p.requires_grad]
    if not unfrozen:
        return
    hooks.unhooked = [p for p in hooks.unhooked if not p.requires_grad]
    register_hooks(hooks, unfrozen)
    for p in unfrozen:
        take_grad(hooks, p)
