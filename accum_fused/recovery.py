"""Out-of-memory recovery: one micro-batch run as a transaction (``opt.run(batch, loss_fn)``).

Owns: ``run_micro_batch`` behind ``AccumulatingOptimizer.run``, recognising an out-of-memory
error, splitting a batch along dim 0 (``split_batch``), and the optimizer's ``RecoveryState``
(the largest part that worked, retries counted, growing back).

How a micro-batch is taken, per mode, so that a pass that runs out of memory leaves the window
as it was (or as the unsplit micro-batch would have left it), and its retry counts once:

- plain mode: every part's loss, times its share of the micro-batch's weight, goes through
  autograd into ``.grad``; only then does ``step(weight=w)`` take the micro-batch, once. A pass
  that fails has touched nothing but ``.grad``, which is emptied, and the micro-batch is run
  again in twice as many parts. Any exception leaves the window as it was before the micro-batch.
- in_backward (mode A and B): the hooks add each parameter's gradient into the window while
  backward runs, and a failed pass cannot be subtracted without keeping its gradients (measured
  2.7x slower on CPU, in_backward.settle_failed_pass). What a failed pass added, it added whole
  (a parameter's gradient is complete when its hook runs), so those parameters keep it
  (``Window.transaction.complete``) and the retried parts, which count as one micro-batch of the same
  weight (``Window.transaction.parts_left``), skip them. The pass folds nothing into the update and starts no
  collective (``Window.transaction.active``): its failure leaves no parameter updated and no rank
  waiting. An exception other than out-of-memory after something was added cannot be undone:
  mode B discards the window with a RuntimeWarning, mode A keeps the sum (autograd's semantics).

Ranks recover alone: no collective runs inside a micro-batch (the window's reduction at its
close is the only one), so a rank that splits takes longer and the others wait at the close.

Must not: touch the window's buffers or counters except through its fields for parts; the
update math is the optimizer's.
"""
from __future__ import annotations

import gc
import logging
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Callable

import torch
from torch import Tensor

from .framework_guard import user_stacklevel
from .window import tell_transaction

log = logging.getLogger("accum_fused")

# The CPU allocator raises a plain RuntimeError (torch 2.13: "[enforce fail at alloc_cpu.cpp:...]
# ... DefaultCPUAllocator: can't allocate memory ..."): no type to match there.
_CPU_OOM_MESSAGES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (CUDA and the other device allocators), Python's MemoryError, or the
    CPU allocator's RuntimeError."""
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CPU_OOM_MESSAGES)


class RecoveryState:
    """``opt.recovery``: what out-of-memory recovery learnt and did.

    ``max_part_size``: the largest number of samples a part may hold, learnt from an
    out-of-memory error (None: micro-batches run whole); later micro-batches start split to it.
    ``grow_back_after``: after this many windows closed without an out-of-memory error the limit
    doubles (None: it stays). ``retries``: passes that ran out of memory and were retried."""

    def __init__(self) -> None:
        self._max_part_size: int | None = None
        self._grow_back_after: int | None = None
        self.retries = 0
        self._clean_windows = 0
        self._updates_seen = 0
        self._failed_in_window = False

    @property
    def max_part_size(self) -> int | None:
        return self._max_part_size

    @max_part_size.setter
    def max_part_size(self, value) -> None:
        self._max_part_size = _check_count("max_part_size", value)

    @property
    def grow_back_after(self) -> int | None:
        return self._grow_back_after

    @grow_back_after.setter
    def grow_back_after(self, value) -> None:
        self._grow_back_after = _check_count("grow_back_after", value)

    def __setstate__(self, state: dict) -> None:
        # Pickled before these were validated properties: plain attributes.
        for key in ("max_part_size", "grow_back_after"):
            if key in state:
                state["_" + key] = state.pop(key)
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"RecoveryState(max_part_size={self.max_part_size}, grow_back_after={self.grow_back_after}, "
                f"retries={self.retries})")

    def to_state(self) -> dict:
        # failed_in_window: an open window that ran out of memory is not clean after a resume
        # either (without it, a resumed run grew its parts back a window early: other parts).
        return {"max_part_size": self.max_part_size, "grow_back_after": self.grow_back_after,
                "retries": self.retries, "clean_windows": self._clean_windows,
                "failed_in_window": self._failed_in_window}

    def load_state(self, saved: dict, update_count: int) -> None:
        self.max_part_size, self.grow_back_after = saved["max_part_size"], saved["grow_back_after"]
        self.retries, self._clean_windows = saved["retries"], saved["clean_windows"]
        self._failed_in_window = saved.get("failed_in_window", False)  # (absent from older checkpoints: False, as before)
        self._updates_seen = update_count

    def _after_micro_batch(self, update_count: int) -> None:
        """Count the windows that closed since the last micro-batch; grow back after enough clean ones."""
        closed = update_count - self._updates_seen
        self._updates_seen = update_count
        if closed <= 0:
            return
        self._clean_windows = 0 if self._failed_in_window else self._clean_windows + closed
        self._failed_in_window = False
        if (self.grow_back_after is not None and self.max_part_size is not None
                and self._clean_windows >= self.grow_back_after):
            self.max_part_size *= 2
            self._clean_windows = 0
            log.info("accum_fused: %d windows without running out of memory: parts of up to %d samples from now on",
                     self.grow_back_after, self.max_part_size)


