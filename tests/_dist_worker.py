"""One rank of the two-process gloo tests (tests/test_distributed.py starts two of these).

    python tests/_dist_worker.py RANK WORLD_SIZE PORT OUT_DIR

Runs every scenario of ``SCENARIOS`` on every backend that loads, each against the
single-process big batch over all ranks' micro-batches, computed here from the same seeded
data; writes {"<scenario>[<backend>]": "ok" | failure text} to OUT_DIR/rank<RANK>.json.

The data is uneven on purpose: rank 0 accumulates 3 micro-batches per window, rank 1 two, with
random sizes; the ranks start from different initial parameters; an auxiliary head gets
gradients on one rank only in some windows and on no rank in another; the last window is
partial (rank 0 has one micro-batch, rank 1 none) and closed with flush().
"""
from __future__ import annotations

import io
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import accum_fused
from _helpers import run_worker_cases, worker_case_ids

STEPS_PER_RANK = (3, 2)  # accumulation_steps of rank 0 and rank 1
FULL_WINDOWS = 3
CLIP = 0.5


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 2)  # used by some micro-batches only

    def forward(self, x, y, use_aux: bool) -> torch.Tensor:
        """Mean loss over the micro-batch's samples (the aux term only where the batch uses it)."""
        hidden = torch.tanh(self.body(x))
        loss = nn.functional.mse_loss(self.head(hidden), y)
        return loss + self.aux(hidden).pow(2).mean() if use_aux else loss


def micro_loss(model: nn.Module, micro_batch) -> torch.Tensor:
    return model(*micro_batch)


def make_data(seed: int = 7):
    """data[rank][window] = micro-batches; the last window is partial."""
    gen = torch.Generator().manual_seed(seed)
    data = [[] for _ in STEPS_PER_RANK]
    for window in range(FULL_WINDOWS + 1):
        for rank, k in enumerate(STEPS_PER_RANK):
            count = k if window < FULL_WINDOWS else (1 if rank == 0 else 0)
            batches = []
            for i in range(count):
                n = int(torch.randint(1, 8, (1,), generator=gen))
                # aux: rank 0 in window 0, rank 1 in window 2, nobody in windows 1 and 3
                use_aux = (window == 0 and rank == 0) or (window == 2 and rank == 1 and i == 0)
                batches.append((torch.randn(n, 6, generator=gen), torch.randn(n, 3, generator=gen), use_aux))
            data[rank].append(batches)
    return data


def reference_params(make_torch_opt, data, clip=None, skip_windows=(), rank_scale=(1.0, 1.0)):
    """The single process big batch: rank 0's initial parameters, one torch.optim step per
    window on the mean loss over every rank's samples of that window (a rank's samples weighing
    ``rank_scale[rank]`` each)."""
    model = Net(seed=100)
    opt = make_torch_opt(model.parameters())
    for window in range(len(data[0])):
        if window in skip_windows:
            continue
        batches = [(b, scale) for rank_data, scale in zip(data, rank_scale) for b in rank_data[window]]
        total = sum(len(b[0]) * scale for b, scale in batches)
        opt.zero_grad(set_to_none=True)
        (sum(len(b[0]) * scale / total * micro_loss(model, b) for b, scale in batches)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach() for p in model.parameters()]


def train(model, opt, batches, scaler=None, poison=None, weight_scale=1.0) -> None:
    for i, b in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = micro_loss(model, b)
        if poison == i:
            loss = loss * float("inf")
        if getattr(opt, "in_backward", False):
            opt.backward(loss, weight=len(b[0]) * weight_scale)
        elif scaler is None:
            loss.backward()
            opt.step(weight=len(b[0]) * weight_scale)
        else:
            scaler.scale(loss).backward()
            scaler.step(opt, weight=len(b[0]))
            scaler.update()


def check_close(params, expected, what: str) -> None:
    assert len(params) == len(expected)
    for i, (a, b) in enumerate(zip(params, expected)):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}, param {i}: {m}")


def check_ranks_identical(params) -> None:
    """Every rank holds bit-identical parameters (they applied the same update)."""
    for i, p in enumerate(params):
        theirs = p.detach().clone()
        dist.broadcast(theirs, src=0)
        assert torch.equal(theirs, p.detach()), f"param {i} differs between ranks"


