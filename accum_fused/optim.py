"""SGD, Adam and AdamW that accumulate gradients inside the optimizer.

This module is the front: argument checks, param groups, window bookkeeping, the GradScaler
contract and state_dict. It does no per-element math; that lives in ``accum_fused.backends``.

Each class subclasses the torch.optim class of the same name and calls its ``__init__``, so
constructor arguments, defaults, validation messages and param-group layout are torch's own.
"""
from __future__ import annotations

import math
import numbers
import sys
import weakref
from collections import OrderedDict, defaultdict
from itertools import chain
from typing import Any, Callable

import torch
from torch import Tensor

from . import backends, distributed

__all__ = ["SGD", "Adam", "AdamW", "GradientAccumulator"]

# Optimizer state entries that hold one value per parameter element (everything but "step").
_ELEMENTWISE_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")

# Weights are kept in units of 2**shift, shift a multiple of _WEIGHT_BAND, so that any finite
# positive weight fits the fp32 buffers (uniform 1e-46 weights underflowed fp32 to a zero update,
# 1e38 overflowed it to NaN). Weights in [1, 2**32) -- counts, token counts -- get shift 0 and the
# arithmetic is exactly what it was; other shifts are exact powers of two, so results are the same
# up to fp32 range. A later weight of 2**_WEIGHT_HEADROOM or more in the window's units moves the
# window to its band (one rescaling pass over the live buffers), so a scaled weight stays < 2**64.
_WEIGHT_BAND = 32
_WEIGHT_HEADROOM = 64


def _state_dtype(param: Tensor) -> torch.dtype:
    """Buffers and optimizer state: fp64 for fp64 parameters, fp32 for every other real dtype;
    complex64 / complex128 for complex parameters (torch.optim's state layout for them)."""
    if param.is_complex():
        return torch.complex128 if param.dtype == torch.complex128 else torch.complex64
    return torch.float64 if param.dtype == torch.float64 else torch.float32


def _is_dtensor(t: Tensor) -> bool:
    # Only FSDP2 / tensor-parallel users have DTensors, and they have imported the module.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _kernel_view(t: Tensor) -> Tensor:
    """What a backend sees of a parameter, gradient, buffer or state tensor: a DTensor's local
    shard (FSDP2: every operation of the window is elementwise, so each rank updates its own
    shard), complex tensors as real ones with a trailing dimension of 2, as torch.optim's own
    implementations do (torch.view_as_real). Views: writes reach the original."""
    if _is_dtensor(t):
        t = t.to_local()
    return torch.view_as_real(t) if t.is_complex() else t


def _like_param(local: Tensor, param: Tensor) -> Tensor:
    """A state tensor a backend created from local shards, given the parameter's global layout
    back (a DTensor for a DTensor parameter, complex for a complex one), as torch.optim's own
    state would have it."""
    if param.is_complex() and not local.is_complex():
        local = torch.view_as_complex(local)
    if _is_dtensor(param) and not _is_dtensor(local):
        from torch.distributed.tensor import DTensor
        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return local


def _called_from_torch_checkpoint(function: str) -> bool:
    """Whether torch.distributed.checkpoint.state_dict's ``function`` is on the call stack (a
    few frames up). Its get/set_optimizer_state_dict call step() with zero gradients and lr 0
    to create state (``_init_optim_state``), which must not count as a micro-batch, and keep
    only "state" and "param_groups" of state_dict() (``_get_optim_state_dict``). step() asks
    every micro-batch: without that module imported, no stack is walked."""
    if "torch.distributed.checkpoint.state_dict" not in sys.modules:
        return False
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == function and code.co_filename.replace("\\", "/").endswith("checkpoint/state_dict.py"):
            return True
        frame = frame.f_back
    return False


def _weight_band(weight: float) -> int:
    return _WEIGHT_BAND * math.floor(math.frexp(weight)[1] / _WEIGHT_BAND)


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


class _Window:
    """The open accumulation window and the counters derived from it: the one object that
    step(), flush(), state_dict() and cross-rank sync share. It is changed in place and never
    re-bound, so a framework wrapper that copies the optimizer's ``__dict__`` (Lightning's
    LightningOptimizer) reaches the same window instead of splitting it.

    ``buffers[p]`` holds the weighted gradient sum of the open window in ``_state_dtype(p)``, in
    units of ``2**weight_shift``; ``live`` holds the parameters that received a gradient in the
    open window (their buffers are live; every other buffer is stale and the next gradient
    overwrites it, so no zeroing pass is ever needed).
    """

    def __init__(self) -> None:
        self.buffers: dict[Tensor, Tensor] = {}
        self.live: set[Tensor] = set()
        self.micro_step = 0
        self.weight_sum = 0.0  # in units of 2**weight_shift
        self.weight_shift = 0
        self.found_inf: Tensor | None = None
        self.updated = False
        self.update_count = 0
        self.last_grad_norm: Tensor | None = None
        # The next micro-batch's weight, given before its gradients arrive
        # (set_micro_batch_weight, opt.backward), and the backward pass adding it (in_backward).
        self.pending_weight: float | None = None
        # opt.backward() ran for the pending micro-batch and step() has not taken it yet (with
        # FSDP2 its weight then scaled the loss: the gradient already carries it).
        self.backward_done = False
        # FSDP2, per micro-batch of the window: its weight when given only after backward (None
        # when it scaled the loss), which ShardSync checks is equal on every rank; and whether a
        # micro-batch's gradients were held back by FSDP (set_requires_gradient_sync(False)), so
        # that they arrive summed with a later one's and take that one's weight.
        self.late_weights: list[float | None] = []
        self.grads_held = False
        self.backward_pass: _BackwardPass | None = None
        # Buffers that are autograd's own gradient tensors (in_backward zero-copy): dropped when
        # the window closes, since the next window adopts fresh ones (resident 12 B/param for
        # fp32 AdamW, as the native loop after zero_grad, instead of 16).
        self.adopted: set[Tensor] = set()

    def close(self) -> None:
        for p in self.adopted:
            del self.buffers[p]
        self.adopted.clear()
        self.live.clear()
        self.late_weights.clear()
        self.grads_held = False
        self.micro_step, self.weight_sum, self.weight_shift, self.found_inf = 0, 0.0, 0, None


