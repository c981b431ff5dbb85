"""The update an optimizer gives its window: ``UpdateSpec``, the one surface through which the
window's close, plain mode's step table and the in-backward hooks' folds reach the optimizer.

Each optimizer class names its spec (``update_spec``, a class attribute: optim.py's SGDUpdate,
AdamUpdate, WrappedUpdate); the window's modules call ``opt.update_spec.<verb>(opt, ...)`` and
never a private method of the optimizer. A spec holds no state of its own (the optimizer passes
itself to every call): nothing to copy, pickle or rebuild.

Owns: the parameters as the window sees them (order, names in errors, the backend each runs
on, the dtype its state follows), and the grouped update of SGD/Adam/AdamW (``apply``: the
window's gradient per param group, in backend calls sharing device, dtype, call key and how the
last micro-batch folds in).
Must not: hold window state (window/ is the state) or do per-element math (backends do).
"""
from __future__ import annotations

import itertools
import operator
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from . import backends
from .layout import kernel_view, state_dtype
from .window import UpdatePlan


class UpdateSpec:
    """The default spec: the optimizer's parameters and backends; subclasses add the update."""

    # Fuse the window's last micro-batch into the update pass when nothing needs the whole
    # window's sums first (clipping, a cross-rank reduce). GradientAccumulator's inner step
    # receives a finished gradient: it cannot.
    folds_last_micro_batch = True
    # Whether the update runs as per-group backend calls on ``state_lists`` (SGD/Adam/AdamW):
    # what window.UpdatePlan keeps and in_backward's extension hooks fold. False: ``apply`` only.
    has_lists = True
    # ``state_lists``' lists of state tensors, by the state entry each holds.
    kept_state_entries: dict[str, str] = {}
    # Whether ``state_lists`` creates the state a first update would (Adam's zero moments).
    state_lists_create_state = False

    # ------------------------------------------------------------------ the parameters
    @staticmethod
    def params(opt) -> list[Tensor]:
        """Every parameter, group after group: the order of state_dict indices and of every
        per-parameter list the window keeps."""
        return [p for group in opt.param_groups for p in group["params"]]

    @staticmethod
    def name(opt, p: Tensor) -> str:
        """How errors name ``p``: by its name where the optimizer was given names
        (``model.named_parameters()``, as torch.optim accepts), else by its index."""
        index = 0
        for group in opt.param_groups:
            names = group.get("param_names")
            for i, q in enumerate(group["params"]):
                if q is p:
                    what = f"{tuple(p.shape)}, {p.dtype}, {p.device}"
                    if names is not None:
                        return f"parameter {names[i]!r} (index {index}, {what})"
                    return (f"parameter {index} ({what}; build the optimizer from model.named_parameters() to see "
                            "names here)")
                index += 1
        return f"a parameter this {type(opt).__name__} does not hold ({tuple(p.shape)})"

    @staticmethod
    def backend_for(opt, param: Tensor):
        """The backend module that runs ``param`` (``backends.resolve``, which keeps its answers)."""
        return backends.resolve(opt.backend, param.device, param.dtype)

    @staticmethod
    def state_dtype(p: Tensor):
        """The dtype the elementwise state follows when ``p`` changes dtype or device (None: the
        state keeps its own)."""
        return state_dtype(p)

    # ------------------------------------------------------------------ the update
    def apply(self, opt, win, last_grads: dict, last_weight: float, grad_scale: Tensor | None, weight_sum: float,
              clip_coef: Tensor | None) -> None:
        """Update every parameter of the window with its gradient (the last micro-batch folded
        in where ``last_grads`` holds it), group by group, in ``update`` calls that share
        (device, dtype), the call key (Adam's step count) and how the last micro-batch folds in."""
        if not last_grads:  # (every parameter live: the kept lists, one call per group)
            plan = UpdatePlan.for_window(opt, win, build=True)
            if plan is not None and plan.uniform(opt):
                plan.update(opt, plan.buffers_of(win), weight_sum, clip_coef)
                return
        for group in opt.param_groups:
            # (a parameter without a gradient all window is left alone, as torch leaves it)
            params = [p for p in group["params"] if p in win.live or p in last_grads]
            calls = defaultdict(list)
            for p, call_key in zip(params, self.call_keys(opt, params)):
                grad = last_grads.get(p)
                win.buffer(p)
                fold = None if grad is None else (grad.dtype, p not in win.live)
                calls[(p.device, p.dtype, call_key, fold)].append(p)
            for (_, _, _, fold), params in calls.items():
                last = {}
                if fold is not None:
                    last = dict(grads=[kernel_view(last_grads[p]) for p in params], weight=last_weight,
                                overwrite=fold[1], grad_scale=grad_scale)
                self.update(opt, self.backend_for(opt, params[0]), group, params,
                            [kernel_view(win.buffers[p]) for p in params],
                            weight_sum=weight_sum, clip_coef=clip_coef, **last)

    def call_keys(self, opt, params: list[Tensor]) -> list:
        """Per parameter, an extra key for parameters that cannot share one backend call (none by
        default)."""
        return [None] * len(params)

    def uniform_call_key(self, opt, lists: dict[str, list]) -> bool:
        """Whether the parameters of ``state_lists``'s ``lists`` share one call key (see
        ``call_keys``): window.UpdatePlan asks it before one call updates them all."""
        return True

    def state_lists(self, opt, group, params: list[Tensor]) -> dict[str, list]:
        """The per-parameter tensors of one ``update`` call (window.UpdatePlan keeps them while
        the optimizer state stays the same): ``states`` (each parameter's state dict), ``params``
        (kernel views) and the class's ``kept_state_entries``."""
        raise NotImplementedError

    def lists_complete(self, group, lists: dict[str, list]) -> bool:
        """Whether ``lists`` hold every state tensor the update reads (none that its first
        update creates): only then does window.UpdatePlan keep them."""
        return not any(t is None for values in lists.values() for t in values)

    def lists_stand(self, opt, params: list[Tensor], lists: dict[str, list]) -> bool:
        """Whether ``lists`` (``state_lists(opt, group, params)``, kept by window.UpdatePlan)
        still hold the state's own tensors: a state dict or entry replaced by hand
        (``opt.state[p] = {}``, ``opt.state[p]["exp_avg"] = t``) makes them stale, as torch.optim
        would read the new one. Identity checks only: no tensor is read."""
        states = list(map(opt.state.get, params))
        if not all(map(operator.is_, states, lists["states"])):
            return False
        for name, key in self.kept_state_entries.items():
            kept = lists[name]
            if not kept:
                continue
            try:  # (map over dict.get: no Python frame per parameter)
                entries = list(map(dict.get, states, itertools.repeat(key)))
            except TypeError:  # (a parameter without a state dict)
                entries = [None if state is None else state.get(key) for state in states]
            if not all(map(operator.is_, entries, kept)):
                return False
        return True

    def update(self, opt, backend, group, params: list[Tensor], buffers: list[Tensor], lists: dict | None = None,
               **window) -> None:
        """One backend call updating ``params`` (``lists``: their ``state_lists``, when kept)."""
        raise NotImplementedError

    @staticmethod
    def hyperparameters(group) -> dict[str, Any]:
        """The group's arguments of every backend's update op (and of in_backward's extension
        hooks, which fold a parameter's update with the same op), but Adam's step count."""
        raise NotImplementedError

    @staticmethod
    def step_counts(opt, params: list[Tensor]) -> dict[int, int]:
        """The step counts in ``params``' state, read at once, by ``id`` of the tensor (for
        ``fold_count`` and ``call_keys``)."""
        return step_counts([state.get("step") for state in map(opt.state.get, params) if state])

    def fold_count(self, step: Tensor | None, known: dict[int, int]) -> int | None:
        """The step count the next update of a parameter whose state holds ``step`` runs at
        (``update`` counts it first); None for an update without one. ``known``: step counts
        already read, by ``id(step)`` (``step_counts``)."""
        return None


def step_count(step: Tensor, known: dict[int, int]) -> int:
    """``step``'s value, from ``known`` (``step_counts``) where it was read there."""
    count = known.get(id(step))
    return int(step.item()) if count is None else count


def step_counts(steps: list[Tensor | None]) -> dict[int, int]:
    """Each step count tensor's value by ``id``, read at once (one stack and one tolist: a
    .item() per parameter costs ~1 us each); empty where they cannot be stacked (step tensors
    of several dtypes or devices: a loaded, unusual state), for the caller to read one by one."""
    known = [step for step in steps if isinstance(step, Tensor)]
    try:
        values = torch.stack(known).tolist() if known else []
    except RuntimeError:
        return {}
    return {id(step): int(value) for step, value in zip(known, values)}