# ----------------------------------------------------------------------------- optimizers
# name -> (accum_fused optimizer factory, torch.optim factory for the big batch, clip)
def _sgd(params, **kw):
    return accum_fused.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, **kw)


def _adamw(params, **kw):
    return accum_fused.AdamW(params, lr=0.01, weight_decay=0.1, max_grad_norm=CLIP, **kw)


def _wrapped_rmsprop(params, accumulation_steps, **kw):
    inner = torch.optim.RMSprop(params, lr=0.01, momentum=0.9, weight_decay=0.01)
    return accum_fused.GradientAccumulator(inner, accumulation_steps, max_grad_norm=CLIP, **kw)


OPTIMIZERS = {
    "SGD-nesterov": (_sgd, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01), None),
    "AdamW-clip": (_adamw, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), CLIP),
    "wrapped-RMSprop-clip": (_wrapped_rmsprop,
                             lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, weight_decay=0.01), CLIP),
}


def _build(name, model, rank, backend, group):
    make, _, _ = OPTIMIZERS[name]
    return make(model.parameters(), accumulation_steps=STEPS_PER_RANK[rank], process_group=group, backend=backend)


# ----------------------------------------------------------------------------- scenarios
def big_batch(name, rank, backend, group, data):
    """Several windows and a flushed partial window equal the single-process big batch."""
    model = Net(seed=100 + rank)  # different initial parameters per rank: broadcast at construction
    opt = _build(name, model, rank, backend, group)
    for window in range(FULL_WINDOWS):
        train(model, opt, data[rank][window])
        assert opt.updated and opt.update_count == window + 1, (opt.updated, opt.update_count)
    train(model, opt, data[rank][FULL_WINDOWS])
    assert opt.flush() is True  # rank 1 has no micro-batch in this window and must still flush
    assert opt.update_count == FULL_WINDOWS + 1
    _, make_torch, clip = OPTIMIZERS[name]
    expected = reference_params(make_torch, data, clip)
    check_close(list(model.parameters()), expected, name)
    check_ranks_identical(list(model.parameters()))
    if clip is not None:
        assert opt.last_grad_norm is not None and opt.last_grad_norm > 0


def inf_skips_window(name, rank, backend, group, data):
    """A non-finite micro-batch on rank 1 (GradScaler) skips that window on both ranks."""
    model = Net(seed=100 + rank)
    opt = _build(name, model, rank, backend, group)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for window in range(FULL_WINDOWS):
        before = [p.detach().clone() for p in model.parameters()]
        train(model, opt, data[rank][window], scaler, poison=1 if (window == 1 and rank == 1) else None)
        if window == 1:
            assert not opt.updated, "the poisoned window was applied"
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "params moved"
    train(model, opt, data[rank][FULL_WINDOWS], scaler)
    assert opt.flush() is True
    assert opt.update_count == FULL_WINDOWS, opt.update_count
    _, make_torch, clip = OPTIMIZERS[name]
    expected = reference_params(make_torch, data, clip, skip_windows=(1,))
    check_close(list(model.parameters()), expected, name)
    check_ranks_identical(list(model.parameters()))


def resume_mid_window(name, rank, backend, group, data):
    """state_dict taken in the middle of a window (each rank its own) resumes bit-exactly."""
    def run(checkpoint_at=None):
        model = Net(seed=100 + rank)
        opt = _build(name, model, rank, backend, group)
        for window in range(FULL_WINDOWS + 1):
            batches = data[rank][window]
            if window == checkpoint_at:
                train(model, opt, batches[:1])
                blob = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
                blob.seek(0)
                saved = torch.load(blob, weights_only=False)
                model = Net(seed=999)  # a fresh process would start from other values
                model.load_state_dict(saved["model"])
                opt = _build(name, model, rank, backend, group)
                opt.load_state_dict(saved["opt"])
                assert opt.micro_step == 1
                batches = batches[1:]
            train(model, opt, batches)
        assert opt.flush()
        return [p.detach() for p in model.parameters()]

    uninterrupted = run()
    resumed = run(checkpoint_at=1)
    for i, (a, b) in enumerate(zip(uninterrupted, resumed)):
        assert torch.equal(a, b), f"param {i}: resumed run differs by {(a - b).abs().max().item()}"


