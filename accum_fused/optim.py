"""SGD, Adam and AdamW that accumulate gradients inside the optimizer, and GradientAccumulator.

This module is the front: the public classes, torch.optim-compatible construction, argument
checks, param groups, the GradScaler contract, and ``step`` / ``flush`` / ``zero_grad`` /
``backward`` / ``state_dict`` as thin entry points. It does no window arithmetic and no
per-element math: the open window and its closing live in ``window.py``, the hooks of
``in_backward=True`` in ``in_backward.py``, checkpoint layouts in ``checkpoint.py``,
cross-rank agreement in ``distributed.py``, the math in ``accum_fused.backends``. What it keeps
here per optimizer class is the update itself (``_update``: which state a backend call takes).

Each class subclasses the torch.optim class of the same name and calls its ``__init__``, so
constructor arguments, defaults, validation messages and param-group layout are torch's own.
"""
from __future__ import annotations

import math
import numbers
from collections import OrderedDict, defaultdict
from typing import Any, Callable

import torch
from torch import Tensor

from . import backends, checkpoint, distributed, in_backward as hooks
from .checkpoint import called_from_torch_checkpoint
from .layout import is_dtensor, kernel_view, like_param, state_dtype
from .window import Window

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
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, numbers.Integral):
        raise TypeError(f"accumulation_steps must be an int, got {type(accumulation_steps).__name__}")
    if accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
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


def _check_weight(weight) -> float:
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


def _window_view(name: str, doc: str) -> property:
    def get(self):
        return getattr(self._window, name)

    def set_(self, value):
        setattr(self._window, name, value)

    return property(get, set_, doc=doc)


