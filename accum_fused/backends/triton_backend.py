"""Backend "triton": multi-tensor Triton kernels (``_triton_kernels.py``) and their launchers.

Same keyword-only functions as ``reference.py``, which is their specification.

Where it runs: CUDA tensors (NVIDIA compute capability >= 7.0, or ROCm) with fp32/bf16/fp16
parameters; CPU tensors only through Triton's interpreter, i.e. when ``TRITON_INTERPRET=1`` was
set before this module was imported (that is how the tests run the kernels without a GPU; the
interpreter is slow and meant for testing). Under the interpreter CUDA tensors are not supported
(the interpreter cannot follow device addresses stored in tables). Import fails with an
ImportError saying why when Triton is not installed, or when there is neither a CUDA device nor
``TRITON_INTERPRET=1`` (checked before Triton is imported, so "auto" moves on at once).

Launches per call, whatever the number of tensors: ``accumulate`` 1 (2 with norms),
``window_norms`` 2, ``sgd_update``/``adam_update`` 1. Each kernel finds its tensors through int64
address tables (see ``_triton_kernels``). The tables of buffers, parameters and state are built
once per set of tensors and cached on the device, keyed by the tensors' addresses and sizes, so a
steady-state step uploads nothing; the gradients' address table is cached the same way in its
own small cache (autograd may hand out new gradient tensors every micro-batch, and the caching
allocator usually hands back the same addresses).

Every tensor a launch writes in place gets its autograd version counter bumped
(``increment_version``), as torch's in-place ops do.

Differences from the reference, none visible through the optimizers (the same as backend "cpp"):
- with a fused last micro-batch (``grads``), the update does not write the accumulation buffer
  back (the window is closing and the next window overwrites it): 4 bytes/param saved;
- ``lr`` given as a tensor is read once on the host (``.item()``), as backend "cpp" does;
- kernels walk memory in order, so a tensor whose layout differs from its buffer's is copied
  into the buffer's layout first, and copied back after the kernel if the kernel writes it.
Rounding: the kernels perform the reference's fp32 operations in its order, with a fused
multiply-add exactly where torch's kernels use one (see ``_triton_kernels``), so SGD matches the
reference (and torch.optim at k=1) bit for bit on CPU under the interpreter. Adam does up to an
ulp apart in some elements: the kernels' sqrt is correctly rounded, torch's CPU sqrt (MKL) is
not (it differs from IEEE sqrt for 20% of random fp32 inputs); with an IEEE sqrt patched into
torch, the k=1 Adam/AdamW parity tests pass bit for bit too.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch
from torch import Tensor
from torch.autograd.graph import increment_version  # the kernels write through pointers autograd does not see

from ..layout import KERNEL_DTYPES
from ._kernel_args import adam_scalars, device_scalar, sgd_scalars
from .reference import BF16_UPDATES
from .reference import write_window_grads  # noqa: F401  (torch's foreach ops on every backend)

from . import _FIX

FIX = _FIX["triton"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# Checked before importing Triton: on a CPU-only machine without the interpreter the backend is
# unavailable, and "auto" must learn that without paying for Triton's import.
if not _interpreting() and not torch.cuda.is_available():
    raise ImportError(
        "no device Triton can run on here: no CUDA device, and TRITON_INTERPRET=1 (Triton's CPU "
        "interpreter, for testing) is not set"
    )

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    raise ImportError(f"Triton is not installed ({exc}); {FIX}") from exc

from . import _triton_kernels as K  # noqa: E402  (after the availability checks)

name = "triton"

# Whether the kernels were decorated in interpreter mode: Triton reads TRITON_INTERPRET when a
# kernel is defined, so this, not the environment at call time, decides where they can run.
INTERPRETED = not isinstance(K.adam_kernel, triton.runtime.JITFunction)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# The kernels' run-time scalars after (weight, weight_sum), in their order, from _kernel_args's
# sgd_scalars / adam_scalars (the cpp backend's too); each a float, so a kernel is compiled once.
_SGD_KERNEL_SCALARS = ("neg_lr", "momentum", "one_minus_dampening", "weight_decay")
_ADAM_KERNEL_SCALARS = ("decay_factor", "weight_decay", "lerp_weight", "beta2", "one_minus_beta2", "bc2_sqrt", "eps",
                        "neg_step_size")

_cuda_ok: dict[int, bool] = {}


def _cuda_device_supported(device: torch.device) -> bool:
    index = torch.cuda.current_device() if device.index is None else device.index
    ok = _cuda_ok.get(index)
    if ok is None:
        ok = bool(torch.version.hip) or torch.cuda.get_device_capability(index) >= (7, 0)
        _cuda_ok[index] = ok
    return ok


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """fp32/bf16/fp16 parameters on CUDA devices Triton compiles for, or on CPU under the
    interpreter (``TRITON_INTERPRET=1`` set before import). fp64 goes to the reference."""
    if dtype not in KERNEL_DTYPES:
        return False
    device = torch.device(device)
    if device.type == "cpu":
        return INTERPRETED and _interpreting()
    if device.type == "cuda":
        return not INTERPRETED and _cuda_device_supported(device)
    return False


# ------------------------------------------------------------------------------------- tables
class _Plan:
    """Device tables for one set of tensors: ``meta`` [n, META] int64 and ``chunks``
    [n_chunks, 2] int64 (see ``_triton_kernels``)."""

    __slots__ = ("meta", "chunks", "n", "n_chunks", "aligned", "width", "block", "chunk")

    def __init__(self, device: torch.device, numels: list[int], role_ptrs: list[list[int]], flags: list[int]):
        n = len(numels)
        self.n = n
        self.width = K.PTR0 + len(role_ptrs)
        self.block, self.chunk = K.tile_sizes(max(numels, default=0))
        numel = torch.tensor(numels, dtype=torch.int64)
        counts = (numel + self.chunk - 1) // self.chunk
        chunk_end = torch.cumsum(counts, 0)
        chunk_begin = chunk_end - counts
        self.n_chunks = int(chunk_end[-1]) if n else 0
        tensor_of_chunk = torch.repeat_interleave(torch.arange(n, dtype=torch.int64), counts)
        start = (torch.arange(self.n_chunks, dtype=torch.int64) - chunk_begin[tensor_of_chunk]) * self.chunk
        meta = torch.empty(n, self.width, dtype=torch.int64)
        meta[:, K.NUMEL] = numel
        meta[:, K.FLAGS] = torch.tensor(flags, dtype=torch.int64)
        meta[:, K.CHUNK_BEGIN] = chunk_begin
        meta[:, K.CHUNK_END] = chunk_end
        for r, ptrs in enumerate(role_ptrs):
            meta[:, K.PTR0 + r] = torch.tensor(ptrs, dtype=torch.int64)
        self.meta = _upload(meta, device)
        self.chunks = _upload(torch.stack([tensor_of_chunk, start], 1).contiguous(), device)
        self.aligned = all(p % 16 == 0 for ptrs in role_ptrs for p in ptrs)


def _upload(host: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class _LRU(OrderedDict):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.hits = 0
        self.misses = 0

    def get_or_build(self, key, build):
        value = self.get(key)
        if value is not None:
            self.hits += 1
            self.move_to_end(key)
            return value
        self.misses += 1
        value = self[key] = build()
        if len(self) > self.capacity:
            self.popitem(last=False)
        return value


# One entry per distinct call site in steady state (a param group x dtype x kernel): a handful.
_plans = _LRU(64)
_grad_tables = _LRU(16)


def _plan(device: torch.device, roles: list[list[Tensor | None]], flags: list[int] | None = None) -> _Plan:
    """The cached tables for the tensors of ``roles`` (first role: the buffers, defining sizes).
    A None tensor (a role the kernel will not touch) gets address 0."""
    numels = [t.numel() for t in roles[0]]
    role_ptrs = [[0 if t is None else t.data_ptr() for t in tensors] for tensors in roles]
    flags = flags or [0] * len(numels)
    key = (device, tuple(numels), tuple(map(tuple, role_ptrs)), tuple(flags))
    return _plans.get_or_build(key, lambda: _Plan(device, numels, role_ptrs, flags))


def _grad_table(device: torch.device, grads: list[Tensor]) -> tuple[Tensor, bool]:
    ptrs = tuple(g.data_ptr() for g in grads)

    def build():
        return _upload(torch.tensor(ptrs, dtype=torch.int64), device), all(p % 16 == 0 for p in ptrs)

    return _grad_tables.get_or_build((device, ptrs), build)


_dummies: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _dummy(device: torch.device) -> tuple[Tensor, Tensor]:
    """An fp32 and an int64 tensor standing in for absent pointer arguments (never read)."""
    pair = _dummies.get(device)
    if pair is None:
        pair = _dummies[device] = (torch.ones(1, device=device), torch.zeros(1, dtype=torch.int64, device=device))
    return pair


def _launch(kernel, grid: int, *args, **constexprs) -> None:
    """Every kernel launch goes through here (tests wrap it to inspect the arguments). The first
    argument is a tensor on the call's device (a table, or the gradient of a one-tensor call);
    Triton launches on the current device and stream, so another device is made current."""
    device = args[0].device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            kernel[(grid,)](*args, **constexprs, **K.LAUNCH_OPTIONS)
    else:
        kernel[(grid,)](*args, **constexprs, **K.LAUNCH_OPTIONS)


# ------------------------------------------------------------------------------------- helpers
def _dense(t: Tensor) -> bool:
    """Its elements fill one range of memory without gaps or overlaps (any dimension order)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(t: Tensor, buf: Tensor) -> bool:
    return t.stride() == buf.stride() or (t.is_contiguous() and buf.is_contiguous())


