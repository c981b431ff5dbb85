"""SGD, Adam and AdamW that accumulate gradients inside the optimizer, and GradientAccumulator.

Owns: the public classes: their torch.optim-compatible constructors and argument checks, and
per class the update a window ends with, as the class's ``update_spec`` (update.UpdateSpec:
SGDUpdate, AdamUpdate: which state one backend call takes; WrappedUpdate: the window gradient
into ``.grad``, then the inner step).
The entry points they share (step, flush, backward, state_dict, ...) are ``base.py``'s.
Must not: do window bookkeeping or per-element math (``accum_fused.window``, ``accum_fused.backends``).

Each class subclasses the torch.optim class of the same name and calls its ``__init__``, so
constructor arguments, defaults, validation messages and param-group layout are torch's own.
"""
from __future__ import annotations

import inspect
import numbers
from collections import OrderedDict, defaultdict
from typing import Any

import torch
from torch import Tensor

from . import backends, checkpoint, distributed
from .base import AccumulatingOptimizer, check_accumulation_steps, restore_defaults
from . import framework_guard as guard
from .backends.reference import BF16_UPDATES, hash32
from .layout import kernel_view, like_param, state_dtype
from .distributed import NOT_GIVEN
from .update import UpdateSpec, step_count, step_counts

__all__ = ["SGD", "Adam", "AdamW", "GradientAccumulator"]


def _as_float(value: float | Tensor) -> float:
    return value.item() if isinstance(value, Tensor) else float(value)


def _lr(group: dict[str, Any]) -> float | Tensor:
    # A 1-element tensor lr stays a 0-dim tensor, as torch's update receives it: torch then
    # computes lr * weight_decay and lr / bias_correction in fp32 tensor arithmetic, and the
    # reference must round the same way to match it bit for bit.
    lr = group["lr"]
    return lr.detach().reshape(()) if isinstance(lr, Tensor) else float(lr)


def _check_accumulation_args(accumulation_steps, max_grad_norm, backend, capturable, differentiable, process_group):
    check_accumulation_steps(accumulation_steps)
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real):
            raise TypeError(f"max_grad_norm must be a number or None, got {type(max_grad_norm).__name__}")
        if not max_grad_norm > 0:  # also refuses NaN
            raise ValueError(f"max_grad_norm must be > 0, got {max_grad_norm}")
    backends.check_name(backend)
    distributed.check_process_group(process_group)
    if capturable:
        raise NotImplementedError("accum_fused optimizers do not implement capturable=True (CUDA graphs)")
    if differentiable:
        raise NotImplementedError("accum_fused optimizers do not implement differentiable=True")


def _check_bf16_update(param_group: dict[str, Any], default: str) -> None:
    mode = param_group.get("bf16_update", default)
    if mode not in BF16_UPDATES:
        raise ValueError(f"bf16_update must be one of {BF16_UPDATES}, got {mode!r}")
    params = param_group.get("params", [])
    params = [params] if isinstance(params, Tensor) else params
    if mode != "nearest" and any(isinstance(p, Tensor) and p.dtype == torch.float16 for p in params):
        raise ValueError(f"bf16_update={mode!r} rounds bf16 parameters; this group has float16 parameters: make them "
                         "bf16 (or fp32), or keep bf16_update='nearest' for that group")