def _check_count(name: str, value) -> int | None:
    """None, or an int >= 1 (a part of 0 samples, or growing back after 0 windows, means nothing)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"opt.recovery.{name} must be an int >= 1 or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"opt.recovery.{name} must be >= 1 or None, got {value}")
    return int(value)


# ------------------------------------------------------------------------------------ batches
def num_samples(batch, _depth: int = 0) -> int | None:
    """The size along dim 0 of the first tensor in ``batch`` (tensors, sequences, mappings such
    as a Hugging Face BatchEncoding, and the attributes of a batch object of the user's own: a
    dataclass, a class holding its tensors), or None when it holds none."""
    if isinstance(batch, Tensor):
        return batch.shape[0] if batch.dim() else None
    items = _items(batch)
    if items is not None and _depth < 8:  # (a cycle of objects ends here)
        for item in items:
            n = num_samples(item, _depth + 1)
            if n is not None:
                return n
    return None


def _items(value) -> list | None:
    """What a batch holds: a sequence's items, a mapping's values, an object's attributes."""
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (str, bytes, int, float, complex, bool, type)) or value is None:
        return None
    attributes = getattr(value, "__dict__", None)
    return list(attributes.values()) if isinstance(attributes, dict) else None


def split_batch(batch, sizes: list[int]) -> list:
    """``batch`` split along dim 0 into parts of ``sizes`` samples: every tensor whose dim 0 is
    the batch's size is split (views, no copy); other values (scalars, strings, tensors of
    another size) are shared by every part. Containers keep their type (a BatchEncoding stays
    one, a namedtuple stays one)."""
    n = sum(sizes)

    def split(value) -> list:
        if isinstance(value, Tensor):
            if value.dim() and value.shape[0] == n:
                return list(value.split(sizes))
            return [value] * len(sizes)
        if isinstance(value, Mapping):
            columns = {key: split(item) for key, item in value.items()}
            return [_rebuild(value, {key: parts[i] for key, parts in columns.items()}) for i in range(len(sizes))]
        if isinstance(value, (list, tuple)):
            columns = [split(item) for item in value]
            return [_rebuild(value, [parts[i] for parts in columns]) for i in range(len(sizes))]
        if num_samples(value) == n:  # an object of the user's own holds batch tensors: only they can split it
            raise TypeError(f"opt.run() cannot split this batch: a {type(value).__name__} holds its tensors (tensors, "
                            "tuples, lists, dicts and namedtuples are split); pass split=fn(batch, n) -> n parts")
        return [value] * len(sizes)

    return split(batch)


def _rebuild(like, items):
    if isinstance(like, Mapping):
        if type(like) is dict:
            return dict(items)
        try:
            return type(like)(items)  # BatchEncoding(dict), OrderedDict, ...
        except TypeError:
            return dict(items)
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*items)
    return type(like)(items)