def _window_view(name: str, doc: str) -> property:
    def get(self):
        return getattr(self._window, name)

    def set_(self, value):
        setattr(self._window, name, value)

    return property(get, set_, doc=doc)


class _BackwardPass:
    """The micro-batch a running backward pass is adding (in_backward)."""

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
            optimizer._take_grad(param)
    return hook


def _remove_hooks(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class _AccumulatingOptimizer:
    """Window bookkeeping shared by SGD, Adam, AdamW and GradientAccumulator.

    The open window is ``self._window`` (a ``_Window``). Subclasses implement ``_apply_window``
    (SGD/Adam/AdamW: ``_update`` per backend call, gathering their state and calling the
    backend's update function; GradientAccumulator: write ``.grad``, inner step).

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
        self._window = _Window()
        self._sync: distributed.WindowSync | None = None
        self._hook_handles: list = []
        mesh = self._check_params(self._all_params())
        # FSDP2 (DTensor parameters): the ranks of the mesh agree once per window (ShardSync).
        self._shards = None if mesh is None else distributed.ShardSync(mesh, type(self).__name__)
        if process_group is not None:
            self._sync = distributed.WindowSync(process_group, type(self).__name__)
            self._sync.add_params(self._all_params(), _state_dtype)
            self._window.buffers = self._sync.buffers
        else:
            distributed.warn_if_ddp_without_sync(type(self).__name__, self._all_params())
        if in_backward:
            self._register_hooks(self._all_params())
            # Hooks hold the optimizer weakly; when it is collected they go with it.
            weakref.finalize(self, _remove_hooks, self._hook_handles)

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
        self._sync_new_group()

    def _add_group(self, param_group) -> None:
        super().add_param_group(param_group)

    def _check_params(self, tensors):
        """Refuse, before anything changes, parameters no backend can run correctly. Returns
        the FSDP2 device mesh when the parameters are DTensors, else None."""
        tensors = [t for t in tensors if isinstance(t, Tensor)]
        if getattr(self, "_shards", None) is None and not any(_is_dtensor(t) for t in tensors):
            return None
        if self.process_group is not None:
            raise NotImplementedError(
                f"{type(self).__name__} got DTensor parameters (FSDP2) and a process_group: FSDP2 reduces the "
                "gradients itself, and accum_fused agrees with the other ranks over the parameters' mesh; "
                "leave process_group unset"
            )
        owned = self._all_params() if hasattr(self, "_window") else []
        return distributed.shard_mesh(owned + tensors, type(self).__name__)

    def _sync_new_group(self) -> None:
        # During torch's __init__ there is no _sync yet: _init_accumulation registers all groups.
        if getattr(self, "_sync", None) is not None:
            self._sync.add_params(self.param_groups[-1]["params"], _state_dtype)
        if getattr(self, "in_backward", False):
            self._register_hooks(self.param_groups[-1]["params"])

    def _all_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _param_name(self, p: Tensor) -> str:
        index = next(i for i, q in enumerate(self._all_params()) if q is p)
        return f"parameter {index} (shape {tuple(p.shape)}, {p.dtype}, {p.device})"

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

    def _check_fused_groups(self, pairs) -> None:
        """fused=True is accepted (every backend call is one fused pass) and validated as torch
        does at step(): floating-point parameters on a device torch's fused kernels support."""
        fused = {p for group in self.param_groups if group.get("fused") for p in group["params"]}
        if fused:
            from torch.optim.optimizer import _device_dtype_check_for_fused  # torch's own message
            for p, _ in pairs:
                if p in fused:
                    _device_dtype_check_for_fused(p)

    def _backend_for(self, param: Tensor):
        return backends.resolve(self.backend, param.device, param.dtype.to_real())

    def _conform_to_params(self, params, closing: bool) -> None:
        """Validate before anything changes. A parameter whose dtype or device changed after
        construction (``model.double()``, ``model.to(...)``) carries its buffer and state
        along (value-preserving: widening is exact; narrowing rounds what the user narrowed);
        what cannot follow (a changed shape, flat cross-rank buffers) raises here."""
        win = self._window
        for p in params:
            buf = win.buffers.get(p)
            if buf is not None and (buf.dtype != _state_dtype(p) or buf.device != p.device or buf.shape != p.shape):
                if self._sync is not None:
                    raise RuntimeError(
                        f"{self._param_name(p)} changed dtype, device or shape after this {type(self).__name__} "
                        "was built with a process_group, whose buffers are fixed: convert the model before "
                        "building the optimizer"
                    )
                if p not in win.live:
                    del win.buffers[p]  # stale: the next gradient allocates a fresh one
                elif buf.shape != p.shape:
                    raise RuntimeError(f"{self._param_name(p)} changed shape in the middle of a window")
                else:
                    win.buffers[p] = buf.to(device=p.device, dtype=_state_dtype(p))
            if not closing:
                continue
            state = self.state.get(p, {})
            for key in _ELEMENTWISE_STATE:
                value = state.get(key)
                if not isinstance(value, Tensor):
                    continue
                if value.shape != p.shape:
                    raise ValueError(
                        f"optimizer state {key!r} of {self._param_name(p)} has shape {tuple(value.shape)}: the "
                        "loaded state_dict belongs to another model; load one saved from this model's optimizer"
                    )
                if value.dtype != _state_dtype(p) or value.device != p.device:
                    state[key] = value.to(device=p.device, dtype=_state_dtype(p))

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
        if _called_from_torch_checkpoint("_init_optim_state"):
            self._init_state_for_checkpoint()
            return None
        win = self._window
        if weight is not None:
            weight = _check_weight(weight)
            if win.backward_done:
                raise ValueError("this micro-batch's weight was given to backward(loss, weight=...): call step() "
                                 "without weight=")
        if self.in_backward:
            self._check_in_backward_step(1.0 if weight is None else weight)
        self._refuse_scaler_when_sharded()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if weight is None:
            weight = 1.0 if win.pending_weight is None else win.pending_weight
        in_loss = win.backward_done and self._shards is not None
        pairs = self._collect_grads()
        self._check_fused_groups(pairs)
        closing = win.micro_step + 1 >= self.accumulation_steps
        self._conform_to_params([p for p, _ in pairs] + list(win.live), closing)
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            # Sum on the device: no host synchronisation per micro-batch.
            found = found_inf.detach().float()
            found_inf = found if win.found_inf is None else win.found_inf + found
        else:
            found_inf = win.found_inf
        weight = self._enter_weight(weight)
        grad_weight = 1.0 if in_loss else weight  # FSDP2: opt.backward scaled the loss by it
        # Nothing above changed the window's meaning; from here on the micro-batch is taken.
        win.pending_weight = None
        win.backward_done = False
        win.micro_step += 1
        # in_backward mode A: the buffers hold the sum of the loop's backward passes (what
        # autograd would have summed into .grad), so the window's divisor is 1.
        win.weight_sum = 1.0 if self.in_backward else win.weight_sum + weight
        win.found_inf = found_inf
        if self._shards is not None and not self.in_backward:  # (in_backward mode A sums: no weights)
            win.late_weights.append(None if in_loss else weight)
            win.grads_held |= not pairs
        if not closing:
            self._accumulate(pairs, grad_weight, grad_scale)
            win.updated = False
        elif self._folds_last_micro_batch and self.max_grad_norm is None and not self._spans_ranks():
            # The last micro-batch is folded into the update pass (one pass over the bytes).
            win.updated = self._finish_window(pairs, grad_weight, grad_scale)
        else:
            # Clipping needs the whole window's norm first: the last accumulate pass returns it
            # (across ranks the norms are measured on the reduced sums instead).
            local_norms = self.max_grad_norm is not None and not self._spans_ranks()
            norms = self._accumulate(pairs, grad_weight, grad_scale,
                                     norm_weight_sum=win.weight_sum if local_norms else None)
            win.updated = self._finish_window([], grad_weight, None, norms)
        if self.accumulation_steps > 1:
            for p, _ in pairs:
                p.grad = None
        return loss

    def _spans_ranks(self) -> bool:
        """Whether closing a window needs the other ranks (process_group, FSDP2)."""
        return self._sync is not None or self._shards is not None

    def _refuse_scaler_when_sharded(self) -> None:
        if self._shards is not None and getattr(self, "found_inf", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__} with FSDP2 parameters cannot be driven by torch.amp.GradScaler: GradScaler "
                "checks each rank's own shards for non-finite values and updates its scale per rank, so the ranks' "
                "scales drift apart. Use bf16 (MixedPrecisionPolicy(param_dtype=torch.bfloat16)); accum_fused "
                "skips a window with a non-finite value on any rank on every rank"
            )

    def _enter_weight(self, weight: float) -> float:
        """``weight`` in the window's units (see _WEIGHT_BAND), moving the window to a higher
        band first when this weight would not fit the current one. With FSDP2 the units stay 1:
        opt.backward puts the weight into the loss, before the ranks' gradients are summed."""
        win = self._window
        if self._shards is not None:
            return weight
        band = _weight_band(weight)
        if win.micro_step == 0:
            win.weight_shift = band
        elif band - win.weight_shift >= _WEIGHT_HEADROOM:
            factor = math.ldexp(1.0, win.weight_shift - band)
            live = [win.buffers[p] for p in win.live]
            if live:
                torch._foreach_mul_(live, factor)
            win.weight_sum *= factor
            win.weight_shift = band
        return math.ldexp(weight, -win.weight_shift)

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
        pending = win.micro_step > 0 or self._spans_ranks()
        if self.in_backward and self.accumulation_steps == 1:
            win.weight_sum = 1.0 if win.live else 0.0  # mode A: a sum (see step)
        if pending:
            self._conform_to_params(list(win.live), closing=True)
        win.updated = self._finish_window([], 1.0, None, flushing=True) if pending else False
        return win.updated

    # ------------------------------------------------------------------------ in_backward
    # A post-accumulate-grad hook per parameter takes each fresh gradient into the window and
    # frees .grad. The first hook of a backward pass opens the micro-batch (_BackwardPass) and
    # queues _end_backward_pass on the autograd engine, which counts it and, on the window's
    # last micro-batch, finishes the update. Without clipping or a process group, each
    # parameter of the last micro-batch is updated inside its own hook (its last gradient
    # fused into the update); otherwise the whole window is updated at the end of backward.

    def _register_hooks(self, params) -> None:
        hook = _make_grad_hook(weakref.ref(self))
        for p in params:
            if p.requires_grad:
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
        self._group_of = {p: group for group in self.param_groups for p in group["params"]}

    def _check_in_backward_step(self, weight: float) -> None:
        if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(
                f"{type(self).__name__}(in_backward=True) cannot be driven by torch.amp.GradScaler: GradScaler "
                "finds non-finite gradients by reading .grad, which in_backward frees inside backward. Use bf16 "
                "autocast (no scaler needed), or in_backward=False with GradScaler"
            )
        if self.accumulation_steps > 1:
            raise RuntimeError(
                f"{type(self).__name__}(in_backward=True, accumulation_steps={self.accumulation_steps}) applies the "
                "update inside the window's last backward pass: call opt.backward(loss, weight=...) per "
                "micro-batch and no step() (or use accumulation_steps=1 and step() where your loop updates)"
            )
        if weight != 1.0:
            raise ValueError(
                "step(weight=...) has no meaning with in_backward=True and accumulation_steps=1: the gradients "
                "were summed during backward, as autograd sums .grad; scale the loss instead"
            )
        if self._window.backward_pass is not None:
            raise RuntimeError("step() was called inside a backward pass; call it after backward returns")

    def set_micro_batch_weight(self, weight: float | Tensor) -> None:
        """The weight of the micro-batch being accumulated now, for loops that call ``step()``
        or ``loss.backward()`` without one (HF Trainer, Lightning, accelerate): the next
        ``step()`` without ``weight=`` (also one whose closure calls this) or, with
        ``in_backward``, the next backward pass uses it. Validated here."""
        weight = _check_weight(weight)
        if self.in_backward and self.accumulation_steps == 1 and weight != 1.0:
            raise ValueError("with in_backward=True and accumulation_steps=1 the backward passes are summed: "
                             "a micro-batch weight has no meaning there (scale the loss instead)")
        if self._shards is not None and self.in_backward and weight != 1.0:
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
        if self._shards is not None and weight != 1.0:
            loss = loss * weight  # before FSDP2's reduce-scatter averages the ranks' gradients
        if not self.in_backward:
            if win.backward_done:
                raise RuntimeError(f"{type(self).__name__}.backward() was called twice without step() in between: "
                                   "autograd would add both micro-batches into .grad under one weight")
            torch.autograd.backward(loss, **backward_kwargs)
            win.pending_weight, win.backward_done = weight, True
            return
        if self.accumulation_steps == 1 and weight != 1.0:
            raise ValueError("with in_backward=True and accumulation_steps=1 the backward passes are summed: "
                             "weight must be 1 (scale the loss instead), or set accumulation_steps")
        if win.backward_pass is not None:
            raise RuntimeError("opt.backward() was called inside another backward pass")
        win.pending_weight = weight
        try:
            torch.autograd.backward(loss, **backward_kwargs)
            if self._window.pending_weight is not None:
                # No parameter of this optimizer received a gradient (FSDP2 may hold them back
                # for a later backward): still one micro-batch.
                self._window.grads_held |= self._shards is not None
                self._begin_backward_pass()
                self._end_backward_pass()
        finally:
            self._window.pending_weight = None
            self._window.backward_pass = None

    @torch.no_grad()
    def _take_grad(self, p: Tensor) -> None:
        """The post-accumulate-grad hook's work for ``p``."""
        grad = p.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__}(in_backward=True) does not support sparse gradients; "
                               "use nn.Embedding(sparse=False)")
        mb = self._window.backward_pass
        if mb is None:
            mb = self._begin_backward_pass()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_pass)
        if p in mb.seen:
            raise RuntimeError(
                f"{self._param_name(p)} received two gradients in one backward pass (its post-accumulate-grad hook "
                "fired twice, e.g. under compiled autograd or a reentrant checkpoint): in_backward cannot tell "
                "its micro-batches apart; use in_backward=False"
            )
        mb.seen.add(p)
        p.grad = None
        win = self._window
        if mb.fold:
            live = p in win.live
            buf = _kernel_view(self._buffer(p))
            self._update(self._backend_for(p), self._group_of[p], [p], [buf], weight_sum=mb.weight_sum,
                         clip_coef=None, grads=[_kernel_view(grad)], weight=mb.weight, overwrite=not live, grad_scale=None)
            mb.done.add(p)
        elif p not in win.live and self._can_adopt(p, grad, mb.weight):
            win.buffers[p] = grad  # zero-copy: autograd's fresh gradient becomes the buffer
            win.adopted.add(p)
            win.live.add(p)
        else:
            self._backend_for(p).accumulate(grads=[_kernel_view(grad)], buffers=[_kernel_view(self._buffer(p))],
                                            weight=mb.weight, overwrite=p not in win.live)
            win.live.add(p)
        if mb.closing and self._sync is not None:
            self._sync.grad_ready(p)  # may launch its bucket's all-reduce while backward goes on

    def _can_adopt(self, p: Tensor, grad: Tensor, weight: float) -> bool:
        """Whether the first gradient of a window can be the buffer itself: the same dtype and
        layout, weight 1, nothing else holding it (a view may be DDP's bucket), no flat buffers."""
        return (weight == 1.0 and self._sync is None and grad.dtype == _state_dtype(p) and grad.device == p.device
                and grad._base is None and grad.is_contiguous() and p.is_contiguous()
                and not _is_dtensor(grad))  # FSDP2's shards are views of one reduce-scatter output

    def _begin_backward_pass(self) -> _BackwardPass:
        win = self._window
        weight = 1.0 if self._window.pending_weight is None else self._window.pending_weight
        self._window.pending_weight = None
        sums = self.accumulation_steps == 1  # mode A: the loop owns the window
        closing = not sums and win.micro_step + 1 >= self.accumulation_steps
        self._conform_to_params(list(win.live), closing)
        if sums:
            win.weight_shift = 0
        else:
            weight = self._enter_weight(weight)
        if closing and self._sync is not None:
            # The window's weights and flags are all known now: exchange them before the last
            # gradients arrive, so that the hooks can all-reduce buckets during this backward
            # (distributed.py). The ranks' common weight band becomes the window's.
            shift = self._sync.begin_overlapped_window(self._all_params(), win.live, win.weight_sum + weight,
                                                       win.weight_shift)
            weight, win.weight_sum = (math.ldexp(x, win.weight_shift - shift) for x in (weight, win.weight_sum))
            win.weight_shift = shift
        fold = closing and self.max_grad_norm is None and not self._spans_ranks()
        # With FSDP2, opt.backward scaled the loss by the weight: the gradients carry it.
        grad_weight = 1.0 if self._shards is not None else weight
        self._window.backward_pass = _BackwardPass(grad_weight, win.weight_sum + weight, closing, fold)
        return self._window.backward_pass

    @torch.no_grad()
    def _end_backward_pass(self) -> None:
        """Queued on the autograd engine by the first hook: runs once the backward pass is done."""
        mb, self._window.backward_pass = self._window.backward_pass, None
        if mb is None:
            return
        win = self._window
        win.micro_step += 1
        win.weight_sum = mb.weight_sum
        if self._shards is not None and self.accumulation_steps > 1:
            win.late_weights.append(None)  # opt.backward put the weight into the loss
        if not mb.closing:
            win.updated = False
            return
        if not mb.fold:
            win.updated = self._finish_window([], mb.weight, None)
            return
        # Parameters updated in their hooks are done; the window's others (no gradient in its
        # last micro-batch) are updated here.
        try:
            win.live -= mb.done
            if win.live:
                self._apply_window({}, mb.weight, None, mb.weight_sum, None)
            win.updated = bool(mb.done or win.live)
            win.update_count += win.updated
        finally:
            win.close()

    def _accumulate(self, pairs, weight: float, grad_scale: Tensor | None, norm_weight_sum: float | None = None):
        """Add one micro-batch into the buffers. With ``norm_weight_sum``, also return
        {param: ||acc / norm_weight_sum||} for the parameters accumulated here."""
        calls = defaultdict(list)
        for p, grad in pairs:
            overwrite = p not in self._window.live
            calls[(p.device, p.dtype, grad.dtype, overwrite)].append((p, grad))
        norms = {}
        for (_, _, _, overwrite), items in calls.items():
            call_norms = self._backend_for(items[0][0]).accumulate(
                grads=[_kernel_view(g) for _, g in items],
                buffers=[_kernel_view(self._buffer(p)) for p, _ in items],
                weight=weight,
                overwrite=overwrite,
                grad_scale=grad_scale,
                norm_weight_sum=norm_weight_sum,
            )
            if call_norms is not None:
                norms.update(zip([p for p, _ in items], call_norms.unbind()))
        self._window.live.update(p for p, _ in pairs)
        return norms

    def _buffer(self, p: Tensor) -> Tensor:
        buf = self._window.buffers.get(p)
        if buf is None:
            buf = self._window.buffers[p] = torch.empty_like(p, dtype=_state_dtype(p),
                                                             memory_format=torch.preserve_format)
        return buf

    def _finish_window(self, last_pairs, last_weight: float, grad_scale: Tensor | None, norms=None,
                       flushing: bool = False) -> bool:
        """Close the window: skip it if GradScaler saw a non-finite micro-batch or no parameter
        received a gradient, otherwise clip and update. ``last_pairs`` is the last micro-batch,
        not yet accumulated; ``norms`` the per-parameter window-gradient norms already computed."""
        win = self._window
        weight_sum = win.weight_sum
        clip_coef = None
        if self._sync is not None:
            weight_sum, skip, live = self._sync.reduce_window(
                self._all_params(), win.live, weight_sum, win.weight_shift, win.found_inf, flushing)
            win.live.clear()
            win.live.update(live)
        elif self._shards is not None:
            weight_sum, skip, clip_coef = self._close_sharded_window(weight_sum, flushing)
        else:
            skip = win.found_inf is not None and bool(win.found_inf.item() > 0)
        # An empty window (no gradient anywhere: no micro-batch on any rank, or only None grads)
        # is not an update, as torch.optim's step without gradients changes nothing.
        applied = not skip and weight_sum > 0 and bool(win.live or last_pairs)
        try:
            if applied:
                if self.max_grad_norm is not None and clip_coef is None:
                    clip_coef = self._clip_coefficient(weight_sum, norms or {})
                self._apply_window(dict(last_pairs), last_weight, grad_scale, weight_sum, clip_coef)
                win.update_count += 1
        finally:
            win.close()
        return applied

    def _close_sharded_window(self, weight_sum: float, flushing: bool) -> tuple[float, bool, Tensor | None]:
        """FSDP2: agree with the mesh's other ranks on the window (see distributed.ShardSync).
        Returns (the divisor W / N, skip, clip coefficient or None). The window's global norm is
        measured whether or not it clips, so that a non-finite value in any rank's shard skips
        the window on every rank instead of updating some shards and not others."""
        win = self._window
        if win.grads_held and len(set(win.late_weights)) > 1:  # late weights, or late and in-loss mixed
            raise RuntimeError(
                "a micro-batch's gradients were held back by FSDP2 (set_requires_gradient_sync(False)) and arrived "
                "summed with a later one's, but the window's weights, given after backward, differ: pass each "
                f"weight before its backward with {type(self).__name__}.backward(loss, weight=w), then step()"
            )
        by_kind = defaultdict(list)
        for p in self._all_params():
            if p in win.live:
                by_kind[(p.device, p.dtype)].append(p)
        sq_norm = None
        for params in by_kind.values():
            norms = self._backend_for(params[0]).window_norms(
                buffers=[_kernel_view(win.buffers[p]) for p in params], weight_sum=1.0)
            part = norms.to(torch.float64).square().sum()
            sq_norm = part if sq_norm is None else sq_norm + part.to(sq_norm.device)
        device = self._all_params()[0].device
        divisor, sq_norm = self._shards.reduce_window(device, weight_sum, sq_norm, flushing, win.late_weights,
                                                      self.accumulation_steps)
        if divisor <= 0:
            return divisor, False, None
        total_norm = (sq_norm.sqrt() / divisor).float()
        if not math.isfinite(total_norm.item()):
            return divisor, True, None
        if self.max_grad_norm is None:
            return divisor, False, None
        self.last_grad_norm = total_norm
        return divisor, False, torch.clamp(self.max_grad_norm / (total_norm + 1e-6), max=1.0)

    def _clip_coefficient(self, weight_sum: float, norms: dict[Tensor, Tensor]) -> Tensor:
        """min(max_grad_norm / (||g|| + 1e-6), 1) on the device, as clip_grad_norm_ computes
        it. ``norms`` has the per-parameter norms the last accumulate pass produced; the
        window's other parameters (no gradient in that micro-batch) are measured here."""
        live = [p for p in self._all_params() if p in self._window.live]
        missing = defaultdict(list)
        for p in live:
            if p not in norms:
                missing[(p.device, p.dtype)].append(p)
        for params in missing.values():
            measured = self._backend_for(params[0]).window_norms(
                buffers=[_kernel_view(self._window.buffers[p]) for p in params], weight_sum=weight_sum)
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
        live = self._window.live
        calls = defaultdict(list)
        for p in group["params"]:
            grad = last_grads.get(p)
            if grad is None and p not in live:
                continue  # no gradient all window: left alone, as torch leaves it
            self._buffer(p)
            fold = None if grad is None else (grad.dtype, p not in live)
            calls[(p.device, p.dtype, self._call_key(p), fold)].append(p)
        for (_, _, _, fold), params in calls.items():
            last = {}
            if fold is not None:
                last = dict(grads=[_kernel_view(last_grads[p]) for p in params], weight=last_weight,
                            overwrite=fold[1], grad_scale=grad_scale)
            self._update(self._backend_for(params[0]), group, params,
                         [_kernel_view(self._window.buffers[p]) for p in params],
                         weight_sum=weight_sum, clip_coef=clip_coef, **last)

    def _call_key(self, p: Tensor):
        """Extra key for parameters that cannot share one backend call (none by default)."""
        return None

    def _update(self, backend, group, params, buffers, **window) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------------- state_dict
    _ACCUMULATION_ATTRS = ("accumulation_steps", "max_grad_norm", "backend", "_window", "process_group", "_sync",
                           "in_backward", "_hook_handles")

    def __getstate__(self) -> dict[str, Any]:
        # torch's __getstate__ keeps only defaults/state/param_groups; copy.deepcopy and
        # pickle must keep the open window too.
        self._refuse_copy_when_synced()
        return {**super().__getstate__(), **{k: getattr(self, k) for k in self._ACCUMULATION_ATTRS}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for key in ("process_group", "_sync"):  # pickled by older versions
            self.__dict__.setdefault(key, None)
        self.__dict__.setdefault("in_backward", False)
        self.__dict__.setdefault("_hook_handles", [])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's zero_grad; with in_backward and accumulation_steps=1 it also empties the
        buffers, which hold what .grad would have held (with k > 1 the window is the optimizer's)."""
        super().zero_grad(set_to_none)
        if (getattr(self, "in_backward", False) and self.accumulation_steps == 1
                and not _called_from_torch_checkpoint("_init_optim_state")):  # clearing its own zero grads
            self._window.close()

    def _refuse_copy_when_synced(self) -> None:
        if getattr(self, "in_backward", False):
            raise TypeError(
                f"a {type(self).__name__} with in_backward=True cannot be pickled or deep-copied (its hooks live on "
                "the model's parameters); save and load its state_dict() instead"
            )
        if self._sync is not None:
            raise TypeError(
                f"a {type(self).__name__} with a process_group cannot be pickled or deep-copied (a process "
                "group is a live connection); save and load its state_dict() instead"
            )

    def state_dict(self) -> dict[str, Any]:
        """torch's state_dict plus an ``"accumulation"`` entry with the open window: its
        buffers (by parameter index, as in ``"state"``), counters and GradScaler flag. With
        FSDP2 parameters the window is carried inside "state" and "param_groups" instead (see
        _window_inside_state)."""
        return self._finish_state_dict({**super().state_dict(), "accumulation": self._accumulation_entry()})

    def _init_state_for_checkpoint(self) -> None:
        """torch.distributed.checkpoint's stand-in for a first step: create the state a first
        update would, so that a fresh optimizer's state_dict is a load template; the window,
        parameters and step counts stay as they are."""

    def _finish_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._shards is not None:
            return self._window_inside_state(state_dict)
        if self._window.micro_step > 0 and _called_from_torch_checkpoint("_get_optim_state_dict"):
            raise RuntimeError(
                f"torch.distributed.checkpoint's get_optimizer_state_dict keeps only 'state' and 'param_groups' of "
                f"{type(self).__name__}.state_dict(), so this open window ({self._window.micro_step} micro-batches) "
                "would be lost: save at a window boundary (after the update or flush()), or save opt.state_dict() "
                "itself (torch.save)"
            )
        return state_dict

    def _window_inside_state(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """FSDP2 users checkpoint with torch.distributed.checkpoint (get/set_optimizer_state_dict,
        dcp.save/load), which keeps only "state" and "param_groups". So the window rides there:
        each parameter's buffer as "accumulation_buffer" in its state (a DTensor, saved sharded;
        for every parameter, so that a fresh optimizer's state_dict is a load template for any
        checkpoint), whether it is live as "accumulation_live", and the counters as the first
        group's "accumulation". load_state_dict takes them back out."""
        if self._window.grads_held:
            raise RuntimeError(
                "FSDP2 holds gradients of this open window (set_requires_gradient_sync(False)), which no checkpoint "
                "saves: checkpoint at a window boundary (after the update or flush())"
            )
        entry = state_dict.pop("accumulation")
        state = dict(state_dict["state"])
        for index, p in enumerate(self._all_params()):
            if p.requires_grad:
                state[index] = {**state.get(index, {}), "accumulation_buffer": self._buffer(p),
                                "accumulation_live": torch.tensor(float(index in entry["buffers"]))}
        # The counters every rank shares as plain numbers: DCP saves a group's values as bytes
        # (once, not per rank), and a load template (a fresh optimizer's, whose norm is None)
        # must have the same kind of entry as the checkpoint. The rank's own weights as a
        # DTensor with one shard per rank, [weight sum, then (given, weight) per micro-batch].
        local = [entry.pop("weight_sum")]
        for weight in entry.pop("late_weights") + [None] * (self.accumulation_steps - len(self._window.late_weights)):
            local += [0.0, 0.0] if weight is None else [1.0, weight]
        del entry["grads_held"]  # False: refused above
        from torch.distributed.tensor import DTensor, Shard
        mesh = self._shards.mesh
        entry["rank_weights"] = DTensor.from_local(
            torch.tensor(local, dtype=torch.float64, device=mesh.device_type), mesh, [Shard(0)], run_check=False)
        groups = [dict(group) for group in state_dict["param_groups"]]
        groups[0]["accumulation"] = {key: value.item() if isinstance(value, Tensor) and not _is_dtensor(value) else value
                                     for key, value in entry.items() if key != "buffers"}
        return {**state_dict, "state": state, "param_groups": groups}

    @staticmethod
    def _window_out_of_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The inverse of _window_inside_state: (state_dict as torch.optim has it, the
        "accumulation" entry), or the state_dict unchanged and None when it carries no window."""
        groups = state_dict.get("param_groups") or [{}]
        if "accumulation" not in groups[0]:
            return state_dict, None
        groups = [dict(group) for group in groups]
        entry = {**groups[0].pop("accumulation"), "buffers": {}}
        for key in ("found_inf", "last_grad_norm"):
            if entry.get(key) is not None:
                entry[key] = torch.tensor(entry[key], dtype=torch.float32)
        local = entry.pop("rank_weights").to_local().tolist()
        entry["weight_sum"] = local[0]
        entry["late_weights"] = [weight if given else None for given, weight in zip(local[1::2], local[2::2])]
        del entry["late_weights"][entry["micro_step"]:]
        state = {}
        for index, saved in state_dict["state"].items():
            saved = dict(saved)
            buffer, live = saved.pop("accumulation_buffer", None), saved.pop("accumulation_live", None)
            if live is not None and float(live) > 0:
                entry["buffers"][index] = buffer
            if saved:
                state[index] = saved
        return {**state_dict, "state": state, "param_groups": groups}, entry

    def _accumulation_entry(self) -> dict[str, Any]:
        win = self._window
        index = {p: i for i, p in enumerate(self._all_params())}
        return {
            "accumulation_steps": self.accumulation_steps,
            "micro_step": win.micro_step,
            "weight_sum": win.weight_sum,
            "weight_shift": win.weight_shift,
            "update_count": win.update_count,
            "updated": win.updated,
            "found_inf": win.found_inf,
            "last_grad_norm": win.last_grad_norm,
            "late_weights": list(win.late_weights),
            "grads_held": win.grads_held,
            "buffers": {index[p]: win.buffers[p] for p in win.live},
        }

    def _split_accumulation_entry(self, state_dict: dict[str, Any]):
        """(state_dict without "accumulation", that entry or None, {saved param id: param}),
        the entry checked against this optimizer before anything is loaded."""
        state_dict = dict(state_dict)
        accumulation = state_dict.pop("accumulation", None)
        if accumulation is None:
            state_dict, accumulation = self._window_out_of_state(state_dict)
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = self._all_params()
        by_id = dict(zip(saved_ids, params)) if len(saved_ids) == len(params) else {}
        if accumulation is not None:
            self._check_accumulation_entry(accumulation, by_id)
        return state_dict, accumulation, by_id

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state_dict (resuming mid-window exactly) or a torch.optim one of the
        same class (migration: the window starts empty, state is widened to fp32).

        torch's load_state_dict runs as it is, so load_state_dict pre and post hooks see and
        change exactly what they do on torch.optim; torch casts floating state to the parameter
        dtype, so for reduced-precision parameters the wide state is put back from the loaded
        values (by a post hook that runs before the user's)."""
        torch_state_dict, accumulation, by_id = self._split_accumulation_entry(state_dict)
        if "accumulation" in state_dict:
            torch_state_dict = state_dict  # torch ignores the entry; hooks see it as saved
        loaded = {}

        def capture(optimizer, final_state_dict):  # registered last: sees the user's pre hooks' result
            loaded["state_dict"] = final_state_dict

        def keep_state_wide(optimizer):  # registered first: runs before the user's post hooks
            final = loaded["state_dict"]
            saved_ids = chain.from_iterable(g["params"] for g in final["param_groups"])
            for param_id, p in zip(saved_ids, self._all_params()):
                entry, p_state = final["state"].get(param_id), self.state.get(p)
                if not isinstance(entry, dict) or not isinstance(p_state, dict):
                    continue
                for key in self._wide_state_keys:
                    if isinstance(entry.get(key), Tensor) and key in p_state:
                        p_state[key] = entry[key].to(device=p.device, dtype=_state_dtype(p))
                step = p_state.get("step")
                if isinstance(step, Tensor) and step.device.type != "cpu":
                    p_state["step"] = step.cpu()  # read every update: keep it off the device

        pre = self.register_load_state_dict_pre_hook(capture)
        post = self.register_load_state_dict_post_hook(keep_state_wide, prepend=True)
        try:
            super().load_state_dict(torch_state_dict)  # validates groups first
        finally:
            pre.remove()
            post.remove()
        self._restore_window(accumulation, by_id)

    def _restore_window(self, accumulation: dict[str, Any] | None, by_id: dict) -> None:
        """Reopen the saved window (or start an empty one when the checkpoint has none)."""
        win = self._window
        win.close()
        if accumulation is None:
            return
        win.micro_step = accumulation["micro_step"]
        win.weight_sum = accumulation["weight_sum"]
        win.weight_shift = accumulation.get("weight_shift", 0)  # saved before weight bands: 0
        win.update_count = accumulation["update_count"]
        win.updated = accumulation["updated"]
        win.late_weights[:] = accumulation.get("late_weights", [])
        win.grads_held = accumulation.get("grads_held", False)
        # Saved on the device the checkpoint was taken on: bring them to this optimizer's.
        device = self._all_params()[0].device if self._all_params() else torch.device("cpu")
        norm, found = accumulation["last_grad_norm"], accumulation["found_inf"]
        win.last_grad_norm = None if norm is None else norm.to(device)
        win.found_inf = None if found is None else found.to(device, copy=True)
        for param_id, saved in accumulation["buffers"].items():
            p = by_id[param_id]
            self._buffer(p).copy_(saved)
            win.live.add(p)

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
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p, dtype=_state_dtype(p))

    def _update(self, backend, group, params, buffers, **window) -> None:
        momentum = _as_float(group["momentum"])
        # .get on the defaultdict: SGD without momentum keeps no per-parameter entry, as torch.
        momentum_buffers = [_kernel_view(b) if b is not None else None
                            for b in (self.state.get(p, {}).get("momentum_buffer") for p in params)]
        backend.sgd_update(
            params=[_kernel_view(p) for p in params], buffers=buffers, momentum_buffers=momentum_buffers,
            lr=_lr(group), momentum=momentum, dampening=_as_float(group["dampening"]),
            weight_decay=_as_float(group["weight_decay"]), nesterov=group["nesterov"],
            maximize=group["maximize"], **window,
        )
        if momentum != 0:
            for p, momentum_buffer in zip(params, momentum_buffers):
                if self.state[p].get("momentum_buffer") is None:  # new: a backend made it from local shards
                    self.state[p]["momentum_buffer"] = _like_param(momentum_buffer, p)


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
            wide = dict(dtype=_state_dtype(p), memory_format=torch.preserve_format)
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
            params=[_kernel_view(p) for p in params], buffers=buffers,
            exp_avgs=[_kernel_view(s["exp_avg"]) for s in states], exp_avg_sqs=[_kernel_view(s["exp_avg_sq"]) for s in states],
            max_exp_avg_sqs=[_kernel_view(s["max_exp_avg_sq"]) for s in states] if amsgrad else [],
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
                buffers=[_kernel_view(self._window.buffers[p]) for p in params], grads=[_kernel_view(p.grad) for p in params],
                weight_sum=weight_sum, clip_coef=clip_coef)
        self.optimizer.step()
        if self.accumulation_steps > 1:
            # The window gradient was ours; a backward into it would add it to the next window.
            for params in calls.values():
                for p in params:
                    p.grad = None

    def __getstate__(self) -> dict[str, Any]:
        self._refuse_copy_when_synced()
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state_dict plus the ``"accumulation"`` entry (open window)."""
        return self._finish_state_dict({**self.optimizer.state_dict(), "accumulation": self._accumulation_entry()})

    def _init_state_for_checkpoint(self) -> None:
        self.optimizer.step()  # the zero gradients and lr 0 torch.distributed.checkpoint set

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our state_dict (mid-window resume) or a plain one of the inner optimizer."""
        state_dict, accumulation, by_id = self._split_accumulation_entry(state_dict)
        self.optimizer.load_state_dict(state_dict)
        self._restore_window(accumulation, by_id)
