"""BatchNorm running statistics over an accumulation window: the big batch's, not k micro-batches'.

Owns: ``window_batchnorm(model, opt)``, which takes over the ``forward`` of the BatchNorm
modules of ``model`` (``nn.BatchNorm1d/2d/3d`` with ``track_running_stats=True``) so that, in
training mode, a forward still normalises with its micro-batch's own statistics (the same output
and gradients as the module's own forward) but leaves ``running_mean`` / ``running_var`` /
``num_batches_tracked`` alone and records the micro-batch's per-channel statistics instead; when
``opt``'s window closes, the window's pooled statistics update the running statistics once, as
one forward over the concatenated big batch would. The math is here, in one place: per channel a
set of samples is (n, mean, M2), M2 the sum of squared deviations; micro-batches combine with
Chan et al.'s parallel formula, ranks with one all_reduce of sums, and the running update is
``_BatchNorm.forward``'s.

Why: with gradient accumulation each micro-batch's forward updates the running statistics, so
an update of k micro-batches applies the momentum k times, each time to the statistics of a k-th
of the samples (pytorch #46516): the running statistics forget k times faster than the big
batch's (momentum 0.1, k = 8: 0.9^8 = 0.43 of the old value kept per update instead of 0.9), are
noisier, and ``num_batches_tracked`` counts micro-batches.

What cannot be made exact: the forward normalisation. The big batch's forward normalises
micro-batch 1 with the statistics of all k micro-batches, so micro-batch 1's output, and its
backward, would need micro-batch k's statistics first: that means holding every micro-batch's
activations until the window's last forward (the memory accumulation exists to save), or running
every forward twice. So each micro-batch is normalised with its own statistics, exactly as
without accum_fused. That is ghost batch normalisation (Hoffer et al., 2017, "Train longer,
generalize better"), which is often a regulariser in its own right; only the running statistics,
which evaluation uses, become the big batch's.

Must not: change a forward's output or gradients, or touch the window's buffers or counters:
it only listens (window.WindowListeners) and keeps its own records on the handle.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from ..base import AccumulatingOptimizer
from ..optim import GradientAccumulator
from ..window import window_listeners

# The optimizer state_dict's entry: {qualified module name: {"count", "mean", "m2"}}.
STATE_KEY = "window_batchnorm"

Stats = tuple[float, Tensor, Tensor]  # per channel: (element count n, mean, M2), mean and M2 in fp64


# ------------------------------------------------------------------------------- the math
@torch.no_grad()
def _moments(x: Tensor) -> Stats:
    """(n, mean, M2) per channel (dim 1, whatever the memory format) of a BatchNorm input, by two
    passes in fp32 (fp64 input stays fp64): the mean, then the squared deviations from it (variance
    relative error 1e-7 to 4e-7 measured on N(5, 3^2) data). torch.var_mean (Welford) is as exact
    but 20x slower on CPU: on one core, 16x64x32x32 fp32, 6.0 ms against 0.29 ms here and 1.9 ms
    for BatchNorm's forward."""
    x = x.detach()
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    dims = [0, *range(2, x.dim())]
    mean = x.mean(dim=dims, keepdim=True)
    m2 = (x - mean).square_().sum(dim=dims)  # (a temporary the size of x, as the forward's output)
    return float(x.numel() // x.shape[1]), mean.flatten().double(), m2.double()


def _combine(a: Stats | None, b: Stats) -> Stats:
    """Chan et al.'s parallel formula: the (n, mean, M2) of two sets of samples together, of any
    sizes. It adds squared deviations, never squares of raw values, so a large mean cancels no
    digits."""
    if a is None:
        return b
    (na, ma, m2a), (nb, mb, m2b) = a, b
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), m2a + m2b + delta.square() * (na * nb / n)


