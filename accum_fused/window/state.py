"""The open accumulation window: one object, held by its optimizer, changed in place.

Owns: the window's buffers (``buffers[p]``, the weighted gradient sum of the open window in
``state_dtype(p)``; views into flat per-(device, dtype) storage when ranks synchronise), which
parameters are live, the micro-batch count, the weight total and its band, the found-inf flag,
the counters ``micro_step`` / ``updated`` / ``update_count`` / ``last_grad_norm`` that the
optimizer's properties read, and the cross-rank reducer the buffers belong to (``sync``:
replicas, ``shards``: FSDP2). Its verbs: ``begin_micro_batch`` / ``accumulate_one`` / ``write_one`` / ``adopt`` / ``mark_written`` /
``finish_micro_batch`` (one arriving parameter at a time, from in_backward.py's hooks),
``close`` (close.py), ``discard``, ``abandon`` (discard a window that held something, without
closing it). Plain mode's micro-batches (a whole micro-batch from step()) are plain.py's; the
step table and the update's kept lists table.py's. The other concerns that share the window
keep their fields in records on it, by owner: ``passes`` (in_backward.py's), ``transaction``
(recovery.py's), ``caches`` (the fast paths' mirrors of the window and their keys).

Must not: read ``.grad`` or touch hooks (the optimizer and in_backward.py hand gradients in),
or do per-element math (backends do). It asks its optimizer, passed to the verbs that need it,
for its update spec (``opt.update_spec``, update.py: the parameters, their backends and names,
the update itself), ``state``, ``accumulation_steps``, ``max_grad_norm``, ``in_backward``;
never for a private method.
It holds no reference to the optimizer, so a framework wrapper that copies the optimizer's
``__dict__`` (Lightning's LightningOptimizer) reaches the same window instead of splitting it.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..layout import fits, kernel_view, state_dtype
from .close import WindowListeners, close, tell_listeners
from .table import StepTable, UpdatePlan, conform_optimizer_state

# Weights are kept in units of 2**shift, shift a multiple of _WEIGHT_BAND, so that any finite
# positive weight fits the fp32 buffers (uniform 1e-46 weights underflowed fp32 to a zero update,
# 1e38 overflowed it to NaN). Weights in [1, 2**32) -- counts, token counts -- get shift 0 and the
# arithmetic is exactly what it was; other shifts are exact powers of two, so results are the same
# up to fp32 range. A later weight of 2**_WEIGHT_HEADROOM or more in the window's units moves the
# window to its band (one rescaling pass over the live buffers), so a scaled weight stays < 2**64.
_WEIGHT_BAND = 32
_WEIGHT_HEADROOM = 64


def _weight_band(weight: float) -> int:
    return _WEIGHT_BAND * math.floor(math.frexp(weight)[1] / _WEIGHT_BAND)


class _Record:
    """A few named fields, picklable (slots)."""

    __slots__ = ()

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state: dict) -> None:
        self.__init__()
        for name, value in state.items():
            setattr(self, name, value)


class PassRecords(_Record):
    """in_backward.py's records on the window: the backward pass running now (``current``, a
    BackwardPass), whether opt.backward() runs it (``own``), and whether opt.backward() was ever
    used in mode B (``owned``: then only its passes are micro-batches)."""

    __slots__ = ("current", "own", "owned")

    def __init__(self) -> None:
        self.current = None
        self.own = False
        self.owned = False


class Transaction(_Record):
    """Out-of-memory recovery's records on the window (recovery.py writes them): a micro-batch
    run as parts counts once. While ``parts_left`` > 0 the part being added is not the
    micro-batch's last: it neither counts nor closes the window. ``complete``: parameters whose
    gradient of the part being run is already in (a failed in-backward pass of the part it was
    split from added it whole), which its hooks drop; recovery.py sets it per part
    (_Part.done): the parts after it take their gradients whole. ``active``: a run() pass is
    running, whose failure must leave nothing half-applied (no update inside its hooks, no
    collective in it). ``part_serial``: bumped as each part runs (accum_fused.nn's records tell
    parts apart by it); ``closings``: bumped as close() begins (a failure after it was the
    update's, not a pass's)."""

    __slots__ = ("parts_left", "complete", "active", "part_serial", "closings")

    def __init__(self) -> None:
        self.parts_left = 0
        self.complete: set[Tensor] = set()
        self.active = False
        self.part_serial = 0
        self.closings = 0


# A window pickled before these records: its flat fields -> (record, field).
_FLAT_FIELDS = {"backward_pass": ("passes", "current"), "own_backward": ("passes", "own"),
                "backward_owned": ("passes", "owned"), "parts_left": ("transaction", "parts_left"),
                "complete": ("transaction", "complete"), "active": ("transaction", "active"),
                "part_serial": ("transaction", "part_serial"), "closings": ("transaction", "closings")}


# The mirrors' keys before the one epoch (dropped: a loaded window's tables are built anew).
_OLD_MIRRORS = ("version", "buffers_version")


class Mirrors:
    """The fast paths' tables of the window and what keeps them true (never pickled: rebuilt).
    ``epoch``: the window's layout epoch, bumped by every change to ``buffers``, ``live`` or
    ``adopted`` that the fast paths' tables are not told of (Window.changed): a table built at
    another epoch is stale. Plain mode's ``step_table`` (table.StepTable, every parameter's
    buffer and live flag) and the in-backward modes' ``hook_state`` (csrc/hooks.cpp's HookState,
    whose slots are the rows of the hooked parameters; in_backward.FastPath) each keep the epoch
    they are true to, and follow what they are told of (the takes they make, mark_live,
    python_took, the window's end). ``table_blocked``: the step table was built, or could not
    take a micro-batch, in this window (at most one build per window). ``update_plan``: the
    update's per-parameter lists, kept between closes while they stand (table.UpdatePlan)."""

    __slots__ = ("step_table", "table_blocked", "epoch", "update_plan", "hook_state")

    def __init__(self) -> None:
        self.step_table: StepTable | None = None
        self.table_blocked = False
        self.epoch = 0
        self.update_plan: UpdatePlan | None = None
        self.hook_state = None


class Window:
    """The open window; see the module docstring. ``live`` holds the parameters that received
    a gradient in the open window (their buffers are live; every other buffer is stale and the
    next gradient overwrites it, so no zeroing pass is ever needed)."""

    def __init__(self, sync=None, shards=None) -> None:
        self.buffers: dict[Tensor, Tensor] = {} if sync is None else sync.buffers
        self.live: set[Tensor] = set()
        self.micro_step = 0
        self.weight_sum = 0.0  # in units of 2**weight_shift
        self.weight_shift = 0
        self.found_inf: Tensor | None = None
        self.updated = False
        self.update_count = 0
        self.last_grad_norm: Tensor | None = None
        # Who else holds this window's sums: a distributed.WindowSync (process_group: the
        # buffers are its flat segments) or a distributed.ShardSync (FSDP2), or neither.
        self.sync = sync
        self.shards = shards
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
        # The records of the concerns that share the window (every holder of the window sees
        # the same ones): in_backward.py's backward passes, recovery.py's transaction, the fast
        # paths' mirrors of the window and what keeps them true.
        self.passes = PassRecords()
        self.transaction = Transaction()
        self.caches = Mirrors()
        # Buffers that are autograd's own gradient tensors (in_backward zero-copy), or that a
        # fused Linear's GEMM started (accum_fused.nn): dropped when the window closes, since the
        # next window adopts or writes fresh ones (resident 12 B/param for fp32 AdamW, as the
        # native loop after zero_grad, instead of 16).
        self.adopted: set[Tensor] = set()
        self.listeners = WindowListeners()  # told when the window ends (close.WindowListeners)

    def __getstate__(self) -> dict:
        # (the fast paths' mirrors are not picklable: a copy builds its own; nor are listeners
        # carried: see WindowListeners)
        return {**self.__dict__, "caches": Mirrors(), "listeners": WindowListeners()}

    def __setstate__(self, state: dict) -> None:
        # A window pickled before these records has their fields flat (or, before out-of-memory
        # recovery and the step table, not at all).
        if not isinstance(state.get("transaction", Transaction()), Transaction):
            state["active"] = state.pop("transaction")
        flat = {name: state.pop(name) for name in (*_FLAT_FIELDS, *Mirrors.__slots__, *_OLD_MIRRORS) if name in state}
        self.__dict__.update(passes=PassRecords(), transaction=Transaction(), caches=Mirrors(),
                             listeners=WindowListeners())
        self.__dict__.update(state)
        for name, value in flat.items():
            record, field = _FLAT_FIELDS.get(name, (None, None))
            if record is not None:
                setattr(getattr(self, record), field, value)

    def refuse_replaced_params(self, name: str) -> None:
        """Refuse parameters replaced in ``name``'s param groups while the window is open (its
        buffers are the old parameters'): base.py's _rewire and in_backward's pass alike."""
        if self.micro_step or self.live:
            raise RuntimeError(
                f"a param group's parameters were replaced (its \"params\" list or one in it) while {name}'s window "
                f"was open ({self.micro_step} micro-batch(es) in it): replace them between windows (after an update, "
                "or flush())"
            )

    def changed(self) -> None:
        """``buffers``, ``live`` or ``adopted`` changed in a way the fast paths' tables are not
        told of: a new layout epoch, in which they are built anew."""
        self.caches.epoch += 1

    def last_part(self) -> bool:
        """Whether the micro-batch being added ends with this part (see ``parts_left``)."""
        return self.transaction.parts_left == 0

    def closes_with(self, opt) -> bool:
        """Whether the micro-batch (part) being added now is the window's last."""
        return self.transaction.parts_left == 0 and self.micro_step + 1 >= opt.accumulation_steps

    @property
    def may_adopt(self) -> bool:
        """Whether a gradient may become its buffer (zero-copy, layout.adoptable): not where the
        buffers are views of flat storage the ranks reduce (process_group, DDP's buckets) or a
        sharded window (FSDP2)."""
        return self.sync is None and self.shards is None

    def folds_last(self, opt) -> bool:
        """Whether nothing needs the whole window before its update, so that the last
        micro-batch's gradients may go straight into the update pass (plain mode's last
        accumulate folded into the update kernel, mode B's per-parameter update in its hook):
        clipping needs the window's norm first, and ranks their reduced sums."""
        return opt.update_spec.folds_last_micro_batch and opt.max_grad_norm is None and not self.spans_ranks

    @property
    def spans_ranks(self) -> bool:
        """Whether closing the window needs the other ranks (process_group, FSDP2)."""
        return self.sync is not None or self.shards is not None

    # ------------------------------------------------------------------ taking gradients in
    def buffer(self, p: Tensor) -> Tensor:
        """``p``'s buffer, allocated when it has none."""
        buf = self.buffers.get(p)
        if buf is None:
            buf = self.buffers[p] = torch.empty_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            self.changed()
        return buf

    def enter_weight(self, weight: float) -> float:
        """``weight`` in the window's units (see _WEIGHT_BAND), moving the window to a higher
        band first when this weight would not fit the current one. With FSDP2 the units stay 1:
        opt.backward puts the weight into the loss, before the ranks' gradients are summed."""
        if self.shards is not None:
            return weight
        band = _weight_band(weight)
        if self.micro_step == 0 and not self.live:  # (not a later part of the first micro-batch)
            self.weight_shift = band
        elif band - self.weight_shift >= _WEIGHT_HEADROOM:
            factor = math.ldexp(1.0, self.weight_shift - band)
            live = [self.buffers[p] for p in self.live]
            if live:
                torch._foreach_mul_(live, factor)
            self.weight_sum *= factor
            self.weight_shift = band
        return math.ldexp(weight, -self.weight_shift)

    def running_found_inf(self, found_inf: Tensor | None) -> Tensor | None:
        """The window's non-finite flag with this micro-batch's (GradScaler's) added: summed on
        the device, so no host synchronisation per micro-batch."""
        if found_inf is None:
            return self.found_inf
        found = found_inf.detach().float()
        return found if self.found_inf is None else self.found_inf + found

    def count_micro_batch(self, opt, weight: float, found_inf: Tensor | None) -> None:
        """step()'s micro-batch (or its last part) is taken: counters, weight total, flag."""
        self.pending_weight = None
        self.backward_done = False
        self.micro_step += self.last_part()
        # in_backward mode A: the buffers hold the sum of the loop's backward passes (what
        # autograd would have summed into .grad), so the window's divisor is 1.
        self.weight_sum = 1.0 if opt.in_backward else self.weight_sum + weight
        self.found_inf = found_inf

    def take_pending_weight(self) -> float:
        """The weight given for the next micro-batch before its gradients (else 1), consumed."""
        weight = 1.0 if self.pending_weight is None else self.pending_weight
        self.pending_weight = None
        return weight

    def begin_micro_batch(self, opt, weight: float, closing: bool) -> tuple[float, float]:
        """in_backward: a micro-batch whose gradients will arrive one parameter at a time begins.
        Validates, brings ``weight`` into the window's units (mode A sums backward passes: units
        of 1) and, on the window's last micro-batch with a process group, exchanges the window's
        metadata now, so that the hooks can all-reduce buckets during this backward
        (distributed.py; the ranks' common weight band becomes the window's). Returns (weight,
        weight total including it), in the window's units. Live buffers are conformed here on the
        window's last micro-batch (the update reads them all); on the others, as each gradient
        arrives (the extension's hooks take only gradients that fit their buffer and hand the
        others to in_backward.py, which conforms first)."""
        if closing:
            self.conform_live(opt)
        if opt.accumulation_steps == 1:
            self.weight_shift = 0
        else:
            weight = self.enter_weight(weight)
        if closing and self.sync is not None and not self.transaction.active:
            # (a run() pass reduces at its end instead: a pass that fails must not leave a
            # collective half-done on this rank while the others wait in it)
            shift = self.sync.begin_overlapped_window(opt.update_spec.params(opt), self.live, self.weight_sum + weight,
                                                      self.weight_shift)
            weight, self.weight_sum = (math.ldexp(x, self.weight_shift - shift) for x in (weight, self.weight_sum))
            self.weight_shift = shift
        return weight, self.weight_sum + weight

    def finish_micro_batch(self, opt, weight: float, weight_sum: float, closing: bool,
                           updated_in_hooks: set | None = None, norms: dict | None = None) -> None:
        """in_backward: the micro-batch begun by begin_micro_batch has all its gradients in.
        Counts it; on the window's last micro-batch, closes the window (``updated_in_hooks``:
        the parameters its hooks already updated, when it was folded into the update; ``norms``:
        the window-gradient norms its hooks' accumulate passes produced, for clipping)."""
        if self.last_part():
            self.micro_step += 1
            self.transaction.complete.clear()
        self.weight_sum = weight_sum
        if self.shards is not None and opt.accumulation_steps > 1:
            self.late_weights.append(None)  # opt.backward put the weight into the loss
        if not closing:
            self.updated = False
        else:
            self.close(opt, (), weight, None, norms, updated_in_hooks=updated_in_hooks or frozenset())

    def hold_grads(self) -> None:
        """A micro-batch arrived without gradients: with FSDP2 they were held back
        (set_requires_gradient_sync(False)) and arrive summed with a later one's."""
        self.grads_held |= self.shards is not None

    def accumulate_one(self, p: Tensor, grad: Tensor, weight: float, backend,
                       norm_weight_sum: float | None = None) -> Tensor | None:
        """One parameter's gradient in (an in-backward hook): the hot path, one backend call.
        With ``norm_weight_sum``, returns ||acc / norm_weight_sum||, from the same pass."""
        norms = backend.accumulate(grads=[kernel_view(grad)], buffers=[kernel_view(self.buffer(p))], weight=weight,
                                   overwrite=p not in self.live, norm_weight_sum=norm_weight_sum)
        self.live.add(p)
        return None if norms is None else norms[0]

    def write_one(self, p: Tensor, writer, weight: float, backend=None,
                  norm_weight_sum: float | None = None) -> Tensor | None:
        """accum_fused.nn's fused Linear: ``writer`` puts weight x this micro-batch's gradient of
        ``p`` straight into its buffer (overwriting a stale one). With ``norm_weight_sum``,
        returns ||acc / norm_weight_sum|| (``backend``'s norm pass over the buffer)."""
        overwrite = p not in self.live
        buf = self.buffer(p)  # (without ranks, let go of as the window closes: below)
        writer.write(buf, weight, overwrite=overwrite)
        if overwrite and self.sync is None:
            self.adopted.add(p)  # let go when the window closes, as an adopted gradient is
        self.live.add(p)
        if norm_weight_sum is None:
            return None
        return backend.window_norms(buffers=[kernel_view(buf)], weight_sum=norm_weight_sum)[0]

    def join_ranks(self, sync) -> None:
        """The window's buffers move into ``sync``'s flat storage (a DDP module's group, taken
        over after construction): micro-batches already taken were not reduced, so their sums
        are reduced with the rest of the window."""
        for p in self.live:
            sync.buffers[p].copy_(self.buffers[p])
        self.buffers = sync.buffers
        self.adopted.clear()
        self.sync = sync
        self.changed()

    def mark_written(self, p: Tensor) -> None:
        """The extension's hooks overwrote ``p``'s stale buffer with its first gradient of the
        window (in_backward.FastPath): the buffer is live."""
        self.live.add(p)

    def adopt(self, params: list[Tensor], grads: list[Tensor], param_set: set[Tensor] | None = None) -> None:
        """Zero-copy first micro-batch: autograd's fresh gradients become ``params``' buffers (a
        stale buffer one had is dropped). ``param_set``: the same parameters as a set, whose
        hashes the set updates reuse (the extension's hooks adopted them in one pass). Only
        in_backward's hooks adopt, and they keep the extension's rows true themselves (the
        extension adopted them, or in_backward's python_took writes its row): no new epoch."""
        self.buffers.update(zip(params, grads))
        keys = params if param_set is None else param_set
        self.adopted.update(keys)
        self.live.update(keys)

    def conform_live(self, opt) -> None:
        """``conform`` of every live parameter before the window closes: where every parameter
        is live and the update's lists are kept (UpdatePlan), one extension call checks that
        nothing needs to follow its parameter, instead of a Python loop over them."""
        plan = UpdatePlan.for_window(opt, self, build=False)
        if plan is None or not plan.conforms(opt, self):
            self.conform(opt, list(self.live), closing=True)

    def conform(self, opt, params, closing: bool) -> None:
        """Validate before anything changes. A parameter whose dtype or device changed after
        construction (``model.double()``, ``model.to(...)``) carries its buffer and state
        along (value-preserving: widening is exact; narrowing rounds what the user narrowed);
        what cannot follow (a changed shape, flat cross-rank buffers) raises here."""
        for p in params:
            buf = self.buffers.get(p)
            if buf is not None and not fits(buf, p):
                if self.sync is not None:
                    raise RuntimeError(
                        f"{opt.update_spec.name(opt, p)} changed dtype, device or shape after this {type(opt).__name__} "
                        "was built with a process_group, whose buffers are fixed: convert the model before "
                        "building the optimizer"
                    )
                self.changed()
                if p not in self.live:
                    del self.buffers[p]  # stale: the next gradient allocates a fresh one
                elif buf.shape != p.shape:
                    raise ValueError(
                        f"{opt.update_spec.name(opt, p)} changed shape from {tuple(buf.shape)} in the middle of a window: its "
                        "accumulated gradient no longer fits it. Resize parameters between windows (after an "
                        "update or flush()), then build a new optimizer for them"
                    )
                else:
                    self.buffers[p] = buf.to(device=p.device, dtype=state_dtype(p))
        if closing:
            conform_optimizer_state(opt, params)  # the update reads it next

    # ------------------------------------------------------------------------- closing
    def close(self, opt, *args, **kwargs) -> bool:
        """Close the window (close.py's ``close``: sync -> found-inf -> clip -> update)."""
        return close(self, opt, *args, **kwargs)

    def discard(self) -> None:
        """Empty the window (counters of past updates stay). Buffers kept between windows stay
        allocated, stale; adopted ones (autograd's gradients, fresh loaded ones) are let go of.
        A table true to the window follows (no live flag, no adopted buffer) into the new epoch."""
        table, hooks = self.caches.step_table, self.caches.hook_state
        epoch = self.caches.epoch
        table_current = table is not None and table.epoch == epoch
        rows_current = hooks is not None and hooks.epoch == epoch
        self.changed()
        if table_current:
            table.cpp.new_window()  # (a stale table is built anew before it is used)
            table.epoch = self.caches.epoch
            if len(self.adopted) == len(table.buffered):
                table.buffered = set()
            elif self.adopted:
                table.buffered.difference_update(self.adopted)
        if hooks is not None:
            hooks.new_window()
            if rows_current:
                hooks.epoch = self.caches.epoch
        if len(self.adopted) == len(self.buffers) and self.sync is None:
            self.buffers.clear()  # (every buffer was adopted: no deletion per parameter)
        else:
            for p in self.adopted:
                del self.buffers[p]
        self.adopted.clear()
        self.live.clear()
        self.caches.table_blocked = False
        self.late_weights.clear()
        self.grads_held = False
        self.micro_step, self.weight_sum, self.weight_shift, self.found_inf = 0, 0.0, 0, None

    def abandon(self, opt) -> None:
        """Give the open window up without closing it (mode A's zero_grad(), a failed backward
        pass that cannot be taken back out): discarded, and, when it held micro-batches, its
        listeners told. An empty window is not told about: mode A's zero_grad()
        between a forward and its backward (a common loop) gives nothing up."""
        held = self.micro_step > 0 or bool(self.live)
        self.discard()
        if held:
            tell_listeners(self, opt, closed=False)