class _Part:
    """A part of a micro-batch and its sample count (None: not countable). ``shareable``: the
    sizes of the parts it was split with add up to the micro-batch's, so a ``weight=`` given for
    the micro-batch is shared among them by their sizes (a user's ``split`` may return parts
    that hold no countable tensor, or count something else). ``done``: in_backward, the
    parameters whose gradient of this part is in the window already (a failed pass of the part
    it was split from added them whole); its pass skips them, and no other part does."""
    __slots__ = ("batch", "size", "shareable", "done")

    def __init__(self, batch, size: int | None, shareable: bool = True):
        self.batch, self.size, self.shareable = batch, size, shareable
        self.done: frozenset = frozenset()

    def share(self, total: int | None) -> float:
        """The part's share of the micro-batch's samples (1 for the micro-batch whole)."""
        if self.size == total and self.shareable:
            return 1.0
        if not self.shareable:
            raise TypeError(
                "opt.run() with split=: the parts split(batch, n) returned hold no tensor to count samples by (or "
                "their counts do not add up to the batch's), so the micro-batch's weight cannot be shared among "
                "them: return (loss, weight) from loss_fn (mode A, which sums passes: give every part a tensor "
                "whose dim 0 counts its samples)")
        return self.size / total


def _split(batch, total: int | None, count: int, split: Callable | None) -> list[_Part]:
    if split is not None:
        pieces = split(batch, count)
        if not isinstance(pieces, (list, tuple)) or not pieces:
            raise ValueError(f"opt.run(): split(batch, {count}) must return a non-empty list of parts, got "
                             f"{type(pieces).__name__}{'' if pieces else ' (empty)'}")
        pieces = list(pieces)
        sizes = [num_samples(piece) for piece in pieces]
        shareable = total is not None and None not in sizes and sum(sizes) == total
        return [_Part(piece, size, shareable) for piece, size in zip(pieces, sizes)]
    if total is None:
        raise TypeError("opt.run() cannot split this batch: it holds no tensor with a batch dimension; pass "
                        "split=fn(batch, n) -> n parts")
    count = min(count, total)
    base, extra = divmod(total, count)
    sizes = [base + (i < extra) for i in range(count)]
    return [_Part(piece, size) for piece, size in zip(split_batch(batch, sizes), sizes)]