def rank0_checkpoint_on_every_rank(name, rank, backend, group, data):
    """Issue 29 row 4: rank 0's mid-window state_dict loaded on every rank (the "save on rank 0"
    habit) resumed every rank with rank 0's micro-batches, 2e-2 off, silently. It is refused on
    another rank and in another world size, before anything changes; a boundary state_dict
    (rank-free) loads on any rank."""
    model = Net(seed=100 + rank)
    opt = _build(name, model, rank, backend, group)
    train(model, opt, data[rank][0][:1])
    mid = opt.state_dict()
    assert (mid["accumulation"]["rank"], mid["accumulation"]["world_size"]) == (rank, dist.get_world_size())
    from_rank0 = [mid]
    dist.broadcast_object_list(from_rank0, src=0)
    fresh = _build(name, Net(seed=100 + rank), rank, backend, group)
    if rank == 0:
        fresh.load_state_dict(from_rank0[0])
        assert fresh.micro_step == 1
    else:
        try:
            fresh.load_state_dict(from_rank0[0])
        except ValueError as e:
            assert "holds the open window of rank 0 of 2" in str(e) and "every rank's own" in str(e), e
        else:
            raise AssertionError("rank 0's mid-window state_dict loaded on rank 1")
        assert fresh.micro_step == 0 and fresh.state_dict()["state"] == {}
    other_world = {**mid, "accumulation": {**mid["accumulation"], "world_size": 4}}
    try:
        _build(name, Net(seed=100 + rank), rank, backend, group).load_state_dict(other_world)
    except ValueError as e:
        assert "of 4" in str(e), e
    else:
        raise AssertionError("a mid-window state_dict of 4 ranks loaded into 2")
    train(model, opt, data[rank][0][1:])
    assert opt.updated and opt.micro_step == 0
    boundary = opt.state_dict()
    assert "rank" not in boundary["accumulation"]
    from_rank0 = [boundary]
    dist.broadcast_object_list(from_rank0, src=0)
    _build(name, Net(seed=100 + rank), rank, backend, group).load_state_dict(from_rank0[0])  # loads anywhere


class _OutOfMemoryAbove(torch.autograd.Function):
    """Identity; its backward runs out of memory when the pass holds more than ``limit`` samples."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.n, ctx.limit = x.shape[0], limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.limit is not None and ctx.n > ctx.limit:
            raise torch.OutOfMemoryError(f"injected: {ctx.n} samples > {ctx.limit}")
        return grad, None


def _gated_loss(model, batch, limit):
    """Net's loss with the injected failure between its layers (the head's gradients are in)."""
    module = getattr(model, "module", model)  # (a DDP model: its forward runs the watch)
    x, y, use_aux = batch
    if module is not model:
        model(x, y, use_aux)  # DDP's forward (no reduction: accum_fused owns the window); its result unused
    hidden = _OutOfMemoryAbove.apply(torch.tanh(module.body(x)), limit)
    loss = nn.functional.mse_loss(module.head(hidden), y)
    return loss + module.aux(hidden).pow(2).mean() if use_aux else loss


def run_recovers_alone(name, rank, backend, group, data):
    """Issue 30: only rank 1 runs out of memory (above 2 samples per pass) and retries in parts,
    with no collective per micro-batch: plain mode and mode B with a process_group, and a DDP
    model taken over. No hang; the ranks end bit-identical and on the big batch."""
    make, make_torch, clip = OPTIMIZERS[name]
    limit = 2 if rank == 1 else None
    for mode in ("plain", "B", "ddp"):
        model = Net(seed=100 + rank)
        kwargs = dict(accumulation_steps=STEPS_PER_RANK[rank], backend=backend)
        if mode == "ddp":
            opt = make(model.parameters(), **kwargs)
            driven = nn.parallel.DistributedDataParallel(model, process_group=group)
        else:
            opt = make(model.parameters(), process_group=group, in_backward=mode == "B", **kwargs)
            driven = model
        for window in range(FULL_WINDOWS + 1):
            for batch in data[rank][window]:
                opt.recovery.max_part_size = None  # every pass above the limit fails, the closing ones too
                opt.run(batch, lambda b: _gated_loss(driven, b, limit))
        opt.flush()
        assert (opt.recovery.retries > 0) == (rank == 1), (mode, opt.recovery)
        check_close(list(model.parameters()), reference_params(make_torch, data, clip), f"{name} {mode}")
        check_ranks_identical(list(model.parameters()))
        opt.close()


def _ddp_window_loss(model, batch, window_samples: int) -> torch.Tensor:
    """Mode A under DDP, as transformers' Trainer scales it: the micro-batch's share of the
    window's samples over every rank, times the world size (DDP averages over the ranks)."""
    return micro_loss(model, batch) * (len(batch[0]) * dist.get_world_size() / window_samples)


