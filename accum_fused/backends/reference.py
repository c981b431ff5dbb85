"""Pure-PyTorch reference backend: THE specification every kernel is tested against.

Every function takes lists of tensors of one (device, parameter dtype) group and plain numbers,
keyword-only; compiled backends expose the same functions with the same signatures.

Notation, per parameter tensor i of the window (k micro-batches, weights w_j > 0):

    acc_i        fp32 accumulation buffer (fp64 for fp64 parameters)
    W            the window's weight total, sum_j w_j
    g_i          the window gradient, acc_i / W, times the clip coefficient c when clipping
    c            min(max_grad_norm / (||g||_2 + 1e-6), 1) over all parameters, as
                 torch.nn.utils.clip_grad_norm_ computes it

The update math runs in the buffer dtype (fp32, or fp64 for fp64 parameters): parameters are
read in their own dtype, widened, updated, and written back rounded once. The op sequence for
fp32 parameters is torch's single-tensor path (torch/optim/sgd.py, adam.py), so k=1 with
weight 1 reproduces torch.optim bit for bit on CPU. ``lr`` is a float or, when the user gave a
tensor lr, a 0-dim tensor used exactly as torch uses it (compiled backends take its value).

bf16 parameters are written back as ``bf16_update`` says (``_read_param`` / ``_write_param``):
``"nearest"`` (torch's rounding), ``"stochastic"`` (rounded up with probability equal to the
fraction of an ulp, from 16 bits of a hash of the element's memory offset and the tensor's
``rounding_keys`` entry: every backend draws the same bits), or ``"kahan"`` (the parameter is
p + c with c in ``compensations``, a bf16 tensor per parameter: the update reads p + c, writes
p rounded to nearest and c = the rest rounded to bf16).
"""
from __future__ import annotations

import torch
from torch import Tensor

name = "torch"


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """The reference runs wherever PyTorch does, for every floating dtype."""
    return dtype.is_floating_point


def accumulate(
    *,
    grads: list[Tensor],
    buffers: list[Tensor],
    weight: float,
    overwrite: bool,
    grad_scale: Tensor | None = None,
    norm_weight_sum: float | None = None,
) -> Tensor | None:
    """Add one micro-batch into the buffers.

        acc_i <- (0 if overwrite else acc_i) + weight * grad_i / grad_scale

    ``grad_scale`` is GradScaler's current scale (a 1-element tensor) or None when the
    gradients are not scaled. ``overwrite`` starts a window without a zeroing pass.
    With ``norm_weight_sum`` (the last micro-batch of a clipped window) it returns
    ``window_norms(buffers=buffers, weight_sum=norm_weight_sum)`` of the updated buffers:
    kernels compute those inside the accumulate pass.
    """
    for grad, buf in zip(grads, buffers):
        if weight == 1.0 and grad_scale is None:
            contribution = grad  # (g * 1 is g; a narrower gradient widens exactly as it is added)
        else:
            contribution = grad.to(buf.dtype).mul_(weight) if grad.dtype != buf.dtype else grad * weight
            if grad_scale is not None:
                contribution.div_(grad_scale.to(device=buf.device, dtype=buf.dtype))
        if overwrite:
            buf.copy_(contribution)
        else:
            buf.add_(contribution)
    if norm_weight_sum is not None:
        return window_norms(buffers=buffers, weight_sum=norm_weight_sum)
    return None


def window_norms(*, buffers: list[Tensor], weight_sum: float) -> Tensor:
    """Per-tensor L2 norms of the window gradients: [ ||acc_i / W||_2 for i ], a 1-D tensor."""
    if not buffers:
        return torch.zeros(0)
    return torch.stack([torch.linalg.vector_norm(buf / weight_sum) for buf in buffers])


def write_window_grads(*, buffers: list[Tensor], grads: list[Tensor], weight_sum: float,
                       clip_coef: Tensor | None) -> None:
    """GradientAccumulator's hand-over to the inner optimizer: grad_i <- acc_i / W * c, computed
    in the buffer dtype and rounded once to grad_i's dtype (the parameter's).

    torch's multi-tensor ops, on every backend: the grads must be materialised for the inner
    optimizer anyway, and this is the same arithmetic as ``_window_grad``.
    """
    if not buffers:
        return
    window = torch._foreach_div(buffers, weight_sum)
    if clip_coef is not None:
        torch._foreach_mul_(window, clip_coef.to(device=buffers[0].device, dtype=buffers[0].dtype))
    torch._foreach_copy_(grads, window)


