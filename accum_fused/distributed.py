"""Cross-rank synchronisation for the accumulating optimizers: once per window, not per micro-batch.

Owns: process groups (checks, broadcast of parameters), DDP detection and switching its
per-backward sync off, the flat buffers and the once-per-window reduction of replicas
(``WindowSync``: bucketed, overlapped with the last backward in mode B), and FSDP2's mesh and
once-per-window agreement (``shard_mesh``, ``ShardSync``: closing a sharded window). Must not:
know about optimizers or windows; it gets parameters, buffers, numbers and a backend lookup,
and returns what the ranks agreed on.

With ``process_group=...`` an optimizer keeps its fp32 accumulation buffers as views into one
flat tensor per (device, buffer dtype) ("segments", in parameter order, as DDP's buckets with
``gradient_as_bucket_view``), so each bucket all-reduce works in place, with no copy in or out.

At every window boundary (and on ``flush()``) ``WindowSync.reduce_window`` runs two collectives:
1. one small fp64 all-reduce of [weight total, non-finite flag, flush flag, one "has a
   gradient" flag per parameter]: every rank learns the global weight total, whether any rank
   saw a non-finite micro-batch (then all skip the window, and nothing else is sent), which
   parameters received a gradient on some rank, and whether the ranks disagree on how the
   window closes (some in step(), some in flush(): an error on every rank, not a hang);
2. in-place all-reduces (SUM) of the weighted gradient sums of those parameters, in buckets of
   ``BUCKET_BYTES`` over contiguous runs of the flat segments, all in flight at once.
Every rank then holds the same Σ wᵢgᵢ over all ranks' micro-batches and the same Σ wᵢ, so the
update equals the single-process big batch, whatever the number and sizes of each rank's
micro-batches. Nothing here does per-element math beyond zeroing stale buffers.

in_backward mode B overlaps the reduce with the window's last backward pass, as DDP does:
``begin_overlapped_window`` runs the metadata all-reduce when that backward starts (its weight
is known before its gradients), ``grad_ready`` launches fixed buckets as the hooks take their
gradients, and ``reduce_window`` at the end of backward launches the rest and waits.

``torch.distributed`` is imported lazily: importing accum_fused never needs it.
"""
from __future__ import annotations

import gc
import math
import os
import weakref
from collections import defaultdict
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor

from .layout import kernel_view

# DDP's 25 MiB default is sized to overlap buckets with backward. In the plain mode nothing
# overlaps (the reduce follows the window's last step()), so buckets only bound the number of
# calls: measured with benchmarks/bench_comm.py (2 gloo ranks, 8.4M fp32 params, k=8), 25, 64
# and 256 MiB within noise of each other. in_backward mode B overlaps buckets with the last
# backward (smaller buckets start sooner); bucket size not yet tuned for it, nor on NCCL.
BUCKET_BYTES = 64 << 20
# Added to a rank's weight band in the metadata all-reduce so that 0 can mean "no micro-batch".
_BAND_OFFSET = 1 << 20


def _dist():
    import torch.distributed as dist

    return dist


class _NotGiven:
    """``process_group``'s default: no argument. An explicit None is told apart from it:
    ``torch.distributed.group.WORLD`` is None until ``init_process_group()``, so
    ``process_group=group.WORLD`` before it arrives as None, and would train every rank alone."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN = _NotGiven()


def launched_world_size() -> int:
    """The number of ranks a launcher started (torchrun, Lightning, accelerate set WORLD_SIZE)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def check_process_group(process_group) -> None:
    """Raise a clear error unless ``process_group`` is not given, None, or a usable
    torch.distributed group. None given explicitly in a job a launcher started on several ranks,
    before torch.distributed is initialized, is ``group.WORLD`` read too early: refused."""
    if process_group is NOT_GIVEN:
        return
    dist = _dist()
    if process_group is None:
        if launched_world_size() > 1 and dist.is_available() and not dist.is_initialized():
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialized: process_group=None in a job "
                f"launched on WORLD_SIZE={launched_world_size()} ranks (torch.distributed.group.WORLD is None until "
                "init_process_group()); call torch.distributed.init_process_group(...) before building the "
                "optimizer, or leave process_group out for ranks that update alone")
        return
    if not dist.is_available():
        raise RuntimeError("process_group needs torch.distributed, which this PyTorch build does not include")
    if not dist.is_initialized():
        raise RuntimeError(
            "process_group was given but torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) first (torchrun sets up its environment)"
        )
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (torch.distributed.group.WORLD "
            f"or one from new_group()) or None, got {type(process_group).__name__}"
        )


