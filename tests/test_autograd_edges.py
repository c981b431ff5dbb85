"""Autograd's contracts at the edges (issue 21): version counters, checkpointing, failed
backward passes, foreign backward passes, parameters unfrozen later, a second optimizer on the
same parameters, step hooks, LR schedulers, closure-driven optimizers.

Oracles: torch.optim on the same loop where the semantics coincide (k=1, mode A), else the
plain mode on the same micro-batches and weights. Every test runs on every backend that loads.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.checkpoint import checkpoint

import accum_fused

from _helpers import (KERNEL_VS_TORCH_TOLERANCE, OPTIMIZERS, assert_params_changed, assert_params_close,
                      assert_params_equal, loss_of, make_batches, make_model)

HYPER = {"SGD": dict(lr=0.1, momentum=0.9), "Adam": dict(lr=0.01, amsgrad=True), "AdamW": dict(lr=0.01)}
SIZES = [3, 1, 4, 2, 5, 3, 2, 2]
INPLACE_ERROR = "modified by an inplace operation"

# How the loop drives the optimizer: plain step() (k=1 and k=2), mode A, mode B.
MODES = {
    "plain-k1": dict(accumulation_steps=1),
    "plain-k2": dict(accumulation_steps=2),
    "mode-a": dict(accumulation_steps=1, in_backward=True),
    "mode-b": dict(accumulation_steps=2, in_backward=True),
}


def _close(model, ref, backend, rtol=None, atol=None):
    if backend == "torch" and rtol is None:
        assert_params_equal(model, ref)
    else:
        tol = KERNEL_VS_TORCH_TOLERANCE if rtol is None else dict(rtol=rtol, atol=atol)
        assert_params_close(model, ref, **tol)


def _micro_batch(opt, model, batch, weight=1.0):
    """One micro-batch the way each mode takes it; returns whether it updated."""
    loss = loss_of(model, batch)
    if opt.in_backward and opt.accumulation_steps > 1:
        opt.backward(loss, weight=weight)
        return opt.updated
    loss.backward()
    if opt.in_backward:  # mode A: the loop's step() is the update
        opt.step()
        opt.zero_grad()
        return True
    opt.step(weight=weight)
    opt.zero_grad()
    return opt.updated


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises when ``armed`` (a caught out-of-memory error, say)."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("simulated failure inside backward")
        return grad


class _Failing(nn.Module):
    def forward(self, x):
        return _FailOnce.apply(x)


def _model_failing_midway(seed=0):
    """make_model's layers with a node between them whose backward can fail: the head's
    gradients arrive (and its hooks run) before the failure, the first layer's never do."""
    base = make_model(seed)
    return nn.Sequential(base[0], base[1], _Failing(), base[2])