def _train_ddp(mode, ddp, opt, data, rank, window) -> None:
    """One window of the own loop through a DDP model: plain (``step(weight=)``), mode B
    (``opt.backward(loss, weight=)``) or mode A (loss scaled by the global sample count, summed
    by the hooks, one ``step()``)."""
    if mode != "A":
        train(ddp, opt, data[rank][window])
        return
    window_samples = sum(len(b[0]) for rank_data in data for b in rank_data[window])
    for batch in data[rank][window]:
        _ddp_window_loss(ddp, batch, window_samples).backward()
    opt.step()
    opt.zero_grad()


def _ddp_own_loop(mode, name, rank, backend, group, data, wrap_first: bool, explicit_group: bool = False):
    """A DistributedDataParallel model and an accum_fused optimizer without a process_group, in the
    own loop: the optimizer takes DDP's group and turns its per-backward all-reduce off
    (``wrap_first``: built after wrapping, found by its parameters; otherwise built first, found
    at DDP's first forward, the HF Trainer / accelerate order). Every rank ends bit-identical and
    on the single-process big batch, the partial last window included; no warning."""
    make, make_torch, clip = OPTIMIZERS[name]
    model = Net(seed=100 + rank)
    k = 1 if mode == "A" else STEPS_PER_RANK[rank]
    kwargs = dict(accumulation_steps=k, backend=backend)
    if mode != "plain":
        kwargs["in_backward"] = True
    if explicit_group:
        kwargs["process_group"] = group
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: this is the supported path
        if wrap_first:
            ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
            opt = make(model.parameters(), **kwargs)
            assert ddp.require_backward_grad_sync is False
        else:
            opt = make(model.parameters(), **kwargs)
            ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        for window in range(FULL_WINDOWS + 1):
            if mode == "A" and window == 1:
                with ddp.no_sync():  # a no_sync() block restores the flag it found: DDP must stay off
                    _train_ddp(mode, ddp, opt, data, rank, window)
            else:
                _train_ddp(mode, ddp, opt, data, rank, window)
            assert ddp.require_backward_grad_sync is False
            if window < FULL_WINDOWS:
                assert opt.updated and opt.update_count == window + 1, (opt.updated, opt.update_count)
    if mode != "A":
        assert opt.flush()
    assert opt.update_count == FULL_WINDOWS + 1
    assert opt.process_group is not None
    assert all(p.grad is None for p in model.parameters()) or mode == "plain"
    check_close(list(model.parameters()), reference_params(make_torch, data, clip), f"{name} mode {mode}")
    check_ranks_identical(list(model.parameters()))


def ddp_plain(name, rank, backend, group, data):
    for wrap_first in (True, False):
        _ddp_own_loop("plain", name, rank, backend, group, data, wrap_first)


def ddp_mode_a(name, rank, backend, group, data):
    for wrap_first in (True, False):
        _ddp_own_loop("A", name, rank, backend, group, data, wrap_first)


def ddp_mode_b(name, rank, backend, group, data):
    for wrap_first in (True, False):
        _ddp_own_loop("B", name, rank, backend, group, data, wrap_first)


def ddp_explicit_group(name, rank, backend, group, data):
    """process_group=... given as well (the earlier recipe): the same, wrapped before or after."""
    for wrap_first in (True, False):
        _ddp_own_loop("plain", name, rank, backend, group, data, wrap_first, explicit_group=True)


def ddp_unowned_parameters(name, rank, backend, group, data):
    """Part of the DDP model trained by another (torch.optim) optimizer: turning DDP's sync off
    would leave that part unreduced, so DDP's first forward raises on every rank, naming the fix."""
    model = Net(seed=100 + rank)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = accum_fused.SGD(list(model.body.parameters()) + list(model.head.parameters()), lr=0.1,
                          accumulation_steps=2, backend=backend)
    torch.optim.SGD(model.aux.parameters(), lr=0.1)
    try:
        train(ddp, opt, data[rank][0][:1])
    except RuntimeError as exc:
        assert "'aux.weight'" in str(exc) and "no accum_fused optimizer" in str(exc), str(exc)
    else:
        raise AssertionError("no error for DDP parameters outside the accum_fused optimizer")