class _AccumulatingOptimizer:
    """The entry points shared by SGD, Adam, AdamW and GradientAccumulator.

    The open window is ``self._window`` (window.Window), created once and never re-bound.
    Subclasses implement ``_apply_window`` (SGD/Adam/AdamW: ``Window.update_params``, which
    calls their ``_update`` per backend call; GradientAccumulator: write ``.grad``, inner step).
    """

    # torch.amp.GradScaler.step: hand us grad_scale / found_inf instead of unscaling .grad.
    _step_supports_amp_scaling = True
    # State that stays in state_dtype whatever the parameter dtype (torch would cast it).
    _wide_state_keys: tuple[str, ...] = ()
    # Fuse the window's last micro-batch into the update pass when nothing needs the whole
    # window's sums first (clipping, a cross-rank reduce).
    _folds_last_micro_batch = True

    micro_step = _window_view("micro_step", "Micro-batches in the open window.")
    updated = _window_view("updated", "Whether the last step()/flush() applied an update.")
    update_count = _window_view("update_count", "Updates applied (skipped or empty windows do not count).")
    last_grad_norm = _window_view("last_grad_norm", "Pre-clip global norm of the last clipped window.")

    @property
    def micro_batch_weight(self) -> float | None:
        """The weight set by set_micro_batch_weight for the next micro-batch, or None."""
        return self._window.pending_weight

    def _init_accumulation(self, accumulation_steps: int, max_grad_norm: float | None, backend: str,
                           process_group, in_backward: bool = False) -> None:
        if not isinstance(in_backward, bool):
            raise TypeError(f"in_backward must be a bool, got {type(in_backward).__name__}")
        self.accumulation_steps = int(accumulation_steps)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.backend = backend
        self.process_group = process_group
        self.in_backward = in_backward
        self._hook_handles: list = []
        name, params = type(self).__name__, self._all_params()
        mesh = self._check_params(params)
        # FSDP2 (DTensor parameters): the ranks of the mesh agree once per window (ShardSync).
        shards = None if mesh is None else distributed.ShardSync(mesh, name)
        sync = None
        if process_group is not None:
            sync = distributed.WindowSync(process_group, name)
            sync.add_params(params, state_dtype)
        else:
            distributed.warn_if_ddp_without_sync(name, params)
        self._window = Window(sync, shards)
        if in_backward:
            hooks.install(self)

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
                hooks.register_hooks(self, self.param_groups[-1]["params"])

    def _add_group(self, param_group) -> None:
        super().add_param_group(param_group)

    def _check_params(self, tensors):
        """Refuse, before anything changes, parameters no backend can run correctly. Returns
        the FSDP2 device mesh when the parameters are DTensors, else None."""
        tensors = [t for t in tensors if isinstance(t, Tensor)]
        built = hasattr(self, "_window")
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
        return [p for group in self.param_groups for p in group["params"]]

    def _param_name(self, p: Tensor) -> str:
        index = next(i for i, q in enumerate(self._all_params()) if q is p)
        return f"parameter {index} (shape {tuple(p.shape)}, {p.dtype}, {p.device})"

    def _backend_for(self, param: Tensor):
        return backends.resolve(self.backend, param.device, param.dtype.to_real())

    def _collect_grads(self) -> list[tuple[Tensor, Tensor]]:
        """(param, grad) for every parameter with a gradient, validated: no sparse gradient,
        and fused=True groups on a device and dtype torch's fused kernels support, as torch
        checks at step() (fused=True is accepted: every backend call is one fused pass)."""
        pairs = [(p, p.grad) for p in self._all_params() if p.grad is not None]
        for _, grad in pairs:
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (a parameter has "
                    "one); use torch.optim.SparseAdam or nn.Embedding(sparse=False)"
                )
        fused = {p for group in self.param_groups if group.get("fused") for p in group["params"]}
        if fused:
            from torch.optim.optimizer import _device_dtype_check_for_fused  # torch's own message
            for p, _ in pairs:
                if p in fused:
                    _device_dtype_check_for_fused(p)
        return pairs

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
        win = self._window
        if weight is not None:
            weight = _check_weight(weight)
            if win.backward_done:
                raise ValueError("this micro-batch's weight was given to backward(loss, weight=...): call step() "
                                 "without weight=")
        if self.in_backward:
            hooks.check_step(self, 1.0 if weight is None else weight)
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
        pairs = self._collect_grads()
        win.add_micro_batch(self, pairs, weight, getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        if self.accumulation_steps > 1:
            for p, _ in pairs:
                p.grad = None
        return loss

    @torch._disable_dynamo
    @torch.no_grad()
    def flush(self) -> bool:
        """Apply a pending partial window, averaged over the weights it holds. Returns True
        when an update was applied; False when nothing was pending, the window held no
        gradient, or it was skipped because a micro-batch had non-finite gradients. With a
        process_group it is collective: call it on every rank, including ranks whose window is
        empty."""
        win = self._window
        if win.backward_pass is not None:
            raise RuntimeError("flush() was called inside a backward pass; call it after backward returns")
        if self.in_backward and self.accumulation_steps == 1:
            win.weight_sum = 1.0 if win.live else 0.0  # mode A: a sum (see Window.add_micro_batch)
        if not (win.micro_step > 0 or win.spans_ranks):
            win.updated = False
            return False
        win.conform(self, list(win.live), closing=True)
        return win.close(self, flushing=True)

    def set_micro_batch_weight(self, weight: float | Tensor) -> None:
        """The weight of the micro-batch being accumulated now, for loops that call ``step()``
        or ``loss.backward()`` without one (HF Trainer, Lightning, accelerate): the next
        ``step()`` without ``weight=`` (also one whose closure calls this) or, with
        ``in_backward``, the next backward pass uses it. Validated here."""
        weight = _check_weight(weight)
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
        if weight is None:
            weight = 1.0 if win.pending_weight is None else win.pending_weight
        weight = _check_weight(weight)
        if win.shards is not None and weight != 1.0:
            loss = loss * weight  # before FSDP2's reduce-scatter averages the ranks' gradients
        if self.in_backward:
            hooks.backward(self, loss, weight, backward_kwargs)
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
            self._window.discard()

    # --------------------------------------------------------------------------- updating
    def _apply_window(self, last_grads, last_weight, grad_scale, weight_sum, clip_coef) -> None:
        """Update every live parameter with the window gradient (Window.close calls this)."""
        self._window.update_params(self, last_grads, last_weight, grad_scale, weight_sum, clip_coef)

    def _call_key(self, p: Tensor):
        """Extra key for parameters that cannot share one backend call (none by default)."""
        return None

    def _update(self, backend, group, params, buffers, **window) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoint, copies
    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict plus an ``"accumulation"`` entry with the open window: its
        buffers (by parameter index, as in ``"state"``), counters and GradScaler flag. With
        FSDP2 parameters the window is carried inside "state" and "param_groups" instead."""
        return checkpoint.state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state_dict (resuming mid-window exactly) or a torch.optim one of the
        same class (migration: the window starts empty, state is widened to fp32)."""
        checkpoint.load_state_dict(self, state_dict, super().load_state_dict)

    def _init_state_for_checkpoint(self) -> None:
        """torch.distributed.checkpoint's stand-in for a first step: create the state a first
        update would, so that a fresh optimizer's state_dict is a load template; the window,
        parameters and step counts stay as they are."""

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ keeps only defaults/state/param_groups; copy.deepcopy and
        # pickle must keep the open window too.
        checkpoint.refuse_copy(self)
        return {**super().__getstate__(), **{k: getattr(self, k) for k in checkpoint.ACCUMULATION_ATTRS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        checkpoint.restore_defaults(self.__dict__)


class SGD(_AccumulatingOptimizer, torch.optim.SGD):
    """torch.optim.SGD with gradient accumulation (see the package README).

    Momentum buffers are fp32 whatever the parameter dtype (torch keeps them in the parameter
    dtype); fp64 parameters keep fp64 state.
    """

    _wide_state_keys = ("momentum_buffer",)

    def __init__(self, params, lr: float | Tensor = 1e-3, momentum: float = 0, dampening: float = 0,
                 weight_decay: float | Tensor = 0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None, backend: str = "auto",
                 process_group=None, in_backward: bool = False):
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, False, differentiable, process_group)
        torch.optim.SGD.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                                 foreach=foreach, differentiable=differentiable, fused=fused)
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group, in_backward)

    def _init_state_for_checkpoint(self) -> None:
        # As torch.optim.SGD's zero-gradient first step would: a zero momentum buffer (with
        # dampening 0 the next update is then the same as from none).
        for group in self.param_groups:
            if _as_float(group["momentum"]) != 0:
                for p in group["params"]:
                    if p.requires_grad and self.state[p].get("momentum_buffer") is None:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=state_dtype(p))

    def _update(self, backend, group, params, buffers, **window) -> None:
        momentum = _as_float(group["momentum"])
        # .get on the defaultdict: SGD without momentum keeps no per-parameter entry, as torch.
        momentum_buffers = [kernel_view(b) if b is not None else None
                            for b in (self.state.get(p, {}).get("momentum_buffer") for p in params)]
        backend.sgd_update(
            params=[kernel_view(p) for p in params], buffers=buffers, momentum_buffers=momentum_buffers,
            lr=_lr(group), momentum=momentum, dampening=_as_float(group["dampening"]),
            weight_decay=_as_float(group["weight_decay"]), nesterov=group["nesterov"],
            maximize=group["maximize"], **window,
        )
        if momentum != 0:
            for p, momentum_buffer in zip(params, momentum_buffers):
                if self.state[p].get("momentum_buffer") is None:  # new: a backend made it from local shards
                    self.state[p]["momentum_buffer"] = like_param(momentum_buffer, p)