# ---------------------------------------------------------------- gradients whose memory is not their values
class _FlaggedGradients(torch.autograd.Function):
    """(a * x).sum() + (b * x).sum() with its own backward: a gets zeros, b its gradient. With
    ``flagged``, as autograd can hand them (and AccumulateGrad stores them as .grad): a's zeros a
    ZeroTensor (no memory behind it), b's gradient a negative view of its negation (its memory
    holds the other sign)."""
    flagged = True

    @staticmethod
    def forward(ctx, a, b, x):
        ctx.save_for_backward(x)
        return (a * x).sum() + (b * x).sum()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        grad_b = (g * x).sum(0)
        if _FlaggedGradients.flagged:
            return torch._efficientzerotensor(x.shape[1:]), torch._neg_view(-grad_b), None
        return torch.zeros(x.shape[1:]), grad_b, None


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_zero_tensor_and_negative_view_gradients_train_as_their_values(backend, name, mode, monkeypatch):
    """Gradients whose memory does not hold their values (a ZeroTensor, a negative view) train
    exactly as the same values in plain tensors: no crash (a ZeroTensor's memory was read as a
    buffer's), no sign flipped."""
    def run(flagged):
        monkeypatch.setattr(_FlaggedGradients, "flagged", flagged)
        torch.manual_seed(0)
        a, b = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
        head = nn.Linear(3, 2)
        params = [a, b, *head.parameters()]
        b_before = b.detach().clone()
        opt = OPTIMIZERS[name][0](params, backend=backend, **HYPER[name], **MODES[mode])
        gen = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(5, 3, generator=gen)
            loss = _FlaggedGradients.apply(a, b, x) + head(x).square().mean()
            if opt.in_backward and opt.accumulation_steps > 1:
                opt.backward(loss)
            else:
                loss.backward()
                opt.step()
                opt.zero_grad()
        assert opt.update_count == (4 if opt.accumulation_steps == 1 else 2)
        assert not torch.equal(b, b_before)
        return [p.detach().clone() for p in params]
    flagged, plain = run(True), run(False)
    for x, y in zip(flagged, plain):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- 1, 2. version counters
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_update_bumps_the_version_of_every_tensor_it_writes(backend, name, mode):
    """Parameters and the state a user can hold (momentum, moments) get their version counters
    bumped by the update, as torch.optim's in-place ops bump them."""
    model = make_model()
    opt = OPTIMIZERS[name][0](model.parameters(), **HYPER[name], **MODES[mode], backend=backend)
    batches = make_batches(SIZES[:4])
    for batch in batches[:2]:
        _micro_batch(opt, model, batch)  # the first update creates the state
    before = {id(t): t._version for t in _written(opt, model)}
    updated = [_micro_batch(opt, model, batch) for batch in batches[2:]]
    assert any(updated)
    for t in _written(opt, model):
        assert t._version > before[id(t)], (mode, tuple(t.shape))


def _written(opt, model):
    return list(model.parameters()) + [v for s in opt.state.values() for k, v in s.items() if k != "step"]


@pytest.mark.parametrize("mode", list(MODES))
def test_backward_through_outputs_saved_before_an_update_raises_as_with_torch_optim(backend, mode):
    """The classic GAN mistake: ``out = D(x)`` kept across an update, then ``out.backward()``."""
    errors = []
    for make in (lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                 lambda m: accum_fused.SGD(m.parameters(), lr=0.1, **MODES[mode], backend=backend)):
        model = make_model()
        opt = make(model)
        batches = make_batches([2, 2])
        kept = loss_of(model, batches[0])
        if isinstance(opt, accum_fused.SGD):
            while not _micro_batch(opt, model, batches[1]):
                pass
        else:
            loss_of(model, batches[1]).backward()
            opt.step()
        with pytest.raises(RuntimeError, match=INPLACE_ERROR) as info:
            kept.backward()
        errors.append(type(info.value))
    assert errors[0] is errors[1]


def test_mode_b_update_of_a_parameter_another_node_still_needs_raises(backend):
    """Row 2: mode B updates a parameter inside backward as soon as its gradient is in. A node
    that saved the parameter's value through a detached alias (used earlier in forward) and runs
    later in backward sees the bump: autograd's in-place error, not a silently different
    gradient. The window is discarded with a warning; the optimizer goes on."""
    lin = nn.Linear(4, 4)
    opt = accum_fused.SGD(lin.parameters(), lr=0.1, accumulation_steps=1 + 1, in_backward=True, backend=backend)
    x, z = torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)

    def loss():
        alias = z @ lin.weight.detach().t()  # earlier in forward: its backward runs after lin's
        return (lin(x) + alias).square().mean()

    opt.backward(loss())
    with pytest.raises(RuntimeError, match=INPLACE_ERROR), pytest.warns(RuntimeWarning, match="discarded"):
        opt.backward(loss())
    assert opt.micro_step == 0
    opt.backward(lin(x).square().mean())
    opt.backward(lin(x).square().mean())
    assert opt.updated and opt.update_count == 1