_SEED_BASE = 0x0A0CF05ED  # accum_fused's stochastic rounding seeds start from splitmix64(this ^ index)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class _Bf16Rounding:
    """The ``bf16_update`` option of SGD/Adam/AdamW: how an update writes bf16 parameters.

    ``"nearest"`` (default, torch's rounding): an update smaller than half a bf16 ulp of the
    weight (|Δ| < |w|·2⁻⁹) is lost. ``"stochastic"``: rounded up or down with the probability
    that makes it unbiased, from bits every backend draws alike (backends/reference.py) under a
    per-parameter key: the state's ``"bf16_rounding_seed"`` (int64, from the parameter's index
    in the optimizer at its first update, the same on every rank; +1 per update, saved in the
    state_dict).
    ``"kahan"``: the state's ``"bf16_compensation"`` (bf16, +2 B/param, in the state_dict) keeps
    what the bf16 parameter cannot hold; the update reads p + c. A per-group option; other
    dtypes are written as they always were (fp16 parameters with a rounding mode are refused).
    """

    def _init_bf16_update(self, bf16_update: str) -> None:
        self.defaults["bf16_update"] = bf16_update
        for group in self.param_groups:
            group.setdefault("bf16_update", bf16_update)
            _check_bf16_update(group, bf16_update)

    def _add_group(self, param_group) -> None:
        if isinstance(param_group, dict):
            _check_bf16_update(param_group, self.defaults.get("bf16_update", "nearest"))
        super()._add_group(param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:  # (a torch.optim state_dict's groups lack it: the constructor's)
            group.setdefault("bf16_update", self.defaults["bf16_update"])
        # torch's load casts every state tensor but "step" to its parameter's floating dtype:
        # the int64 seeds are taken from the state_dict as they were saved.
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for i, p in zip(saved_ids, self._all_params()):
            seed = state_dict["state"].get(i, {}).get("bf16_rounding_seed")
            if seed is not None:
                self.state[p]["bf16_rounding_seed"] = seed.detach().to(torch.int64, copy=True)

    def _init_rounding_state(self, group, params: list[Tensor]) -> str:
        """Create the rounding state of the group's bf16 ``params`` that lack it; returns the
        group's mode ("nearest" for a call of other parameters)."""
        mode = group.get("bf16_update", "nearest")
        if mode == "nearest":
            return mode
        params = [p for p in params if p.dtype == torch.bfloat16]
        if mode == "kahan":
            for p in params:
                comp = self.state[p].get("bf16_compensation")
                if comp is None or comp.device != p.device:
                    self.state[p]["bf16_compensation"] = torch.zeros_like(p) if comp is None else comp.to(p.device)
        elif mode == "stochastic" and any("bf16_rounding_seed" not in self.state[p] for p in params):
            # From the parameter's index alone, not from torch's generator: replicas on ranks
            # seeded apart (seed + rank, for data order) must draw the same bits, or they drift.
            index = {p: i for i, p in enumerate(self._all_params())}
            for p in params:
                if "bf16_rounding_seed" not in self.state[p]:
                    seed = _splitmix64(_SEED_BASE ^ index[p]) >> 1  # (fits int64)
                    self.state[p]["bf16_rounding_seed"] = torch.tensor(seed, dtype=torch.int64)
        return mode if params else "nearest"

    def _rounding_args(self, group, params: list[Tensor]) -> dict[str, Any]:
        """bf16_update's arguments of one backend call (its parameters share a dtype)."""
        mode = self._init_rounding_state(group, params)
        if mode == "nearest":
            return {}
        states = [self.state[p] for p in params]
        if mode == "kahan":
            return dict(bf16_update=mode, compensations=[kernel_view(s["bf16_compensation"]) for s in states])
        seeds = [s["bf16_rounding_seed"] for s in states]
        stacked = torch.stack(seeds)
        keys = hash32((stacked & 0xFFFFFFFF) ^ hash32((stacked >> 32) & 0xFFFFFFFF)).tolist()
        torch._foreach_add_(seeds, 1)  # the next update draws other bits
        return dict(bf16_update=mode, rounding_keys=keys)


class SGDUpdate(UpdateSpec):
    """SGD's update: one backend ``sgd_update`` per call, momentum buffers as its state."""

    kept_state_entries = {"momentum_buffers": "momentum_buffer"}

    @staticmethod
    def hyperparameters(group) -> dict[str, Any]:
        return dict(lr=_lr(group), momentum=_as_float(group["momentum"]), dampening=_as_float(group["dampening"]),
                    weight_decay=_as_float(group["weight_decay"]), nesterov=group["nesterov"],
                    maximize=group["maximize"])

    def lists_complete(self, group, lists: dict[str, list]) -> bool:
        # (without momentum SGD keeps no state: nothing is missing)
        return _as_float(group["momentum"]) == 0 or super().lists_complete(group, lists)

    def state_lists(self, opt, group, params) -> dict[str, list]:
        # (not kept while a momentum buffer is still None: lists_complete)
        # .get on the defaultdict: SGD without momentum keeps no per-parameter entry, as torch.
        states = [opt.state.get(p) for p in params]
        return dict(states=states, params=[kernel_view(p) for p in params],
                    momentum_buffers=[None if s is None or s.get("momentum_buffer") is None
                                      else kernel_view(s["momentum_buffer"]) for s in states])

    def update(self, opt, backend, group, params, buffers, lists=None, **window) -> None:
        hyper = self.hyperparameters(group)
        lists = lists or self.state_lists(opt, group, params)
        momentum_buffers = list(lists["momentum_buffers"])  # (the backend fills in new ones)
        backend.sgd_update(params=lists["params"], buffers=buffers, momentum_buffers=momentum_buffers, **hyper,
                           **window, **opt._rounding_args(group, params))
        if hyper["momentum"] != 0 and any(b is None for b in lists["momentum_buffers"]):
            for p, momentum_buffer in zip(params, momentum_buffers):
                if opt.state[p].get("momentum_buffer") is None:  # new: a backend made it from local shards
                    opt.state[p]["momentum_buffer"] = like_param(momentum_buffer, p)


class SGD(_Bf16Rounding, AccumulatingOptimizer, torch.optim.SGD):
    """torch.optim.SGD with gradient accumulation ([getting started](../getting-started.md),
    [concepts](../concepts.md)).

    Momentum buffers are fp32 whatever the parameter dtype (torch keeps them in the parameter
    dtype); fp64 parameters keep fp64 state.
    """

    update_spec = SGDUpdate()

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float | Tensor = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None, backend: str = "auto",
                 process_group=NOT_GIVEN, in_backward: bool = False, bf16_update: str = "nearest"):
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, False, differentiable, process_group)
        _check_bf16_update({}, bf16_update)
        torch.optim.SGD.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                                 foreach=foreach, differentiable=differentiable, fused=fused)
        self._init_bf16_update(bf16_update)
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group, in_backward)

    def _init_state_for_checkpoint(self) -> None:
        # As torch.optim.SGD's zero-gradient first step would: a zero momentum buffer (with
        # dampening 0 the next update is then the same as from none).
        for group in self.param_groups:
            if _as_float(group["momentum"]) != 0:
                for p in group["params"]:
                    if p.requires_grad and self.state[p].get("momentum_buffer") is None:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p))
            self._init_rounding_state(group, [p for p in group["params"] if p.requires_grad])


