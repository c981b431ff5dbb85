"""The open accumulation window: one object, held by its optimizer, changed in place.

Owns: the window's buffers (``buffers[p]``, the weighted gradient sum of the open window in
``state_dtype(p)``; views into flat per-(device, dtype) storage when ranks synchronise), which
parameters are live, the micro-batch count, the weight total and its band, the found-inf flag,
the counters ``micro_step`` / ``updated`` / ``update_count`` / ``last_grad_norm`` that the
optimizer's properties read, and the cross-rank reducer the buffers belong to (``sync``:
replicas, ``shards``: FSDP2). Its verbs: ``add_micro_batch`` (a whole micro-batch, from step()),
``begin_micro_batch`` / ``accumulate_one`` / ``write_one`` / ``adopt`` / ``mark_written`` /
``finish_micro_batch`` (one arriving parameter at a time, from in_backward.py's hooks),
``close`` (sync -> found-inf -> clip -> update, for plain, synchronised and sharded windows
alike), ``discard``, ``abandon`` (discard a window that held something, without closing it).
Whoever must learn that a window ended (accum_fused.nn's BatchNorm statistics) registers on the
optimizer's ``_window_listeners`` (``WindowListeners``): close and abandon tell them, and
opt.run() tells them when a pass it may retry begins and when it failed (``tell_transaction``).

Must not: read ``.grad`` or touch hooks (the optimizer and in_backward.py hand gradients in),
or do per-element math (backends do). It asks its optimizer, passed to the verbs that need it,
for ``_all_params()``, ``_backend_for(p)``, ``_apply_window(...)`` (the update: SGD/Adam's
backend calls or GradientAccumulator's inner step), ``state``, ``accumulation_steps``,
``max_grad_norm``, ``in_backward``.
It holds no reference to the optimizer, so a framework wrapper that copies the optimizer's
``__dict__`` (Lightning's LightningOptimizer) reaches the same window instead of splitting it.
"""
from __future__ import annotations

import math
import operator
from collections import defaultdict

import torch
from torch import Tensor

from . import backends, ddp
from .backends._kernel_args import device_scalar
from .layout import ELEMENTWISE_STATE, conform_state, fits, kernel_view, state_dtype

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