def _pool_ranks(stats: list[Stats | None], modules: list[_BatchNorm], group) -> list[Stats | None]:
    """Every rank's window statistics pooled over ``group``: one all_reduce of the per-channel
    sums (n, n*mean, M2 + n*mean^2) in fp64, zeros where a rank has none (every rank takes part,
    as every rank closes the window). Sums, so that one all_reduce pools them (Chan's pairs would
    need an all_gather); the price, M2 recovered as a difference, is about (mean/std)^2 * 1e-16
    relative in fp64: negligible for activations."""
    device = modules[0].running_mean.device
    parts = []
    for m, s in zip(modules, stats):
        if s is None:
            parts.append(torch.zeros(1 + 2 * m.running_mean.numel(), dtype=torch.float64, device=device))
        else:
            n, mean, m2 = s
            parts.append(torch.cat([mean.new_tensor([n]), n * mean, m2 + n * mean.square()]).to(device))
    flat = torch.cat(parts)
    torch.distributed.all_reduce(flat, group=group)
    pieces = flat.split([p.numel() for p in parts])
    counts = torch.stack([piece[0] for piece in pieces]).tolist()  # (one host sync, not one per module)
    pooled = []
    for n, piece in zip(counts, pieces):
        if n == 0:
            pooled.append(None)
            continue
        s1, s2 = piece[1:].chunk(2)
        mean = s1 / n
        pooled.append((n, mean, (s2 - n * mean.square()).clamp_min(0)))
    return pooled


@torch.no_grad()
def _update_running(m: _BatchNorm, stats: Stats) -> None:
    """What one training forward of ``m`` over the window's samples does to its running statistics
    (``_BatchNorm.forward`` and the native kernel): num_batches_tracked += 1, then
    running = (1 - f) * running + f * stat with the unbiased variance M2 / (n - 1), f the momentum,
    or 1 / num_batches_tracked when momentum is None (a cumulative average); in fp64 (the CPU
    kernel's accumulation type for fp32), then rounded to the buffer's dtype."""
    n, mean, m2 = stats
    factor = 0.0 if m.momentum is None else m.momentum
    if m.num_batches_tracked is not None:
        m.num_batches_tracked.add_(1)
        if m.momentum is None:
            factor = 1.0 / float(m.num_batches_tracked)
    # (n >= 2: BatchNorm refuses a training forward with one value per channel.)
    for running, stat in ((m.running_mean, mean), (m.running_var, m2 / (n - 1))):
        running.copy_(running.double() * (1 - factor) + stat.to(running.device) * factor)


# ----------------------------------------------------------------------------- the modules
def _no_optimizer():
    return None


class _Taken:
    """One BatchNorm module taken over: its forward, its optimizer (weakly: a model does not
    keep an optimizer alive) and the statistics of its training forwards in the open window."""

    def __init__(self, module: _BatchNorm, opt=None) -> None:
        self.module = module
        self.optimizer = _no_optimizer if opt is None else weakref.ref(opt)
        self.pending: Stats | None = None

    def __reduce__(self):
        # A copy of the model (deepcopy, pickle, torch.save: an EMA model, say) is not the
        # handle's, whose window would never apply its statistics: its modules behave as their
        # own forward, and another window_batchnorm may take them.
        return _Taken, (self.module,)

    def forward(self, input: Tensor) -> Tensor:
        m = self.module
        opt = self.optimizer()
        if not m.training or opt is None or opt._closed:
            # Eval mode reads the running statistics; without a window that can close (the
            # optimizer closed or collected) the module is its own again.
            return type(m).forward(m, input)
        m._check_input_dim(input)
        # _BatchNorm.forward's own call for track_running_stats=False: normalised with the
        # micro-batch's statistics, the running statistics not passed, so not updated.
        out = F.batch_norm(input, None, None, m.weight, m.bias, True, 0.0, m.eps)
        self.pending = _combine(self.pending, _moments(input))  # after the forward succeeded
        return out