# torch.optim.Adam takes decoupled_weight_decay from torch 2.7 (AdamW became Adam with it); before,
# AdamW was a class of its own: the flag is then kept in the groups here, as 2.7 keeps it.
_ADAM_DECOUPLES = "decoupled_weight_decay" in inspect.signature(torch.optim.Adam.__init__).parameters


class AdamUpdate(UpdateSpec):
    """Adam's and AdamW's update: one backend ``adam_update`` per call, at one step count
    (bias corrections depend on it: parameters that missed windows are updated apart)."""

    kept_state_entries = {"steps": "step", "exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq",
                          "max_exp_avg_sqs": "max_exp_avg_sq"}
    state_lists_create_state = True

    @staticmethod
    def hyperparameters(group) -> dict[str, Any]:
        beta1, beta2 = group["betas"]
        return dict(lr=_lr(group), beta1=_as_float(beta1), beta2=_as_float(beta2), eps=_as_float(group["eps"]),
                    weight_decay=_as_float(group["weight_decay"]), amsgrad=group["amsgrad"],
                    maximize=group["maximize"], decoupled_weight_decay=group["decoupled_weight_decay"])

    def call_keys(self, opt, params: list[Tensor]) -> list[int]:
        steps = [opt.state.get(p, {}).get("step") for p in params]
        known = step_counts(steps)  # (read once: the same tensors step_count looks up)
        return [0 if step is None else step_count(step, known) for step in steps]

    def fold_count(self, step: Tensor | None, known: dict[int, int]) -> int | None:
        return step_count(step, known) + 1  # (``update`` adds one to every step count first)

    def uniform_call_key(self, opt, lists: dict[str, list]) -> bool:
        cpp = backends.extension()
        equal = None if cpp is None else cpp.equal_scalars(lists["steps"])  # (CPU step counts: no stack)
        if equal is not None:
            return equal
        try:
            steps = torch.stack(lists["steps"])  # (one comparison for all: no .item() per parameter)
        except RuntimeError:  # (step tensors of several dtypes or devices: a loaded, unusual state)
            return False
        return bool((steps == steps[0]).all())

    def state_lists(self, opt, group, params) -> dict[str, list]:
        states = [opt._init_param_state(p, group) for p in params]
        return dict(states=states, steps=[s["step"] for s in states], params=[kernel_view(p) for p in params],
                    exp_avgs=[kernel_view(s["exp_avg"]) for s in states],
                    exp_avg_sqs=[kernel_view(s["exp_avg_sq"]) for s in states],
                    max_exp_avg_sqs=[kernel_view(s["max_exp_avg_sq"]) for s in states] if group["amsgrad"] else [])

    def update(self, opt, backend, group, params, buffers, lists=None, **window) -> None:
        lists = lists or self.state_lists(opt, group, params)
        steps = lists["steps"]
        # One call for every step count (CPU tensors): 0.4 us per parameter, where ``step += 1``
        # costs 2.5 and a Python-number foreach 1.5 (torch's Adam adds a tensor for the same reason).
        torch._foreach_add_(steps, torch.ones(()), alpha=1.0)
        backend.adam_update(
            params=lists["params"], buffers=buffers, exp_avgs=lists["exp_avgs"], exp_avg_sqs=lists["exp_avg_sqs"],
            max_exp_avg_sqs=lists["max_exp_avg_sqs"], step=int(steps[0].item()), **self.hyperparameters(group),
            **window, **opt._rounding_args(group, params),
        )