def check_devices(process_group, params: Iterable[Tensor]) -> None:
    """NCCL reduces CUDA tensors only: refuse CPU parameters before anything is sent."""
    if _dist().get_backend(process_group) == "nccl":
        on_cpu = [p for p in params if p.device.type != "cuda"]
        if on_cpu:
            raise ValueError(
                f"process_group uses NCCL, which needs CUDA tensors, but {len(on_cpu)} parameter(s) are "
                f"on {on_cpu[0].device}: move the model to CUDA or use a gloo group"
            )


def _chunks(tensors: list[Tensor], max_bytes: int) -> Iterator[list[Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``max_bytes`` (a larger tensor alone)."""
    run, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if run and size + nbytes > max_bytes:
            yield run
            run, size = [], 0
        run.append(t)
        size += nbytes
    if run:
        yield run


@torch.no_grad()
def broadcast_parameters(params: list[Tensor], process_group) -> None:
    """Copy the group's first rank's parameter values to every rank (as DDP does at
    construction), flattened into buckets per (device, dtype)."""
    dist = _dist()
    src = dist.get_global_rank(process_group, 0)
    is_src = dist.get_rank() == src
    by_kind = defaultdict(list)
    for p in params:
        by_kind[(p.device, p.dtype)].append(p)
    for tensors in by_kind.values():
        for run in _chunks(tensors, BUCKET_BYTES):
            flat = torch.cat([t.detach().reshape(-1) for t in run])
            dist.broadcast(flat, src=src, group=process_group)
            if not is_src:
                for t, piece in zip(run, flat.split([t.numel() for t in run])):
                    t.copy_(piece.view(t.shape))


def several_processes() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# What launchers (torchrun, accelerate launch, Lightning's ddp, SLURM scripts) set for each process.
_LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def ddp_possible() -> bool:
    """Whether a DistributedDataParallel module can appear in this process: torch.distributed is
    initialized, or a launcher started the process (it will be). A plain single-process job
    answers False and gets no global module hook (torch.compile(module) warns about those)."""
    import os
    dist = _dist()
    return dist.is_available() and (dist.is_initialized() or any(v in os.environ for v in _LAUNCHER_ENV))


def ddp_modules_holding(params: Iterable[Tensor]) -> list:
    """The live DistributedDataParallel modules that wrap any of ``params``.

    DDP marks nothing on a parameter, so this walks the garbage collector's objects once
    (tens of milliseconds in a large program; done once, at construction, and only when
    torch.distributed is initialized). ``type()`` rather than ``isinstance`` so that no proxy
    object's ``__class__`` is evaluated.
    """
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        return []
    from torch.nn.parallel import DistributedDataParallel

    ids = {id(p) for p in params}
    return [obj for obj in gc.get_objects()
            if issubclass(type(obj), DistributedDataParallel) and wraps_any(obj, ids)]


def wraps_any(ddp, param_ids: set) -> bool:
    return any(id(p) in param_ids for p in ddp.module.parameters())


# ------------------------------------------------------------------------------------ DDP
# An accumulating optimizer whose parameters belong to a DistributedDataParallel module owns
# the window's reduction: DDP's per-backward all-reduce is turned off (as ``no_sync()`` does)
# for as long as an optimizer owns it, and the optimizer all-reduces its fp32 window once per
# update (WindowSync). DDP reads ``require_backward_grad_sync`` in forward to decide whether
# the next backward reduces, so the flag is set in a forward pre-hook on the DDP module, before
# every forward: a ``no_sync()`` block (HF Trainer and accelerate use one for all but a window's
# last micro-batch) restores the flag it found when it exits, and the next forward must not
# reduce either.
#
# Models are often wrapped after the optimizer is built (HF Trainer wraps in train(),
# accelerate in prepare()). An optimizer without a DDP module therefore watches every module's
# forward (one global forward pre-hook, shared, removed when no optimizer watches any more) for
# a DDP module that wraps its parameters: that forward precedes the first backward DDP could
# reduce. How long it watches is ddp.py's decision.

class _DdpOwnership:
    """The accum_fused optimizers that took over one DDP module's gradient sync."""

    def __init__(self, ddp):
        self.owners: list[Callable[[], list[Tensor] | None]] = []  # weak: each an owner's params, or None
        self.checked = False  # every trainable parameter has an owner (checked at the next forward)
        self.handle = ddp.register_forward_pre_hook(_keep_ddp_sync_off)

    def check(self, ddp) -> None:
        owned = set()
        for params_of in self.owners:
            owned.update(id(p) for p in params_of() or ())
        orphans = [name for name, p in ddp.module.named_parameters() if p.requires_grad and id(p) not in owned]
        if orphans:
            raise RuntimeError(
                f"accum_fused synchronises its optimizers' gradients once per window and has turned this "
                f"DistributedDataParallel module's per-backward all-reduce off, but {len(orphans)} of its trainable "
                f"parameters (e.g. {orphans[0]!r}) belong to no accum_fused optimizer and would never be reduced: "
                "give every trainable parameter of the DDP model to accum_fused optimizers (param groups, or a "
                "GradientAccumulator around the other optimizer), or freeze them"
            )
        self.checked = True


_ddp_owned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ddp_watchers: list[tuple[weakref.ref, Callable]] = []  # (owner, found(owner, ddp) -> took it)
_watch_handle = None


def _keep_ddp_sync_off(ddp, args) -> None:
    ddp.require_backward_grad_sync = False
    ownership = _ddp_owned.get(ddp)
    if ownership is not None and not ownership.checked:
        ownership.check(ddp)


def own_ddp_sync(ddp, params_of: Callable[[], list[Tensor] | None]) -> Callable[[], None]:
    """Turn ``ddp``'s per-backward all-reduce off for an optimizer whose parameters it wraps
    (``params_of``: a weak accessor of the optimizer's parameters). Returns the release: when
    the last owner releases, DDP's hook goes and its sync is back on."""
    ownership = _ddp_owned.get(ddp)
    if ownership is None:
        ownership = _ddp_owned[ddp] = _DdpOwnership(ddp)
    ownership.owners.append(params_of)
    ownership.checked = False
    ddp.require_backward_grad_sync = False
    ddp_ref = weakref.ref(ddp)

    def release() -> None:
        module = ddp_ref()
        if module is None or module not in _ddp_owned:
            return
        ownership.owners.remove(params_of)
        if not ownership.owners:
            ownership.handle.remove()
            del _ddp_owned[module]
            module.require_backward_grad_sync = True

    return release


def _watch_forward(module, args) -> None:
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):  # (torch.nn imports it)
        return
    for watch in list(_ddp_watchers):
        owner_ref, found = watch
        owner = owner_ref()
        if owner is None or found(owner, module):  # collected, or it took this DDP module
            unwatch_ddp(watch)
    if module in _ddp_owned:  # its parameters' owners checked once every watcher had its turn
        _keep_ddp_sync_off(module, args)


def watch_for_ddp(owner, found: Callable) -> tuple:
    """Call ``found(owner, ddp)`` before the forward of every DistributedDataParallel module
    until it returns True, ``unwatch_ddp`` is called with the returned token, or ``owner`` (held
    weakly) is collected."""
    global _watch_handle
    watch = (weakref.ref(owner), found)
    _ddp_watchers.append(watch)
    if _watch_handle is None:
        _watch_handle = torch.nn.modules.module.register_module_forward_pre_hook(_watch_forward)
    weakref.finalize(owner, unwatch_ddp, watch)  # an optimizer dropped before its first window
    return watch


def unwatch_ddp(watch: tuple) -> None:
    global _watch_handle
    if watch in _ddp_watchers:
        _ddp_watchers.remove(watch)
    if not _ddp_watchers and _watch_handle is not None:
        _watch_handle.remove()
        _watch_handle = None


def check_same_ranks(process_group, ddp, owner: str) -> None:
    """An explicit process_group must span the ranks DDP reduces over."""
    dist = _dist()
    ours, theirs = dist.get_process_group_ranks(process_group), dist.get_process_group_ranks(ddp.process_group)
    if ours != theirs:
        raise ValueError(
            f"{owner}(process_group=...) spans ranks {ours}, but the DistributedDataParallel module holding its "
            f"parameters reduces over ranks {theirs}: leave process_group unset (the optimizer then uses the DDP "
            "module's group) or pass ddp_model.process_group"
        )


class _OverlappedReduce:
    """One window's bucket all-reduces, launched while its last backward pass runs."""

    def __init__(self, total: float, live: set, buckets: list[tuple[Tensor, list[Tensor]]], expected: set):
        self.total, self.live = total, live  # from the metadata all-reduce at the start
        self.buckets = buckets  # (flat slice, its parameters), in launch order
        # Per bucket, the parameters whose gradient this backward has not delivered yet. Only
        # parameters that require grad can get one; the others do not hold their bucket back.
        self.waiting = [{p for p in members if p in expected} for _, members in buckets]
        self.bucket_of = {p: i for i, (_, members) in enumerate(buckets) for p in members}
        self.works: list = []  # one per launched bucket: buckets[:len(works)] are in flight


class WindowSync:
    """The flat accumulation buffers of one optimizer and the once-per-window reduce."""

    def __init__(self, process_group, owner: str):
        self.group = process_group
        self.owner = owner
        self.buffers: dict[Tensor, Tensor] = {}
        # per segment: (flat tensor, [(param, start, end)] in flat order, contiguous)
        self.segments: list[tuple[Tensor, list[tuple[Tensor, int, int]]]] = []
        self._fixed: list[tuple[Tensor, list[Tensor]]] | None = None  # overlap buckets, built lazily
        self._overlap: _OverlappedReduce | None = None  # the window whose reduce is under way

    def add_params(self, params: list[Tensor], buffer_dtype: Callable[[Tensor], torch.dtype],
                   broadcast: bool = True) -> None:
        """Broadcast new parameters from the first rank (unless DDP did) and give them buffers in
        new segments. Every rank must call this with the same parameters in the same order."""
        params = [p for p in params if p not in self.buffers]
        check_devices(self.group, params)
        if broadcast:
            broadcast_parameters(params, self.group)
        by_kind = defaultdict(list)
        for p in params:
            by_kind[(p.device, buffer_dtype(p))].append(p)
        for (device, dtype), members in by_kind.items():
            flat = torch.empty(sum(p.numel() for p in members), device=device, dtype=dtype)
            entries, start = [], 0
            for p in members:
                # The strides torch.empty_like(p, memory_format=preserve_format) would give (the
                # buffer layout the kernels expect), on the meta device so nothing is allocated.
                stride = torch.empty_like(p, device="meta", dtype=dtype, memory_format=torch.preserve_format).stride()
                self.buffers[p] = flat.as_strided(p.shape, stride, start)
                entries.append((p, start, start + p.numel()))
                start += p.numel()
            self.segments.append((flat, entries))
        self._fixed = None

    def _buckets(self, live: set) -> Iterator[Tensor]:
        """Slices of the flat segments covering exactly the ``live`` parameters, each at most
        BUCKET_BYTES unless one parameter is larger."""
        for flat, entries in self.segments:
            limit = max(1, BUCKET_BYTES // flat.element_size())
            lo = hi = None
            for p, start, end in entries:
                if p in live and lo is not None and end - lo <= limit:
                    hi = end
                    continue
                if lo is not None:
                    yield flat[lo:hi]
                lo, hi = (start, end) if p in live else (None, None)
            if lo is not None:
                yield flat[lo:hi]

    def _fixed_buckets(self, params: list[Tensor]) -> list[tuple[Tensor, list[Tensor]]]:
        """Every parameter's buffer, in contiguous slices of its segment of at most BUCKET_BYTES
        (a larger parameter alone), cut from the segment's end and ordered by their last
        parameter, last first: gradients arrive roughly in reverse parameter order (DDP's
        assumption too). The same on every rank, which hold the same parameters in the same
        order, so every rank launches the same collectives in the same order."""
        if self._fixed is None:
            position = {p: i for i, p in enumerate(params)}
            buckets = []
            for flat, entries in self.segments:
                limit = max(1, BUCKET_BYTES // flat.element_size())
                members, lo, hi = [], 0, 0
                for p, start, end in reversed(entries):
                    if members and hi - start > limit:
                        buckets.append((flat[lo:hi], members))
                        members = []
                    if not members:
                        hi = end
                    lo = start
                    members.append(p)
                if members:
                    buckets.append((flat[lo:hi], members))
            buckets.sort(key=lambda bucket: -max(position[p] for p in bucket[1]))
            self._fixed = buckets
        return self._fixed

    @torch.no_grad()
    def begin_overlapped_window(self, params: list[Tensor], local_live: set, weight_sum: float,
                                weight_shift: int) -> int:
        """Collective, at the start of the window's last backward pass (in_backward mode B), on
        every rank: ``weight_sum`` includes that micro-batch's weight, ``local_live`` the
        parameters live before it. Exchanges the metadata, brings the live buffers to the ranks'
        common weight band and zeroes every other buffer, so that the backward's gradients can
        be added in and each bucket all-reduced as soon as they all arrived (``grad_ready``).
        Returns the common band's shift: the last micro-batch's weight must be given in it."""
        total, _, live, common = self._exchange_metadata(params, local_live, weight_sum, weight_shift, None, False)
        # Every bucket covers all its parameters (which ones this backward reaches is unknown
        # until it ends), so a buffer this rank has not written this window must add zero: a
        # parameter that some rank first reaches now then sums correctly, wherever it is live.
        stale = [self.buffers[p] for p in params if p not in local_live]
        if stale:
            torch._foreach_zero_(stale)
        if weight_shift != common and local_live:
            torch._foreach_mul_([self.buffers[p] for p in local_live], math.ldexp(1.0, weight_shift - common))
        expected = {p for p in params if p.requires_grad}
        self._overlap = _OverlappedReduce(total, live, self._fixed_buckets(params), expected)
        self._launch_ready(self._overlap)
        return common

    def grad_ready(self, p: Tensor) -> None:
        """``p``'s gradient of the window's last backward is in its buffer: launch every bucket
        that is complete and has no unlaunched bucket before it."""
        ov = self._overlap
        if ov is None:
            return
        index = ov.bucket_of[p]
        if index < len(ov.works):
            raise RuntimeError(
                f"accum_fused: a parameter received a gradient after its bucket was all-reduced (it did not "
                f"require grad when this {self.owner}'s last backward of the window began): keep requires_grad "
                "unchanged between forward and backward"
            )
        ov.waiting[index].discard(p)
        self._launch_ready(ov)

    def _launch_ready(self, ov: _OverlappedReduce) -> None:
        dist = _dist()
        while len(ov.works) < len(ov.buckets) and not ov.waiting[len(ov.works)]:
            ov.works.append(dist.all_reduce(ov.buckets[len(ov.works)][0], group=self.group, async_op=True))

    def _finish_overlapped_window(self, ov: _OverlappedReduce, params: list[Tensor],
                                  local_live: set) -> tuple[float, bool, set]:
        """End of the window's last backward: launch the buckets whose parameters got no gradient
        in it (in order), learn which parameters became live in it on any rank, wait."""
        for waiting in ov.waiting:
            waiting.clear()
        self._launch_ready(ov)
        works = ov.works
        # Parameters no rank had written before this backward: live if some rank wrote one now
        # (the same list on every rank; empty, and not sent, when all were live already).
        unknown = [p for p in params if p not in ov.live]
        if unknown:
            flags = torch.tensor([float(p in local_live) for p in unknown], dtype=torch.float64).to(params[0].device)
            works = works + [_dist().all_reduce(flags, group=self.group, async_op=True)]
        for work in works:
            work.wait()
        live = ov.live | ({p for p, flag in zip(unknown, flags.tolist()) if flag > 0} if unknown else set())
        return ov.total, False, live

    def _exchange_metadata(self, params: list[Tensor], local_live: set, weight_sum: float, weight_shift: int,
                           found_inf: Tensor | None, flushing: bool) -> tuple[float, bool, set, int]:
        """The small fp64 all-reduce: (global weight total in the common band's units, any rank
        non-finite, parameters live on some rank, the common band's shift)."""
        dist = _dist()
        device = params[0].device
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        # Each rank's weight band in its own slot (offset so that 0 means "no micro-batch"): the
        # sums are added in the highest band present, so the same units on every rank.
        bands = [0.0] * world
        if weight_sum > 0:
            bands[rank] = float(weight_shift + _BAND_OFFSET)
        true_total = math.ldexp(weight_sum, weight_shift)
        meta = [true_total, 0.0, float(flushing)] + bands + [float(p in local_live) for p in params]
        meta = torch.tensor(meta, dtype=torch.float64).to(device)
        if found_inf is not None:
            meta[1:2] += found_inf.detach().to(device=device, dtype=torch.float64).reshape(1)
        dist.all_reduce(meta, group=self.group)
        total, non_finite, flushers, *rest = meta.tolist()
        bands, flags = rest[:world], rest[world:]
        common = max((int(b) - _BAND_OFFSET for b in bands if b > 0), default=weight_shift)
        total = math.ldexp(total, -common)
        if 0 < flushers < dist.get_world_size(self.group):
            # Raised on every rank alike (all read the same sums), so none is left waiting.
            raise RuntimeError(
                f"accum_fused: {int(flushers)} rank(s) called flush() while the others closed a window in "
                "step(): every rank must close the same number of windows. Give every rank the same "
                "number of micro-batches per epoch (DistributedSampler does), or the same number of "
                "windows through per-rank accumulation_steps, and call flush() on every rank."
            )
        live = {p for p, flag in zip(params, flags) if flag > 0}
        return total, non_finite > 0, live, common

    @torch.no_grad()
    def reduce_window(self, params: list[Tensor], local_live: set, weight_sum: float, weight_shift: int,
                      found_inf: Tensor | None, flushing: bool) -> tuple[float, bool, set]:
        """Collective: every rank of the group must call it once per window, with ``params`` in
        the same order, all from step() or all from flush(). ``weight_sum`` and the buffers are
        in units of ``2**weight_shift`` (the window's weight band, see window/state.py). Returns
        (global weight total in the group's common units, any rank non-finite, globally live
        parameters); unless non-finite, the live parameters' buffers then hold the global sums
        in those units. After ``begin_overlapped_window`` it finishes that window's reduce
        instead (the other arguments were given there)."""
        overlap, self._overlap = self._overlap, None
        if overlap is not None and not flushing:  # (one left by a backward that raised is dropped)
            return self._finish_overlapped_window(overlap, params, local_live)
        total, non_finite, live, common = self._exchange_metadata(
            params, local_live, weight_sum, weight_shift, found_inf, flushing)
        if non_finite or not live:
            return total, non_finite, live
        for p in live - local_live:
            self.buffers[p].zero_()  # stale from an earlier window; this rank adds nothing
        if weight_sum > 0 and weight_shift != common:
            # Rare: weights more than 2**32 apart between ranks. Exact (a power of two).
            torch._foreach_mul_([self.buffers[p] for p in local_live], math.ldexp(1.0, weight_shift - common))
        dist = _dist()
        works = [dist.all_reduce(bucket, group=self.group, async_op=True) for bucket in self._buckets(live)]
        for work in works:
            work.wait()
        return total, False, live


# The name of a tensor-parallel dimension of a device mesh (torchtitan's and PyTorch's tutorials'):
# the ranks along it hold parts of one model replica and see the same micro-batches.
TP_DIM = "tp"


def shard_mesh(params: list[Tensor], owner: str):
    """The device mesh that FSDP2 (``fully_shard``) sharded ``params`` over (with tensor
    parallel, the mesh whose ``"tp"`` dimension the parameters that are not tensor-parallel do
    not span), checked: accum_fused's window math for DTensor parameters assumes FSDP2's
    layouts, in which the gradients are averaged over every data-parallel rank. On the
    data-parallel dimensions:
      - one: every parameter a ``Shard`` (fully_shard) or, without tensor parallel, every one a
        ``Replicate`` (FSDP2's replicate(): whole parameters, gradients all-reduced);
      - two, HSDP's: ``Replicate`` over the replicas, ``Shard`` within each;
    and with tensor parallel, a dimension named ``"tp"`` besides them: the tensor-parallel
    ``Shard`` or ``Replicate`` on it (FSDP2's ``Shard`` may then be a ``_StridedShard``), the
    other parameters on the data-parallel dimensions alone.
    Returns (the mesh, the index of its tensor-parallel dimension or None): ShardSync's input,
    so that which dimension is tensor parallel is decided here alone."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    problems = []
    if any(not isinstance(p, DTensor) for p in params):
        problems.append("a mix of DTensor and plain parameters (shard the whole model with fully_shard)")
    mesh = max(meshes, key=lambda m: m.ndim)
    names = mesh.mesh_dim_names or ()
    tp = names.index(TP_DIM) if mesh.ndim > 1 and TP_DIM in names else None
    data = [dim for dim in range(mesh.ndim) if dim != tp]
    if len(meshes) > 1 and not (tp is not None and all(_dims_of(m, mesh) == data for m in meshes - {mesh})):
        problems.append("parameters on more than one device mesh")
    data_layouts, tp_kinds = set(), set()  # each parameter's placements on the data dimensions; on "tp"
    for p in params:
        if isinstance(p, DTensor):
            kinds = [type(pl) for pl in p.placements]
            if tp is not None and p.device_mesh == mesh:
                tp_kinds.add(kinds.pop(tp))
            data_layouts.add(tuple(kinds))
    if len(data) > 2:
        problems.append(f"a {mesh.ndim}-D device mesh with {len(data)} data-parallel dimensions (FSDP2's one, or "
                        f"HSDP's two, each with or without a tensor-parallel dimension named {TP_DIM!r}, are supported)")
    elif tp is not None:
        if not (tp_kinds <= {Shard, Replicate} and all(
                _is_shard(kinds[-1]) and (len(kinds) == 1 or kinds[0] is Replicate) for kinds in data_layouts)):
            problems.append(f"placements on a tensor-parallel mesh {names} other than FSDP2's (Shard, or HSDP's "
                            f"Replicate and Shard) on its data dimensions and Shard or Replicate on {TP_DIM!r}")
    elif len(data) == 2 and data_layouts != {(Replicate, Shard)}:
        problems.append("placements on a 2-D device mesh other than HSDP's (Replicate(), Shard(0)) (for tensor "
                        f"parallel + FSDP2, name its tensor-parallel dimension {TP_DIM!r})")
    elif len(data) == 1 and data_layouts not in ({(Shard,)}, {(Replicate,)}):
        problems.append("placements other than FSDP2's Shard or replicate()'s Replicate (one of them)")
    if problems:
        raise NotImplementedError(f"{owner} got DTensor parameters with {'; '.join(problems)}")
    return mesh, tp


def _is_shard(placement) -> bool:
    """A ``Shard`` placement (or type), or ``_StridedShard``: how FSDP2 shards, over its data
    dimension, a parameter tensor parallel sharded on the same tensor dimension."""
    from torch.distributed.tensor import Shard
    kind = placement if isinstance(placement, type) else type(placement)
    return issubclass(kind, Shard) or kind.__name__ == "_StridedShard"


def _dims_of(sub, mesh) -> list[int] | None:
    """The dimensions of ``mesh`` that its submesh ``sub`` spans (by name, the same ranks on this
    rank), or None."""
    dist, dims = _dist(), []
    for i, name in enumerate(sub.mesh_dim_names or ()):
        if name not in (mesh.mesh_dim_names or ()):
            return None
        dim = mesh.mesh_dim_names.index(name)
        if sorted(dist.get_process_group_ranks(sub.get_group(i))) != sorted(
                dist.get_process_group_ranks(mesh.get_group(dim))):
            return None
        dims.append(dim)
    return dims or None


class ShardSync:
    """FSDP2: once-per-window agreement between the ranks of the parameters' mesh.

    FSDP2 reduce-scatters every backward's gradients itself, averaged over the mesh's N ranks,
    so each rank's buffers hold its shard of (1/N)·Σ_r Σ_j wᵣⱼ·gᵣⱼ when the weights entered
    before the reduce (``opt.backward(loss, weight=)`` scales the loss) or were equal on every
    rank. At the window boundary one small fp64 all-reduce gives every rank:
      - the global weight total W, so the update divides the buffers by W / N;
      - the global squared norm of the buffers (every shard), for clipping and so that a
        non-finite value on any rank skips the window on every rank;
      - whether the ranks close the window alike (all in step() or all in flush());
      - per micro-batch, how many ranks passed a weight only after backward (``step(weight=)``)
        and the sum and sum of squares of those weights: such weights reach the gradient after
        FSDP averaged it with equal weight per rank, which is right only if they are equal.
    """

    def __init__(self, mesh, tp: int | None, owner: str):
        """``mesh`` and ``tp``, its tensor-parallel dimension (or None): what shard_mesh found."""
        self.mesh = mesh
        self.owner = owner
        # This rank's place on each dimension of the mesh.
        self.coords = [mesh.get_local_rank(i) for i in range(mesh.ndim)]
        # The data-parallel ranks: every rank of the mesh but along tp (tensor parallel), whose
        # ranks see the same micro-batches. FSDP2 averages the gradients over all N of them
        # (HSDP: reduce-scattered within a replica, then all-reduced over the replicas).
        self.size = math.prod(mesh.size(i) for i in range(mesh.ndim) if i != tp)
        # The agreement is one sum over every rank of the mesh (an all-reduce per dimension), to
        # which the weights and checks come from one rank per data-parallel rank (the first
        # along tp) and the norm from every shard once (counts_here).
        self.groups = [mesh.get_group(i) for i in range(mesh.ndim)]
        self.gives_weights = tp is None or self.coords[tp] == 0
        self.tp_size = 1 if tp is None else mesh.size(tp)
        # The mesh dimensions each parameter's mesh spans, by id (with a reference, so that the id
        # stays its): the whole mesh (an equal object too), or (tensor parallel's other parameters)
        # its data dimensions alone.
        self._spans = {id(mesh): (mesh, range(mesh.ndim))}
        self._data_dims = [dim for dim in range(mesh.ndim) if dim != tp]

    def counts_here(self, p: Tensor) -> bool:
        """Whether this rank's shard of ``p`` goes into the window's norm: on each dimension of
        the mesh along which ``p`` is not sharded (HSDP's replicas, tensor parallel's replicated
        parameters, or a dimension ``p``'s mesh does not span), only the first rank's copy."""
        mesh = p.device_mesh
        spans = self._spans.get(id(mesh))
        if spans is None:  # (shard_mesh checked: a mesh other than the whole spans its data dimensions)
            spans = self._spans[id(mesh)] = (mesh, range(mesh.ndim) if mesh == self.mesh else self._data_dims)
        placed = dict(zip(spans[1], p.placements))
        return all(coord == 0 or (dim in placed and _is_shard(placed[dim])) for dim, coord in enumerate(self.coords))

    @torch.no_grad()
    def agree(self, live: list[Tensor], buffers: dict[Tensor, Tensor], backend_for, device: torch.device,
              weight_sum: float, flushing: bool, late_weights: list[float | None], grads_held: bool,
              window_length: int) -> tuple[float, Tensor | None]:
        """Collective: close a window of sharded buffers. ``live``: the parameters with a
        gradient in it, in parameter order; ``buffers[p]`` their local shards' sums. Returns (the
        divisor W / N, the window gradient's global norm as a 0-dim fp32 tensor; None when the
        window is empty on every rank)."""
        if grads_held and len(set(late_weights)) > 1:  # late weights, or late and in-loss mixed
            raise RuntimeError(
                "a micro-batch's gradients were held back by FSDP2 (set_requires_gradient_sync(False)) and arrived "
                "summed with a later one's, but the window's weights, given after backward, differ: pass each "
                f"weight before its backward with {self.owner}.backward(loss, weight=w), then step()"
            )
        by_kind = defaultdict(list)
        for p in live:
            if self.counts_here(p):
                by_kind[(p.device, p.dtype)].append(p)
        sq_norm = None
        for members in by_kind.values():
            norms = backend_for(members[0]).window_norms(
                buffers=[kernel_view(buffers[p]) for p in members], weight_sum=1.0)
            part = norms.to(torch.float64).square().sum()
            sq_norm = part if sq_norm is None else sq_norm + part.to(sq_norm.device)
        divisor, sq_norm = self.reduce_window(device, weight_sum, sq_norm, flushing, late_weights, window_length)
        if divisor <= 0:
            return divisor, None
        return divisor, (sq_norm.sqrt() / divisor).float()

    @torch.no_grad()
    def reduce_window(self, device: torch.device, weight_sum: float, sq_norm: Tensor | None, flushing: bool,
                      late_weights: list[float | None], window_length: int) -> tuple[float, Tensor]:
        """Collective over the mesh; every rank has the same ``window_length`` (its optimizer's
        accumulation_steps). ``late_weights[j]`` is micro-batch j's weight when it was given
        after backward, else None. Returns (W / N, global squared norm as a 0-dim fp64 tensor
        on ``device``)."""
        dist = _dist()
        late = []
        # Padded to the window length (the same on every rank): the all-reduce's size must agree
        # also when a rank flushes a partial window while another closes a full one.
        for w in late_weights + [None] * (window_length - len(late_weights)):
            late += [0.0, 0.0, 0.0] if w is None else [1.0, w, w * w]
        values = [weight_sum, float(flushing), 0.0] + late
        if not self.gives_weights:
            values = [0.0] * len(values)
        if self.tp_size > 1:  # every rank's weight total: a "tp" group's ranks must agree on it
            values.append(weight_sum)
        meta = torch.tensor(values, dtype=torch.float64).to(device)
        if sq_norm is not None:
            meta[2:3] += sq_norm.to(torch.float64).reshape(1)
        for group in self.groups:
            dist.all_reduce(meta, group=group)
        values = meta.tolist()
        total, flushers = values[0], values[1]
        if self.tp_size > 1 and abs(values[-1] - self.tp_size * total) > 1e-9 * abs(values[-1]):
            raise RuntimeError(
                f"accum_fused: the ranks along the device mesh's {TP_DIM!r} dimension gave this window different "
                "micro-batch weights, but tensor-parallel ranks must see the same micro-batches (each "
                f"{TP_DIM!r} group is one data-parallel rank): give them the same data and weights, or, if that "
                f"dimension is data-parallel, do not name it {TP_DIM!r}"
            )
        if 0 < flushers < self.size:
            raise RuntimeError(
                f"accum_fused: {int(flushers)} rank(s) called flush() while the others closed a window in step(): "
                "with FSDP2 every rank must close the same windows (the same number of micro-batches per rank)"
            )
        for j in range(window_length):
            count, s, sq = values[3 + 3 * j: 6 + 3 * j]
            if count == 0:
                continue
            if count != self.size or abs(self.size * sq - s * s) > 1e-9 * s * s:
                raise RuntimeError(
                    f"accum_fused: micro-batch {j} of this window has different weights on different ranks, "
                    "given after backward (step(weight=) or set_micro_batch_weight): FSDP2 had already averaged "
                    "the ranks' gradients with equal weight. Pass each micro-batch's weight before its backward "
                    f"with {self.owner}.backward(loss, weight=w) (it scales the loss), then call step()"
                )
        return total / self.size, meta[2]