class _Layout:
    """Presents every tensor of a call in its buffer's memory layout (see module docstring)."""

    def __init__(self, buffers: list[Tensor]):
        for i, b in enumerate(buffers):
            if b.dtype != torch.float32:
                raise TypeError(f"buffers[{i}] must be float32 for backend 'triton', got {b.dtype}")
            if not _dense(b):
                raise ValueError(f"buffers[{i}] must be dense (the optimizer's buffers are, by construction)")
        self.buffers = buffers
        self.copy_back: list[tuple[Tensor, Tensor]] = []

    def read(self, tensors: list[Tensor]) -> list[Tensor]:
        return [t if _same_layout(t, b) else torch.empty_like(b, dtype=t.dtype).copy_(t)
                for t, b in zip(tensors, self.buffers)]

    def read_write(self, tensors: list[Tensor]) -> list[Tensor]:
        out = []
        for t, b in zip(tensors, self.buffers):
            if not _same_layout(t, b):
                staged = torch.empty_like(b, dtype=t.dtype).copy_(t)
                self.copy_back.append((t, staged))
                t = staged
            out.append(t)
        return out

    def finish(self) -> None:
        for t, staged in self.copy_back:
            t.copy_(staged)


def _check(device: torch.device, dtype: torch.dtype, what: str) -> None:
    if not supports(device, dtype):
        raise TypeError(f"backend 'triton' does not support {what} of dtype {dtype} on {device}")