# ------------------------------------------------------------ 3. reentrant checkpointing
class _Blocks(nn.Module):
    def __init__(self, reentrant: bool | None, share: bool = False):
        super().__init__()
        base = make_model()
        self.first, self.act, self.head = base[0], base[1], base[2]
        self.reentrant, self.share = reentrant, share

    def forward(self, x):
        h = self.act(self.first(x))
        if self.reentrant is None:
            out = self.head(h)
        else:
            out = checkpoint(self.head, h, use_reentrant=self.reentrant)
        if self.share:  # the head's parameters also used outside the checkpoint: two gradients in one pass
            out = out + 0.1 * self.head.weight.sum()
        return out


@pytest.mark.parametrize("share", [False, True], ids=["", "shared-outside"])
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("driver", ["opt.backward", "loss.backward"])
def test_mode_b_checkpointed_last_block_is_one_micro_batch(backend, reentrant, driver, share):
    """One backward call is one micro-batch, whatever autograd runs inside it: a reentrant
    checkpoint's inner backward (where the last block's gradients arrive first) included."""
    k = 3
    batches = make_batches(SIZES)
    models = _Blocks(reentrant, share), _Blocks(None, share)
    clip = None if not share else 1.0  # a shared parameter cannot be folded into the update twice
    opt_b = accum_fused.AdamW(models[0].parameters(), lr=0.01, accumulation_steps=k, in_backward=True,
                              max_grad_norm=clip, backend=backend)
    opt_p = accum_fused.AdamW(models[1].parameters(), lr=0.01, accumulation_steps=k, max_grad_norm=clip,
                              backend=backend)
    for i, batch in enumerate(batches):
        if driver == "opt.backward":
            opt_b.backward(loss_of(models[0], batch))
        else:
            loss_of(models[0], batch).backward()
        loss_of(models[1], batch).backward()
        opt_p.step()
        opt_p.zero_grad()
        expected = ((i + 1) % k, (i + 1) // k)
        assert (opt_b.micro_step, opt_b.update_count) == (opt_p.micro_step, opt_p.update_count) == expected
        assert all(p.grad is None for p in models[0].parameters())
    assert_params_changed(models[0], _Blocks(None))
    _close(models[0], models[1], backend, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------- 4. unfrozen after construction
@pytest.mark.parametrize("driver", ["opt.backward", "loss.backward"])
def test_mode_b_parameter_unfrozen_after_construction_trains(backend, driver):
    """requires_grad_(True) after the optimizer was built: it trains from then on, as the
    plain mode (which reads .grad) and torch.optim do."""
    batches = make_batches(SIZES)
    models = make_model(), make_model()
    for model in models:
        model[0].weight.requires_grad_(False)
    opt_b = accum_fused.Adam(models[0].parameters(), lr=0.01, accumulation_steps=2, in_backward=True, backend=backend)
    opt_p = accum_fused.Adam(models[1].parameters(), lr=0.01, accumulation_steps=2, backend=backend)
    for i, batch in enumerate(batches):
        if i == 3:  # mid-window
            for model in models:
                model[0].weight.requires_grad_(True)
        if driver == "opt.backward":
            opt_b.backward(loss_of(models[0], batch))
        else:
            loss_of(models[0], batch).backward()
        loss_of(models[1], batch).backward()
        opt_p.step()
        opt_p.zero_grad()
        assert models[0][0].weight.grad is None
    assert not torch.equal(models[0][0].weight, make_model()[0].weight)
    _close(models[0], models[1], backend)


def test_mode_a_parameter_unfrozen_after_construction_trains_as_with_torch_optim(backend):
    batches = make_batches(SIZES)
    model, ref = make_model(), make_model()
    for m in (model, ref):
        m[0].weight.requires_grad_(False)
    opt = accum_fused.Adam(model.parameters(), lr=0.01, in_backward=True, backend=backend)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for i, batch in enumerate(batches):
        for m, o in ((model, opt), (ref, ref_opt)):
            if i == 3:
                m[0].weight.requires_grad_(True)
            (loss_of(m, batch) / 2).backward()
            if i % 2 == 1:
                o.step()
                o.zero_grad()
    assert model[0].weight.grad is None and not torch.equal(model[0].weight, make_model()[0].weight)
    _close(model, ref, backend)


# ---------------------------------------------------------------- 5. failed backward passes
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mode_a_failed_backward_then_zero_grad_behaves_as_torch_optim(backend, name):
    batches = make_batches(SIZES)
    model, ref = _model_failing_midway(), _model_failing_midway()
    opt = OPTIMIZERS[name][0](model.parameters(), **HYPER[name], in_backward=True, backend=backend)
    ref_opt = OPTIMIZERS[name][1](ref.parameters(), **HYPER[name])
    for i, batch in enumerate(batches):
        for m, o in ((model, opt), (ref, ref_opt)):
            _FailOnce.armed = i == 2
            try:
                loss_of(m, batch).backward()
            except RuntimeError as error:
                assert "simulated" in str(error)
                o.zero_grad()  # skip the batch: the partial gradients go
                continue
            o.step()
            o.zero_grad()
    assert opt.update_count == len(batches) - 1
    _close(model, ref, backend)


@pytest.mark.parametrize("driver", ["opt.backward", "loss.backward"])
@pytest.mark.parametrize("skip_with_zero_grad", [True, False], ids=["zero_grad", "no-zero_grad"])
@pytest.mark.parametrize("failing", [0, 1], ids=["first-of-window", "middle-of-window"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mode_b_failed_backward_is_taken_out_or_its_window_discarded(backend, name, failing, skip_with_zero_grad,
                                                                       driver):
    """A micro-batch whose backward raised, whatever the loop does next: as the window's first it
    is taken back out exactly (no warning); later in a window, where its gradients are already in
    the window's sums, the window is discarded with a RuntimeWarning. Either way the run equals
    the plain mode on the micro-batches that were kept."""
    k = 3
    batches = make_batches(SIZES + [2, 3])
    model = _model_failing_midway()
    opt = OPTIMIZERS[name][0](model.parameters(), **HYPER[name], accumulation_steps=k, in_backward=True,
                              backend=backend)
    kept, window_so_far, failures = [], [], 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in batches:
            _FailOnce.armed = opt.micro_step == failing and failures < 2 and opt.update_count == failures
            loss = loss_of(model, batch)
            try:
                opt.backward(loss, weight=len(batch[0])) if driver == "opt.backward" else loss.backward()
            except RuntimeError as error:
                assert "simulated" in str(error)
                failures += 1
                if failing:  # the window's micro-batches so far go with it
                    window_so_far = []
                if skip_with_zero_grad:
                    opt.zero_grad()
                continue
            window_so_far.append(batch)
            if opt.micro_step == 0:
                kept += window_so_far
                window_so_far = []
        flushed = opt.flush()
        kept += window_so_far
    discards = [w for w in caught if issubclass(w.category, RuntimeWarning) and "discarded" in str(w.message)]
    assert failures == 2 and len(discards) == (2 if failing else 0), [str(w.message) for w in caught]
    plain = make_model()
    opt_p = OPTIMIZERS[name][0](plain.parameters(), **HYPER[name], accumulation_steps=k, backend=backend)
    for batch in kept:
        loss_of(plain, batch).backward()
        opt_p.step(weight=len(batch[0]) if driver == "opt.backward" else 1.0)
        opt_p.zero_grad()
    assert opt_p.flush() == flushed
    assert opt.update_count == opt_p.update_count >= 2
    _close(model, plain, backend)


def test_mode_b_failed_last_micro_batch_discards_its_window_and_goes_on(backend):
    model = _model_failing_midway()
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=2, in_backward=True, backend=backend)
    batches = make_batches(SIZES)
    opt.backward(loss_of(model, batches[0]))
    _FailOnce.armed = True
    with pytest.raises(RuntimeError, match="simulated"), pytest.warns(RuntimeWarning, match="window was discarded"):
        opt.backward(loss_of(model, batches[1]))
    assert (opt.micro_step, opt.update_count) == (0, 0)
    for batch in batches[2:6]:
        opt.backward(loss_of(model, batch))
    assert opt.update_count == 2


@pytest.mark.parametrize("settled_by", ["opt.backward", "loss.backward", "flush"])
def test_the_discarded_window_warning_points_at_the_users_line(backend, settled_by):
    """Mode B's "window was discarded" warning names the user's line however the failed pass is
    settled: in opt.backward's own handler, in a hook inside the user's next loss.backward()
    (torch's autograd frames between), or at an entry point (flush()). A fixed stacklevel named
    another frame than the user's on two of the three."""
    model = _model_failing_midway()
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=3, in_backward=True, backend=backend)
    batches = make_batches(SIZES)
    own = settled_by != "opt.backward"
    opt.backward(loss_of(model, batches[0])) if not own else loss_of(model, batches[0]).backward()
    _FailOnce.armed = True  # (the second micro-batch: its head's gradients are added to the window's)
    with pytest.warns(RuntimeWarning, match="window was discarded") as record:
        with pytest.raises(RuntimeError, match="simulated"):
            opt.backward(loss_of(model, batches[1])) if not own else loss_of(model, batches[1]).backward()
        if settled_by == "loss.backward":  # (found by the next pass's first hook)
            loss_of(model, batches[2]).backward()
        elif settled_by == "flush":
            opt.flush()
    assert [w.filename for w in record] == [__file__], [(w.filename, w.lineno) for w in record]


# ------------------------------------------------------------ 6. a foreign backward pass
def _gan_step(d_step, g_opt, D, G, real, z):
    """One iteration of the standard GAN loop: D's micro-batch, then G's step through D (D not
    frozen: D's parameters get gradients too), then D's zero_grad()."""
    d_loss = D(real).square().mean() + (1 - D(G(z).detach())).square().mean()
    d_step(d_loss)
    g_loss = (1 - D(G(z))).square().mean()
    g_loss.backward()
    g_opt.step()
    g_opt.zero_grad()


def test_mode_a_gan_generator_backward_through_d_is_discarded_by_zero_grad_as_with_torch_optim(backend):
    torch.manual_seed(3)
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(6)]
    runs = []
    for make in (lambda D: accum_fused.Adam(D.parameters(), lr=0.01, in_backward=True, backend=backend),
                 lambda D: torch.optim.Adam(D.parameters(), lr=0.01)):
        torch.manual_seed(0)
        D, G = nn.Linear(3, 1), nn.Linear(2, 3)
        d_opt, g_opt = make(D), torch.optim.SGD(G.parameters(), lr=0.1)

        def d_step(loss):
            loss.backward()
            d_opt.step()
            d_opt.zero_grad()

        for real, z in data:
            _gan_step(d_step, g_opt, D, G, real, z)
            d_opt.zero_grad()
        runs.append((D, G))
    for a, b in zip(*runs):
        _close(a, b, backend)


def test_mode_b_gan_generator_backward_through_d_is_not_a_d_micro_batch(backend):
    torch.manual_seed(3)
    data = [(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(6)]
    runs = []
    for in_backward in (True, False):
        torch.manual_seed(0)
        D, G = nn.Linear(3, 1), nn.Linear(2, 3)
        d_opt = accum_fused.Adam(D.parameters(), lr=0.01, accumulation_steps=2, in_backward=in_backward,
                                 backend=backend)
        g_opt = torch.optim.SGD(G.parameters(), lr=0.1)

        def d_step(loss):
            if in_backward:
                d_opt.backward(loss)
            else:
                loss.backward()
                d_opt.step()
            d_opt.zero_grad()

        for real, z in data:
            _gan_step(d_step, g_opt, D, G, real, z)
            d_opt.zero_grad()
        runs.append((D, G, d_opt.update_count))
    assert runs[0][2] == runs[1][2] == 3
    for a, b in zip(runs[0][:2], runs[1][:2]):
        _close(a, b, backend)


# ------------------------------------------- 10. a second optimizer on the same parameters
def test_second_in_backward_optimizer_on_the_same_parameters_is_refused_until_close(backend):
    model = make_model()
    old = accum_fused.AdamW(model.parameters(), in_backward=True, backend=backend)
    scheduler = torch.optim.lr_scheduler.StepLR(old, 1)  # keeps the old optimizer alive, as in a notebook
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        accum_fused.AdamW(model.parameters(), in_backward=True, backend=backend)
    old.close()
    new = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=2, in_backward=True, backend=backend)
    for batch in make_batches([2, 2]):
        new.backward(loss_of(model, batch))
    assert new.update_count == 1 and old.micro_step == 0
    with pytest.raises(RuntimeError, match="was closed"):
        old.flush()
    with pytest.raises(RuntimeError, match="was closed"):
        old.backward(loss_of(model, batch))
    del scheduler


def test_a_collected_in_backward_optimizer_frees_its_parameters(backend):
    model = make_model()
    accum_fused.AdamW(model.parameters(), in_backward=True, backend=backend)
    gc.collect()
    accum_fused.AdamW(model.parameters(), in_backward=True, backend=backend)


@pytest.mark.parametrize("foreign", ["torch.optim", "accum_fused plain"])
def test_foreign_optimizer_stepping_parameters_a_live_in_backward_one_takes_raises(backend, foreign):
    model, ref = make_model(), make_model()
    owner = accum_fused.AdamW(model.parameters(), in_backward=True, backend=backend)
    make = (lambda m: torch.optim.SGD(m.parameters(), lr=0.1)) if foreign == "torch.optim" else (
        lambda m: accum_fused.SGD(m.parameters(), lr=0.1, backend=backend))
    other = make(model)
    batch = make_batches([3])[0]
    loss_of(model, batch).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"close\(\)"):
        other.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    owner.close()
    owner.zero_grad()
    loss_of(model, batch).backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks gone: .grad is torch's again
    other.step()
    ref_opt = make(ref)
    loss_of(ref, batch).backward()
    ref_opt.step()
    _close(model, ref, backend)


