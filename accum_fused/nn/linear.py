"""Linear weight (and bias) gradients written straight into an optimizer's window buffers.

Owns: ``fuse_linear_gradients(model, opt)``, which makes the ``nn.Linear`` layers of ``model``
whose weights ``opt`` (``in_backward=True``) takes compute their weight gradient in backward as
``buffer.addmm_(grad_out^T, input, alpha=w)`` (``beta=0`` on the window's first micro-batch:
no zeroing pass) instead of materialising it for autograd to hand over: Megatron-LM's
``gradient_accumulation_fusion``; on CUDA bf16/fp16 operands go to the GEMM as they are, with an
fp32 output (``torch.addmm(out_dtype=)``). The bias gradient (grad_out summed over the rows) is
summed in fp32 into its buffer the same way. The gradient then takes the same path through the backward
pass as a hook's (in_backward.take_written): the same micro-batch, weight, clipping norms,
failure handling and, on mode B's last micro-batch without clipping, the parameter's update
at the end of the pass. Where the extension's hooks are armed for the parameter (a pass's
gradients after its first) and the operands are fp32, they write it (HookState.write_linear, the
same ops) with no Python per gradient; take_written is the spec they are tested against.

Must not: change the buffers other than through the window (``Window.write_one`` calls the
writer), or change a layer's forward result: input gradients go through autograd as before, and
so does a bias the optimizer does not hold or another module shares.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import in_backward
from ..base import hooks_of, window_of
from ..layout import kernel_view


_LOW_PRECISION = (torch.bfloat16, torch.float16)

# torch.addmm(out_dtype=) is torch 2.8's (its aten overload "dtype"): before it, the operands are
# widened on CUDA too.
_ADDMM_HAS_OUT_DTYPE = "dtype" in torch.ops.aten.addmm.overloads()


def _gemm_into(buffer: Tensor, a: Tensor, b: Tensor, beta: float, alpha: float, native_out_dtype: bool) -> None:
    """buffer <- beta * buffer + alpha * (a @ b), in the buffer's fp32. ``native_out_dtype``
    (CUDA): bf16/fp16 operands go to the GEMM as they are, accumulating into an fp32 output
    (torch.addmm(out_dtype=), CUDA-only in torch, from 2.8); elsewhere they are widened first (on
    CPU addmm has no low-precision inputs with an fp32 output)."""
    if native_out_dtype and _ADDMM_HAS_OUT_DTYPE and a.dtype in _LOW_PRECISION and b.dtype == a.dtype:
        torch.addmm(buffer, a, b, out_dtype=buffer.dtype, beta=beta, alpha=alpha, out=buffer)
    else:
        buffer.addmm_(a.to(buffer.dtype), b.to(buffer.dtype), beta=beta, alpha=alpha)


class _WeightGradient:
    """The weight gradient grad_out^T @ input of one Linear call, computed only when asked:
    into a window buffer (``write``), or as a tensor for autograd (``tensor``)."""

    def __init__(self, grad_out: Tensor, inp: Tensor, autocast_dtype: torch.dtype | None):
        self.grad_out = grad_out.reshape(-1, grad_out.shape[-1])
        self.inp = inp.reshape(-1, inp.shape[-1])
        self.autocast_dtype = autocast_dtype

    def write(self, buffer: Tensor, weight: float, overwrite: bool) -> None:
        g, x = self.grad_out, self.inp
        if self.autocast_dtype is not None:  # the operands autocast's own GEMM would take
            g, x = g.to(self.autocast_dtype), x.to(self.autocast_dtype)
        _gemm_into(buffer, g.t(), x, beta=0.0 if overwrite else 1.0, alpha=weight, native_out_dtype=buffer.is_cuda)

    def write_in_extension(self, fast, param: Tensor) -> bool:
        """Written by the extension's hooks where they were armed for ``param`` (in_backward.FastPath.
        write_linear: no Python per gradient), with fp32 operands outside autocast."""
        return self.autocast_dtype is None and fast.write_linear(param, self.grad_out, self.inp)

    def tensor(self) -> Tensor:
        """What nn.Linear's backward would give autograd (in the autocast dtype under autocast)."""
        dtype = self.autocast_dtype or self.grad_out.dtype
        return self.grad_out.to(dtype).t() @ self.inp.to(dtype)