def _groups(keys: list) -> list[list[int]]:
    """Indices grouped by key, in first-seen order."""
    out: dict = {}
    for i, key in enumerate(keys):
        out.setdefault(key, []).append(i)
    return list(out.values())


def _pick(items, idx):
    return None if items is None else [items[i] for i in idx]


# ------------------------------------------------------------------------------------- API
def accumulate(
    *,
    grads: list[Tensor],
    buffers: list[Tensor],
    weight: float,
    overwrite: bool,
    grad_scale: Tensor | None = None,
    norm_weight_sum: float | None = None,
) -> Tensor | None:
    if not buffers:
        return None if norm_weight_sum is None else torch.zeros(0)
    dtypes = [g.dtype for g in grads]
    if len(set(dtypes)) > 1:  # the front never does this; the kernel takes one gradient dtype
        norms = torch.empty(len(buffers), device=buffers[0].device)
        for idx in _groups(dtypes):
            part = accumulate(grads=_pick(grads, idx), buffers=_pick(buffers, idx), weight=weight,
                              overwrite=overwrite, grad_scale=grad_scale, norm_weight_sum=norm_weight_sum)
            if part is not None:
                norms[idx] = part
        return None if norm_weight_sum is None else norms
    device = buffers[0].device
    _check(device, dtypes[0], "gradients")
    grads = _Layout(buffers).read(grads)
    if len(buffers) == 1:
        return _accumulate_one(grads[0], buffers[0], weight, overwrite, grad_scale, norm_weight_sum)
    plan = _plan(device, [buffers])
    grad_ptrs, grads_aligned = _grad_table(device, grads)
    norm = norm_weight_sum is not None
    scale = device_scalar(grad_scale, device)
    dummy_f, _ = _dummy(device)
    partial = torch.empty(plan.n_chunks if norm else 1, device=device)
    if plan.n_chunks:
        _launch(K.accumulate_kernel, plan.n_chunks,
                plan.chunks, plan.meta, grad_ptrs, partial, dummy_f if scale is None else scale,
                float(weight), float(norm_weight_sum) if norm else 1.0,
                G_DTYPE=_TL_DTYPES[dtypes[0]], OVERWRITE=bool(overwrite), HAS_SCALE=scale is not None,
                NORM=norm, ALIGNED=plan.aligned and grads_aligned, META=plan.width, CHUNK=plan.chunk,
                BLOCK=plan.block)
    increment_version(buffers)
    if not norm:
        return None
    return _finish_norms(plan, partial, device)