class WindowBatchNorm:
    """What ``window_batchnorm`` did: ``modules`` (the BatchNorm modules taken, in model order)
    and ``names`` (their qualified names in the model). It is the optimizer's window listener;
    ``remove()`` gives the modules their own forward back, drops the open window's statistics and
    unregisters everything (idempotent)."""

    def __init__(self, taken: dict[str, _Taken], opt) -> None:
        self._taken = taken
        self.names = list(taken)
        self.modules = [t.module for t in taken.values()]
        self._optimizer = weakref.ref(opt)
        self._loading: dict[str, Stats] | None = None
        # GradientAccumulator's state_dict() is its inner optimizer's plus the window: torch's
        # hooks run on the inner one.
        target = opt.optimizer if isinstance(opt, GradientAccumulator) else opt
        self._hooks = [target.register_state_dict_post_hook(self._save),
                       target.register_load_state_dict_pre_hook(self._check_load),
                       target.register_load_state_dict_post_hook(self._load)]

    # -------------------------------------------------------------- window listener
    def window_closed(self, opt, applied: bool) -> None:
        """Applied or skipped (non-finite gradients), the big batch's forward would have updated
        the running statistics: they are updated either way."""
        stats = [t.pending for t in self._taken.values()]
        self.window_discarded(opt)
        if opt.process_group is not None:
            stats = _pool_ranks(stats, self.modules, opt.process_group)
        for m, s in zip(self.modules, stats):
            if s is not None:
                _update_running(m, s)

    def window_discarded(self, opt) -> None:
        for t in self._taken.values():
            t.pending = None

    # ------------------------------------------------------------------- checkpoint
    def _save(self, optimizer, state_dict: dict) -> None:
        state_dict[STATE_KEY] = {name: {"count": t.pending[0], "mean": t.pending[1].clone(), "m2": t.pending[2].clone()}
                                 for name, t in self._taken.items() if t.pending is not None}

    def _check_load(self, optimizer, state_dict: dict) -> None:
        """Checked before the optimizer loads anything; applied by _load once it has."""
        loading = {}
        for name, saved in state_dict.get(STATE_KEY, {}).items():
            t = self._taken.get(name)
            if t is None:
                raise ValueError(
                    f"the checkpoint holds window statistics of BatchNorm {name!r}, which this window_batchnorm "
                    f"handle does not take (it takes {self.names}): load it with the model it was saved with"
                )
            channels = (t.module.running_mean.numel(),)
            if saved["mean"].shape != channels or saved["m2"].shape != channels:
                raise ValueError(f"the checkpoint's window statistics of BatchNorm {name!r} have "
                                 f"{tuple(saved['mean'].shape)} channels, the module {channels}")
            device = t.module.running_mean.device
            loading[name] = (float(saved["count"]), saved["mean"].to(device, torch.float64),
                             saved["m2"].to(device, torch.float64))
        self._loading = loading

    def _load(self, optimizer) -> None:
        """The loaded window replaces the open one: so do its statistics (none when it has none)."""
        loading, self._loading = self._loading or {}, None
        for name, t in self._taken.items():
            t.pending = loading.get(name)

    # ----------------------------------------------------------------------- remove
    def remove(self) -> None:
        for t in self._taken.values():
            if t.module.__dict__.get("forward") == t.forward:
                del t.module.forward
        self._taken.clear()
        opt = self._optimizer()
        if opt is not None and self in opt._window_listeners:
            opt._window_listeners.remove(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def window_batchnorm(model: nn.Module, opt) -> WindowBatchNorm:
    """Make the running statistics of ``model``'s BatchNorm modules those of ``opt``'s window
    (the big batch), not those of its k micro-batches. Returns a handle (``modules``,
    ``names``, ``remove()``).

    Takes every ``nn.BatchNorm1d/2d/3d`` of ``model`` that tracks running statistics
    (``track_running_stats=True``); others are left alone. In training mode a forward normalises
    with its micro-batch's own statistics, exactly as before (the same output and gradients),
    does not touch ``running_mean`` / ``running_var`` / ``num_batches_tracked``, and records the
    micro-batch's per-channel element count, mean and sum of squared deviations (fp32 pass over
    the input, kept in fp64). When the window closes (the update applied, or skipped for
    non-finite gradients: the big batch's forward would have updated the statistics all the same)
    they update the running statistics once, as one training forward over the concatenation of
    the window's micro-batches would: mean, unbiased variance, ``momentum`` (or the cumulative
    average when it is None), ``num_batches_tracked += 1``. A window given up without closing (a
    failed backward pass that discards it, mode A's ``zero_grad()`` with micro-batches in the
    window) drops them; a window that closes without training forwards changes nothing. The
    statistics are every training forward's since the last window close: a forward whose backward
    failed but whose micro-batch was taken back out exactly, or a training forward without
    backward, counts, as it would have updated the running statistics without accum_fused.
    Eval mode is untouched.

    The forward normalisation cannot be the big batch's: micro-batch 1's would need micro-batch
    k's statistics before micro-batch 1's backward, i.e. every micro-batch's activations held
    until the last forward. Normalising with micro-batch statistics is ghost batch normalisation
    (Hoffer et al., 2017), often a regulariser.

    Several processes: with ``opt.process_group`` (given, or taken from a DDP module) the
    statistics are pooled over its ranks when the window closes (one fp64 all_reduce; window
    close is collective already), so they are the big batch over every rank's micro-batches:
    call this on every rank, with the same model. FSDP2 and ``nn.SyncBatchNorm`` are refused.

    Checkpoints: ``opt.state_dict()`` saves the open window's statistics (under
    ``"window_batchnorm"``, by module name) and ``opt.load_state_dict()`` restores them: call
    ``window_batchnorm`` before loading. After ``opt.close()`` (or when ``opt`` is collected) the
    modules behave as their own forward again (running statistics per micro-batch), as do the
    modules of a copy of the model (deepcopy, pickle: an EMA model), which no window would
    update; another ``window_batchnorm`` may take those."""
    if not isinstance(opt, AccumulatingOptimizer):
        raise TypeError(
            f"window_batchnorm needs an accum_fused optimizer (SGD, Adam, AdamW, GradientAccumulator), got "
            f"{type(opt).__name__}: it updates the running statistics when that optimizer's window closes"
        )
    opt._check_open("window_batchnorm()")
    if opt._window.shards is not None:
        raise ValueError("window_batchnorm does not support FSDP2 (DTensor parameters) yet")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    taken, untracked = {}, []
    for name, m in model.named_modules():
        if not isinstance(m, _BatchNorm):
            continue
        label = repr(name) if name else type(model).__name__
        if not m.track_running_stats or m.running_mean is None:
            untracked.append(label)
            continue
        owner = getattr(m.forward, "__self__", None)
        if isinstance(owner, _Taken) and owner.optimizer() is not None:
            raise ValueError(f"BatchNorm {label} is taken by window_batchnorm already: call the earlier handle's "
                             "remove() first")
        if isinstance(m, nn.SyncBatchNorm):
            raise ValueError(
                f"{label} is an nn.SyncBatchNorm, which window_batchnorm does not support (its forward synchronises "
                "each micro-batch across ranks, a path it does not take over). Use nn.BatchNorm*d: window_batchnorm "
                "pools the window's statistics over opt.process_group when the window closes (each rank's forward "
                "then normalises with its own micro-batch); or pass only the submodules without SyncBatchNorm"
            )
        if type(m).forward is not _BatchNorm.forward or ("forward" in m.__dict__ and not isinstance(owner, _Taken)):
            raise ValueError(f"BatchNorm {label} ({type(m).__name__}) has a forward of its own, which window_batchnorm "
                             "would replace: pass only the submodules whose BatchNorm layers are torch's")
        if is_lazy(m.running_mean):
            raise ValueError(f"{label} is a lazy BatchNorm that has not seen an input: run one forward first")
        taken[name] = _Taken(m, opt)
    if not taken:
        why = (f"its BatchNorm modules ({', '.join(untracked)}) do not track running statistics "
               "(track_running_stats=False)" if untracked else "it has no nn.BatchNorm1d/2d/3d module")
        raise ValueError(f"window_batchnorm found nothing to take in this {type(model).__name__}: {why}; pass the "
                         "model whose BatchNorm layers should keep the window's running statistics")
    others = [h for h in opt._window_listeners if isinstance(h, WindowBatchNorm)]
    if others:
        raise ValueError(f"this {type(opt).__name__} has a window_batchnorm handle already (taking {others[0].names}): "
                         "remove() it first, or take the whole model in one call")
    # After every check: a refused call changes nothing.
    handle = WindowBatchNorm(taken, opt)
    window_listeners(opt).append(handle)
    for t in taken.values():
        t.module.forward = t.forward
    return handle