def ddp_mismatched_windows(name, rank, backend, group, data):
    """DDP adopted, rank 0 flushing while rank 1 closes a window in step(): an error on both
    ranks, not a hang."""
    model = Net(seed=100 + rank)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=2, backend=backend)
    _expect_mismatched_windows_error(ddp, opt, rank, data)


def ddp_wrapped_after_first_window(name, rank, backend, group, data):
    """An optimizer without a process_group in a job of several processes keeps watching after
    its first window: a model wrapped in DDP only then is taken over at its first forward, and
    from there the ranks train alike (SGD without state: DDP's broadcast made them equal)."""
    model = Net(seed=100 + rank)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=STEPS_PER_RANK[rank], backend=backend)
    train(model, opt, data[rank][0])  # one window on each rank alone
    assert opt.update_count == 1 and opt.process_group is None
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    for window in range(1, FULL_WINDOWS + 1):
        train(ddp, opt, data[rank][window])
    assert opt.flush() and opt.process_group is not None and ddp.require_backward_grad_sync is False
    check_ranks_identical(list(model.parameters()))


def ddp_released_with_optimizer(name, rank, backend, group, data):
    """When the optimizer is collected (a notebook rebuilding it), DDP's own sync comes back."""
    import gc

    model = Net(seed=100 + rank)
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=2, backend=backend)
    assert ddp.require_backward_grad_sync is False
    del opt
    gc.collect()
    assert ddp.require_backward_grad_sync is True
    assert not ddp._forward_pre_hooks


def empty_flush(name, rank, backend, group, data):
    """flush() with no micro-batch on any rank applies nothing, on every rank."""
    model = Net(seed=100 + rank)
    opt = _build(name, model, rank, backend, group)
    before = [p.detach().clone() for p in model.parameters()]
    assert opt.flush() is False and opt.update_count == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _expect_mismatched_windows_error(forward, opt, rank, data) -> None:
    """Rank 0 flushes one micro-batch while rank 1 closes a window of two in step(): both
    ranks must raise "same number of windows"."""
    batches = data[rank][0][:1] if rank == 0 else data[rank][0][:2]
    try:
        train(forward, opt, batches)
        if rank == 0:
            opt.flush()
    except RuntimeError as exc:
        assert "same number of windows" in str(exc), str(exc)
    else:
        raise AssertionError("no error for ranks closing windows differently")


def mismatched_windows(name, rank, backend, group, data):
    """Rank 1 closes a window in step() while rank 0 flushes: a clear error on both ranks,
    not a hang or a silent mix-up."""
    model = Net(seed=100 + rank)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=2, process_group=group, backend=backend)
    _expect_mismatched_windows_error(model, opt, rank, data)


def in_backward_big_batch(name, rank, backend, group, data):
    """in_backward mode B (opt.backward per micro-batch, the update in the k-th backward, the
    window all-reduced at the end of it) equals the single-process big batch."""
    model = Net(seed=100 + rank)
    make, make_torch, clip = OPTIMIZERS[name]
    opt = make(model.parameters(), accumulation_steps=STEPS_PER_RANK[rank], process_group=group, backend=backend,
               in_backward=True)
    for window in range(FULL_WINDOWS):
        train(model, opt, data[rank][window])
        assert opt.updated and opt.update_count == window + 1, (opt.updated, opt.update_count)
        assert all(p.grad is None for p in model.parameters())
    train(model, opt, data[rank][FULL_WINDOWS])
    assert opt.flush() is True
    check_close(list(model.parameters()), reference_params(make_torch, data, clip), name)
    check_ranks_identical(list(model.parameters()))


class CollectiveLog:
    """Records, in order, every torch.distributed.all_reduce (distributed.py looks it up at each
    call) as ("all_reduce", numel, dtype, async_op), and whatever else a test appends."""

    def __init__(self):
        self.events: list[tuple] = []

    def __enter__(self):
        self._inner = dist.all_reduce

        def all_reduce(tensor, *args, async_op=False, **kwargs):
            self.events.append(("all_reduce", tensor.numel(), tensor.dtype, async_op))
            return self._inner(tensor, *args, async_op=async_op, **kwargs)

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._inner

    def buckets(self) -> list[tuple]:
        """The fp32 bucket all-reduces (the metadata and live flags are fp64)."""
        return [e for e in self.events if e[0] == "all_reduce" and e[2] == torch.float32]


