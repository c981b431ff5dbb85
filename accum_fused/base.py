"""The entry points every accum_fused optimizer shares: what torch.optim's API means here.

Owns: ``AccumulatingOptimizer``, the base of SGD, Adam, AdamW and GradientAccumulator (optim.py):
construction of the window and its reducers, param groups, the weight argument's checks,
and ``step`` / ``flush`` / ``backward`` / ``set_micro_batch_weight`` / ``zero_grad`` /
``state_dict`` / ``load_state_dict`` / copies as thin entry points that validate, then
delegate: the open window and its closing to ``accum_fused.window``, backward passes to
``in_backward.py``, checkpoint layouts to ``checkpoint.py``, ranks to ``distributed.py``.

Must not: do window arithmetic, per-element math or per-class update math (the class's
``update_spec``, update.py and optim.py), or hold any of the window's state outside ``_window``.
"""
from __future__ import annotations

import itertools
import math
import numbers
import operator
import warnings
import weakref
from typing import Any, Callable

import torch
from torch import Tensor

from . import backends, checkpoint, ddp, distributed, in_backward as hooks
from .checkpoint import called_from_torch_checkpoint
from . import framework_guard as guard
from .layout import is_dtensor, state_dtype
from .update import UpdateSpec
from .window import Window
from .window import plain


def check_weight(weight) -> float:
    if isinstance(weight, Tensor):
        if weight.numel() != 1 or weight.is_complex():
            raise TypeError("weight must be a real number or a 1-element real tensor")
        weight = weight.item()
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
        raise TypeError(f"weight must be a real number, got {type(weight).__name__}")
    weight = float(weight)
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"weight must be finite and > 0, got {weight}")
    return weight