class Adam(_AccumulatingOptimizer, torch.optim.Adam):
    """torch.optim.Adam with gradient accumulation (see the package README).

    exp_avg / exp_avg_sq / max_exp_avg_sq are fp32 whatever the parameter dtype (torch keeps
    them in the parameter dtype); fp64 parameters keep fp64 state. ``step`` is a CPU tensor.
    """

    _wide_state_keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0, amsgrad: bool = False, *, foreach: bool | None = None,
                 maximize: bool = False, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, decoupled_weight_decay: bool = False,
                 accumulation_steps: int = 1, max_grad_norm: float | None = None, backend: str = "auto",
                 process_group=None, in_backward: bool = False):
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, capturable, differentiable,
                                 process_group)
        torch.optim.Adam.__init__(self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                                  maximize=maximize, capturable=capturable, differentiable=differentiable,
                                  fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group, in_backward)

    def _call_key(self, p: Tensor):
        # Bias corrections depend on the step, which differs for parameters that missed windows.
        step = self.state.get(p, {}).get("step")
        return 0 if step is None else int(step.item())

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

    def _update(self, backend, group, params, buffers, **window) -> None:
        amsgrad = group["amsgrad"]
        for p in params:
            self._init_param_state(p, group)["step"] += 1
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        backend.adam_update(
            params=[kernel_view(p) for p in params], buffers=buffers,
            exp_avgs=[kernel_view(s["exp_avg"]) for s in states], exp_avg_sqs=[kernel_view(s["exp_avg_sq"]) for s in states],
            max_exp_avg_sqs=[kernel_view(s["max_exp_avg_sq"]) for s in states] if amsgrad else [],
            step=int(states[0]["step"].item()), lr=_lr(group), beta1=_as_float(beta1),
            beta2=_as_float(beta2), eps=_as_float(group["eps"]), weight_decay=_as_float(group["weight_decay"]),
            amsgrad=amsgrad, maximize=group["maximize"], decoupled_weight_decay=group["decoupled_weight_decay"],
            **window,
        )