# ------------------------------------------------------------------------------ bf16 rounding
BF16_UPDATES = ("nearest", "stochastic", "kahan")
_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """x * c mod 2**32 for x in [0, 2**32) (Python ints or int64 tensors, which must not overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def hash32(x):
    """The 32-bit hash every backend draws stochastic rounding bits from ("lowbias32", a bijection
    on [0, 2**32)): Python ints or int64 tensors holding values in that range."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _memory_offsets(t: Tensor) -> Tensor:
    """Each element's offset from the tensor's first element in memory (the index a kernel walking
    memory in order gives it), as int64."""
    offsets = torch.zeros(t.shape, dtype=torch.int64, device=t.device)
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[dim] = size
        offsets = offsets + torch.arange(size, dtype=torch.int64, device=t.device).view(shape) * stride
    return offsets


def _stochastic_bf16(x: Tensor, key: int) -> Tensor:
    """fp32 ``x`` rounded to bf16 stochastically: 16 hashed bits added below the kept mantissa
    carry into it with probability (x - down) / ulp. NaN and infinity stay as they are."""
    bits = x.view(torch.int32).to(torch.int64) & _M32
    random = hash32((_memory_offsets(x) & _M32) ^ key) & 0xFFFF
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = torch.where(finite, (bits + random) & 0xFFFF0000, bits)
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32)
    return rounded.view(torch.float32).to(torch.bfloat16)  # (exact: the low 16 bits are zero)


def _read_param(p: Tensor, buf: Tensor, bf16_update: str, comp: Tensor | None) -> Tensor:
    """The parameter in the update's dtype: p itself (fp32/fp64) or a widened copy, p + c for Kahan."""
    if p.dtype == buf.dtype:
        return p
    param = p.to(buf.dtype)
    return param.add_(comp) if bf16_update == "kahan" and p.dtype == torch.bfloat16 else param


def _write_param(p: Tensor, param: Tensor, bf16_update: str, key: int | None, comp: Tensor | None) -> None:
    """Write the updated ``param`` (update dtype) into ``p`` as ``bf16_update`` says."""
    if param is p:
        return
    if p.dtype != torch.bfloat16 or bf16_update == "nearest":
        p.copy_(param)
    elif bf16_update == "stochastic":
        p.copy_(_stochastic_bf16(param, key))
    else:  # kahan
        rounded = param.to(torch.bfloat16)
        comp.copy_(param - rounded.to(param.dtype))  # exact in fp32, then rounded to bf16
        p.copy_(rounded)


def _rounding_of(params, bf16_update, rounding_keys, compensations):
    """Per parameter: (key, compensation), checked as the compiled backends check them."""
    if bf16_update not in BF16_UPDATES:
        raise ValueError(f"bf16_update must be one of {BF16_UPDATES}, got {bf16_update!r}")
    n = len(params)
    if bf16_update != "nearest" and any(p.dtype != torch.bfloat16 for p in params):
        raise TypeError("stochastic and Kahan rounding are for bf16 parameters")
    keys = list(rounding_keys) if bf16_update == "stochastic" else [None] * n
    comps = list(compensations) if bf16_update == "kahan" else [None] * n
    if len(keys) != n or len(comps) != n:
        raise ValueError(f"bf16_update={bf16_update!r} needs one rounding key or compensation per parameter")
    return keys, comps


def _window_grad(buf: Tensor, weight_sum: float, clip_coef: Tensor | None, maximize: bool) -> Tensor:
    """g = acc / W * c, negated for maximize (a new tensor; the buffer is left as it is)."""
    grad = buf / weight_sum
    if clip_coef is not None:
        grad.mul_(clip_coef.to(device=buf.device, dtype=buf.dtype))
    return grad.neg_() if maximize else grad