class WindowListeners(list):
    """The optimizer's ``_window_listeners``: objects told, in order, when its window ends.
    ``window_closed(opt, applied)``: the window closed (``applied``: an update was applied;
    False: skipped for non-finite gradients, or empty); with a process_group every rank closes
    it together, so a listener may run a collective there. ``window_discarded(opt)``: a window
    that held micro-batches was emptied without closing (a failed backward pass that cannot be
    taken back out, mode A's ``zero_grad()``). A copy of the optimizer (deepcopy, pickle) starts
    with none: listeners belong to a model, and a copy must not carry the model along."""

    def __reduce__(self):
        return type(self), ()


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
        # in_backward.py's record of the backward pass running now (a BackwardPass), kept here so
        # that every holder of the window sees the same one; whether opt.backward() runs it, and
        # whether opt.backward() was ever used in mode B (then only its passes are micro-batches).
        self.backward_pass = None
        self.own_backward = False
        self.backward_owned = False
        # Buffers that are autograd's own gradient tensors (in_backward zero-copy), or that a
        # fused Linear's GEMM started (accum_fused.nn): dropped when the window closes, since the
        # next window adopts or writes fresh ones (resident 12 B/param for fp32 AdamW, as the
        # native loop after zero_grad, instead of 16).
        self.adopted: set[Tensor] = set()
        # Out-of-memory recovery (recovery.py): a micro-batch run as parts counts once. While
        # ``parts_left`` > 0 the part being added is not the micro-batch's last: it neither counts
        # nor closes the window. ``complete``: parameters whose gradient of the part being run
        # is already in (a failed in-backward pass of the part it was split from added it
        # whole), which its hooks drop; recovery.py sets it per part (_Part.done): the parts
        # after it take their gradients whole. ``transaction``: a run() pass is running, whose failure
        # must leave nothing half-applied (no update inside its hooks, no collective in it).
        self.parts_left = 0
        self.complete: set[Tensor] = set()
        self.transaction = False
        self.part_serial = 0  # bumped as each part runs: accum_fused.nn's records tell parts apart by it
        self.closings = 0  # bumped as close() begins: a failure after it was the update's, not a pass's
        # Plain mode's micro-batches in one extension call (StepTable, csrc/step_table.cpp). The
        # table mirrors ``buffers`` and ``live`` for every parameter; ``version`` is bumped by every
        # change to them it does not mirror (``changed``), which makes it stale. ``table_blocked``:
        # it was built, or could not take a micro-batch, in this window (at most one build per window).
        self.step_table: StepTable | None = None
        self.table_blocked = False
        self.version = 0
        # Bumped with ``version`` where buffers kept between windows change (allocated, replaced,
        # dropped, loaded); not by adoptions, live flags or the buffers a window lets go of
        # (in_backward.FastPath's window-start lists are true to it).
        self.buffers_version = 0
        # The update's per-parameter lists, kept between closes while they stand (UpdatePlan).
        self.update_plan: UpdatePlan | None = None
        # in_backward's extension hooks (csrc/hooks.cpp's HookState), whose lists for the next
        # pass hold buffers of the window (adopted gradients): let go of when it is emptied.
        self.hook_state = None

    def __getstate__(self) -> dict:
        # (the extension's table is not picklable; a copy builds its own)
        return {**self.__dict__, "step_table": None, "table_blocked": False, "update_plan": None,
                "hook_state": None}

    def __setstate__(self, state: dict) -> None:
        # An optimizer pickled before out-of-memory recovery (or the step table) has a window without its fields.
        self.__dict__.update(parts_left=0, complete=set(), transaction=False, part_serial=0, closings=0,
                             step_table=None, table_blocked=False, version=0, buffers_version=0, update_plan=None,
                             hook_state=None)
        self.__dict__.update(state)

    def changed(self, kept: bool = True) -> None:
        """``buffers`` or ``live`` changed in a way the step table does not mirror: it is stale.
        ``kept``: a buffer kept between windows changed (not only adopted ones or live flags)."""
        self.version += 1
        self.buffers_version += kept

    def last_part(self) -> bool:
        """Whether the micro-batch being added ends with this part (see ``parts_left``)."""
        return self.parts_left == 0

    def closes_with(self, opt) -> bool:
        """Whether the micro-batch (part) being added now is the window's last."""
        return self.parts_left == 0 and self.micro_step + 1 >= opt.accumulation_steps

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
        return opt.max_grad_norm is None and not self.spans_ranks

    @property
    def spans_ranks(self) -> bool:
        """Whether closing the window needs the other ranks (process_group, FSDP2)."""
        return self.sync is not None or self.shards is not None

    # ------------------------------------------------------------------ taking gradients in
    def buffer(self, p: Tensor, kept: bool = True) -> Tensor:
        """``p``'s buffer, allocated when it has none (``kept``: it stays between windows; else
        the window lets go of it as it ends)."""
        buf = self.buffers.get(p)
        if buf is None:
            buf = self.buffers[p] = torch.empty_like(p, dtype=state_dtype(p), memory_format=torch.preserve_format)
            self.changed(kept=kept)
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

    def add_micro_batch(self, opt, pairs, weight: float, grad_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """step(): take one micro-batch, ``pairs`` of (param, grad), with ``weight``; on the
        window's last micro-batch, close the window. Validates before anything changes."""
        in_loss = self.backward_done and self.shards is not None
        closing = self.closes_with(opt)
        # The buffers this call writes, and at closing every buffer the update reads, fit their
        # parameters (a current step table vouches for all of them in one call), and at closing
        # the optimizer state too (once per table: what changes it makes the table stale).
        table = self.step_table
        if table is not None and self._table_current(table) and table.cpp.conforms():
            if closing and not table.state_conformed:
                params = [p for p, _ in pairs]
                conform_state(opt.state, params + list(self.live.difference(params)), opt._param_name,
                              opt._state_dtype_of)
                table.state_conformed = True
        elif closing and not pairs:  # (in_backward mode A's step(): the window is in the buffers)
            self.conform_live(opt)
        else:
            params = [p for p, _ in pairs]
            self.conform(opt, params + list(self.live.difference(params)) if closing else params, closing)
        found_inf = self._running_found_inf(found_inf)
        weight = self.enter_weight(weight)
        grad_weight = 1.0 if in_loss else weight  # FSDP2: opt.backward scaled the loss by it
        # Nothing above changed the window's meaning; from here on the micro-batch is taken.
        self._count_micro_batch(opt, weight, found_inf)
        if self.shards is not None and not opt.in_backward:  # (in_backward mode A sums: no weights)
            self.late_weights.append(None if in_loss else weight)
            if not pairs:
                self.hold_grads()
        if not closing:
            self.accumulate(pairs, grad_weight, grad_scale, opt._backend_for)
            self.updated = False
        elif opt._folds_last_micro_batch and self.folds_last(opt):
            self.close(opt, pairs, grad_weight, grad_scale)  # the last micro-batch folded into the update pass
        else:
            # Clipping needs the whole window's norm first: the last accumulate pass returns it
            # (across ranks the norms are measured on the reduced sums instead).
            local_norms = opt.max_grad_norm is not None and not self.spans_ranks
            norms = self.accumulate(pairs, grad_weight, grad_scale, opt._backend_for,
                                    norm_weight_sum=self.weight_sum if local_norms else None)
            self.close(opt, (), grad_weight, None, norms)

    def take_with_table(self, opt, weight: float, grad_scale: Tensor | None, found_inf: Tensor | None) -> bool:
        """step() in plain mode, on a micro-batch that does not close the window: what
        add_micro_batch does, in one extension call (StepTable) instead of a Python loop over the
        parameters. False, with nothing changed, where the table cannot take it exactly so
        (add_micro_batch then does, and is the spec this is tested against)."""
        if opt.in_backward or self.shards is not None or self.parts_left:
            return False
        closing = self.closes_with(opt)
        if closing and self.sync is not None:
            return False
        table = self._table_for(opt)
        if table is None:
            return False
        present = table.cpp.check([group["params"] for group in opt.param_groups])
        if present <= 0:  # (none: add_micro_batch warns; -1: something it must check, conform or raise)
            if present < 0:
                self.step_table = None
            return False
        plan = None
        if closing:
            try:
                plan = table.closing_plan(opt, self, present)
            finally:
                if plan is None:  # (refused, or raised: the table must not keep the gradients alive)
                    table.cpp.drop_checked()
            if plan is None:
                return False
        found_inf = self._running_found_inf(found_inf)
        weight = self.enter_weight(weight)
        self._count_micro_batch(opt, weight, found_inf)
        if closing:
            table.close(opt, self, plan, weight, grad_scale)
            return True
        newly_live, _, given, given_buffers, adopted = table.cpp.take(
            weight, device_scalar(grad_scale, table.device), opt.accumulation_steps > 1)
        if given:
            self._table_gave_buffers(table, given, given_buffers, adopted)
        if newly_live:
            if not self.live and len(newly_live) == len(table.buffered):
                self.live.update(table.buffered)  # (set to set: no tensor hashed again)
            else:
                self.live.update(table.params[i] for i in newly_live)
        self.updated = False
        return True

    def _table_gave_buffers(self, table: StepTable, given: list[int], buffers: list[Tensor], adopted: int) -> None:
        """The table gave these parameters buffers (their first ``adopted`` are autograd's
        gradients, taken zero-copy and let go of when the window ends, as the in-backward hooks
        adopt them; the rest fresh ones, kept): ``buffers`` follows, the table stays current."""
        params = [table.params[i] for i in given]
        self.buffers.update(zip(params, buffers))
        if adopted:
            self.adopted.update(params[:adopted])
        if adopted < len(params):
            self.buffers_version += 1  # (a buffer kept between windows; the table mirrors it: no version)
        table.buffered.update(params)

    def _running_found_inf(self, found_inf: Tensor | None) -> Tensor | None:
        """The window's non-finite flag with this micro-batch's (GradScaler's) added: summed on
        the device, so no host synchronisation per micro-batch."""
        if found_inf is None:
            return self.found_inf
        found = found_inf.detach().float()
        return found if self.found_inf is None else self.found_inf + found

    def _count_micro_batch(self, opt, weight: float, found_inf: Tensor | None) -> None:
        """step()'s micro-batch (or its last part) is taken: counters, weight total, flag."""
        self.pending_weight = None
        self.backward_done = False
        self.micro_step += self.last_part()
        # in_backward mode A: the buffers hold the sum of the loop's backward passes (what
        # autograd would have summed into .grad), so the window's divisor is 1.
        self.weight_sum = 1.0 if opt.in_backward else self.weight_sum + weight
        self.found_inf = found_inf

    def _table_for(self, opt) -> StepTable | None:
        """The step table, true to ``buffers`` and ``live``; built (once per window at most)
        when there is none or it went stale; None where plain mode's loop stays Python's."""
        table = self.step_table
        if table is not None and self._table_current(table):
            return table
        self.step_table = None
        if self.table_blocked or backends.extension_paths(opt.backend) is None:
            return None
        self.table_blocked = True
        self.step_table = StepTable.build(opt, self)
        return self.step_table

    def _table_current(self, table: StepTable) -> bool:
        return table.version == self.version and table.cpp.live_count == len(self.live)

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
        if closing and self.sync is not None and not self.transaction:
            # (a run() pass reduces at its end instead: a pass that fails must not leave a
            # collective half-done on this rank while the others wait in it)
            shift = self.sync.begin_overlapped_window(opt._all_params(), self.live, self.weight_sum + weight,
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
            self.complete.clear()
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

    def accumulate(self, pairs, weight: float, grad_scale: Tensor | None, backend_for,
                   norm_weight_sum: float | None = None) -> dict[Tensor, Tensor]:
        """Add one micro-batch into the buffers. With ``norm_weight_sum``, also return
        {param: ||acc / norm_weight_sum||} for the parameters accumulated here."""
        calls = defaultdict(list)
        for p, grad in pairs:
            overwrite = p not in self.live
            calls[(p.device, p.dtype, grad.dtype, overwrite)].append((p, grad))
        norms = {}
        for (_, _, _, overwrite), items in calls.items():
            call_norms = backend_for(items[0][0]).accumulate(
                grads=[kernel_view(g) for _, g in items],
                buffers=[kernel_view(self.buffer(p)) for p, _ in items],
                weight=weight,
                overwrite=overwrite,
                grad_scale=grad_scale,
                norm_weight_sum=norm_weight_sum,
            )
            if call_norms is not None:
                norms.update(zip([p for p, _ in items], call_norms.unbind()))
        self.live.update(p for p, _ in pairs)
        table = self.step_table
        if table is not None and table.version == self.version:
            table.cpp.mark_live([p for p, _ in pairs])
        return norms

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
        buf = self.buffer(p, kept=self.sync is not None)  # (without ranks, let go of as the window closes: below)
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

    def adopt(self, p: Tensor, grad: Tensor) -> None:
        """Zero-copy first micro-batch: autograd's fresh gradient becomes ``p``'s buffer (a
        stale buffer it had is dropped: a kept buffer changed)."""
        kept = p in self.buffers
        self.adopt_many([p], [grad])
        self.buffers_version += kept

    def adopt_many(self, params: list[Tensor], grads: list[Tensor], param_set: set[Tensor] | None = None) -> None:
        """``adopt`` for each of ``params`` (the extension's hooks adopted them in one pass; it
        knows which stale buffers they replace). ``param_set``: the same parameters as a set,
        whose hashes the set updates reuse."""
        self.buffers.update(zip(params, grads))
        keys = params if param_set is None else param_set
        self.adopted.update(keys)
        self.live.update(keys)
        self.changed(kept=False)

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
                        f"{opt._param_name(p)} changed dtype, device or shape after this {type(opt).__name__} "
                        "was built with a process_group, whose buffers are fixed: convert the model before "
                        "building the optimizer"
                    )
                self.changed()
                if p not in self.live:
                    del self.buffers[p]  # stale: the next gradient allocates a fresh one
                elif buf.shape != p.shape:
                    raise ValueError(
                        f"{opt._param_name(p)} changed shape from {tuple(buf.shape)} in the middle of a window: its "
                        "accumulated gradient no longer fits it. Resize parameters between windows (after an "
                        "update or flush()), then build a new optimizer for them"
                    )
                else:
                    self.buffers[p] = buf.to(device=p.device, dtype=state_dtype(p))
        if closing:
            conform_state(opt.state, params, opt._param_name, opt._state_dtype_of)  # the update reads it next

    # ------------------------------------------------------------------------- closing
    def close(self, opt, last_pairs=(), last_weight: float = 1.0, grad_scale: Tensor | None = None,
              norms: dict | None = None, flushing: bool = False, update=None, updated_in_hooks: set = frozenset()) \
            -> bool:
        """Close the window: agree with the other ranks (sums, weight total, non-finite flags),
        skip it if a micro-batch was non-finite or no parameter received a gradient, otherwise
        clip and update. ``last_pairs`` is the last micro-batch, not yet accumulated (folded into
        the update pass); ``norms`` the per-parameter window-gradient norms already computed.
        ``update(weight_sum)``: the step table's close updates instead of ``opt._apply_window`` (the
        last micro-batch and the norms are then its own). ``updated_in_hooks``: parameters mode B's
        last pass already updated inside their hooks (folds_last: no ranks, no clipping); the
        window's other live parameters (no gradient in that pass) are updated here. Sets and
        returns ``updated``."""
        self.closings += 1
        weight_sum, skip, clip_coef = self._agree(opt, flushing)
        self.live -= updated_in_hooks
        # An empty window (no gradient anywhere: no micro-batch on any rank, or only None grads)
        # is not an update, as torch.optim's step without gradients changes nothing.
        applied = not skip and weight_sum > 0 and bool(self.live or last_pairs or updated_in_hooks)
        closed = False
        try:
            if applied and update is not None:
                update(weight_sum)
            elif applied and (self.live or last_pairs):
                if opt.max_grad_norm is not None and clip_coef is None:
                    clip_coef = self._clip_coefficient(opt, weight_sum, norms or {})
                opt._apply_window(dict(last_pairs), last_weight, grad_scale, weight_sum, clip_coef)
            self.update_count += applied
            closed = True
        finally:
            self.discard()
            # (set before the listeners run: one that raises must not leave the last window's value)
            self.updated = closed and applied
            ddp.window_closed(opt)
            _tell_listeners(opt, closed, applied)  # (an update that raised: the window is lost)
        return applied

    def discard(self) -> None:
        """Empty the window (counters of past updates stay). Buffers kept between windows stay
        allocated, stale; adopted ones (autograd's gradients, fresh loaded ones) are let go of."""
        table = self.step_table
        # (while the table is current, the window's adopted buffers are the ones it gave)
        current = table is not None and table.version == self.version
        # A new window: what was cached from this one's live set (in_backward.FastPath's arm lists)
        # does not carry over. The step table follows (no live flag, no adopted buffer), unless it
        # was stale already.
        self.changed(kept=False)
        if current and self.adopted:
            table.cpp.drop_adopted()
            if len(self.adopted) == len(table.buffered):
                table.buffered = set()
            else:
                table.buffered.difference_update(self.adopted)
        if self.hook_state is not None:
            self.hook_state.new_window()
        if len(self.adopted) == len(self.buffers) and self.sync is None:
            self.buffers.clear()  # (every buffer was adopted: no deletion per parameter)
        else:
            for p in self.adopted:
                del self.buffers[p]
        self.adopted.clear()
        self.live.clear()
        if table is not None:
            table.cpp.reset_live()
            if current:
                table.version = self.version
        self.table_blocked = False
        self.late_weights.clear()
        self.grads_held = False
        self.micro_step, self.weight_sum, self.weight_shift, self.found_inf = 0, 0.0, 0, None

    def abandon(self, opt) -> None:
        """Give the open window up without closing it (mode A's zero_grad(), a failed backward
        pass that cannot be taken back out): discarded, and, when it held micro-batches, the
        optimizer's listeners told. An empty window is not told about: mode A's zero_grad()
        between a forward and its backward (a common loop) gives nothing up."""
        held = self.micro_step > 0 or bool(self.live)
        self.discard()
        if held:
            _tell_listeners(opt, closed=False)

    def _agree(self, opt, flushing: bool) -> tuple[float, bool, Tensor | None]:
        """(the window's divisor, skip it, clip coefficient when already known)."""
        if self.sync is not None:
            weight_sum, skip, live = self.sync.reduce_window(
                opt._all_params(), self.live, self.weight_sum, self.weight_shift, self.found_inf, flushing)
            self.live.clear()
            self.live.update(live)
            return weight_sum, skip, None
        if self.shards is not None:
            return self._agree_sharded(opt, flushing)
        return self.weight_sum, self.found_inf is not None and bool(self.found_inf.item() > 0), None

    def _agree_sharded(self, opt, flushing: bool) -> tuple[float, bool, Tensor | None]:
        """FSDP2 (distributed.ShardSync.agree): (the divisor W / N, skip, clip coefficient or
        None). The window's global norm is measured whether or not it clips, so that a
        non-finite value in any rank's shard skips the window on every rank instead of updating
        some shards and not others."""
        params = opt._all_params()
        divisor, total_norm = self.shards.agree(
            [p for p in params if p in self.live], self.buffers, opt._backend_for, params[0].device, self.weight_sum,
            flushing, self.late_weights, self.grads_held, opt.accumulation_steps)
        if divisor <= 0:
            return divisor, False, None
        if not math.isfinite(total_norm.item()):
            return divisor, True, None
        if opt.max_grad_norm is None:
            return divisor, False, None
        self.last_grad_norm = total_norm
        return divisor, False, torch.clamp(opt.max_grad_norm / (total_norm + 1e-6), max=1.0)

    def _clip_coefficient(self, opt, weight_sum: float, norms: dict | list) -> Tensor:
        """min(max_grad_norm / (||g|| + 1e-6), 1) on the device, as clip_grad_norm_ computes
        it. ``norms`` has the per-parameter norms the last accumulate pass produced, by parameter
        or aligned with ``opt._all_params()`` (None: not measured); the window's other
        parameters (no gradient in that micro-batch) are measured here."""
        params = opt._all_params()
        if isinstance(norms, dict):
            norms = list(map(norms.get, params))
        else:
            norms = list(norms)
        if len(self.live) == len(params):  # (every parameter is live: no lookup per parameter)
            live = range(len(params))
        else:
            live = [i for i, p in enumerate(params) if p in self.live]
        missing = defaultdict(list)
        for i in [i for i in live if norms[i] is None]:
            missing[(params[i].device, params[i].dtype)].append(i)
        for indices in missing.values():
            measured = opt._backend_for(params[indices[0]]).window_norms(
                buffers=[kernel_view(self.buffers[params[i]]) for i in indices], weight_sum=weight_sum)
            for i, norm in zip(indices, measured.unbind()):
                norms[i] = norm
        values = [norms[i] for i in live]
        device = params[live[0]].device
        try:
            stacked = torch.stack(values)  # (one device, the common case: no .to per parameter)
        except RuntimeError:  # (parameters spread over several devices)
            stacked = None
        if stacked is None or stacked.device != device:
            stacked = torch.stack([norm.to(device) for norm in values])
        return self.clip_for(opt, torch.linalg.vector_norm(stacked))

    def clip_for(self, opt, total_norm: Tensor) -> Tensor:
        """The clip coefficient for the window's gradient norm (kept as ``last_grad_norm``)."""
        self.last_grad_norm = total_norm
        return torch.clamp(opt.max_grad_norm / (total_norm + 1e-6), max=1.0)


class StepTable:
    """The extension's table of plain mode's micro-batches (csrc/step_table.cpp: every
    parameter of the optimizer in order, its buffer, whether it is live), with what the window
    needs back: the parameters by index, the set of those with buffers, the device, and the
    window's ``version`` it is true to."""

    def __init__(self, cpp, params: list[Tensor], buffered: set, device: torch.device, version: int) -> None:
        self.cpp, self.params, self.buffered, self.device, self.version = cpp, params, buffered, device, version
        self.state_conformed = False  # conform_state ran since it was built (what moves state makes it stale)

    @staticmethod
    def build(opt, win: Window) -> StepTable | None:
        """None where the table cannot stand in for add_micro_batch: parameters on several
        devices or not plain tensors (DTensor, complex), a parameter the cpp backend does not
        run, fused=True groups (torch's device checks), a live buffer that must follow its
        parameter first (Window.conform). A stale buffer that no longer fits its parameter is
        dropped here, as Window.conform drops it: the table then vouches for every buffer."""
        cpp = backends.extension_paths(opt.backend)
        params = opt._all_params()
        if cpp is None or not params or any(group.get("fused") for group in opt.param_groups):
            return None
        device = params[0].device
        buffers = []
        for p in params:
            if p.device != device or kernel_view(p) is not p or opt._backend_for(p) is not cpp:
                return None
            buf = win.buffers.get(p)
            if buf is not None and not fits(buf, p):
                if p in win.live or win.sync is not None:
                    return None  # (Window.conform carries it along, or raises)
                del win.buffers[p]  # stale: as Window.conform does, the next gradient allocates a fresh one
                win.changed()
                buf = None
            buffers.append(buf)
        live = [p in win.live for p in params]
        adopted = [p in win.adopted for p in params]
        # (DDP's buffers are views of its flat buckets: not to be replaced by gradients)
        table = cpp.StepTable(params, buffers, live, adopted, may_adopt=win.may_adopt)
        return StepTable(table, params, {p for p, buf in zip(params, buffers) if buf is not None}, device, win.version)

    def closing_plan(self, opt, win: Window, present: int) -> UpdatePlan | None:
        """How the window's closing micro-batch and the update run with no Python loop over the
        parameters (the table's check found ``present`` gradients): the case training loops
        give, where every parameter of the table has a gradient in the closing micro-batch, all
        of them live in the window (or none: accumulation_steps=1), each param group of one
        dtype and one call key (Adam's step count). None, with nothing changed, where
        add_micro_batch must close it. Validates first, as add_micro_batch does: every buffer
        fits (the table's check), the state is conformed."""
        n = len(self.params)
        if present != n or self.cpp.live_count not in (0, n) or not hasattr(opt, "_state_lists"):
            return None
        if self.cpp.missing_buffers():  # (a closing micro-batch without live buffers: Window.buffer allocates)
            return None
        if not self.cpp.conforms():
            return None
        if not self.state_conformed:
            conform_state(opt.state, self.params, opt._param_name, opt._state_dtype_of)
            self.state_conformed = True
        plan = UpdatePlan.for_window(opt, win, build=True, every_live=False)
        return plan if plan is not None and plan.count == n and plan.uniform(opt) else None

    def close(self, opt, win: Window, plan: UpdatePlan, weight: float, grad_scale: Tensor | None) -> None:
        """Take the closing micro-batch (counted by the caller) and close ``win`` with ``plan``."""
        clear = opt.accumulation_steps > 1
        last = norms = None
        if opt._folds_last_micro_batch and win.folds_last(opt):  # (no ranks: take_with_table)
            last = dict(grads=self.cpp.present_grads(), weight=weight, overwrite=self.cpp.live_count == 0,
                        grad_scale=grad_scale)
            self.cpp.release(clear)  # (the list keeps the gradients for the update pass)
        else:
            norm_weight_sum = win.weight_sum if opt.max_grad_norm is not None else None
            # (every buffer is live at closing: none given, so no return but the norms matters)
            norms = self.cpp.take(weight, device_scalar(grad_scale, self.device), clear, norm_weight_sum)[1]
        win.live.update(self.buffered)

        def update(weight_sum: float) -> None:
            clip_coef = None if norms is None else win.clip_for(opt, torch.linalg.vector_norm(norms))
            # (buffers read now, not kept with the plan: adopted buffers are new each window)
            plan.update(opt, self.cpp.buffers(), weight_sum, clip_coef, last)
        win.close(opt, (), weight, grad_scale, update=update)


class UpdatePlan:
    """Per param group, the arguments of one ``opt._update`` call besides the buffers and the
    window's scalars (``opt._state_lists``), so that a window in which every parameter is live
    updates each group in one call, with no Python loop over its parameters: the step table's
    closing micro-batch (plain mode) and the in-backward modes' close alike. One extension call
    checks that the buffers and state fit their parameters (``conforms``, instead of
    Window.conform's loop). Kept on the window between closes while it stands: the param groups
    hold the same parameters in the same order, the groups' list-shaping flags stand
    (``state_key``) and every kept state tensor is still the one its entry holds
    (``opt._state_lists_stand``: a state loaded, or replaced by hand, is read anew, as
    torch.optim reads it). Built only where each group is of one dtype and one device and its
    parameters are plain tensors; kept only where no state is missing (SGD's momentum buffers
    exist after its first update)."""

    def __init__(self, calls: list, key: tuple, complete: bool) -> None:
        self.calls, self.key, self.complete = calls, key, complete  # calls: (group, params, lists, backend, span)
        self.count = sum(len(params) for _, params, _, _, _ in calls)

    @staticmethod
    def for_window(opt, win: Window, build: bool, every_live: bool = True) -> UpdatePlan | None:
        """The plan, when it stands (and ``every_live``: every parameter is live in ``win``);
        else built anew where ``build`` (the update creates the state it holds) and it can be."""
        if not hasattr(opt, "_state_lists") or win.shards is not None:
            return None
        plan = win.update_plan
        if plan is not None and (not every_live or len(win.live) == plan.count) and plan.stand(opt):
            return plan
        win.update_plan = None
        if not build or (every_live and len(win.live) != sum(len(group["params"]) for group in opt.param_groups)):
            return None  # (and no state is created for a parameter the window leaves alone)
        calls, start, complete = [], 0, True
        for group in opt.param_groups:
            params = list(group["params"])
            if not params:
                continue
            first = params[0]
            if any(p.dtype != first.dtype or p.device != first.device or kernel_view(p) is not p for p in params):
                return None
            lists = opt._state_lists(group, params)
            complete &= not any(t is None for values in lists.values() for t in values)
            calls.append((group, params, lists, opt._backend_for(first), slice(start, start + len(params))))
            start += len(params)
        plan = UpdatePlan(calls, UpdatePlan.state_key(opt), complete)
        if complete:  # (state that the update creates: read again at the next close)
            win.update_plan = plan
        return plan

    @staticmethod
    def state_key(opt) -> tuple:
        """What the kept lists' shape depends on beyond the parameters: the group flags that add
        lists (amsgrad, momentum). Their tensors are checked by identity (``_state_lists_stand``)."""
        return tuple((group.get("amsgrad"), group.get("momentum", 0) != 0) for group in opt.param_groups)

    def stand(self, opt) -> bool:
        groups = [group for group in opt.param_groups if group["params"]]
        return (self.key == UpdatePlan.state_key(opt) and len(groups) == len(self.calls)
                and all(group is kept_group and len(group["params"]) == len(params)
                        and all(map(operator.is_, group["params"], params))
                        and opt._state_lists_stand(params, lists)
                        for group, (kept_group, params, lists, _, _) in zip(groups, self.calls)))

    def uniform(self, opt) -> bool:
        """Whether each group's parameters share one call key (Adam's step count): one call each."""
        return all(opt._uniform_call_key(lists) for _, _, lists, _, _ in self.calls)

    def conforms(self, opt, win: Window) -> bool:
        """Whether Window.conform and conform_state would change nothing for the window's live
        parameters (all of them): one extension call per group."""
        cpp = backends._load("cpp")
        if cpp is None:
            return False
        for _, params, lists, _, _ in self.calls:
            tensors = [list(map(win.buffers.__getitem__, params))]
            tensors += [lists[name] for name, key in opt._kept_state_entries.items()
                        if key in ELEMENTWISE_STATE and lists[name]]
            if not cpp.state_fits(params, tensors):
                return False
        return True

    def update(self, opt, buffers: list[Tensor], weight_sum: float, clip_coef: Tensor | None,
               last: dict | None = None) -> None:
        """Window.close's update (``uniform`` holds): one ``opt._update`` per group. ``buffers``
        and ``last["grads"]`` (a last micro-batch folded into the update pass) are aligned with
        the plan's parameters, group after group."""
        for group, params, lists, backend, span in self.calls:
            fold = {} if last is None else {**last, "grads": last["grads"][span]}
            opt._update(backend, group, params, buffers[span], lists=lists, weight_sum=weight_sum,
                        clip_coef=clip_coef, **fold)

    def buffers_of(self, win: Window) -> list[Tensor]:
        return [win.buffers[p] for _, params, _, _, _ in self.calls for p in params]


def window_listeners(opt) -> WindowListeners:
    """``opt._window_listeners``, to register on. A copy of an optimizer (or one pickled before
    listeners) may have a plain list (checkpoint.restore_defaults): it becomes a WindowListeners
    here, so that copies of the copy carry no listener either."""
    listeners = opt._window_listeners
    if type(listeners) is not WindowListeners:
        listeners = opt._window_listeners = WindowListeners(listeners)
    return listeners


def tell_transaction(opt, event: str) -> None:
    """recovery.py: a pass of opt.run() begins ("transaction_begins") or failed
    ("transaction_failed"); listeners that record per forward (accum_fused.nn) take it back."""
    for listener in list(getattr(opt, "_window_listeners", ())):
        told = getattr(listener, event, None)
        if told is not None:
            told(opt)


def _tell_listeners(opt, closed: bool, applied: bool = False) -> None:
    """The window ended: closed (``applied`` or not) or given up; see WindowListeners."""
    for listener in list(getattr(opt, "_window_listeners", ())):
        if closed:
            listener.window_closed(opt, applied)
        else:
            listener.window_discarded(opt)