class _BiasGradient:
    """The bias gradient of one Linear call (grad_out summed over the rows), summed straight
    in the buffer's fp32 when written."""

    def __init__(self, grad_out: Tensor):
        self.grad_out = grad_out.reshape(-1, grad_out.shape[-1])

    def write(self, buffer: Tensor, weight: float, overwrite: bool) -> None:
        total = self.grad_out.sum(0, dtype=buffer.dtype)
        if overwrite:
            torch.mul(total, weight, out=buffer)
        else:
            buffer.add_(total, alpha=weight)

    def write_in_extension(self, fast, param: Tensor) -> bool:
        return fast.write_linear(param, self.grad_out, None)

    def tensor(self) -> Tensor:
        return self.grad_out.sum(0)


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, owner: "_Fused") -> Tensor:
        ctx.save_for_backward(x, weight, bias)
        ctx.owner = owner
        device = x.device.type
        ctx.autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w = weight.to(ctx.autocast) if ctx.autocast is not None else weight
            grad_x = grad_out @ w.to(grad_out.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = ctx.owner.take(ctx.owner.module.weight, weight, _WeightGradient(grad_out, x, ctx.autocast))
        if ctx.needs_input_grad[2]:
            gradient = _BiasGradient(grad_out)
            grad_b = ctx.owner.take(ctx.owner.module.bias, bias, gradient) if ctx.owner.fuse_bias else gradient.tensor()
        return grad_x, grad_w, grad_b, None


class _Fused:
    """One fused layer: its optimizer (weakly) and its own forward, put back by ``remove``."""

    def __init__(self, module: nn.Linear, opt, fuse_bias: bool) -> None:
        self.module = module
        self.optimizer = weakref.ref(opt)
        self.fuse_bias = fuse_bias

    def forward(self, x: Tensor) -> Tensor:
        m = self.module
        return _FusedLinear.apply(x, m.weight, m.bias, self)

    def take(self, param: Tensor | None, saved: Tensor, gradient) -> Tensor | None:
        """Hand ``gradient`` of ``param`` to the optimizer's window; what autograd gets instead
        (None when the window took it). ``saved``: the tensor the forward saw, ``param`` itself
        or, in a checkpoint's recomputation, a detached alias of it (the window knows the
        Parameter)."""
        opt = self.optimizer()
        same = param is not None and (param is saved or (
            param.data_ptr() == saved.data_ptr() and param.shape == saved.shape))
        # A collected or closed optimizer takes nothing: the gradient lands in .grad, as after
        # close() without fused layers.
        hooks = None if opt is None else hooks_of(opt)
        # (the pass's later gradients, where the extension's hooks are armed; else, and for the
        # pass's first, Python's take_written, the spec)
        fast = None if hooks is None else hooks.fast_path
        if same and fast is not None and gradient.write_in_extension(fast, param):
            return None
        with torch.no_grad():
            taken = hooks is not None and same and in_backward.take_written(hooks, param, gradient)
        return None if taken else gradient.tensor()


class FusedLinearHandle:
    """What ``fuse_linear_gradients`` did: ``fused`` (the layers' names); ``remove()`` gives
    them their own forward back."""

    def __init__(self, fused: dict[str, _Fused]) -> None:
        self._fused = fused
        self.fused = list(fused)

    def remove(self) -> None:
        for f in self._fused.values():
            if f.module.__dict__.get("forward") == f.forward:
                del f.module.forward
        self._fused.clear()


def fuse_linear_gradients(model: nn.Module, opt) -> FusedLinearHandle:
    """Route the weight and bias gradients of ``model``'s ``nn.Linear`` layers straight into
    ``opt``'s window buffers (see the module docstring). ``opt`` must take gradients inside backward
    (``in_backward=True``: mode A or B) on one process; layers whose weight ``opt`` does not
    hold, and subclasses of nn.Linear (MultiheadAttention's out_proj is used without its
    forward), keep their normal path. A weight tied to another module (an LM head sharing the
    embedding) is refused: its other gradient would arrive through autograd after the GEMM's;
    a bias ``opt`` does not hold, or one shared with another module, keeps its normal path.
    After ``opt.close()`` (or when it is collected) the layers hand autograd their gradients."""
    if not getattr(opt, "in_backward", False):
        raise ValueError(
            "fuse_linear_gradients needs an optimizer with in_backward=True: the plain mode reads .grad after "
            "backward, which a fused layer never materialises"
        )
    if window_of(opt, "fuse_linear_gradients").spans_ranks:
        raise ValueError("fuse_linear_gradients does not support several processes (process_group, DDP, FSDP2) yet")
    owned = set(opt.update_spec.params(opt))
    users: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), []).append(name or type(module).__name__)
    fused = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or module.weight not in owned:
            continue
        tied = users[id(module.weight)]
        if len(set(tied)) > 1:
            raise ValueError(
                f"the weight of {name!r} is shared with {sorted(set(tied) - {name})}: its other gradient would reach "
                "the window after the fused one; untie it, or fuse the other layers only "
                "(fuse_linear_gradients(submodule, opt))"
            )
        if kernel_view(module.weight) is not module.weight:
            raise ValueError(f"{name!r} has a complex or DTensor weight: not supported by fuse_linear_gradients")
        if isinstance(getattr(module.forward, "__self__", None), _Fused):
            raise ValueError(f"{name!r} is fused already: call the earlier handle's remove() first")
        bias = module.bias
        fuse_bias = (bias is not None and bias in owned and len(set(users[id(bias)])) == 1
                     and kernel_view(bias) is bias)
        fused[name] = _Fused(module, opt, fuse_bias)
    if not fused:
        raise ValueError(
            f"no nn.Linear of this {type(model).__name__} has its weight in this {type(opt).__name__}: pass the "
            "model whose parameters the optimizer was built with (subclasses of nn.Linear keep their own path)"
        )
    for f in fused.values():  # (after every check: a refused call changes nothing)
        f.module.forward = f.forward
    return FusedLinearHandle(fused)
