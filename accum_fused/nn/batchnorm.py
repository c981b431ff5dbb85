"""BatchNorm running statistics over an accumulation window: the big batch's, not k micro-batches'.

Owns: ``window_batchnorm(model, opt)``, which takes over the ``forward`` of the BatchNorm
modules of ``model`` (``nn.BatchNorm1d/2d/3d`` with ``track_running_stats=True``) so that, in
training mode, a forward still normalises with its micro-batch's own statistics (the same output
and gradients as the module's own forward) but leaves ``running_mean`` / ``running_var`` /
``num_batches_tracked`` alone and records the micro-batch's per-channel statistics instead; when
``opt``'s window closes, the window's pooled statistics update the running statistics as one
forward over the concatenated big batch would: once per call of the module, call j of every
micro-batch pooled together. Compiled (torch.compile), the record runs through a custom op with
an ordered effect, so that it is the eager record at every call. The math is here, in one place: per channel a
set of samples is (n, mean, M2), M2 the sum of squared deviations; micro-batches combine with
Chan et al.'s parallel formula, ranks with an all_reduce of sums, and the running update is
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

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from ..base import AccumulatingOptimizer, is_open, window_of
from ..checkpoint import Unclaimed
from ..optim import GradientAccumulator

# The optimizer state_dict's entry: {qualified module name: _Record.to_state()}.
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


def _pool_ranks(calls: list[list[Stats]], problems: list[str | None], names: list[str],
                modules: list[_BatchNorm], group) -> list[list[Stats]]:
    """Every rank's window statistics pooled over ``group``, call by call (``calls[i][j]``: module
    i's j-th call of each micro-batch, pooled over this rank's micro-batches). Two all_reduces,
    every rank taking part as every rank closes the window: the calls per micro-batch (the most
    any rank made, the fewest any rank with calls made, whether any rank's own record is
    inconsistent), so that every rank raises together or pads to the same layout; then the
    per-channel sums (n, n*mean, M2 + n*mean^2) in fp64, zeros where a rank has no such call.
    Sums, so that one all_reduce pools them (Chan's pairs would need an all_gather); the price,
    M2 recovered as a difference, is about (mean/std)^2 * 1e-16 relative in fp64: negligible for
    activations."""
    device = modules[0].running_mean.device
    none = 1 << 62  # the fewest calls of a rank without any
    agree = torch.tensor([[len(c), -(len(c) or none), problem is not None] for c, problem in zip(calls, problems)],
                         dtype=torch.int64, device=device)
    torch.distributed.all_reduce(agree, op=torch.distributed.ReduceOp.MAX, group=group)
    agreed = agree.tolist()
    for name, problem, (most, fewest, anywhere) in zip(names, problems, agreed):
        if problem is not None:
            raise RuntimeError(problem)
        if anywhere or (-fewest not in (most, none)):
            raise RuntimeError(
                f"BatchNorm {name!r}: the ranks' micro-batches call it a different number of times in this window "
                f"(between {min(-fewest, most)} and {most} per micro-batch; see the other ranks' errors), and its "
                "statistics were dropped: every micro-batch of every rank must call it equally often")
    parts = []
    for m, mine, (most, _, _) in zip(modules, calls, agreed):
        for j in range(most):
            if j < len(mine):
                n, mean, m2 = mine[j]
                parts.append(torch.cat([mean.new_tensor([n]), n * mean, m2 + n * mean.square()]).to(device))
            else:
                parts.append(torch.zeros(1 + 2 * m.running_mean.numel(), dtype=torch.float64, device=device))
    if not parts:
        return [[] for _ in modules]
    flat = torch.cat(parts)
    torch.distributed.all_reduce(flat, group=group)
    pieces = flat.split([p.numel() for p in parts])
    counts = torch.stack([piece[0] for piece in pieces]).tolist()  # (one host sync, not one per call)
    pooled, at = [], 0
    for most, _, _ in agreed:
        pooled.append([])
        for n, piece in zip(counts[at:at + most], pieces[at:at + most]):
            s1, s2 = piece[1:].chunk(2)
            mean = s1 / n
            pooled[-1].append((n, mean, (s2 - n * mean.square()).clamp_min(0)))
        at += most
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


# ------------------------------------------------------------------------ the window's record
def _miscount(name: str, calls: int, others: int) -> str:
    return (
        f"BatchNorm {name!r} was called {calls} time(s) in one micro-batch of this window and {others} time(s) in "
        "another: window_batchnorm updates the running statistics as the big batch's forward would, once per call, "
        "pooling call j of every micro-batch, so every micro-batch of a window must call the module equally often. "
        "A forward repeated before its micro-batch reached step() / opt.backward() (a retried micro-batch, a "
        "forward for logging) counts as more calls: run such forwards in eval mode (model.eval()), or in a window "
        "of their own"
    )


class _Record:
    """One module's training forwards in the open window. ``calls[j]``: the statistics of its j-th
    call in each micro-batch, pooled over the micro-batches (the big batch's forward makes the
    same calls, each on the concatenation of what the micro-batches passed to it);
    ``per_micro_batch``: how many calls a micro-batch makes, known once one micro-batch has
    ended; ``micro_batch`` / ``made``: the micro-batch being recorded (the window's
    (micro_step, part_serial): micro_step moves on when step() or a backward pass takes a
    micro-batch, part_serial when opt.run() runs a part of one) and its calls so far."""

    def __init__(self, calls: list[Stats] | None = None, per_micro_batch: int | None = None,
                 micro_batch: int | None = None, made: int = 0) -> None:
        self.calls = [] if calls is None else calls
        self.per_micro_batch = per_micro_batch
        self.micro_batch = micro_batch
        self.made = made

    def add(self, name: str, micro_batch: tuple[int, int], stats: Stats) -> None:
        """Pool one call's ``stats`` into the call it is; a call that makes its micro-batch's count
        differ from the others' raises and changes nothing."""
        per, made = self.per_micro_batch, self.made
        if micro_batch != self.micro_batch:  # the micro-batch recorded so far has ended
            if self.micro_batch is not None:
                if per is not None and made != per:
                    raise RuntimeError(_miscount(name, made, per))
                per = made
            made = 0
        if per is not None and made >= per:
            raise RuntimeError(_miscount(name, made + 1, per))
        if made < len(self.calls):
            self.calls[made] = _combine(self.calls[made], stats)
        else:
            self.calls.append(stats)
        self.per_micro_batch, self.micro_batch, self.made = per, micro_batch, made + 1

    def problem(self, name: str) -> str | None:
        """At the window's close: the last micro-batch made fewer calls than the others (more, or
        fewer in an earlier one, raised at a forward)."""
        if self.per_micro_batch is not None and self.made != self.per_micro_batch:
            return _miscount(name, self.made, self.per_micro_batch) + "; the window's statistics were dropped"
        return None

    def to_state(self) -> dict:
        return {"calls": [{"count": n, "mean": mean.clone(), "m2": m2.clone()} for n, mean, m2 in self.calls],
                "per_micro_batch": self.per_micro_batch, "micro_batch": self.micro_batch, "made": self.made}

    @classmethod
    def from_state(cls, name: str, saved: dict, module: _BatchNorm) -> _Record:
        """A saved record, checked against ``module``; a checkpoint from before per-call records
        holds one (count, mean, m2): one call per micro-batch, the micro-batches so far ended."""
        if "calls" not in saved:
            saved = {"calls": [saved], "per_micro_batch": 1, "micro_batch": None, "made": 0}
        channels = module.running_mean.numel()
        calls = []
        for call in saved["calls"]:
            if call["mean"].shape != (channels,) or call["m2"].shape != (channels,):
                raise ValueError(f"the checkpoint's window statistics of BatchNorm {name!r} are of "
                                 f"{call['mean'].numel()} channels, the module has {channels}: load it with the "
                                 "model it was saved with")
            device = module.running_mean.device
            calls.append((float(call["count"]), call["mean"].to(device, torch.float64),
                          call["m2"].to(device, torch.float64)))
        return cls(calls, saved["per_micro_batch"], saved["micro_batch"], saved["made"])


# ----------------------------------------------------------------------------- the modules
def _no_optimizer():
    return None


# The modules taken, by slot: how the compiled forward's record op finds its module.
_TAKEN: weakref.WeakValueDictionary[int, _Taken] = weakref.WeakValueDictionary()
_SLOTS = itertools.count()


class _Taken:
    """One BatchNorm module taken over: its forward, its optimizer (weakly: a model does not
    keep an optimizer alive) and the record of its training forwards in the open window."""

    def __init__(self, module: _BatchNorm, opt=None, name: str = "") -> None:
        self.module = module
        self.name = name
        self.optimizer = _no_optimizer if opt is None else weakref.ref(opt)
        self.record = _Record()
        self.slot = next(_SLOTS)
        _TAKEN[self.slot] = self

    def __reduce__(self):
        # A copy of the model (deepcopy, pickle, torch.save: an EMA model, say) is not the
        # handle's, whose window would never apply its statistics: its modules behave as their
        # own forward, and another window_batchnorm may take them.
        return _Taken, (self.module,)

    def forward(self, input: Tensor) -> Tensor:
        m = self.module
        opt = self.optimizer()
        if not m.training or opt is None or not is_open(opt) or not torch.is_grad_enabled():
            # Eval mode reads the running statistics; without a window that can close (the
            # optimizer closed or collected) the module is its own again. A train-mode forward
            # under no_grad (a metric pass in train mode, precise-BN's recalibration) is no
            # micro-batch's: torch's own forward counts it, as it would without window_batchnorm
            # (it used to count as one more call of the micro-batch, and the window's close
            # refused the window after its update was applied).
            return type(m).forward(m, input)
        m._check_input_dim(input)
        # _BatchNorm.forward's own call for track_running_stats=False: normalised with the
        # micro-batch's statistics, the running statistics not passed, so not updated.
        out = F.batch_norm(input, None, None, m.weight, m.bias, True, 0.0, m.eps)
        if torch.compiler.is_compiling():
            # Traced, the record would run once, at tracing, with its Python numbers baked into the
            # graph (element counts stuck at 100, 200, 300, 300 over four micro-batches of 100; the
            # running variance 1.94x the big batch's after 10 windows): the graph calls this op
            # instead, which records in Python at every call, in call order (an ordered effect).
            _compiled_record(input.detach(), self.slot)
        else:
            self.add(input)  # after the forward succeeded
        return out

    def add(self, input: Tensor) -> None:
        opt = self.optimizer()
        if opt is not None:  # (a compiled graph may outlive the optimizer)
            # (a part of a micro-batch that opt.run split records as a micro-batch of its own:
            # its calls pool into the same calls; recovery.py counts parts in part_serial)
            win = window_of(opt)
            self.record.add(self.name, (win.micro_step, win.transaction.part_serial), _moments(input))


@torch.library.custom_op("accum_fused::window_batchnorm_record", mutates_args=())
def _record_op(input: Tensor, slot: int) -> None:
    """The compiled forward's record: ``_Taken.add`` of the module taken in ``slot``. Returns
    nothing and is kept in the graph (not dead code) and in call order by its ordered effect."""
    taken = _TAKEN.get(slot)
    if taken is not None:
        taken.add(input)


@_record_op.register_fake
def _(input: Tensor, slot: int) -> None:
    return None


# torch >= 2.10: a custom op can declare an ordered effect, and the compiled record stays in the graph.
ORDERED_EFFECTS = hasattr(_record_op, "register_effect")
if ORDERED_EFFECTS:
    _record_op.register_effect(torch.library.EffectType.ORDERED)
    _compiled_record = _record_op
else:
    # Before torch 2.10 a custom op cannot declare an ordered effect, and a graph may drop or
    # reorder an op that returns nothing: the compiled forward calls the eager record through a
    # graph break instead (correct, one break per BatchNorm call; fullgraph=True refuses it).
    _compiled_record = torch._dynamo.disable(_record_op)


class WindowBatchNorm:
    """What ``window_batchnorm`` did: ``modules`` (the BatchNorm modules taken, in model order)
    and ``names`` (their qualified names in the model). It is the optimizer's window listener;
    ``remove()`` gives the modules their own forward back, drops the open window's statistics and
    unregisters everything (idempotent)."""

    state_key = STATE_KEY  # its entry of the optimizer's state_dict (checkpoint.py asks)

    def __init__(self, taken: dict[str, _Taken], opt) -> None:
        self._taken = taken
        self.names = list(taken)
        self.modules = [t.module for t in taken.values()]
        self._optimizer = weakref.ref(opt)
        self._loading: dict[str, _Record] | None = None
        # GradientAccumulator's state_dict() is its inner optimizer's plus the window: torch's
        # hooks run on the inner one.
        target = opt.optimizer if isinstance(opt, GradientAccumulator) else opt
        self._hooks = [target.register_state_dict_post_hook(self._save),
                       target.register_load_state_dict_pre_hook(self._check_load),
                       target.register_load_state_dict_post_hook(self._load)]

    # -------------------------------------------------------------- window listener
    def window_closed(self, opt, applied: bool) -> None:
        """Applied or skipped (non-finite gradients), the big batch's forward would have updated
        the running statistics: they are updated either way, once per call, in call order. Every
        module's record is checked before any running statistic changes."""
        records = [t.record for t in self._taken.values()]
        self.window_discarded(opt)
        calls = [r.calls for r in records]
        problems = [r.problem(name) for name, r in zip(self.names, records)]
        if opt.process_group is not None:
            calls = _pool_ranks(calls, problems, self.names, self.modules, opt.process_group)
        for problem in problems:
            if problem is not None:
                raise RuntimeError(problem)
        for m, module_calls in zip(self.modules, calls):
            for stats in module_calls:
                _update_running(m, stats)

    def window_discarded(self, opt) -> None:
        for t in self._taken.values():
            t.record = _Record()

    def transaction_begins(self, opt) -> None:
        """opt.run() starts a pass that may fail (recovery.py): remember the records as they are."""
        self._before = {name: _Record(list(t.record.calls), t.record.per_micro_batch, t.record.micro_batch,
                                      t.record.made) for name, t in self._taken.items()}

    def transaction_failed(self, opt) -> None:
        """That pass failed: its forwards' statistics do not count."""
        before, self._before = getattr(self, "_before", None), None
        if before is not None:
            for name, t in self._taken.items():
                t.record = before[name]

    # ------------------------------------------------------------------- checkpoint
    def _save(self, optimizer, state_dict: dict) -> None:
        state_dict[STATE_KEY] = {name: t.record.to_state() for name, t in self._taken.items() if t.record.calls}

    def _check_load(self, optimizer, state_dict: dict) -> None:
        """Checked before the optimizer loads anything; applied by _load once it has."""
        self._loading = _parse_entry(self._taken, state_dict.get(STATE_KEY, {}))

    def _load(self, optimizer) -> None:
        """The loaded window replaces the open one: so do its statistics (none when it has none)."""
        loading, self._loading = self._loading or {}, None
        for name, t in self._taken.items():
            t.record = loading.get(name) or _Record()

    # ----------------------------------------------------------------------- remove
    def remove(self) -> None:
        """Give the modules their own forward back, drop the open window's statistics and stop
        listening to the optimizer (idempotent)."""
        for t in self._taken.values():
            t.optimizer = _no_optimizer  # (a compiled graph still calling its record op records nothing)
            if t.module.__dict__.get("forward") == t.forward:
                del t.module.forward
        self._taken.clear()
        opt = self._optimizer()
        listeners = [] if opt is None else window_of(opt).listeners
        if self in listeners:
            listeners.remove(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()


def _parse_entry(taken: dict[str, _Taken], entry: dict) -> dict[str, _Record]:
    """A checkpoint's ``"window_batchnorm"`` entry as records of the modules ``taken``, or a
    ValueError naming what does not match."""
    records = {}
    for name, saved in entry.items():
        t = taken.get(name)
        if t is None:
            raise ValueError(
                f"the checkpoint holds window statistics of BatchNorm {name!r}, which this window_batchnorm "
                f"handle does not take (it takes {list(taken)}): load it with the model it was saved with"
            )
        records[name] = _Record.from_state(name, saved, t.module)
    return records


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
    they update the running statistics as one training forward over the concatenation of the
    window's micro-batches would: mean, unbiased variance, ``momentum`` (or the cumulative average
    when it is None), ``num_batches_tracked += 1``, once per call of the module in that forward (a
    module called twice per forward, as in a siamese net, updates twice, in call order, the j-th
    update with the j-th calls of every micro-batch). A micro-batch is the forwards before its
    ``step()`` / backward pass; every micro-batch of a window must call the module equally often,
    or the offending forward (or the window's close) raises. A window given up without closing (a
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

    torch.compile: ``torch.compile(model)``, ``model.compile()`` (``fullgraph=True`` too), a
    compiled ``opt.step`` or training-step function record every call as eager does.

    Several processes: with ``opt.process_group`` (given, or taken from a DDP module) the
    statistics are pooled over its ranks when the window closes (two small fp64 all_reduces;
    window close is collective already), so they are the big batch over every rank's micro-batches:
    call this on every rank, with the same model. FSDP2 and ``nn.SyncBatchNorm`` are refused.

    Checkpoints: ``opt.state_dict()`` saves the open window's statistics (under
    ``"window_batchnorm"``, by module name) and ``opt.load_state_dict()`` restores them, whether
    ``window_batchnorm`` is called before or after loading (loaded first, the optimizer keeps them
    until this call claims them; a window that ends unclaimed warns that they were dropped). After ``opt.close()`` (or when ``opt`` is collected) the
    modules behave as their own forward again (running statistics per micro-batch), as do the
    modules of a copy of the model (deepcopy, pickle: an EMA model), which no window would
    update; another ``window_batchnorm`` may take those."""
    if not isinstance(opt, AccumulatingOptimizer):
        raise TypeError(
            f"window_batchnorm needs an accum_fused optimizer (SGD, Adam, AdamW, GradientAccumulator), got "
            f"{type(opt).__name__}: it updates the running statistics when that optimizer's window closes"
        )
    win = window_of(opt, "window_batchnorm()")
    listeners = win.listeners
    if win.shards is not None:
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
        taken[name] = _Taken(m, opt, name)
    if not taken:
        why = (f"its BatchNorm modules ({', '.join(untracked)}) do not track running statistics "
               "(track_running_stats=False)" if untracked else "it has no nn.BatchNorm1d/2d/3d module")
        raise ValueError(f"window_batchnorm found nothing to take in this {type(model).__name__}: {why}; pass the "
                         "model whose BatchNorm layers should keep the window's running statistics")
    others = [h for h in listeners if isinstance(h, WindowBatchNorm)]
    if others:
        raise ValueError(f"this {type(opt).__name__} has a window_batchnorm handle already (taking {others[0].names}): "
                         "remove() it first, or take the whole model in one call")
    # The open window's statistics of a checkpoint loaded before this call, waiting to be claimed.
    waiting = [w for w in listeners if isinstance(w, Unclaimed) and w.key == STATE_KEY]
    records = _parse_entry(taken, waiting[0].entry) if waiting else {}
    # After every check: a refused call changes nothing.
    handle = WindowBatchNorm(taken, opt)
    for w in waiting:
        listeners.remove(w)
    listeners.append(handle)
    for name, record in records.items():
        taken[name].record = record
    for t in taken.values():
        t.module.forward = t.forward
    return handle