class small_buckets:
    """BUCKET_BYTES of 64: each of Net's six parameters gets a bucket of its own (aux.bias 8 B,
    aux.weight 64 B, head.bias 12 B, ...), so the overlapped reduce launches six in turn."""

    def __enter__(self):
        self._saved = accum_fused.distributed.BUCKET_BYTES
        accum_fused.distributed.BUCKET_BYTES = 64

    def __exit__(self, *exc):
        accum_fused.distributed.BUCKET_BYTES = self._saved


def _with_aux(data, uses_aux):
    """``data`` with the aux head used where ``uses_aux(window, rank, i)``."""
    return [[[(x, y, uses_aux(window, rank, i)) for i, (x, y, _) in enumerate(batches)]
             for window, batches in enumerate(rank_data)] for rank, rank_data in enumerate(data)]


def _overlapped_equals_plain_and_big_batch(name, rank, backend, group, data, scale):
    """in_backward mode B (buckets all-reduced during the window's last backward, six buckets)
    against the plain mode's reduce after the last step() on the same data and weights: equal
    (bit for bit on the reference backend) and both the single-process big batch. The aux head
    tests the live flags: window 0 only rank 0's first micro-batch uses it (live, but no gradient
    in either rank's last backward: its bucket is launched at the end of backward, and rank 1's
    buffer must add zero); window 1 only rank 1's last micro-batch (live on no rank when that
    backward starts; rank 0's buffer is stale from window 0); window 2 nobody (left alone); the
    partial window 3 rank 0 (flush)."""
    data = _with_aux(data, lambda window, r, i: (window, r, i) in {(0, 0, 0), (1, 1, 1), (3, 0, 0)})
    make, make_torch, clip = OPTIMIZERS[name]
    results = {}
    with small_buckets():
        for mode in ("plain", "in_backward"):
            model = Net(seed=100 + rank)
            opt = make(model.parameters(), accumulation_steps=STEPS_PER_RANK[rank], process_group=group,
                       backend=backend, in_backward=mode == "in_backward")
            for window in range(FULL_WINDOWS):
                with CollectiveLog() as log:
                    train(model, opt, data[rank][window], weight_scale=scale[rank])
                assert opt.updated and opt.update_count == window + 1, (mode, opt.updated, opt.update_count)
                if mode == "in_backward":
                    # fixed buckets: all parameters, every window, whichever are live
                    sizes = [e[1] for e in log.buckets()]
                    assert len(sizes) >= 3 and sum(sizes) == sum(p.numel() for p in model.parameters()), sizes
            train(model, opt, data[rank][FULL_WINDOWS], weight_scale=scale[rank])
            assert opt.flush() is True
            results[mode] = [p.detach().clone() for p in model.parameters()]
            check_close(results[mode], reference_params(make_torch, data, clip, rank_scale=scale), f"{name} {mode}")
            check_ranks_identical(results[mode])
    for i, (a, b) in enumerate(zip(results["in_backward"], results["plain"])):
        if backend == "torch":
            assert torch.equal(a, b), f"param {i}: overlapped differs from plain by {(a - b).abs().max().item()}"
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m: f"param {i}: {m}")


def in_backward_overlapped(name, rank, backend, group, data):
    _overlapped_equals_plain_and_big_batch(name, rank, backend, group, data, scale=(1.0, 1.0))


def in_backward_overlapped_bands(name, rank, backend, group, data):
    """As in_backward_overlapped, rank 0's weights 2**40 times rank 1's: rank 1's buffers move to
    rank 0's weight band when the last backward starts, before any bucket is sent."""
    _overlapped_equals_plain_and_big_batch(name, rank, backend, group, data, scale=(2.0**40, 1.0))