def _accumulate_one(grad: Tensor, buffer: Tensor, weight: float, overwrite: bool, grad_scale: Tensor | None,
                    norm_weight_sum: float | None) -> Tensor | None:
    """accumulate of one gradient (the in-backward hooks' call), without tables: the same tiles
    and the same per-chunk partial sums as the table kernel's, finished in the same order."""
    device = buffer.device
    block, chunk = K.tile_sizes(buffer.numel())
    programs = -(-buffer.numel() // chunk)
    norm = norm_weight_sum is not None
    scale = device_scalar(grad_scale, device)
    dummy_f, _ = _dummy(device)
    partial = torch.empty(programs if norm else 1, device=device)
    if programs:
        _launch(K.accumulate_one_kernel, programs, grad, buffer, buffer.numel(), partial,
                   dummy_f if scale is None else scale, float(weight), float(norm_weight_sum) if norm else 1.0,
                   OVERWRITE=bool(overwrite), HAS_SCALE=scale is not None, NORM=norm, CHUNK=chunk, BLOCK=block)
    increment_version([buffer])
    if not norm:
        return None
    out = torch.empty(1, device=device)
    if not programs:
        return out.zero_()
    _launch(K.norm_one_finish_kernel, 1, partial, out, programs, BLOCK=K.FINISH_BLOCK)
    return out


def _finish_norms(plan: _Plan, partial: Tensor, device: torch.device) -> Tensor:
    out = torch.empty(plan.n, device=device)
    if plan.n_chunks == 0:
        return out.zero_()
    _launch(K.norm_finish_kernel, plan.n, plan.meta, partial, out, META=plan.width, BLOCK=K.FINISH_BLOCK)
    return out


def window_norms(*, buffers: list[Tensor], weight_sum: float) -> Tensor:
    if not buffers:
        return torch.zeros(0)
    device = buffers[0].device
    _Layout(buffers)  # checks them
    plan = _plan(device, [buffers])
    partial = torch.empty(max(plan.n_chunks, 1), device=device)
    if plan.n_chunks:
        _launch(K.sumsq_kernel, plan.n_chunks, plan.chunks, plan.meta, partial, float(weight_sum),
                ALIGNED=plan.aligned, META=plan.width, CHUNK=plan.chunk, BLOCK=plan.block)
    return _finish_norms(plan, partial, device)


def _split_call(params, grads) -> list[list[int]] | None:
    """Index groups when one call mixes parameter dtypes or gradient dtypes (the front never
    does; the kernels take one of each), else None."""
    keys = [(p.dtype, None if grads is None else grads[i].dtype) for i, p in enumerate(params)]
    return _groups(keys) if len(set(keys)) > 1 else None


def _update_inputs(device, layout: "_Layout", grads, grad_scale, clip_coef, plan: "_Plan"):
    """An update kernel's inputs beyond its plan: the folded last micro-batch's gradients
    (staged where a layout needs it: the caller keeps ``staged`` alive until the launch), their
    pointer table, whether every access is aligned, and the GradScaler scale and clip
    coefficient as device scalars (a dummy where absent; the kernel's HAS_* flags say which)."""
    dummy_f, dummy_i = _dummy(device)
    aligned, grad_ptrs, staged = plan.aligned, dummy_i, None
    if grads is not None:
        staged = layout.read(grads)
        grad_ptrs, grads_aligned = _grad_table(device, staged)
        aligned = aligned and grads_aligned
    scale = device_scalar(grad_scale, device) if grads is not None else None
    clip = device_scalar(clip_coef, device)
    return staged, grad_ptrs, aligned, dummy_f if scale is None else scale, dummy_f if clip is None else clip


def _rounding(device, layout, params, bf16_update, rounding_keys, compensations):
    """(ROUNDING, the compensation role of the table, the keys table) of an update call; checked
    as the reference checks them."""
    if bf16_update not in BF16_UPDATES:
        raise ValueError(f"bf16_update must be one of {BF16_UPDATES}, got {bf16_update!r}")
    rounding = BF16_UPDATES.index(bf16_update)
    if rounding and params[0].dtype != torch.bfloat16:
        raise TypeError("stochastic and Kahan rounding are for bf16 parameters")
    comps = layout.read_write(compensations) if rounding == 2 else [None] * len(params)
    keys = _dummy(device)[1]
    if rounding == 1:
        keys = _upload(torch.tensor(list(rounding_keys), dtype=torch.int64), device)
    if len(comps) != len(params) or keys.numel() < (len(params) if rounding == 1 else 1):
        raise ValueError(f"bf16_update={bf16_update!r} needs one rounding key or compensation per parameter")
    return rounding, comps, keys


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
    if not params:
        return
    split = _split_call(params, grads)
    if split is not None:
        for idx in split:
            part = [momentum_buffers[i] for i in idx] if momentum != 0 else [None] * len(idx)
            sgd_update(params=_pick(params, idx), buffers=_pick(buffers, idx), momentum_buffers=part,
                       weight_sum=weight_sum, clip_coef=clip_coef, lr=lr, momentum=momentum, dampening=dampening,
                       weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, grads=_pick(grads, idx),
                       weight=weight, overwrite=overwrite, grad_scale=grad_scale, bf16_update=bf16_update,
                       rounding_keys=_pick(rounding_keys, idx), compensations=_pick(compensations, idx))
            if momentum != 0:
                for i, b in zip(idx, part):
                    momentum_buffers[i] = b
        return
    device = buffers[0].device
    _check(device, params[0].dtype, "parameters")
    if grads is not None:
        _check(device, grads[0].dtype, "gradients")
    layout = _Layout(buffers)
    rounding, comps, keys = _rounding(device, layout, params, bf16_update, rounding_keys, compensations)
    has_momentum = momentum != 0
    flags = [0] * len(params)
    moms: list[Tensor | None] = [None] * len(params)
    if has_momentum:
        for i, b in enumerate(momentum_buffers):
            if b is None:
                # The kernel writes b <- g into it (the reference's grad.clone()).
                b = momentum_buffers[i] = torch.empty_like(buffers[i])
                flags[i] = K.FIRST_MOMENTUM
            moms[i] = b
        moms = layout.read_write(moms)
    params_k = layout.read_write(params)
    plan = _plan(device, [buffers, params_k, moms, comps], flags)
    staged, grad_ptrs, aligned, scale, clip = _update_inputs(device, layout, grads, grad_scale, clip_coef, plan)
    if plan.n_chunks:
        s = sgd_scalars(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize)
        _launch(K.sgd_kernel, plan.n_chunks, plan.chunks, plan.meta, grad_ptrs, keys, scale, clip, float(weight),
                float(weight_sum), *map(float, (s[name] for name in _SGD_KERNEL_SCALARS)),
                ROUNDING=rounding,
                P_DTYPE=_TL_DTYPES[params[0].dtype],
                G_DTYPE=_TL_DTYPES[grads[0].dtype] if grads is not None else tl.float32,
                FUSE=grads is not None, OVERWRITE=bool(overwrite) and grads is not None,
                HAS_SCALE=grads is not None and grad_scale is not None, HAS_CLIP=clip_coef is not None,
                HAS_WD=weight_decay != 0,
                HAS_MOMENTUM=has_momentum, NESTEROV=bool(nesterov) and has_momentum, MAXIMIZE=bool(maximize),
                ALIGNED=aligned, META=plan.width, CHUNK=plan.chunk, BLOCK=plan.block)
    layout.finish()
    increment_version(params + [b for b in momentum_buffers if b is not None]
                      + (compensations if rounding == 2 else []))


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
    if not params:
        return
    split = _split_call(params, grads)
    if split is not None:
        for idx in split:
            adam_update(params=_pick(params, idx), buffers=_pick(buffers, idx), exp_avgs=_pick(exp_avgs, idx),
                        exp_avg_sqs=_pick(exp_avg_sqs, idx),
                        max_exp_avg_sqs=_pick(max_exp_avg_sqs, idx) if amsgrad else [], step=step,
                        weight_sum=weight_sum, clip_coef=clip_coef, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                        weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        decoupled_weight_decay=decoupled_weight_decay, grads=_pick(grads, idx), weight=weight,
                        overwrite=overwrite, grad_scale=grad_scale, bf16_update=bf16_update,
                        rounding_keys=_pick(rounding_keys, idx), compensations=_pick(compensations, idx))
        return
    device = buffers[0].device
    _check(device, params[0].dtype, "parameters")
    if grads is not None:
        _check(device, grads[0].dtype, "gradients")
    layout = _Layout(buffers)
    rounding, comps, keys = _rounding(device, layout, params, bf16_update, rounding_keys, compensations)
    maxes = layout.read_write(max_exp_avg_sqs) if amsgrad else [None] * len(params)
    plan = _plan(device, [buffers, layout.read_write(params), layout.read_write(exp_avgs),
                          layout.read_write(exp_avg_sqs), maxes, comps])
    staged, grad_ptrs, aligned, scale, clip = _update_inputs(device, layout, grads, grad_scale, clip_coef, plan)
    if plan.n_chunks:
        s = adam_scalars(step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, decoupled_weight_decay=decoupled_weight_decay)
        _launch(K.adam_kernel, plan.n_chunks, plan.chunks, plan.meta, grad_ptrs, keys, scale, clip, float(weight),
                float(weight_sum), *map(float, (s[name] for name in _ADAM_KERNEL_SCALARS)),
                ROUNDING=rounding, P_DTYPE=_TL_DTYPES[params[0].dtype],
                G_DTYPE=_TL_DTYPES[grads[0].dtype] if grads is not None else tl.float32,
                FUSE=grads is not None, OVERWRITE=bool(overwrite) and grads is not None,
                HAS_SCALE=grads is not None and grad_scale is not None, HAS_CLIP=clip_coef is not None,
                HAS_WD=weight_decay != 0,
                DECOUPLED=bool(decoupled_weight_decay), AMSGRAD=bool(amsgrad), MAXIMIZE=bool(maximize),
                ALIGNED=aligned, META=plan.width, CHUNK=plan.chunk, BLOCK=plan.block)
    layout.finish()
    increment_version(params + exp_avgs + exp_avg_sqs + (max_exp_avg_sqs if amsgrad else [])
                      + (compensations if rounding == 2 else []))
