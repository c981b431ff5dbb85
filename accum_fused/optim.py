"""SGD, Adam and AdamW that accumulate gradients inside the optimizer.

This module is the front: argument checks, param groups, window bookkeeping, the GradScaler
contract and state_dict. It does no per-element math; that lives in ``accum_fused.backends``.

Each class subclasses the torch.optim class of the same name and calls its ``__init__``, so
constructor arguments, defaults, validation messages and param-group layout are torch's own.
"""
from __future__ import annotations

import math
import numbers
from collections import OrderedDict, defaultdict
from itertools import chain
from typing import Any, Callable

import torch
from torch import Tensor

from . import backends, distributed

__all__ = ["SGD", "Adam", "AdamW", "GradientAccumulator"]


def _state_dtype(param: Tensor) -> torch.dtype:
    """Buffers and optimizer state: fp64 for fp64 parameters, fp32 for every other dtype."""
    return torch.float64 if param.dtype == torch.float64 else torch.float32


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


class _AccumulatingOptimizer:
    """Window bookkeeping shared by SGD, Adam and AdamW.

    Per parameter, ``_buffers[p]`` holds the weighted gradient sum of the open window in
    ``_state_dtype(p)``; ``_window_params`` holds the parameters that received a gradient in
    the open window (their buffers are live; every other buffer is stale and the next
    gradient overwrites it, so no zeroing pass is ever needed). Subclasses implement
    ``_apply_window`` (SGD/Adam/AdamW: ``_update`` per backend call, gathering their state and
    calling the backend's update function; GradientAccumulator: write ``.grad``, inner step).

    With a ``process_group`` (``_sync``), the buffers are views into flat per-(device, dtype)
    tensors and each window's sums and weight totals are all-reduced once, before the update
    (see ``accum_fused/distributed.py``).
    """

    # torch.amp.GradScaler.step: hand us grad_scale / found_inf instead of unscaling .grad.
    _step_supports_amp_scaling = True
    # State that stays in _state_dtype whatever the parameter dtype (torch would cast it).
    _wide_state_keys: tuple[str, ...] = ()
    # Fuse the window's last micro-batch into the update pass when nothing needs the whole
    # window's sums first (clipping, a cross-rank reduce).
    _folds_last_micro_batch = True

    def _init_accumulation(self, accumulation_steps: int, max_grad_norm: float | None, backend: str,
                           process_group) -> None:
        self.accumulation_steps = int(accumulation_steps)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.backend = backend
        self.micro_step = 0
        self.updated = False
        self.update_count = 0
        self.last_grad_norm: Tensor | None = None
        self._buffers: dict[Tensor, Tensor] = {}
        self._window_params: set[Tensor] = set()
        self._weight_sum = 0.0
        self._window_found_inf: Tensor | None = None
        self.process_group = process_group
        self._sync: distributed.WindowSync | None = None
        if process_group is not None:
            self._sync = distributed.WindowSync(process_group, type(self).__name__)
            self._sync.add_params(self._all_params(), _state_dtype)
            self._buffers = self._sync.buffers
        else:
            distributed.warn_if_ddp_without_sync(type(self).__name__, self._all_params())

    # ----------------------------------------------------------------------------- params
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict):
            params = param_group.get("params")
            if params is not None and not isinstance(params, (Tensor, set)):
                params = list(params)  # a generator must survive being read here and in torch
                param_group = {**param_group, "params": params}
            items = [params] if isinstance(params, Tensor) else params or []
            self._refuse_complex(item[1] if isinstance(item, tuple) else item for item in items)
        self._add_group(param_group)
        self._sync_new_group()

    def _add_group(self, param_group) -> None:
        super().add_param_group(param_group)

    def _refuse_complex(self, tensors) -> None:
        if any(isinstance(t, Tensor) and t.is_complex() for t in tensors):
            raise ValueError(f"{type(self).__name__} does not support complex parameters; "
                             "optimize torch.view_as_real(param) instead")

    def _sync_new_group(self) -> None:
        # During torch's __init__ there is no _sync yet: _init_accumulation registers all groups.
        if getattr(self, "_sync", None) is not None:
            self._sync.add_params(self.param_groups[-1]["params"], _state_dtype)

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _collect_grads(self) -> list[tuple[Tensor, Tensor]]:
        """(param, grad) for every parameter with a gradient; refuses sparse ones first."""
        pairs = [(p, p.grad) for p in self._all_params() if p.grad is not None]
        for _, grad in pairs:
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (a parameter has "
                    "one); use torch.optim.SparseAdam or nn.Embedding(sparse=False)"
                )
        return pairs

    def _backend_for(self, param: Tensor):
        return backends.resolve(self.backend, param.device, param.dtype)

    # ------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, *, weight: float | Tensor = 1.0):
        """Accumulate this micro-batch's gradients (times ``weight``); on every
        ``accumulation_steps``-th call, apply the update with sum(w_i g_i) / sum(w_i).
        Returns the closure's loss, like torch.optim. With a process_group, the boundary call
        is collective: every rank reaches it once per window."""
        weight = _check_weight(weight)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = self._collect_grads()
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            # Sum on the device: no host synchronisation per micro-batch.
            found = found_inf.detach().float()
            self._window_found_inf = found if self._window_found_inf is None else self._window_found_inf + found
        self.micro_step += 1
        self._weight_sum += weight
        if self.micro_step < self.accumulation_steps:
            self._accumulate(pairs, weight, grad_scale)
            self.updated = False
        elif self._folds_last_micro_batch and self.max_grad_norm is None and self._sync is None:
            # The last micro-batch is folded into the update pass (one pass over the bytes).
            self.updated = self._finish_window(pairs, weight, grad_scale)
        else:
            # Clipping needs the whole window's norm first: the last accumulate pass returns it
            # (after a cross-rank reduce the norms are measured on the reduced sums instead).
            local_norms = self.max_grad_norm is not None and self._sync is None
            norms = self._accumulate(pairs, weight, grad_scale,
                                     norm_weight_sum=self._weight_sum if local_norms else None)
            self.updated = self._finish_window([], weight, None, norms)
        return loss

    @torch.no_grad()
    def flush(self) -> bool:
        """Apply a pending partial window, averaged over the weights it holds. Returns True
        when an update was applied; False when nothing was pending or the window was skipped
        because a micro-batch had non-finite gradients. With a process_group it is collective:
        call it on every rank, including ranks whose window is empty."""
        pending = self.micro_step > 0 or self._sync is not None
        self.updated = self._finish_window([], 1.0, None, flushing=True) if pending else False
        return self.updated

    def _accumulate(self, pairs, weight: float, grad_scale: Tensor | None, norm_weight_sum: float | None = None):
        """Add one micro-batch into the buffers. With ``norm_weight_sum``, also return
        {param: ||acc / norm_weight_sum||} for the parameters accumulated here."""
        calls = defaultdict(list)
        for p, grad in pairs:
            overwrite = p not in self._window_params
            calls[(p.device, p.dtype, grad.dtype, overwrite)].append((p, grad))
        norms = {}
        for (_, _, _, overwrite), items in calls.items():
            call_norms = self._backend_for(items[0][0]).accumulate(
                grads=[g for _, g in items],
                buffers=[self._buffer(p) for p, _ in items],
                weight=weight,
                overwrite=overwrite,
                grad_scale=grad_scale,
                norm_weight_sum=norm_weight_sum,
            )
            if call_norms is not None:
                norms.update(zip([p for p, _ in items], call_norms.unbind()))
        self._window_params.update(p for p, _ in pairs)
        return norms

    def _buffer(self, p: Tensor) -> Tensor:
        buf = self._buffers.get(p)
        if buf is None:
            buf = self._buffers[p] = torch.empty_like(p, dtype=_state_dtype(p), memory_format=torch.preserve_format)
        return buf

    def _finish_window(self, last_pairs, last_weight: float, grad_scale: Tensor | None, norms=None,
                       flushing: bool = False) -> bool:
        """Close the window: skip it if GradScaler saw a non-finite micro-batch, otherwise
        clip and update. ``last_pairs`` is the last micro-batch, not yet accumulated;
        ``norms`` the per-parameter window-gradient norms already computed, if any."""
        weight_sum = self._weight_sum
        if self._sync is not None:
            weight_sum, skip, self._window_params = self._sync.reduce_window(
                self._all_params(), self._window_params, weight_sum, self._window_found_inf, flushing)
        else:
            skip = self._window_found_inf is not None and bool(self._window_found_inf.item() > 0)
        applied = not skip and weight_sum > 0  # 0: no rank had a micro-batch (a collective flush)
        if applied:
            clip_coef = None if self.max_grad_norm is None else self._clip_coefficient(weight_sum, norms or {})
            self._apply_window(dict(last_pairs), last_weight, grad_scale, weight_sum, clip_coef)
            self.update_count += 1
        self._window_params = set()
        self.micro_step = 0
        self._weight_sum = 0.0
        self._window_found_inf = None
        return applied

    def _clip_coefficient(self, weight_sum: float, norms: dict[Tensor, Tensor]) -> Tensor:
        """min(max_grad_norm / (||g|| + 1e-6), 1) on the device, as clip_grad_norm_ computes
        it. ``norms`` has the per-parameter norms the last accumulate pass produced; the
        window's other parameters (no gradient in that micro-batch) are measured here."""
        live = [p for p in self._all_params() if p in self._window_params]
        if not live:
            self.last_grad_norm = torch.zeros(())
            return torch.ones(())
        missing = defaultdict(list)
        for p in live:
            if p not in norms:
                missing[(p.device, p.dtype)].append(p)
        for params in missing.values():
            measured = self._backend_for(params[0]).window_norms(
                buffers=[self._buffers[p] for p in params], weight_sum=weight_sum)
            norms = {**norms, **dict(zip(params, measured.unbind()))}
        first_device = live[0].device
        total_norm = torch.linalg.vector_norm(torch.stack([norms[p].to(first_device) for p in live]))
        self.last_grad_norm = total_norm
        return torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0)

    def _apply_window(self, last_grads, last_weight, grad_scale, weight_sum, clip_coef) -> None:
        """Update every group with the window gradient (the last micro-batch folded in when
        ``last_grads`` holds it)."""
        for group in self.param_groups:
            self._update_group(group, last_grads, last_weight, grad_scale, weight_sum, clip_coef)

    def _update_group(self, group, last_grads, last_weight, grad_scale, weight_sum, clip_coef) -> None:
        """Split the group's window parameters into backend calls that share (device, dtype),
        the subclass's call key (Adam's step count) and how the last micro-batch folds in."""
        calls = defaultdict(list)
        for p in group["params"]:
            grad = last_grads.get(p)
            if grad is None and p not in self._window_params:
                continue  # no gradient all window: left alone, as torch leaves it
            self._buffer(p)
            fold = None if grad is None else (grad.dtype, p not in self._window_params)
            calls[(p.device, p.dtype, self._call_key(p), fold)].append(p)
        for (_, _, _, fold), params in calls.items():
            last = {}
            if fold is not None:
                last = dict(grads=[last_grads[p] for p in params], weight=last_weight,
                            overwrite=fold[1], grad_scale=grad_scale)
            self._update(self._backend_for(params[0]), group, params, [self._buffers[p] for p in params],
                         weight_sum=weight_sum, clip_coef=clip_coef, **last)

    def _call_key(self, p: Tensor):
        """Extra key for parameters that cannot share one backend call (none by default)."""
        return None

    def _update(self, backend, group, params, buffers, **window) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------- state_dict
    _ACCUMULATION_ATTRS = ("accumulation_steps", "max_grad_norm", "backend", "micro_step", "updated",
                           "update_count", "last_grad_norm", "_buffers", "_window_params",
                           "_weight_sum", "_window_found_inf", "process_group", "_sync")

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ keeps only defaults/state/param_groups; copy.deepcopy and
        # pickle must keep the open window too.
        self._refuse_copy_when_synced()
        return {**super().__getstate__(), **{k: getattr(self, k) for k in self._ACCUMULATION_ATTRS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key in ("process_group", "_sync"):  # pickled before process_group existed
            self.__dict__.setdefault(key, None)

    def _refuse_copy_when_synced(self) -> None:
        if self._sync is not None:
            raise TypeError(
                f"a {type(self).__name__} with a process_group cannot be pickled or deep-copied (a process "
                "group is a live connection); save and load its state_dict() instead"
            )

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict plus an ``"accumulation"`` entry with the open window: its
        buffers (by parameter index, as in ``"state"``), counters and GradScaler flag."""
        return {**super().state_dict(), "accumulation": self._accumulation_entry()}

    def _accumulation_entry(self) -> dict[str, Any]:
        index = {p: i for i, p in enumerate(self._all_params())}
        return {
            "accumulation_steps": self.accumulation_steps,
            "micro_step": self.micro_step,
            "weight_sum": self._weight_sum,
            "update_count": self.update_count,
            "updated": self.updated,
            "found_inf": self._window_found_inf,
            "last_grad_norm": self.last_grad_norm,
            "buffers": {index[p]: self._buffers[p] for p in self._window_params},
        }

    def _split_accumulation_entry(self, state_dict: dict[str, Any]):
        """(state_dict without "accumulation", that entry or None, {saved param id: param}),
        the entry checked against this optimizer before anything is loaded."""
        state_dict = dict(state_dict)
        accumulation = state_dict.pop("accumulation", None)
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = self._all_params()
        by_id = dict(zip(saved_ids, params)) if len(saved_ids) == len(params) else {}
        if accumulation is not None:
            self._check_accumulation_entry(accumulation, by_id)
        return state_dict, accumulation, by_id

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state_dict (resuming mid-window exactly) or a torch.optim one of the
        same class (migration: the window starts empty, state is widened to fp32)."""
        state_dict, accumulation, by_id = self._split_accumulation_entry(state_dict)
        # torch casts floating state to the parameter dtype; keep ours wide by loading it here.
        wide_state, narrow_state = {}, {}
        for param_id, entry in state_dict["state"].items():
            narrow_state[param_id] = {k: v for k, v in entry.items() if k not in self._wide_state_keys}
            wide_state[param_id] = {k: v for k, v in entry.items() if k in self._wide_state_keys}
        super().load_state_dict({**state_dict, "state": narrow_state})  # validates groups first

        for param_id, entry in wide_state.items():
            p = by_id[param_id]
            for key, value in entry.items():
                is_tensor = isinstance(value, Tensor)
                self.state[p][key] = value.to(device=p.device, dtype=_state_dtype(p)) if is_tensor else value
        for p_state in self.state.values():
            step = p_state.get("step")
            if isinstance(step, Tensor) and step.device.type != "cpu":
                p_state["step"] = step.cpu()  # read every update: keep it off the device
        self._restore_window(accumulation, by_id)

    def _restore_window(self, accumulation: dict[str, Any] | None, by_id: dict) -> None:
        """Reopen the saved window (or start an empty one when the checkpoint has none)."""
        self._window_params = set()
        self.micro_step, self._weight_sum, self._window_found_inf = 0, 0.0, None
        if accumulation is None:
            return
        self.micro_step = accumulation["micro_step"]
        self._weight_sum = accumulation["weight_sum"]
        self.update_count = accumulation["update_count"]
        self.updated = accumulation["updated"]
        self.last_grad_norm = accumulation["last_grad_norm"]
        found = accumulation["found_inf"]
        self._window_found_inf = None if found is None else found.clone()
        for param_id, saved in accumulation["buffers"].items():
            p = by_id[param_id]
            self._buffer(p).copy_(saved)
            self._window_params.add(p)

    def _check_accumulation_entry(self, accumulation: dict[str, Any], by_id: dict) -> None:
        micro_step = accumulation["micro_step"]
        if not 0 <= micro_step < self.accumulation_steps:
            raise ValueError(
                f"checkpoint holds an open window of {micro_step} micro-batches, which does not fit "
                f"accumulation_steps={self.accumulation_steps} of this optimizer"
            )
        for param_id, saved in accumulation["buffers"].items():
            p = by_id.get(param_id)
            if p is None or saved.shape != p.shape:
                raise ValueError(f"checkpoint's accumulation buffer {param_id} does not match this optimizer's parameters")


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
                 process_group=None):
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, False, differentiable, process_group)
        torch.optim.SGD.__init__(self, params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize,
                                 foreach=foreach, differentiable=differentiable, fused=fused)
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group)

    def _update(self, backend, group, params, buffers, **window) -> None:
        momentum = _as_float(group["momentum"])
        momentum_buffers = [self.state[p].get("momentum_buffer") for p in params]
        backend.sgd_update(
            params=params, buffers=buffers, momentum_buffers=momentum_buffers,
            lr=_lr(group), momentum=momentum, dampening=_as_float(group["dampening"]),
            weight_decay=_as_float(group["weight_decay"]), nesterov=group["nesterov"],
            maximize=group["maximize"], **window,
        )
        if momentum != 0:
            for p, momentum_buffer in zip(params, momentum_buffers):
                self.state[p]["momentum_buffer"] = momentum_buffer


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
                 process_group=None):
        _check_accumulation_args(accumulation_steps, max_grad_norm, backend, capturable, differentiable,
                                 process_group)
        torch.optim.Adam.__init__(self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach,
                                  maximize=maximize, capturable=capturable, differentiable=differentiable,
                                  fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._init_accumulation(accumulation_steps, max_grad_norm, backend, process_group)

    def _call_key(self, p: Tensor):
        # Bias corrections depend on the step, which differs for parameters that missed windows.
        step = self.state[p].get("step")
        return 0 if step is None else int(step.item())

    def _update(self, backend, group, params, buffers, **window) -> None:
        amsgrad = group["amsgrad"]
        for p in params:
            state = self.state[p]
            if "step" not in state:
                wide = dict(dtype=_state_dtype(p), memory_format=torch.preserve_format)
                state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                state["exp_avg"] = torch.zeros_like(p, **wide)
                state["exp_avg_sq"] = torch.zeros_like(p, **wide)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, **wide)
            state["step"] += 1
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        backend.adam_update(
            params=params, buffers=buffers,
            exp_avgs=[s["exp_avg"] for s in states], exp_avg_sqs=[s["exp_avg_sq"] for s in states],
            max_exp_avg_sqs=[s["max_exp_avg_sq"] for s in states] if amsgrad else [],
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
                 backend: str = "auto", process_group=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True, accumulation_steps=accumulation_steps,
                         max_grad_norm=max_grad_norm, backend=backend, process_group=process_group)


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
        self._refuse_complex(chain.from_iterable(g["params"] for g in optimizer.param_groups))
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
            if p in self._window_params:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                calls[(p.device, p.dtype)].append(p)  # .grad is overwritten in place
            else:
                p.grad = None
        for params in calls.values():
            self._backend_for(params[0]).write_window_grads(
                buffers=[self._buffers[p] for p in params], grads=[p.grad for p in params],
                weight_sum=weight_sum, clip_coef=clip_coef)
        self.optimizer.step()

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_copy_when_synced()
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict plus the ``"accumulation"`` entry (open window)."""
        return {**self.optimizer.state_dict(), "accumulation": self._accumulation_entry()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state_dict (mid-window resume) or a plain one of the inner optimizer."""
        state_dict, accumulation, by_id = self._split_accumulation_entry(state_dict)
        self.optimizer.load_state_dict(state_dict)
        self._restore_window(accumulation, by_id)