class Adam(_Bf16Rounding, AccumulatingOptimizer, torch.optim.Adam):
    """torch.optim.Adam with gradient accumulation ([getting started](../getting-started.md),
    [concepts](../concepts.md)).

    exp_avg / exp_avg_sq / max_exp_avg_sq are fp32 whatever the parameter dtype (torch keeps
    them in the parameter dtype); fp64 parameters keep fp64 state. ``step`` is a CPU tensor.
    """

    update_spec = AdamUpdate()

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None, backend: str = "auto",
                 process_group=NOT_GIVEN, in_backward: bool = False, bf16_update: str = "nearest"):
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, capturable, differentiable,
                                 process_group)
        _check_bf16_update({}, bf16_update)
        decoupled = {"decoupled_weight_decay": decoupled_weight_decay} if _ADAM_DECOUPLES else {}
        torch.optim.Adam.__init__(self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                                  maximize=maximize, capturable=capturable, differentiable=differentiable,
                                  fused=fused, **decoupled)
        if not _ADAM_DECOUPLES:  # the groups hold it as torch >= 2.7's Adam's do
            self.defaults["decoupled_weight_decay"] = decoupled_weight_decay
            for group in self.param_groups:
                group.setdefault("decoupled_weight_decay", decoupled_weight_decay)
        self._init_bf16_update(bf16_update)
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group, in_backward)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if not _ADAM_DECOUPLES:  # (a group loaded from torch < 2.7's Adam or AdamW lacks the flag)
            for group in self.param_groups:
                group.setdefault("decoupled_weight_decay", self.defaults["decoupled_weight_decay"])

    def _init_param_state(self, p: Tensor, group) -> dict:
        state = self.state[p]
        if "step" not in state:
            wide = dict(dtype=state_dtype(p), memory_format=torch.preserve_format)
            state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
            state["exp_avg"] = torch.zeros_like(p, **wide)
            state["exp_avg_sq"] = torch.zeros_like(p, **wide)
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, **wide)
        return state

    def _init_state_for_checkpoint(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_param_state(p, group)
            self._init_rounding_state(group, [p for p in group["params"] if p.requires_grad])


# (Before torch 2.7 torch.optim.AdamW is not an Adam: with it among the bases, torch.optim.Adam's
# own super().__init__ would reach AdamW's. There accum_fused.AdamW is a torch.optim.Adam only.)
class AdamW(Adam, torch.optim.AdamW if _ADAM_DECOUPLES else torch.optim.Optimizer):
    """torch.optim.AdamW with gradient accumulation: Adam with decoupled weight decay."""

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, accumulation_steps: int = 1, max_grad_norm: float | None = None,
                 backend: str = "auto", process_group=NOT_GIVEN, in_backward: bool = False, bf16_update: str = "nearest"):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, accumulation_steps=accumulation_steps,
                         max_grad_norm=max_grad_norm, backend=backend, process_group=process_group,
                         in_backward=in_backward, bf16_update=bf16_update)