def in_backward_overlaps_backward(name, rank, backend, group, data):
    """The all-reduce really overlaps the window's last backward: buckets of the head's and aux's
    parameters are launched before the body's gradients are taken (the body's hooks, registered
    after the optimizer's, have not all run yet); earlier micro-batches send nothing."""
    data = _with_aux(data, lambda window, r, i: True)  # aux's bucket (launched first) is not held back
    model = Net(seed=100 + rank)
    make, make_torch, clip = OPTIMIZERS[name]
    with small_buckets(), CollectiveLog() as log:
        opt = make(model.parameters(), accumulation_steps=STEPS_PER_RANK[rank], process_group=group,
                   backend=backend, in_backward=True)
        for p in model.body.parameters():
            p.register_post_accumulate_grad_hook(lambda p: log.events.append(("body hook",)))
        for window in range(FULL_WINDOWS):
            for i, batch in enumerate(data[rank][window]):
                del log.events[:]
                opt.backward(micro_loss(model, batch), weight=len(batch[0]))
                collectives = [e for e in log.events if e[0] == "all_reduce"]
                if i + 1 < STEPS_PER_RANK[rank]:
                    assert not collectives and not opt.updated, log.events
                    continue
                assert opt.updated, window
                last_body_hook = max(j for j, e in enumerate(log.events) if e[0] == "body hook")
                first_bucket = log.events.index(log.buckets()[0])
                assert first_bucket < last_body_hook, log.events
    full_windows = [rank_data[:FULL_WINDOWS] for rank_data in data]
    check_close(list(model.parameters()), reference_params(make_torch, full_windows, clip), name)
    check_ranks_identical(list(model.parameters()))


def weight_bands_differ(name, rank, backend, group, data):
    """Rank 0's weights are 1e12 times rank 1's (another 2**32 band): the sums are brought to
    common units before the all-reduce, and the result is still the weighted big batch."""
    scale = (1e12, 1.0)
    model = Net(seed=100 + rank)
    opt = _build(name, model, rank, backend, group)
    for window in range(FULL_WINDOWS + 1):
        train(model, opt, data[rank][window], weight_scale=scale[rank])
    assert opt.flush()
    _, make_torch, clip = OPTIMIZERS[name]
    check_close(list(model.parameters()), reference_params(make_torch, data, clip, rank_scale=scale), name)
    check_ranks_identical(list(model.parameters()))


SCENARIOS = {
    "big_batch": (big_batch, list(OPTIMIZERS)),
    "inf_skips_window": (inf_skips_window, ["AdamW-clip", "wrapped-RMSprop-clip"]),
    "resume_mid_window": (resume_mid_window, ["AdamW-clip", "SGD-nesterov", "wrapped-RMSprop-clip"]),
    "rank0_checkpoint_on_every_rank": (rank0_checkpoint_on_every_rank, ["AdamW-clip", "wrapped-RMSprop-clip"]),
    "run_recovers_alone": (run_recovers_alone, ["SGD-nesterov", "AdamW-clip"]),
    "ddp_plain": (ddp_plain, ["AdamW-clip", "wrapped-RMSprop-clip"]),
    "ddp_mode_a": (ddp_mode_a, ["AdamW-clip", "SGD-nesterov"]),
    "ddp_mode_b": (ddp_mode_b, ["AdamW-clip"]),
    "ddp_explicit_group": (ddp_explicit_group, ["AdamW-clip"]),
    "ddp_unowned_parameters": (ddp_unowned_parameters, ["SGD-nesterov"]),
    "ddp_mismatched_windows": (ddp_mismatched_windows, ["SGD-nesterov"]),
    "ddp_wrapped_after_first_window": (ddp_wrapped_after_first_window, ["SGD-plain"]),
    "ddp_released_with_optimizer": (ddp_released_with_optimizer, ["SGD-nesterov"]),
    "empty_flush": (empty_flush, ["SGD-nesterov"]),
    "mismatched_windows": (mismatched_windows, ["SGD-nesterov"]),
    "in_backward_big_batch": (in_backward_big_batch, ["SGD-nesterov", "AdamW-clip"]),
    "weight_bands_differ": (weight_bands_differ, ["AdamW-clip"]),
    "in_backward_overlapped": (in_backward_overlapped, ["SGD-nesterov", "AdamW-clip"]),
    "in_backward_overlapped_bands": (in_backward_overlapped_bands, ["SGD-nesterov", "AdamW-clip"]),
    "in_backward_overlaps_backward": (in_backward_overlaps_backward, ["SGD-nesterov"]),
}


def case_ids(backends) -> list[str]:
    return worker_case_ids(SCENARIOS, backends)


def main(rank: int, world_size: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))  # not WORLD: exercise group-rank mapping
    data = make_data()
    run_worker_cases(SCENARIOS, rank, out_dir, lambda run, name, backend: run(name, rank, backend, group, data))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