def check_accumulation_steps(value) -> int:
    """The constructor's check, also for ``opt.accumulation_steps = k`` assigned later."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"accumulation_steps must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {value}")
    return int(value)


def _accumulation_steps_get(self) -> int:
    return self.__dict__["accumulation_steps"]


def _accumulation_steps_set(self, value) -> None:
    # Kept in the instance __dict__ under its own name: torch's __setstate__ (and copies, pickles)
    # restore attributes by __dict__.update, which this property then reads unchanged.
    self.__dict__["accumulation_steps"] = check_accumulation_steps(value)


class AccumulatingOptimizer:
    """The methods SGD, Adam, AdamW and GradientAccumulator share."""

    # The open window is ``self._window`` (window.Window), created once and never re-bound.
    # Subclasses name their update (``update_spec``: optim.py's SGDUpdate, AdamUpdate, WrappedUpdate).

    # torch.amp.GradScaler.step: hand us grad_scale / found_inf instead of unscaling .grad.
    _step_supports_amp_scaling = True
    # The update this class gives its window (update.UpdateSpec; optim.py's, per class): the
    # one surface through which the window's modules reach the optimizer.
    update_spec: UpdateSpec = UpdateSpec()

    # (Properties with docstrings, written out: the API reference reads them from the source.)
    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per window, validated as at construction. A change applies to the open
        window too: it closes when its micro-batch count reaches the new value (with the next
        micro-batch if it already has)."""
        return _accumulation_steps_get(self)

    @accumulation_steps.setter
    def accumulation_steps(self, value: int) -> None:
        _accumulation_steps_set(self, value)

    @property
    def micro_step(self) -> int:
        """Micro-batches in the open window."""
        return self._window.micro_step

    @micro_step.setter
    def micro_step(self, value: int) -> None:
        self._window.micro_step = value

    @property
    def updated(self) -> bool:
        """Whether the last step()/flush() (or mode B's last backward) applied an update."""
        return self._window.updated

    @updated.setter
    def updated(self, value: bool) -> None:
        self._window.updated = value

    @property
    def update_count(self) -> int:
        """Updates applied (skipped or empty windows do not count)."""
        return self._window.update_count

    @update_count.setter
    def update_count(self, value: int) -> None:
        self._window.update_count = value

    @property
    def last_grad_norm(self) -> Tensor | None:
        """Pre-clip global norm of the last clipped window: None until a window with
        ``max_grad_norm`` set has closed (guard a print of it)."""
        return self._window.last_grad_norm

    @last_grad_norm.setter
    def last_grad_norm(self, value: Tensor | None) -> None:
        self._window.last_grad_norm = value

    @property
    def micro_batch_weight(self) -> float | None:
        """The weight set by set_micro_batch_weight for the next micro-batch, or None."""
        return self._window.pending_weight

    def _init_accumulation(self, accumulation_steps: int, max_grad_norm: float | None, backend: str,
                           process_group, in_backward: bool = False) -> None:
        if not isinstance(in_backward, bool):
            raise TypeError(f"in_backward must be a bool, got {type(in_backward).__name__}")
        self.accumulation_steps = accumulation_steps
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.backend = backend
        if process_group is distributed.NOT_GIVEN:
            process_group = None
        self.process_group = process_group
        self.in_backward = in_backward
        self._hooks: hooks.Hooks | None = None  # in_backward's state (in_backward.Hooks)
        # What close() undoes early and collection undoes anyway (weakref.finalize objects): the
        # in-backward hooks.
        self._releases: list = []
        self._closed = False
        self._ddp: ddp.Takeover | None = None  # DDP's sync taken over (ddp.py)
        params = self._all_params()
        mesh = self._check_params(params)
        sync = None
        if process_group is not None:
            sync = distributed.WindowSync(process_group, type(self).__name__)
            sync.add_params(params, state_dtype)
        self._window = Window(sync)
        self._wire(params, mesh)
        if in_backward:
            self._hooks = hooks.install(self, self._window, weakref.WeakMethod(self._run_step_hooks),
                                        weakref.WeakMethod(self._wiring_stands))
            # (its hooks hold it weakly; when the optimizer is collected they go with it, close() earlier)
            self._releases.append(weakref.finalize(self, hooks.remove_hooks, self._hooks.handles))

    def _wire(self, params: list[Tensor], mesh) -> None:
        """The window's ranks for ``params`` (construction; _rewire): with FSDP2 (DTensors on
        ``mesh``, what _check_params found) the mesh's, which agree once per window (ShardSync);
        else a DistributedDataParallel model's, once one wraps them (ddp.py)."""
        win = self._window
        win.shards = None if mesh is None else distributed.ShardSync(*mesh, type(self).__name__)
        if mesh is not None and self._ddp is not None:
            self._ddp.close()
            win.listeners.remove(self._ddp)
            self._ddp = None
        elif mesh is None and self._ddp is None:
            self._ddp = ddp.Takeover(self, win, params)
        self._wired = self._wiring()

    # ----------------------------------------------------------------------------- params
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            params = param_group.get("params")
            if params is not None and not isinstance(params, (Tensor, set)):
                params = list(params)  # a generator must survive being read here and in torch
                param_group = {**param_group, "params": params}
            if hasattr(self, "_window"):  # during torch's __init__, _init_accumulation checks all
                items = [params] if isinstance(params, Tensor) else params or []
                self._check_params([item[1] if isinstance(item, tuple) else item for item in items])
        self._add_group(param_group)
        if hasattr(self, "_window"):  # during torch's __init__, _init_accumulation registers all
            if self._window.sync is not None:
                self._window.sync.add_params(self.param_groups[-1]["params"], state_dtype)
            if self.in_backward:
                hooks.register_hooks(self._hooks, self.param_groups[-1]["params"])
            if self.__dict__.get("_wired") is not None:
                self._wired = self._wiring()
            self._window.changed()  # (the fast paths' tables hold the parameters: built anew)

    def _add_group(self, param_group) -> None:
        super().add_param_group(param_group)

    def _check_params(self, tensors, anew: bool = False):
        """Refuse, before anything changes, parameters no backend can run correctly. Returns
        the FSDP2 device mesh and its tensor-parallel dimension (shard_mesh) when the parameters
        are DTensors, else None. ``anew``: ``tensors`` are every parameter (_rewire)."""
        tensors = [t for t in tensors if isinstance(t, Tensor)]
        built = hasattr(self, "_window") and not anew
        if not (built and self._window.shards is not None) and not any(is_dtensor(t) for t in tensors):
            return None
        if self.process_group is not None:
            raise NotImplementedError(
                f"{type(self).__name__} got DTensor parameters (FSDP2) and a process_group: FSDP2 reduces the "
                "gradients itself, and accum_fused agrees with the other ranks over the parameters' mesh; "
                "leave process_group unset"
            )
        owned = self._all_params() if built else []
        return distributed.shard_mesh(owned + tensors, type(self).__name__)

    def _all_params(self) -> list[Tensor]:
        return self.update_spec.params(self)

    # ------------------------------------------------------------------------------- step
    # The window bookkeeping is host code: torch.compile(opt.step) runs it eagerly. The lazy
    # form (torch.optim's own load_state_dict uses it): importing accum_fused must not import
    # torch._dynamo (and Triton with it).
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, weight: float | Tensor | None = None):
        """Accumulate this micro-batch's gradients (times ``weight``); on every
        ``accumulation_steps``-th call, apply the update with sum(w_i g_i) / sum(w_i).
        Returns the closure's loss, like torch.optim. With a process_group, the boundary call
        is collective: every rank reaches it once per window.

        With ``accumulation_steps > 1`` the gradients are taken: ``.grad`` is None afterwards
        (the micro-batch lives on in the fp32 buffer), so a ``zero_grad()`` forgotten between
        micro-batches cannot make autograd add one micro-batch into the next. With
        ``accumulation_steps=1``, ``.grad`` is left alone, as torch.optim leaves it.

        ``weight`` defaults to the one given by ``set_micro_batch_weight`` for this micro-batch
        (read after the closure ran, so a closure may set it), else 1.0."""
        if called_from_torch_checkpoint("_init_optim_state"):
            self._init_state_for_checkpoint()
            return None
        if not getattr(self, "_framework_checked", False):
            guard.check_first_step(self)  # a framework loop that would drive it wrong raises
            self._framework_checked = True
        self._check_open("step()")
        win = self._window
        if weight is not None:
            weight = check_weight(weight)
            if win.backward_done:
                raise ValueError("this micro-batch's weight was given to backward(loss, weight=...): call step() "
                                 "without weight=")
        if self.in_backward:
            hooks.check_step(self._hooks, 1.0 if weight is None else weight)
            hooks.rehook_dropped(self._hooks, take=False)  # (a gradient a dropped hook left in .grad: collected below)
        if win.shards is not None and getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__} with FSDP2 parameters cannot be driven by torch.amp.GradScaler: GradScaler "
                "checks each rank's own shards for non-finite values and updates its scale per rank, so the ranks' "
                "scales drift apart. Use bf16 (MixedPrecisionPolicy(param_dtype=torch.bfloat16)); accum_fused "
                "skips a window with a non-finite value on any rank on every rank"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if weight is None:
            weight = 1.0 if win.pending_weight is None else win.pending_weight
        grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if plain.take_with_table(win, self, weight, grad_scale, found_inf):  # (the common micro-batch, in one C++ call)
            return loss
        pairs = plain.collect_grads(self)
        # (k=1: a no-op, as torch's; FSDP2 holds gradients back under set_requires_gradient_sync(False))
        if not pairs and not self.in_backward and self.accumulation_steps > 1 and win.shards is None:
            self._warn_no_gradient(weight)
        plain.add_micro_batch(win, self, pairs, weight, grad_scale, found_inf)
        if self.accumulation_steps > 1:
            for p, _ in pairs:
                p.grad = None
        return loss

    def _warn_no_gradient(self, weight: float) -> None:
        """A plain-mode step() in which no parameter has a gradient: a doubled step() line, or a
        micro-batch whose backward was skipped. It still counts (a micro-batch of zero gradients
        is what the documented "some parameters without gradients" rule gives), but torch.optim's
        step would change nothing: say so, once per optimizer."""
        if getattr(self, "_warned_no_gradient", False):
            return
        self._warned_no_gradient = True
        warnings.warn(
            f"{type(self).__name__}.step() found no gradient on any parameter (was backward() skipped, or step() "
            f"called twice?): it counted as a micro-batch of weight {weight:g} with zero gradients, which dilutes "
            "the window's average (torch.optim's step() would do nothing). Call step() once per backward; to drop "
            "a micro-batch, skip both. (Warned once per optimizer.)",
            stacklevel=guard.user_stacklevel(),
        )

    @torch._disable_dynamo
    @torch.no_grad()
    def flush(self) -> bool:
        """Apply a pending partial window, averaged over the weights it holds. Returns True
        when an update was applied; False when nothing was pending, the window held no
        gradient, or it was skipped because a micro-batch had non-finite gradients. With a
        process_group it is collective: call it on every rank, including ranks whose window is
        empty."""
        win = self._window
        self._check_open("flush()")
        hooks.check_not_in_backward(self._hooks, "flush()")
        if self.in_backward and self.accumulation_steps == 1:
            win.weight_sum = 1.0 if win.live else 0.0  # mode A: a sum (see window.plain.add_micro_batch)
        if not (win.micro_step > 0 or win.spans_ranks):
            win.updated = False
            return False
        win.conform(self, list(win.live), closing=True)
        # An update outside step(): torch's step hooks run around it, as around step()'s.
        self._run_step_hooks(post=False)
        applied = win.close(self, flushing=True)
        self._run_step_hooks(post=True)
        return applied

    def run(self, batch, loss_fn: Callable[[Any], Any], *, weight: float | Tensor | None = None,
            split: Callable[[Any, int], list] | None = None, scaler=None) -> Tensor:
        """Run one micro-batch and take it into the window, recovering from out-of-memory:
        ``loss_fn(batch)`` returns its loss (a mean over what it holds), or ``(loss, weight)``;
        the weight defaults to ``weight=``, else the batch's size along dim 0. Plain mode: forward,
        backward and ``step(weight=)`` (``.grad`` is the run's own: emptied first). in_backward:
        ``opt.backward(loss, weight=)`` (mode A: summed, as its loop does; ``step()`` stays yours; a split
        part's loss is scaled by its share of the samples, so ``loss_fn`` must return a mean over the
        samples it is given times a constant, never a value that grows with their number).

        When a forward or backward pass runs out of memory (``torch.OutOfMemoryError``, the CPU
        allocator's error), its contribution is taken out, memory is freed, and the micro-batch
        is run again split along dim 0 (tensors, tuples/lists/dicts of them, a BatchEncoding;
        ``split(batch, n)`` for anything else) into parts whose weights add up to its weight; it
        counts as one micro-batch. Later micro-batches start at the split that worked
        (``opt.recovery``). A part of one sample that still runs out raises RuntimeError naming
        the sizes tried. Every retry is logged (logger "accum_fused") and counted
        (``opt.recovery.retries``). ``scaler``: a torch.amp.GradScaler (plain mode): losses are
        scaled, ``scaler.step(opt, weight=)`` and ``scaler.update()`` take the micro-batch.
        Returns the micro-batch's loss, detached (the weighted mean of its parts' when split). What
        is exact per mode, and what a split costs: the out-of-memory recovery guide
        ([out-of-memory recovery](../guides/oom-recovery.md))."""
        from . import recovery
        self._check_open("run()")
        if weight is not None:
            weight = check_weight(weight)
            if self.in_backward and self.accumulation_steps == 1:
                raise ValueError("with in_backward=True and accumulation_steps=1 the backward passes are summed: "
                                 "a micro-batch weight has no meaning there (scale the loss instead)")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (batch -> loss or (loss, weight)), got {type(loss_fn).__name__}")
        if split is not None and not callable(split):  # (else found only at an out-of-memory error)
            raise TypeError(f"split must be callable (batch, n) -> n parts, or None, got {type(split).__name__}")
        return recovery.run_micro_batch(self, self._window, batch, loss_fn, weight, split, scaler=scaler)

    @property
    def recovery(self):
        """Out-of-memory recovery's state (recovery.RecoveryState): ``max_part_size``,
        ``grow_back_after``, ``retries``."""
        state = self.__dict__.get("_recovery")
        if state is None:
            from .recovery import RecoveryState
            state = self.__dict__["_recovery"] = RecoveryState()
        return state

    def set_micro_batch_weight(self, weight: float | Tensor) -> None:
        """The weight of the micro-batch being accumulated now, for loops that call ``step()``
        or ``loss.backward()`` without one (HF Trainer, Lightning, accelerate): the next
        ``step()`` without ``weight=`` (also one whose closure calls this) or, with
        ``in_backward``, the next backward pass uses it. Validated here."""
        weight = check_weight(weight)
        if self.in_backward and self.accumulation_steps == 1 and weight != 1.0:
            raise ValueError("with in_backward=True and accumulation_steps=1 the backward passes are summed: "
                             "a micro-batch weight has no meaning there (scale the loss instead)")
        if self._window.shards is not None and self.in_backward and weight != 1.0:
            raise ValueError("with FSDP2 and in_backward=True a micro-batch's weight must reach its gradients "
                             "before FSDP2 averages them over the ranks: pass it to opt.backward(loss, weight=w)")
        if self._window.backward_done:
            raise ValueError("set_micro_batch_weight() after opt.backward(): give the weight to backward(loss, "
                             "weight=...) or set it before")
        self._window.pending_weight = weight

    def backward(self, loss: Tensor, *, weight: float | Tensor | None = None, **backward_kwargs) -> None:
        """Run ``loss.backward(**backward_kwargs)`` as one micro-batch of weight ``weight``
        (default: the one set by set_micro_batch_weight, else 1).

        Without in_backward, call ``step()`` (no ``weight=``) after it. This is how to weight
        micro-batches with FSDP2: FSDP2 averages the ranks' gradients inside backward, so the
        weight must reach them before, and here it scales the loss.

        With in_backward and ``accumulation_steps=k > 1`` the k-th call applies the update
        before it returns (``updated`` says so). With ``accumulation_steps=1`` the gradients
        are summed (weight must be 1) and ``step()`` applies them."""
        win = self._window
        self._check_open("backward()")
        if weight is None:
            weight = 1.0 if win.pending_weight is None else win.pending_weight
        weight = check_weight(weight)
        if win.shards is not None and weight != 1.0:
            loss = loss * weight  # before FSDP2's reduce-scatter averages the ranks' gradients
        if self.in_backward:
            hooks.backward(self._hooks, loss, weight, backward_kwargs)
            return
        if win.backward_done:
            raise RuntimeError(f"{type(self).__name__}.backward() was called twice without step() in between: "
                               "autograd would add both micro-batches into .grad under one weight")
        torch.autograd.backward(loss, **backward_kwargs)
        win.pending_weight, win.backward_done = weight, True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; with in_backward and accumulation_steps=1 it also empties the
        buffers, which hold what .grad would have held (with k > 1 the window is the optimizer's)."""
        super().zero_grad(set_to_none)
        if (getattr(self, "in_backward", False) and self.accumulation_steps == 1
                and not called_from_torch_checkpoint("_init_optim_state")):  # clearing its own zero grads
            hooks.check_not_in_backward(self._hooks, "zero_grad()")
            self._window.abandon(self)

    def close(self) -> None:
        """Stop taking gradients: with in_backward, the hooks on the parameters go (their
        gradients land in ``.grad`` again, and another optimizer may be built on them); with a
        DistributedDataParallel model, DDP's own gradient sync is back. What the optimizer holds
        stays (``state_dict()`` still saves its open window), but ``step()``, ``backward()`` and
        ``flush()`` raise afterwards. Collecting the optimizer does the same. Idempotent."""
        for release in self._releases:
            release()
        self._releases.clear()
        if self._ddp is not None:
            self._ddp.close()
        if self.in_backward:
            hooks.close(self._hooks)
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on this {type(self).__name__}, which was closed (close()); build a new optimizer")
        if self.__dict__.get("_wired") is None:  # (unpickled)
            self._wired = self._wiring()
        elif not self._wiring_stands():
            self._rewire()

    def _wiring(self) -> tuple[list, tuple]:
        """What the window is wired to (FSDP2's mesh, in_backward's hooks, buffers): each param
        group's ``"params"`` list, and the parameters in them."""
        lists = list(map(_PARAMS, self.param_groups))
        return lists, tuple(itertools.chain.from_iterable(lists))

    def _wiring_stands(self) -> bool:
        """Whether every param group's ``"params"`` list, and every parameter in it, is the one
        the window was wired to: the one check of "the same parameters" (by identity, no Python
        loop), run as each of the window's entry points is called and as each in_backward pass
        begins; every other cache of the parameters follows it (_rewire)."""
        lists, params = self._wired
        groups = self.param_groups
        return (len(lists) == len(groups) and all(map(operator.is_, lists, map(_PARAMS, groups)))
                and backends.same_objects(lists, params))

    def _rewire(self) -> None:
        """A param group's ``"params"`` list, or a parameter in it, replaced since the window was
        wired (_wiring_stands), as accelerate's FSDP2 ``prepare`` does (each parameter swapped for
        its sharded DTensor after the optimizer was built), is followed between windows, as if
        the optimizer had been built on the new parameters; mid-window, or where a process group
        holds the old ones, it is refused, nothing changed."""
        name, win = type(self).__name__, self._window
        win.refuse_replaced_params(name)
        if self.process_group is not None:
            raise NotImplementedError(
                f"a param group's parameters were replaced (its \"params\" list or one in it) after {name} was built with a "
                "process group (process_group=, or a DistributedDataParallel model it took over): build the "
                "optimizer on the parameters it is to update"
            )
        params = self._all_params()
        mesh = self._check_params(params, anew=True)
        if self.in_backward:  # (first: it refuses parameters another optimizer takes, nothing changed)
            hooks.rewire(self._hooks, params)
        win.buffers.clear()  # (stale buffers of the parameters replaced)
        win.caches.update_plan = None  # (its lists are the old parameters')
        win.changed()
        self._wire(params, mesh)

    def _run_step_hooks(self, post: bool) -> None:
        """torch.optim's step pre- or post-hooks (global and this optimizer's), for an update that
        does not happen inside step(): mode B's inside backward, flush()'s. As after step(), an LR
        scheduler then sees that the optimizer stepped. A pre-hook's return value, which would
        replace step()'s arguments, has nothing to replace here."""
        from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
        if post:
            self._opt_called = True  # what torch's LRScheduler checks (it wraps step() to set it)
            chain = [*self._optimizer_step_post_hooks.values(), *_global_optimizer_post_hooks.values()]
        else:
            chain = [*_global_optimizer_pre_hooks.values(), *self._optimizer_step_pre_hooks.values()]
        for hook in chain:
            hook(self, (), {})

    # ------------------------------------------------------------------ checkpoint, copies
    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict plus an ``"accumulation"`` entry with the open window: its
        buffers (by parameter index, as in ``"state"``), counters and GradScaler flag. With
        FSDP2 parameters the window is carried inside "state" and "param_groups" instead."""
        guard.check_wrapped(self)
        hooks.settle_if_failed(self._hooks)
        return checkpoint.state_dict(self, self._window, super().state_dict(), self.__dict__.get("_recovery"))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state_dict (resuming mid-window exactly) or a torch.optim one of the
        same class (migration: the window starts empty, state is widened to fp32)."""
        checkpoint.load_state_dict(self, self._window, state_dict, super().load_state_dict)

    def _init_state_for_checkpoint(self) -> None:
        """torch.distributed.checkpoint's stand-in for a first step: create the state a first
        update would, so that a fresh optimizer's state_dict is a load template; the window,
        parameters and step counts stay as they are."""

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ keeps only defaults/state/param_groups; copy.deepcopy and
        # pickle must keep the open window too.
        checkpoint.refuse_copy(self, self._window)
        return {**super().__getstate__(), **{k: getattr(self, k) for k in ACCUMULATION_ATTRS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        restore_defaults(self.__dict__)


_PARAMS = operator.itemgetter("params")  # (a param group's list: _wiring_stands, no Python loop)


# What deepcopy / pickle keep besides torch's defaults / state / param_groups.
ACCUMULATION_ATTRS = ("accumulation_steps", "max_grad_norm", "backend", "_window", "process_group",
                      "in_backward", "_hooks", "_closed")


def restore_defaults(attrs: dict[str, Any]) -> None:
    """A copy's attributes (deepcopy, pickle), and those an optimizer pickled by an older version
    lacks or had."""
    attrs.setdefault("process_group", None)
    attrs.setdefault("in_backward", False)
    attrs.setdefault("_hooks", None)  # (an in_backward optimizer is never pickled)
    attrs.setdefault("_releases", [])  # a copy owns no hooks or DDP module
    attrs.setdefault("_ddp", None)
    attrs.setdefault("_closed", False)
    for gone in ("_window_listeners", "_backends", "_ddp_watch", "_ddp_unwatched"):  # (older versions')
        attrs.pop(gone, None)


# ----------------------------------------------------------- for the modules above this one
# accum_fused.nn and the integrations reach an optimizer's window and in_backward hooks through
# these, not through its attributes: where those live is base.py's business alone.
def window_of(opt, what: str | None = None) -> Window:
    """``opt``'s window; with ``what``, refused first (naming ``what``) if ``opt`` was closed."""
    if what is not None:
        opt._check_open(what)
    return opt._window


def is_open(opt) -> bool:
    """Whether ``opt`` takes micro-batches still (not closed)."""
    return not opt._closed


def hooks_of(opt) -> hooks.Hooks | None:
    """in_backward's hooks of an open ``opt`` (None: closed, or not in_backward)."""
    return None if opt._closed else opt._hooks