class WrappedUpdate(UpdateSpec):
    """GradientAccumulator's update: the window gradient written into each ``.grad`` in the
    parameter's dtype, then the inner optimizer's ``step()``. Its state is the inner optimizer's,
    which keeps the dtype it created (torch.optim's Adam makes bf16 moments for bf16 parameters
    and needs them so); only its device follows the parameter."""

    folds_last_micro_batch = False  # (the inner step receives a finished gradient)
    has_lists = False

    @staticmethod
    def state_dtype(p: Tensor):
        return None

    def apply(self, opt, win, last_grads, last_weight, grad_scale, weight_sum, clip_coef) -> None:
        calls = defaultdict(list)
        for p in self.params(opt):
            if p in win.live or p in last_grads:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                calls[(p.device, p.dtype)].append(p)  # .grad is overwritten in place
            else:
                p.grad = None
        for params in calls.values():
            self.backend_for(opt, params[0]).write_window_grads(
                buffers=[kernel_view(win.buffers[p]) for p in params], grads=[kernel_view(p.grad) for p in params],
                weight_sum=weight_sum, clip_coef=clip_coef)
        opt.optimizer.step()
        if opt.accumulation_steps > 1:
            # The window gradient was ours; a backward into it would add it to the next window.
            for params in calls.values():
                for p in params:
                    p.grad = None


class GradientAccumulator(AccumulatingOptimizer, torch.optim.Optimizer):
    """Gradient accumulation for any ``torch.optim.Optimizer`` instance (Adagrad, RMSprop, NAdam,
    your own): ``step(weight=)`` after every backward adds the micro-batch into fp32 buffers with
    the fused kernels; on the window boundary (or ``flush()``) the window gradient
    Σ wᵢ·gᵢ / Σ wᵢ, clipped when ``max_grad_norm`` is set and reduced across ranks when
    ``process_group`` is set, is written into each parameter's ``.grad`` in the parameter's dtype
    and the inner optimizer's ``step()`` runs. Parameters without a gradient all window get
    ``.grad = None``, so the inner optimizer leaves them alone.

    ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's: LR schedulers work on
    either object. ``state_dict()`` is the inner optimizer's plus the ``"accumulation"`` entry.
    """

    update_spec = WrappedUpdate()

    def __init__(self, optimizer: torch.optim.Optimizer, accumulation_steps: int = 1, *,
                 max_grad_norm: float | None = None, process_group=NOT_GIVEN, backend: str = "auto"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError(
                f"{type(optimizer).__name__} already accumulates gradients: set its accumulation_steps "
                "instead of wrapping it"
            )
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(
                f"{type(optimizer).__name__}.step(closure) needs a closure that recomputes the loss, possibly several "
                "times per update (line search): a window of accumulated micro-batches has no loss to recompute. "
                "Use it without GradientAccumulator, on the full batch"
            )
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, False, False, process_group)
        self.optimizer = optimizer
        # What torch.optim.Optimizer.__init__ sets up besides param_groups/state (the inner
        # optimizer's), so that hooks and LR schedulers work on the wrapper too.
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                      "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                      "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())
        self._patch_step_function()
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def __repr__(self) -> str:
        return (f"GradientAccumulator({self.optimizer!r}, accumulation_steps={self.accumulation_steps}, "
                f"max_grad_norm={self.max_grad_norm}, backend={self.backend!r})")

    def _add_group(self, param_group) -> None:
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def __getstate__(self) -> dict[str, Any]:
        checkpoint.refuse_copy(self, self._window)
        # DDP's takeover (ddp.py) and the releases of what it owns belong to this object: a copy
        # does not watch and owns nothing.
        own = ("_ddp", "_releases")
        return {k: v for k, v in self.__dict__.items() if k not in own}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        restore_defaults(self.__dict__)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict plus the ``"accumulation"`` entry (open window)."""
        guard.check_wrapped(self)
        return checkpoint.state_dict(self, self._window, self.optimizer.state_dict(), self.__dict__.get("_recovery"))

    def _init_state_for_checkpoint(self) -> None:
        self.optimizer.step()  # the zero gradients and lr 0 torch.distributed.checkpoint set

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state_dict (mid-window resume) or a plain one of the inner optimizer."""
        state_dict, accumulation, by_id = checkpoint.split_accumulation_entry(self, state_dict)
        self.optimizer.load_state_dict(state_dict)
        checkpoint.restore_window(self, self._window, accumulation, by_id)