# ------------------------------------------------------------------------------------ the run
def run_micro_batch(opt, win, batch, loss_fn: Callable, weight: float | None, split: Callable | None,
                    step: Callable | None = None, scaler=None) -> Tensor:
    """``opt.run``: see AccumulatingOptimizer.run; ``win`` is its window. ``step``: what takes a plain-mode micro-batch
    (default ``opt.step``; a framework's wrapper passes its own, which calls ``opt.step``).
    ``scaler``: a torch.amp.GradScaler (plain mode): the parts' losses are scaled, the micro-batch
    is taken by ``scaler.step`` and ``scaler.update`` follows; a failed pass changes nothing of
    the scaler's (``scale()`` only reads its scale)."""
    if win.shards is not None:
        raise NotImplementedError(
            f"{type(opt).__name__}.run() with FSDP2 parameters: FSDP2 reduce-scatters inside every backward, so a "
            "rank that split its micro-batch would run collectives the other ranks do not; call "
            "opt.backward(loss, weight=...) yourself with micro-batches that fit"
        )
    if scaler is not None:
        if opt.in_backward:
            raise RuntimeError(f"{type(opt).__name__}(in_backward=True).run(scaler=...): GradScaler finds non-finite "
                               "gradients by reading .grad, which in_backward frees inside backward; use bf16")
        if step is not None:
            raise NotImplementedError("opt.run(scaler=...) through a framework's wrapper")
        step = _scaled_step(opt, scaler)
    if win.backward_done or win.passes.current is not None or win.transaction.parts_left:
        raise RuntimeError(f"{type(opt).__name__}.run() while another micro-batch is pending (backward() without "
                           "step(), or inside a backward pass): finish it first")
    state = opt.recovery
    total = num_samples(batch)
    parts = [_Part(batch, total)]
    if state.max_part_size is not None and total is not None and total > state.max_part_size:
        parts = _split(batch, total, math.ceil(total / state.max_part_size), split)
    tried = [_largest(parts)]
    progress = [0]  # in_backward: parts already in the window
    while True:
        closings = win.transaction.closings
        try:
            if opt.in_backward:
                loss = _run_in_backward(opt, win, parts, loss_fn, weight, total, progress)
            else:
                loss = _run_plain(opt, win, parts, loss_fn, weight, total, step or opt.step,
                                  scale=(lambda x: x) if scaler is None else scaler.scale)
            _end(win)
            state._after_micro_batch(win.update_count)
            return loss
        except Exception as exc:  # noqa: BLE001 (out-of-memory or not: decided here)
            tell_transaction(win, opt, "transaction_failed")  # (the failed pass's forwards do not count)
            # A failure in the window's update (it had begun: Window.close) is not the pass's: the
            # window is gone with it (Window.close), and retrying the micro-batch would make it
            # the first of a new window. Raised as it is.
            if not is_out_of_memory(exc) or win.transaction.closings != closings:
                _give_up(opt, win, progress[0])
                raise
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        # Out of memory. The exception and the frames holding the failed pass's tensors went
        # with the except block; free the rest, then run in more, smaller parts.
        state.retries += 1
        state._failed_in_window = True
        for p in opt.update_spec.params(opt):
            p.grad = None
        gc.collect()
        if any(p.is_cuda for p in opt.update_spec.params(opt)):
            torch.cuda.empty_cache()
        parts_in = progress[0] if opt.in_backward else 0
        try:
            if opt.in_backward:  # the parts in the window stay; the failed one (first left) becomes two
                failed = parts[0]
                smaller = [] if _one_sample([failed]) else _split(failed.batch, failed.size, 2, split)
                more = len(smaller) > 1
                for part in smaller:  # (what the failed pass added whole, theirs to skip; not the parts after)
                    part.done = frozenset(win.transaction.complete)
                parts = smaller + parts[1:]
            else:  # plain mode: the whole micro-batch again, in twice as many parts
                smaller = [] if _one_sample(parts) else _split(batch, total, 2 * len(parts), split)
                more = len(smaller) > len(parts)
                parts = smaller
        except Exception:
            _give_up(opt, win, parts_in)  # (a batch that cannot be split: the window as it was before it)
            raise
        if not more:  # (a user's split that cannot make more parts)
            _fail_at_one_sample(opt, win, tried, reason, parts_in)
        largest = _largest(parts)
        tried.append(largest)
        if isinstance(largest, int):  # (parts of unknown sizes teach later micro-batches nothing)
            state.max_part_size = largest if state.max_part_size is None else min(state.max_part_size, largest)
        log.warning("accum_fused: out of memory on a micro-batch (%s); retrying it in parts of up to %s samples "
                    "(retries so far: %d)", reason, largest, state.retries)


def _one_sample(parts: list[_Part]) -> bool:
    """Whether no part can be split further by its sample count (sizes known, none above 1)."""
    return all(p.size is not None and p.size <= 1 for p in parts)


def _largest(parts: list[_Part]) -> int | str:
    """The largest part's sample count, or "?" where a part's is unknown (a user's split)."""
    sizes = [p.size for p in parts]
    return "?" if None in sizes else max(sizes)


def _fail_at_one_sample(opt, win, tried: list, reason: str, parts_in: int):
    _give_up(opt, win, parts_in)
    raise RuntimeError(
        f"{type(opt).__name__}.run(): a part of one sample still runs out of memory ({reason}); part sizes tried: "
        f"{tried}. Reduce the memory one sample needs (activation checkpointing, shorter sequences, mixed "
        "precision); the window holds the micro-batches before this one"
    )