# -------------------------------------------------------------- 11, 12. step hooks, schedulers
@pytest.mark.parametrize("mode", list(MODES))
def test_step_hooks_run_around_every_update(backend, mode):
    model = make_model()
    opt = accum_fused.SGD(model.parameters(), lr=0.1, **MODES[mode], backend=backend)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o.update_count)))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o.update_count)))
    handle = register_optimizer_step_post_hook(
        lambda o, args, kwargs: calls.append(("global-post", o.update_count)) if o is opt else None)
    try:
        for batch in make_batches([2, 2, 2, 2, 2]):
            _micro_batch(opt, model, batch)
        opt.flush()
    finally:
        handle.remove()
    assert opt.update_count == (3 if mode in ("plain-k2", "mode-b") else 5)
    posts = [n for kind, n in calls if kind == "post"]
    pres = [n for kind, n in calls if kind == "pre"]
    assert len(pres) == len(posts) == len([c for c in calls if c[0] == "global-post"])
    # every update happened between a pre-hook and a post-hook
    assert sorted(set(range(1, opt.update_count + 1))) == sorted({b for a, b in zip(pres, posts) if b == a + 1})


def test_one_cycle_lr_with_mode_b_does_not_warn(backend):
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), lr=0.01, accumulation_steps=2, in_backward=True, backend=backend)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in make_batches([2, 2, 2, 2]):
            opt.backward(loss_of(model, batch))
            if opt.updated:
                scheduler.step()
    assert opt.update_count == 2


# ---------------------------------------------------------- 13. closure-driven optimizers
def test_gradient_accumulator_refuses_closure_driven_optimizers():
    model = make_model()
    with pytest.raises(TypeError, match="closure"):
        accum_fused.GradientAccumulator(torch.optim.LBFGS(model.parameters()), 2)