def _fold_last_micro_batch(buffers, grads, weight, overwrite, grad_scale) -> None:
    # Kernels fuse the window's last micro-batch into the update pass; the reference adds it
    # first, which is the same arithmetic.
    if grads is not None:
        accumulate(grads=grads, buffers=buffers, weight=weight, overwrite=overwrite, grad_scale=grad_scale)


def sgd_update(
    *,
    params: list[Tensor],
    buffers: list[Tensor],
    momentum_buffers: list[Tensor | None],
    weight_sum: float,
    clip_coef: Tensor | None,
    lr: float | Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    grads: list[Tensor] | None = None,
    weight: float = 1.0,
    overwrite: bool = False,
    grad_scale: Tensor | None = None,
    bf16_update: str = "nearest",
    rounding_keys: list[int] | None = None,
    compensations: list[Tensor] | None = None,
) -> None:
    """SGD on the window gradient, as torch.optim.SGD:

        g <- g + weight_decay * p
        b <- g                                   on the first update (momentum_buffers[i] None)
        b <- momentum * b + (1 - dampening) * g  afterwards
        g <- g + momentum * b if nesterov else b (when momentum != 0)
        p <- p - lr * g

    A None in ``momentum_buffers`` is replaced in the list by the new buffer (buffer dtype).
    ``grads``/``weight``/``overwrite``/``grad_scale``: the last micro-batch, folded in first.
    ``bf16_update``/``rounding_keys``/``compensations``: how bf16 parameters are written (module
    docstring).
    """
    keys, comps = _rounding_of(params, bf16_update, rounding_keys, compensations)
    _fold_last_micro_batch(buffers, grads, weight, overwrite, grad_scale)
    for i, (p, buf) in enumerate(zip(params, buffers)):
        param = _read_param(p, buf, bf16_update, comps[i])
        grad = _window_grad(buf, weight_sum, clip_coef, maximize)
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            momentum_buf = momentum_buffers[i]
            if momentum_buf is None:
                momentum_buf = grad.detach().clone()
                momentum_buffers[i] = momentum_buf
            else:
                momentum_buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(momentum_buf, alpha=momentum) if nesterov else momentum_buf
        param.add_(grad, alpha=-lr)
        _write_param(p, param, bf16_update, keys[i], comps[i])


def adam_update(
    *,
    params: list[Tensor],
    buffers: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    step: int,
    weight_sum: float,
    clip_coef: Tensor | None,
    lr: float | Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    grads: list[Tensor] | None = None,
    weight: float = 1.0,
    overwrite: bool = False,
    grad_scale: Tensor | None = None,
    bf16_update: str = "nearest",
    rounding_keys: list[int] | None = None,
    compensations: list[Tensor] | None = None,
) -> None:
    """Adam / AdamW on the window gradient, as torch.optim.Adam(W); ``step`` is the update
    number after incrementing (1 on the first update), shared by all tensors of the call:

        p <- p * (1 - lr * weight_decay)        if decoupled_weight_decay (AdamW)
        g <- g + weight_decay * p               otherwise
        m <- lerp(m, g, 1 - beta1)
        v <- beta2 * v + (1 - beta2) * g * g
        v_max <- max(v_max, v)                  if amsgrad (and v_max is used below)
        p <- p - lr / (1 - beta1^step) * m / (sqrt(v or v_max) / sqrt(1 - beta2^step) + eps)

    ``max_exp_avg_sqs`` is empty unless ``amsgrad``. bf16 parameters are written as in sgd_update.
    """
    keys, comps = _rounding_of(params, bf16_update, rounding_keys, compensations)
    _fold_last_micro_batch(buffers, grads, weight, overwrite, grad_scale)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    for i, (p, buf) in enumerate(zip(params, buffers)):
        param = _read_param(p, buf, bf16_update, comps[i])
        grad = _window_grad(buf, weight_sum, clip_coef, maximize)
        exp_avg, exp_avg_sq = exp_avgs[i], exp_avg_sqs[i]
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if amsgrad:
            torch.maximum(max_exp_avg_sqs[i], exp_avg_sq, out=max_exp_avg_sqs[i])
            denom = (max_exp_avg_sqs[i].sqrt() / bias_correction2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        _write_param(p, param, bf16_update, keys[i], comps[i])