class AdamW(Adam, torch.optim.AdamW):
    """torch.optim.AdamW with gradient accumulation: Adam with decoupled weight decay."""

    def __init__(self, params, lr: float | Tensor = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, accumulation_steps: int = 1, max_grad_norm: float | None = None,
                 backend: str = "auto", process_group=None, in_backward: bool = False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, accumulation_steps=accumulation_steps,
                         max_grad_norm=max_grad_norm, backend=backend, process_group=process_group,
                         in_backward=in_backward)


class GradientAccumulator(_AccumulatingOptimizer, torch.optim.Optimizer):
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

    # The inner step receives a finished gradient: the last micro-batch cannot be fused into it.
    _folds_last_micro_batch = False

    def __init__(self, optimizer: torch.optim.Optimizer, accumulation_steps: int = 1, *,
                 max_grad_norm: float | None = None, process_group=None, backend: str = "auto"):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer instance, got {type(optimizer).__name__}")
        if isinstance(optimizer, _AccumulatingOptimizer):
            raise TypeError(
                f"{type(optimizer).__name__} already accumulates gradients: set its accumulation_steps "
                "instead of wrapping it"
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

    def _apply_window(self, last_grads, last_weight, grad_scale, weight_sum, clip_coef) -> None:
        calls = defaultdict(list)
        for p in self._all_params():
            if p in self._window.live or p in last_grads:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                calls[(p.device, p.dtype)].append(p)  # .grad is overwritten in place
            else:
                p.grad = None
        for params in calls.values():
            self._backend_for(params[0]).write_window_grads(
                buffers=[kernel_view(self._window.buffers[p]) for p in params], grads=[kernel_view(p.grad) for p in params],
                weight_sum=weight_sum, clip_coef=clip_coef)
        self.optimizer.step()
        if self.accumulation_steps > 1:
            # The window gradient was ours; a backward into it would add it to the next window.
            for params in calls.values():
                for p in params:
                    p.grad = None

    def __getstate__(self) -> dict[str, Any]:
        checkpoint.refuse_copy(self)
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict plus the ``"accumulation"`` entry (open window)."""
        return checkpoint.state_dict(self, self.optimizer.state_dict())

    def _init_state_for_checkpoint(self) -> None:
        self.optimizer.step()  # the zero gradients and lr 0 torch.distributed.checkpoint set

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state_dict (mid-window resume) or a plain one of the inner optimizer."""
        state_dict, accumulation, by_id = checkpoint.split_accumulation_entry(self, state_dict)
        self.optimizer.load_state_dict(state_dict)
        checkpoint.restore_window(self, accumulation, by_id)
