"""Triton kernels of backend "triton"; the launchers live in ``triton_backend.py``.

Imported only by ``triton_backend`` (after its availability checks), never by ``import accum_fused``.

Multi-tensor layout, shared by every kernel
-------------------------------------------
A call covers n tensors, each cut into chunks of ``CHUNK`` elements; one program runs one chunk,
walking it in tiles of ``BLOCK`` elements (both constexprs chosen by the launcher). Two int64
tables, built on the host once per set of tensors and cached on the device by the launcher,
describe the call:

    chunks  [n_chunks, 2]       (tensor index t, first element of the chunk)
    meta    [n, META]           numel, flags, first chunk, end chunk, then one address per role
                                (buffer, parameter, state tensors: see each kernel)

and the gradients' addresses, which autograd may move every micro-batch, come in a separate
int64 table ``grad_ptrs [n]``. Every tensor of a role has the dtype of that role's constexpr
(``G_DTYPE`` for gradients, ``P_DTYPE`` for parameters, fp32 for buffers and state), and all
tensors of one index share one dense memory layout, so a chunk is one contiguous range of
memory in each of them.

Scalars that change between calls (weights, lr, bias corrections, ...) are fp32 run-time
arguments, GradScaler's scale and the clip coefficient are 1-element fp32 tensors read on the
device; sizes live in the tables. So a kernel compiles once per combination of constexpr flags
and dtypes, whatever the step, lr or tensor sizes.

Full tiles take an unmasked path: a mask built from a run-time numel has no known alignment,
which makes Triton fall back to scalar loads; with ``ALIGNED`` (every address 16-byte aligned,
checked by the launcher) the unmasked path uses 128-bit loads (checked in the PTX by the tests).
The per-tile work sits in one ``_*_tile`` function per kernel, called for the unmasked and the
masked tile; otherwise the kernels are written out flat, because the interpreter re-patches
``triton.language`` on every call of a ``@triton.jit`` helper (measured: 5 ms per program with
small helpers for loads and stores, most of it in that patching).

Arithmetic is fp32 and follows ``reference.py`` operation by operation, rounding where torch's
kernels round: torch's CPU and CUDA kernels compute ``add(x, alpha=a)``, ``addcmul`` and ``lerp``
with a fused multiply-add (measured on CPU: ``p.add(g, alpha=-lr)`` equals fma(g, -lr, p) for 100%
of 1e5 random elements, p + (-lr * g) for 91%), so the kernels call ``tl.fma`` there, and launch
with ``enable_fp_fusion=False`` so that no other contraction happens: the interpreter (which the
CPU tests run) and a GPU then execute the same roundings. Divisions and square roots are the
correctly rounded ones (``div_rn``/``sqrt_rn``: Triton's ``/`` and ``sqrt`` may be approximate on
GPUs).
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is defined: whether these kernels are interpreted.
# (triton.knobs is Triton 3.4's; before it, triton.jit read the environment variable itself.)
_knobs = getattr(triton, "knobs", None)
INTERPRETED = bool(_knobs.runtime.interpret) if _knobs is not None else os.environ.get("TRITON_INTERPRET", "0") == "1"

# meta columns (the kernels index them by number: 0 numel, 1 flags, 2/3 chunk range, 4.. addresses)
NUMEL, FLAGS, CHUNK_BEGIN, CHUNK_END, PTR0 = 0, 1, 2, 3, 4
# flags bits
FIRST_MOMENTUM = 1

# Tile sizes of compiled kernels: a program per 4096 elements, 1024 per tile (4 warps, 8 fp32 per
# thread). Not tuned yet: awaiting a GPU.
BLOCK = 1024
CHUNK = 4 * BLOCK
FINISH_BLOCK = 256


def tile_sizes(max_numel: int) -> tuple[int, int]:
    """(BLOCK, CHUNK) for a call whose largest tensor has ``max_numel`` elements.

    Under the interpreter a constexpr costs no compilation, and its run time is per program and
    per tile, not per element: an Adam step on 2**20 elements took 2.4 s with 1024-element
    tiles, 0.3 s with 16384-element tiles (2-core CPU). So it scales the tiles with the call (chunks of 4 tiles, so the
    loop over full tiles and the masked tail both run in the tests)."""
    if not INTERPRETED:
        return BLOCK, CHUNK
    block = min(16384, max(BLOCK, triton.next_power_of_2(max(1, -(-max_numel // 4)))))
    return block, 4 * block


# No implicit fused multiply-add contraction (the kernels write their FMAs out; see the module
# docstring), so a GPU rounds as the interpreter does. (Triton 3.9 contracts by default and warns
# that 3.10 will not; say it explicitly.)
LAUNCH_OPTIONS = dict(num_warps=4, enable_fp_fusion=False)

# Triton 3.9's interpreter casts fp32 to bf16 by truncation (GPUs round to nearest even, as
# torch does): 49% of the bf16 results of an SGD step came out 1 ulp off. Under the interpreter
# the kernels round parameters in integer arithmetic; compiled kernels keep the hardware cast.
_ROUND_BF16_BY_HAND = tl.constexpr(INTERPRETED)


@triton.jit
def _to_bf16_rtne(x):
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)  # NaN stays a (quiet) NaN
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_nearest(x, P_DTYPE: tl.constexpr):
    if _ROUND_BF16_BY_HAND and P_DTYPE == tl.bfloat16:
        return _to_bf16_rtne(x)
    else:
        return x.to(P_DTYPE)


# bf16_update (see math.h and the reference): ROUNDING 0 nearest, 1 stochastic, 2 Kahan.
@triton.jit
def _hash32(x):  # "lowbias32", on uint32 (wrapping products)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _bf16_stochastic(x, key, offs):
    """fp32 x rounded stochastically to a bf16 value (returned as fp32, low 16 bits zero)."""
    bits = x.to(tl.uint32, bitcast=True)
    random = _hash32(offs.to(tl.uint32) ^ key) & 0xFFFF
    finite = (bits & 0x7F800000) != 0x7F800000
    bits = tl.where(finite, (bits + random) & 0xFFFF0000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_param(param, comp, offs, mask, other, ROUNDING: tl.constexpr):
    p = tl.load(param + offs, mask=mask, other=other).to(tl.float32)
    if ROUNDING == 2:  # the parameter is p + c
        p = p + tl.load(comp + offs, mask=mask, other=other).to(tl.float32)
    return p


@triton.jit
def _store_param(param, comp, key, offs, p, mask, P_DTYPE: tl.constexpr, ROUNDING: tl.constexpr):
    if ROUNDING == 1:
        p = _bf16_stochastic(p, key, offs)
    if ROUNDING == 2:  # p rounded to nearest, c = the rest (exact in fp32) rounded to bf16
        rounded = _round_nearest(p, P_DTYPE)
        tl.store(comp + offs, _round_nearest(p - rounded.to(tl.float32), tl.bfloat16), mask=mask)
        tl.store(param + offs, rounded, mask=mask)
    else:
        tl.store(param + offs, _round_nearest(p, P_DTYPE), mask=mask)


# ------------------------------------------------------------------------------------------------
# accumulate
#   grad_ptrs  int64 [n]   gradients (G_DTYPE), read
#   meta       col 4: buffer (fp32), read unless OVERWRITE, written
#   partial    fp32 [n_chunks]  NORM: sum over the chunk of (acc / norm_weight_sum)^2, written
#   scale_ptr  fp32 [1]    HAS_SCALE: GradScaler's scale, the gradients are divided by it
#   weight, norm_weight_sum: fp32 run-time scalars
@triton.jit(do_not_specialize=["weight", "norm_weight_sum"])
def accumulate_kernel(chunks_ptr, meta_ptr, grad_ptrs, partial_ptr, scale_ptr, weight, norm_weight_sum,
                      G_DTYPE: tl.constexpr, OVERWRITE: tl.constexpr, HAS_SCALE: tl.constexpr,
                      NORM: tl.constexpr, ALIGNED: tl.constexpr, META: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(chunks_ptr + 2 * pid + 1), CHUNK)
    row = meta_ptr + t * META
    end = tl.minimum(start + CHUNK, tl.load(row))
    buf = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    grad = tl.load(grad_ptrs + t).to(tl.pointer_type(G_DTYPE))
    if ALIGNED:
        buf = tl.multiple_of(buf, 16)
        grad = tl.multiple_of(grad, 16)
    sq = _accumulate_range(grad, buf, start, end, scale_ptr, weight, norm_weight_sum,
                           OVERWRITE, HAS_SCALE, NORM, BLOCK)
    if NORM:
        tl.store(partial_ptr + pid, tl.sum(sq, axis=0))


# accumulate, one tensor (the in-backward hooks' call: a gradient at a time): the same tiles as
# accumulate_kernel's, with the gradient and the buffer passed as pointers, so a call needs no
# table built on the host and uploaded (a new gradient tensor each pass missed the table cache:
# a pinned copy and an upload per gradient; issue 43's GPU run measured mode B on Triton at
# 3.9x the native loop).
#   grad       G_DTYPE [numel], read;  buf  fp32 [numel], read unless OVERWRITE, written
#   partial    fp32 [programs]  NORM: as accumulate_kernel's, per program (one chunk each)
@triton.jit(do_not_specialize=["numel", "weight", "norm_weight_sum"])
def accumulate_one_kernel(grad, buf, numel, partial_ptr, scale_ptr, weight, norm_weight_sum,
                          OVERWRITE: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * CHUNK
    end = tl.minimum(start + CHUNK, numel)
    sq = _accumulate_range(grad, buf, start, end, scale_ptr, weight, norm_weight_sum,
                           OVERWRITE, HAS_SCALE, NORM, BLOCK)
    if NORM:
        tl.store(partial_ptr + pid, tl.sum(sq, axis=0))


# norm_finish_kernel for one tensor: its partial sums in the same order, the square root.
@triton.jit(do_not_specialize=["n_chunks"])
def norm_one_finish_kernel(partial_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, n_chunks, BLOCK):
        idx = c + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + idx, mask=idx < n_chunks, other=0.0)
    tl.store(out_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


@triton.jit
def _accumulate_range(grad, buf, start, end, scale_ptr, weight, norm_weight_sum,
                      OVERWRITE: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr):
    """Elements [start, end) of one tensor, tile by tile (the full tiles unmasked): the squared
    window-gradient sum of the range, per lane (NORM)."""
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        if off + BLOCK <= end:
            sq = _accumulate_tile(grad, buf, off, end, sq, scale_ptr, weight, norm_weight_sum,
                                  OVERWRITE, HAS_SCALE, NORM, False, BLOCK)
        else:
            sq = _accumulate_tile(grad, buf, off, end, sq, scale_ptr, weight, norm_weight_sum,
                                  OVERWRITE, HAS_SCALE, NORM, True, BLOCK)
    return sq


@triton.jit
def _accumulate_tile(grad, buf, off, end, sq, scale_ptr, weight, norm_weight_sum,
                     OVERWRITE: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr,
                     MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = off + tl.arange(0, BLOCK)
    mask = offs < end if MASKED else None
    other = 0.0 if MASKED else None
    acc = tl.load(grad + offs, mask=mask, other=other).to(tl.float32) * weight
    if HAS_SCALE:
        acc = tl.div_rn(acc, tl.load(scale_ptr))
    if not OVERWRITE:
        acc = tl.load(buf + offs, mask=mask, other=other) + acc
    tl.store(buf + offs, acc, mask=mask)
    if NORM:
        x = tl.div_rn(acc, norm_weight_sum)  # masked lanes hold 0
        sq += x * x
    return sq


# ------------------------------------------------------------------------------------------------
# window_norms, first pass
#   meta       col 4: buffer (fp32), read
#   partial    fp32 [n_chunks]  sum over the chunk of (acc / weight_sum)^2, written
@triton.jit(do_not_specialize=["weight_sum"])
def sumsq_kernel(chunks_ptr, meta_ptr, partial_ptr, weight_sum,
                 ALIGNED: tl.constexpr, META: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(chunks_ptr + 2 * pid + 1), CHUNK)
    row = meta_ptr + t * META
    end = tl.minimum(start + CHUNK, tl.load(row))
    buf = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        buf = tl.multiple_of(buf, 16)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(start, end, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        if off + BLOCK <= end:
            x = tl.div_rn(tl.load(buf + offs), weight_sum)
        else:
            x = tl.div_rn(tl.load(buf + offs, mask=offs < end, other=0.0), weight_sum)
        sq += x * x
    tl.store(partial_ptr + pid, tl.sum(sq, axis=0))


# ------------------------------------------------------------------------------------------------
# norms, second pass: one program per tensor sums its chunks' partial sums (a fixed order, so
# the result is deterministic) and writes the square root.
#   meta       cols 2, 3: first and end chunk of each tensor, read
#   partial    fp32 [n_chunks], read
#   out        fp32 [n], written
@triton.jit
def norm_finish_kernel(meta_ptr, partial_ptr, out_ptr, META: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    row = meta_ptr + t * META
    first = tl.load(row + 2)
    last = tl.load(row + 3)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(first, last, BLOCK):
        idx = c + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + idx, mask=idx < last, other=0.0)
    tl.store(out_ptr + t, tl.sqrt_rn(tl.sum(acc, axis=0)))


# ------------------------------------------------------------------------------------------------
# SGD boundary update (torch.optim.SGD on the window gradient)
#   grad_ptrs  int64 [n]   FUSE: the window's last micro-batch (G_DTYPE), read
#   meta       col 1 bit FIRST_MOMENTUM: the momentum buffer is new (b <- g, not read);
#              col 4: buffer (fp32), read unless FUSE and OVERWRITE; col 5: param (P_DTYPE), read,
#              written; col 6: momentum_buffer (fp32) HAS_MOMENTUM: read, written; col 7: the Kahan
#              compensation (bf16) ROUNDING 2: read, written
#   keys_ptr   int64 [n]   ROUNDING 1: the tensors' stochastic rounding keys
#   scale_ptr  fp32 [1]    FUSE and HAS_SCALE: GradScaler's scale for the last micro-batch
#   clip_ptr   fp32 [1]    HAS_CLIP: the clip coefficient
#   weight, weight_sum, neg_lr, momentum, one_minus_dampening, weight_decay: fp32 run-time
# With FUSE the buffer is not written back: the window closes here, the next one overwrites it.
@triton.jit(do_not_specialize=["weight", "weight_sum", "neg_lr", "momentum", "one_minus_dampening",
                               "weight_decay"])
def sgd_kernel(chunks_ptr, meta_ptr, grad_ptrs, keys_ptr, scale_ptr, clip_ptr,
               weight, weight_sum, neg_lr, momentum, one_minus_dampening, weight_decay,
               ROUNDING: tl.constexpr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, FUSE: tl.constexpr,
               OVERWRITE: tl.constexpr,
               HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_WD: tl.constexpr,
               HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
               ALIGNED: tl.constexpr, META: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(chunks_ptr + 2 * pid + 1), CHUNK)
    row = meta_ptr + t * META
    end = tl.minimum(start + CHUNK, tl.load(row))
    first = tl.load(row + 1) & 1
    buf = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    param = tl.load(row + 5).to(tl.pointer_type(P_DTYPE))
    mom = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    comp = tl.load(row + 7).to(tl.pointer_type(tl.bfloat16))
    key = tl.load(keys_ptr + t).to(tl.uint32) if ROUNDING == 1 else 0
    grad = tl.load(grad_ptrs + t).to(tl.pointer_type(G_DTYPE))
    if ALIGNED:
        buf = tl.multiple_of(buf, 16)
        param = tl.multiple_of(param, 16)
        mom = tl.multiple_of(mom, 16)
        grad = tl.multiple_of(grad, 16)
    for off in range(start, end, BLOCK):
        if off + BLOCK <= end:
            _sgd_tile(grad, buf, param, mom, comp, key, off, end, first, scale_ptr, clip_ptr, weight, weight_sum,
                      neg_lr, momentum, one_minus_dampening, weight_decay, ROUNDING, P_DTYPE, FUSE, OVERWRITE,
                      HAS_SCALE, HAS_CLIP, HAS_WD, HAS_MOMENTUM, NESTEROV, MAXIMIZE, False, BLOCK)
        else:
            _sgd_tile(grad, buf, param, mom, comp, key, off, end, first, scale_ptr, clip_ptr, weight, weight_sum,
                      neg_lr, momentum, one_minus_dampening, weight_decay, ROUNDING, P_DTYPE, FUSE, OVERWRITE,
                      HAS_SCALE, HAS_CLIP, HAS_WD, HAS_MOMENTUM, NESTEROV, MAXIMIZE, True, BLOCK)


@triton.jit
def _sgd_tile(grad, buf, param, mom, comp, key, off, end, first, scale_ptr, clip_ptr, weight, weight_sum, neg_lr,
              momentum, one_minus_dampening, weight_decay, ROUNDING: tl.constexpr, P_DTYPE: tl.constexpr,
              FUSE: tl.constexpr, OVERWRITE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
              HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
              MAXIMIZE: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = off + tl.arange(0, BLOCK)
    mask = offs < end if MASKED else None
    other = 0.0 if MASKED else None
    # window sum, with the last micro-batch folded in: (0 or acc) + weight * g / scale
    if FUSE:
        acc = tl.load(grad + offs, mask=mask, other=other).to(tl.float32) * weight
        if HAS_SCALE:
            acc = tl.div_rn(acc, tl.load(scale_ptr))
        if not OVERWRITE:
            acc = tl.load(buf + offs, mask=mask, other=other) + acc
    else:
        acc = tl.load(buf + offs, mask=mask, other=other)
    # window gradient g = acc / W * c, negated for maximize
    g = tl.div_rn(acc, weight_sum)
    if HAS_CLIP:
        g = g * tl.load(clip_ptr)
    if MAXIMIZE:
        g = -g
    p = _load_param(param, comp, offs, mask, other, ROUNDING)
    if HAS_WD:
        g = tl.fma(p, weight_decay, g)  # grad.add(param, alpha=weight_decay)
    if HAS_MOMENTUM:
        if first != 0:  # b <- g; the new buffer is uninitialised, not read
            b = g
        else:  # b.mul_(momentum).add_(g, alpha=1 - dampening)
            b = tl.fma(g, one_minus_dampening, tl.load(mom + offs, mask=mask, other=other) * momentum)
        tl.store(mom + offs, b, mask=mask)
        if NESTEROV:
            g = tl.fma(b, momentum, g)
        else:
            g = b
    p = tl.fma(g, neg_lr, p)  # param.add_(g, alpha=-lr)
    _store_param(param, comp, key, offs, p, mask, P_DTYPE, ROUNDING)


# ------------------------------------------------------------------------------------------------
# Adam / AdamW boundary update (torch.optim.Adam(W) on the window gradient)
#   grad_ptrs  int64 [n]   FUSE: the window's last micro-batch (G_DTYPE), read
#   meta       col 4: buffer (fp32), read unless FUSE and OVERWRITE; col 5: param (P_DTYPE);
#              cols 6, 7: exp_avg, exp_avg_sq (fp32); col 8: max_exp_avg_sq (fp32) AMSGRAD;
#              all read and written; col 9: the Kahan compensation (bf16) ROUNDING 2
#   keys_ptr   int64 [n]   ROUNDING 1: the tensors' stochastic rounding keys
#   scale_ptr  fp32 [1]    FUSE and HAS_SCALE: GradScaler's scale for the last micro-batch
#   clip_ptr   fp32 [1]    HAS_CLIP: the clip coefficient
#   weight, weight_sum, decay_factor (1 - lr*wd), weight_decay, lerp_weight (1 - beta1), beta2,
#   one_minus_beta2, bc2_sqrt (sqrt(1 - beta2^step)), eps, neg_step_size (-lr / (1 - beta1^step)):
#   fp32 run-time scalars, computed by the launcher exactly as the reference computes them.
# With FUSE the buffer is not written back: the window closes here, the next one overwrites it.
@triton.jit(do_not_specialize=["weight", "weight_sum", "decay_factor", "weight_decay", "lerp_weight", "beta2",
                               "one_minus_beta2", "bc2_sqrt", "eps", "neg_step_size"])
def adam_kernel(chunks_ptr, meta_ptr, grad_ptrs, keys_ptr, scale_ptr, clip_ptr,
                weight, weight_sum, decay_factor, weight_decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt,
                eps, neg_step_size,
                ROUNDING: tl.constexpr, P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, FUSE: tl.constexpr,
               OVERWRITE: tl.constexpr,
                HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_WD: tl.constexpr, DECOUPLED: tl.constexpr,
                AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
                ALIGNED: tl.constexpr, META: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunks_ptr + 2 * pid)
    start = tl.multiple_of(tl.load(chunks_ptr + 2 * pid + 1), CHUNK)
    row = meta_ptr + t * META
    end = tl.minimum(start + CHUNK, tl.load(row))
    buf = tl.load(row + 4).to(tl.pointer_type(tl.float32))
    param = tl.load(row + 5).to(tl.pointer_type(P_DTYPE))
    exp_avg = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    exp_avg_sq = tl.load(row + 7).to(tl.pointer_type(tl.float32))
    max_exp_avg_sq = tl.load(row + 8).to(tl.pointer_type(tl.float32))
    comp = tl.load(row + 9).to(tl.pointer_type(tl.bfloat16))
    key = tl.load(keys_ptr + t).to(tl.uint32) if ROUNDING == 1 else 0
    grad = tl.load(grad_ptrs + t).to(tl.pointer_type(G_DTYPE))
    if ALIGNED:
        buf = tl.multiple_of(buf, 16)
        param = tl.multiple_of(param, 16)
        exp_avg = tl.multiple_of(exp_avg, 16)
        exp_avg_sq = tl.multiple_of(exp_avg_sq, 16)
        max_exp_avg_sq = tl.multiple_of(max_exp_avg_sq, 16)
        grad = tl.multiple_of(grad, 16)
    for off in range(start, end, BLOCK):
        if off + BLOCK <= end:
            _adam_tile(grad, buf, param, exp_avg, exp_avg_sq, max_exp_avg_sq, comp, key, off, end, scale_ptr,
                       clip_ptr, weight, weight_sum, decay_factor, weight_decay, lerp_weight, beta2, one_minus_beta2,
                       bc2_sqrt, eps, neg_step_size, ROUNDING, P_DTYPE, FUSE, OVERWRITE, HAS_SCALE, HAS_CLIP, HAS_WD,
                       DECOUPLED, AMSGRAD, MAXIMIZE, False, BLOCK)
        else:
            _adam_tile(grad, buf, param, exp_avg, exp_avg_sq, max_exp_avg_sq, comp, key, off, end, scale_ptr,
                       clip_ptr, weight, weight_sum, decay_factor, weight_decay, lerp_weight, beta2, one_minus_beta2,
                       bc2_sqrt, eps, neg_step_size, ROUNDING, P_DTYPE, FUSE, OVERWRITE, HAS_SCALE, HAS_CLIP, HAS_WD,
                       DECOUPLED, AMSGRAD, MAXIMIZE, True, BLOCK)


@triton.jit
def _adam_tile(grad, buf, param, exp_avg, exp_avg_sq, max_exp_avg_sq, comp, key, off, end, scale_ptr, clip_ptr,
               weight, weight_sum, decay_factor, weight_decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt,
               eps, neg_step_size, ROUNDING: tl.constexpr, P_DTYPE: tl.constexpr,
               FUSE: tl.constexpr, OVERWRITE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_CLIP: tl.constexpr,
               HAS_WD: tl.constexpr, DECOUPLED: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
               MASKED: tl.constexpr, BLOCK: tl.constexpr):
    offs = off + tl.arange(0, BLOCK)
    mask = offs < end if MASKED else None
    other = 0.0 if MASKED else None
    # window sum, with the last micro-batch folded in: (0 or acc) + weight * g / scale
    if FUSE:
        acc = tl.load(grad + offs, mask=mask, other=other).to(tl.float32) * weight
        if HAS_SCALE:
            acc = tl.div_rn(acc, tl.load(scale_ptr))
        if not OVERWRITE:
            acc = tl.load(buf + offs, mask=mask, other=other) + acc
    else:
        acc = tl.load(buf + offs, mask=mask, other=other)
    # window gradient g = acc / W * c, negated for maximize
    g = tl.div_rn(acc, weight_sum)
    if HAS_CLIP:
        g = g * tl.load(clip_ptr)
    if MAXIMIZE:
        g = -g
    p = _load_param(param, comp, offs, mask, other, ROUNDING)
    if HAS_WD:
        if DECOUPLED:
            p = p * decay_factor
        else:
            g = tl.fma(p, weight_decay, g)  # grad.add(param, alpha=weight_decay)
    # exp_avg.lerp_(g, 1 - beta1): w < 0.5 ? a + w*(b-a) : b - (b-a)*(1-w), with torch's FMAs
    m = tl.load(exp_avg + offs, mask=mask, other=other)
    diff = g - m
    m = tl.where(lerp_weight < 0.5, tl.fma(lerp_weight, diff, m), tl.fma(lerp_weight - 1.0, diff, g))
    tl.store(exp_avg + offs, m, mask=mask)
    # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    v = tl.fma(one_minus_beta2 * g, g, tl.load(exp_avg_sq + offs, mask=mask, other=other) * beta2)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    if AMSGRAD:
        v = tl.maximum(tl.load(max_exp_avg_sq + offs, mask=mask, other=other), v,
                       propagate_nan=tl.PropagateNan.ALL)
        tl.store(max_exp_avg_sq + offs, v, mask=mask)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)  # param.addcdiv_(m, denom, value=-step_size)
    _store_param(param, comp, key, offs, p, mask, P_DTYPE, ROUNDING)