def _call(loss_fn, part: _Part, weight: float | None, total: int | None, summed: bool = False) -> tuple[Tensor, float]:
    """(loss, the part's weight): returned by loss_fn, else the caller's weight= shared by
    samples, else the part's sample count."""
    out = loss_fn(part.batch)
    loss, returned = out if isinstance(out, tuple) else (out, None)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError("opt.run(): loss_fn(batch) must return a scalar loss tensor, or (loss, weight)")
    if returned is not None:
        if summed:
            raise ValueError("opt.run() with in_backward=True and accumulation_steps=1 (mode A) sums the backward "
                             "passes: loss_fn must return the loss alone, scaled as your loop backpropagates it")
        return loss, float(returned)
    if weight is not None:
        share = part.share(total)
        return loss, float(weight) * share if share != 1.0 else float(weight)
    if part.size is None:
        raise TypeError("opt.run(): the batch holds no tensor to count its samples by: return (loss, weight) "
                        "from loss_fn, or pass weight=")
    return loss, float(part.size)


def _scaled_step(opt, scaler) -> Callable:
    def step(weight: float) -> None:
        scaler.step(opt, weight=weight)
        scaler.update()
    return step


def _run_plain(opt, win, parts: list[_Part], loss_fn, weight, total, step: Callable, scale: Callable) -> Tensor:
    """Every part through autograd into .grad (times its weight, rescaled by the total once at
    the end when split); then one step() takes the micro-batch."""
    for p in opt.update_spec.params(opt):
        p.grad = None
    tell_transaction(win, opt, "transaction_begins")
    if len(parts) == 1:
        win.transaction.part_serial += 1
        loss, w = _call(loss_fn, parts[0], weight, total)
        scale(loss).backward()
        step(weight=w)
        return loss.detach()
    losses, weights = [], []
    for part in parts:
        win.transaction.part_serial += 1
        loss, w = _call(loss_fn, part, weight, total)
        scale(loss * w).backward()
        losses.append(loss.detach())
        weights.append(w)
    micro_weight = sum(weights)
    with torch.no_grad():
        grads = [p.grad for p in opt.update_spec.params(opt) if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, micro_weight)
    step(weight=micro_weight)
    return _mean(losses, weights)


def _run_in_backward(opt, win, parts: list[_Part], loss_fn, weight, total, progress: list) -> Tensor:
    """Each part one backward pass into the window (``parts`` shrinks as they go in); the
    micro-batch counts once. Mode A sums passes: a part's loss is scaled by its share of the
    micro-batch's samples."""
    mode_a = opt.accumulation_steps == 1
    losses, weights = [], []
    win.transaction.active = True
    try:
        while parts:
            part = parts[0]
            win.transaction.complete.clear()  # (the skipped parameters are the part's own: Window.transaction.complete)
            win.transaction.complete.update(part.done)
            tell_transaction(win, opt, "transaction_begins")
            win.transaction.part_serial += 1
            loss, w = _call(loss_fn, part, weight, total, summed=mode_a)
            win.transaction.parts_left = len(parts) - 1
            if mode_a:
                share = part.share(total)
                opt.backward(loss * share if share != 1.0 else loss)
            else:
                opt.backward(loss, weight=w)
            losses.append(loss.detach())
            weights.append(w)
            parts.pop(0)
            progress[0] += 1
    finally:
        win.transaction.active = False
    return _mean(losses, weights)


def _mean(losses: list[Tensor], weights: list[float]) -> Tensor:
    if len(losses) == 1:
        return losses[0]
    total = sum(weights)
    return sum(loss * (w / total) for loss, w in zip(losses, weights))


def _end(win) -> None:
    win.transaction.parts_left = 0
    win.transaction.complete.clear()


def _give_up(opt, win, parts_in: int) -> None:
    """An exception other than out-of-memory: plain mode touched only .grad (emptied: the window
    is as it was). in_backward: nothing added, nothing changed; otherwise mode A keeps the sum
    (as autograd keeps a failed pass's .grad) and mode B discards the window, saying so."""
    added = parts_in > 0 or bool(win.transaction.complete)
    _end(win)
    if not opt.in_backward:
        for p in opt.update_spec.params(opt):
            p.grad = None
        return
    if added and opt.accumulation_steps > 1:
        lost = win.micro_step
        win.abandon(opt)
        warnings.warn(
            f"{type(opt).__name__}.run() (in_backward): a micro-batch failed after its gradients began to enter the "
            f"window, which cannot take them back out; the window was discarded with the {lost} micro-batch(es) it "
            "held before, and the next micro-batch starts a new window", RuntimeWarning, stacklevel=user_stacklevel())
