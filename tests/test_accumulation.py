"""Accumulation semantics: k micro-batches == one big-batch torch.optim step."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import accum_fused

from _helpers import (
    OPTIMIZERS,
    OUT_FEATURES,
    assert_params_changed,
    assert_params_close,
    assert_params_equal,
    concat,
    loss_of,
    make_batches,
    make_model,
    train_accum,
    train_big_batch,
    ulp_distance,
    windows,
)

HYPER = {
    "SGD": dict(lr=0.1, momentum=0.9, weight_decay=0.05),
    "SGD-nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "Adam": dict(lr=0.01, weight_decay=0.1),
    "AdamW-amsgrad": dict(lr=0.01, amsgrad=True, weight_decay=0.1),
}
CONFIGS = [pytest.param(key.split("-")[0], hyper, id=key) for key, hyper in HYPER.items()]

FP64 = dict(rtol=1e-10, atol=1e-12)
FP32 = dict(rtol=1e-5, atol=1e-6)


def _pair(name, hyper, backend, k, dtype=torch.float64, **extra):
    """(ours, model, torch_opt, ref_model) from identical initial models."""
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model(dtype=dtype)
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.parameters(), accumulation_steps=k, backend=backend, **hyper, **extra)
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    return opt, model, torch_opt, ref_model


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_k_micro_batches_equal_one_big_batch_fp64(backend, name, hyper, k):
    opt, model, torch_opt, ref_model = _pair(name, hyper, backend, k)
    batches = make_batches([4] * (3 * k), dtype=torch.float64)
    train_accum(opt, model, batches)
    train_big_batch(torch_opt, ref_model, batches, k)
    assert opt.update_count == 3
    assert_params_close(model, ref_model, **FP64)
    assert_params_changed(model, make_model(dtype=torch.float64))


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_k_micro_batches_equal_one_big_batch_fp32(backend, name, hyper):
    k = 4
    opt, model, torch_opt, ref_model = _pair(name, hyper, backend, k, dtype=torch.float32)
    batches = make_batches([4] * (3 * k))
    train_accum(opt, model, batches)
    train_big_batch(torch_opt, ref_model, batches, k)
    assert_params_close(model, ref_model, **FP32)
    for p in model.parameters():
        assert p.dtype == torch.float32
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in opt.state[p]:
                assert opt.state[p][key].dtype == torch.float32, key


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_uneven_micro_batches_with_weight_equal_big_batch(backend, name, hyper):
    k = 4
    sizes = [3, 5, 1, 7] + [2, 6, 4, 4] + [1, 1, 9, 2]
    opt, model, torch_opt, ref_model = _pair(name, hyper, backend, k)
    batches = make_batches(sizes, dtype=torch.float64)
    train_accum(opt, model, batches, weighted=True)
    train_big_batch(torch_opt, ref_model, batches, k)
    assert_params_close(model, ref_model, **FP64)

    # The weights matter: unweighted micro-batch means are not the big-batch mean here.
    unweighted, unweighted_model, _, _ = _pair(name, hyper, backend, k)
    train_accum(unweighted, unweighted_model, batches, weighted=False)
    differences = [(a - b).abs().max().item() for a, b in zip(unweighted_model.parameters(), ref_model.parameters())]
    assert max(differences) > 1e-4


def test_float_weights_equal_weighted_mean(backend):
    """window gradient = sum(w_i g_i) / sum(w_i) for arbitrary positive float weights."""
    k = 3
    weights = [0.25, 3.5, 1.0]
    p = nn.Parameter(torch.zeros(6, dtype=torch.float64))
    opt = OPTIMIZERS["SGD"][0]([p], lr=1.0, accumulation_steps=k, backend=backend)
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(6, generator=gen, dtype=torch.float64) for _ in range(k)]
    for g, w in zip(grads, weights):
        p.grad = g.clone()
        opt.step(weight=w)
    expected = -sum(w * g for w, g in zip(weights, grads)) / sum(weights)
    torch.testing.assert_close(p.detach(), expected, **FP64)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_flush_applies_partial_window(backend, name, hyper):
    k = 4
    opt, model, torch_opt, ref_model = _pair(name, hyper, backend, k)
    assert opt.flush() is False  # nothing pending
    assert opt.updated is False
    batches = make_batches([3] * 6 + [3] * 4, dtype=torch.float64)
    first, tail = batches[:6], batches[6:]

    train_accum(opt, model, first)
    assert opt.update_count == 1
    assert opt.micro_step == 2
    initial = copy.deepcopy(model)
    assert opt.flush() is True
    assert opt.updated is True
    assert opt.micro_step == 0
    assert opt.update_count == 2
    assert_params_changed(model, initial)

    after_flush = copy.deepcopy(model)
    assert opt.flush() is False  # nothing pending any more
    assert opt.updated is False
    assert opt.update_count == 2
    assert_params_equal(model, after_flush)

    # A full window after the flush is a fresh window.
    train_accum(opt, model, tail)
    assert opt.update_count == 3
    for window in (batches[:4], batches[4:6], batches[6:]):
        torch_opt.zero_grad()
        loss_of(ref_model, concat(window)).backward()
        torch_opt.step()
    assert_params_close(model, ref_model, **FP64)


def test_flush_of_weighted_partial_window(backend):
    k = 5
    sizes = [2, 7]
    opt, model, torch_opt, ref_model = _pair("AdamW", dict(lr=0.01, weight_decay=0.1), backend, k)
    batches = make_batches(sizes, dtype=torch.float64)
    train_accum(opt, model, batches, weighted=True)
    assert opt.flush() is True
    train_big_batch(torch_opt, ref_model, batches, k)
    assert_params_close(model, ref_model, **FP64)


def _window_reference_grads(grads_per_micro_batch, weights):
    """sum(w * g) / sum(w) per parameter, None counting as zero; None if None throughout."""
    total = sum(weights)
    result = []
    for per_param in zip(*grads_per_micro_batch):
        present = [(w, g) for w, g in zip(weights, per_param) if g is not None]
        result.append(None if not present else sum(w * g for w, g in present) / total)
    return result


@pytest.mark.parametrize("name,hyper", [
    pytest.param("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.1), id="SGD"),
    pytest.param("Adam", dict(lr=0.01, weight_decay=0.1), id="Adam"),
    pytest.param("AdamW", dict(lr=0.01, amsgrad=True, weight_decay=0.1), id="AdamW"),
])
def test_none_grads(backend, name, hyper):
    """None in every micro-batch: parameter untouched, no state; None in some: zero gradient."""
    ours_cls, torch_cls = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (4, 3, 5)]
    ours = [nn.Parameter(t.clone()) for t in init]
    refs = [nn.Parameter(t.clone()) for t in init]
    k = 3
    opt = ours_cls(ours, accumulation_steps=k, backend=backend, **hyper)
    torch_opt = torch_cls(refs, **hyper)
    weights = [1.0, 2.0, 0.5]

    def g(n):
        return torch.randn(n, generator=gen, dtype=torch.float64)

    # Per window, per micro-batch: grads of (a, b, c).
    window1 = [(g(4), None, None), (None, None, g(5)), (g(4), None, None)]  # b: never
    window2 = [(g(4), None, None), (g(4), None, None), (g(4), g(3), None)]  # c: never
    for window in (window1, window2):
        before = [p.detach().clone() for p in ours]
        for grads, w in zip(window, weights):
            for p, grad in zip(ours, grads):
                p.grad = None if grad is None else grad.clone()
            opt.step(weight=w)
        assert opt.updated is True
        for p, grad in zip(refs, _window_reference_grads(window, weights)):
            p.grad = grad
        torch_opt.step()
        for i, (a, b) in enumerate(zip(ours, refs)):
            torch.testing.assert_close(a.detach(), b.detach(), **FP64, msg=lambda m: f"param {i}: {m}")
        untouched = 1 if window is window1 else 2
        assert torch.equal(ours[untouched].detach(), before[untouched])
        if window is window1:
            assert not opt.state.get(ours[1]), f"state created for a parameter without gradients: {opt.state[ours[1]]}"
            assert not torch.equal(ours[2].detach(), before[2])  # zero grads in 2 of 3 micro-batches: updated


@pytest.mark.parametrize("name,hyper", [
    pytest.param("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.1), id="SGD"),
    pytest.param("AdamW", dict(lr=0.01, weight_decay=0.1), id="AdamW"),
])
def test_mixed_dtypes_in_one_group(backend, name, hyper):
    """fp32, bf16, fp16 and fp64 parameters in one optimizer: grouped, each updated in its
    buffer dtype (fp64 for fp64, fp32 otherwise) and rounded once to the parameter's dtype."""
    ours_cls, torch_cls = OPTIMIZERS[name]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    sizes = [5, 7, 4, 3]
    gen = torch.Generator().manual_seed(7)
    params = [nn.Parameter(torch.randn(n, generator=gen, dtype=torch.float64).to(dt)) for n, dt in zip(sizes, dtypes)]
    buf_dtypes = [torch.float64 if dt == torch.float64 else torch.float32 for dt in dtypes]
    # Reference: torch.optim on shadow parameters in the buffer dtype, re-read from our
    # parameters before every update (no master weights: the parameter is the truth).
    shadows = [nn.Parameter(p.detach().to(bd)) for p, bd in zip(params, buf_dtypes)]
    k = 2
    opt = ours_cls(params, accumulation_steps=k, backend=backend, **hyper)
    torch_opt = torch_cls(shadows, **hyper)
    initial = [p.detach().clone() for p in params]
    for _ in range(3):
        grads = [[torch.randn(n, generator=gen, dtype=torch.float64).to(dt) for n, dt in zip(sizes, dtypes)]
                 for _ in range(k)]
        with torch.no_grad():
            for p, shadow, bd in zip(params, shadows, buf_dtypes):
                shadow.copy_(p.to(bd))
        for micro in grads:
            for p, grad in zip(params, micro):
                p.grad = grad
            opt.step()
        for i, (shadow, bd) in enumerate(zip(shadows, buf_dtypes)):
            shadow.grad = (grads[0][i].to(bd) + grads[1][i].to(bd)) / 2
        torch_opt.step()
        for p, shadow in zip(params, shadows):
            expected = shadow.detach().to(p.dtype)
            assert p.dtype == expected.dtype
            if p.dtype in (torch.bfloat16, torch.float16):
                assert ulp_distance(p.detach(), expected).max().item() <= 1, p.dtype
            else:
                rtol, atol = (1e-12, 1e-14) if p.dtype == torch.float64 else (1e-6, 1e-7)
                torch.testing.assert_close(p.detach(), expected, rtol=rtol, atol=atol)
    for p, bd, before in zip(params, buf_dtypes, initial):
        assert not torch.equal(p.detach(), before), p.dtype
        state_tensors = {key: v for key, v in opt.state[p].items()
                         if key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")}
        assert state_tensors, p.dtype
        for key, value in state_tensors.items():
            assert value.dtype == bd, (p.dtype, key, value.dtype)


def test_bf16_accumulation_precision(backend):
    """64 bf16 micro-batch grads of varied magnitude: the fp32 buffer gives the fp64 mean rounded
    to bf16 (>= 99% exact, none more than 1 ulp off); naive bf16 `.grad +=` does not."""
    n, k = 4096, 64
    gen = torch.Generator().manual_seed(11)
    scales = 10.0 ** (torch.rand(k, 1, generator=gen, dtype=torch.float64) * 4 - 2)  # 1e-2 .. 1e2
    grads = (torch.randn(k, n, generator=gen, dtype=torch.float64) * scales).to(torch.bfloat16)
    expected = (-grads.double().mean(dim=0)).to(torch.bfloat16)

    def meets_bar(result: torch.Tensor) -> bool:
        dist = ulp_distance(result, expected)
        return (dist == 0).double().mean().item() >= 0.99 and dist.max().item() <= 1

    p = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    opt = OPTIMIZERS["SGD"][0]([p], lr=1.0, accumulation_steps=k, backend=backend)
    for j in range(k):
        p.grad = grads[j].clone()
        opt.step(weight=1.0)
    assert opt.updated is True
    assert p.dtype == torch.bfloat16
    dist = ulp_distance(p.detach(), expected)
    exact_fraction = (dist == 0).double().mean().item()
    assert exact_fraction >= 0.99, exact_fraction
    assert dist.max().item() <= 1
    assert meets_bar(p.detach())

    # The naive approach, accumulating into a bf16 .grad, then one torch.optim.SGD step.
    q = nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
    torch_opt = torch.optim.SGD([q], lr=1.0)
    q.grad = torch.zeros(n, dtype=torch.bfloat16)
    for j in range(k):
        q.grad += grads[j] / k
    torch_opt.step()
    assert not meets_bar(q.detach())


def test_param_groups_with_different_lr(backend):
    k = 3
    model = make_model(dtype=torch.float64)
    ref_model = copy.deepcopy(model)

    def groups(m):
        return [{"params": m[0].parameters(), "lr": 0.2}, {"params": m[2].parameters(), "lr": 0.01, "momentum": 0.5}]

    opt = OPTIMIZERS["SGD"][0](groups(model), lr=0.1, momentum=0.9, accumulation_steps=k, backend=backend)
    torch_opt = torch.optim.SGD(groups(ref_model), lr=0.1, momentum=0.9)
    batches = make_batches([4] * (3 * k), dtype=torch.float64)
    train_accum(opt, model, batches)
    train_big_batch(torch_opt, ref_model, batches, k)
    assert_params_close(model, ref_model, **FP64)
    assert [g["lr"] for g in opt.param_groups] == [0.2, 0.01]


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_add_param_group_mid_training(backend, name, hyper):
    k = 3
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model(dtype=torch.float64)
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model[0].parameters(), accumulation_steps=k, backend=backend, **hyper)
    torch_opt = torch_cls(ref_model[0].parameters(), **hyper)
    batches = make_batches([4] * (4 * k), dtype=torch.float64)
    frozen = [p.detach().clone() for p in model[2].parameters()]
    train_accum(opt, model, batches[: 2 * k])
    train_big_batch(torch_opt, ref_model, batches[: 2 * k], k)
    assert all(torch.equal(a, b) for a, b in zip(model[2].parameters(), frozen))

    opt.add_param_group({"params": model[2].parameters(), "lr": 0.05})
    torch_opt.add_param_group({"params": ref_model[2].parameters(), "lr": 0.05})
    train_accum(opt, model, batches[2 * k :])
    train_big_batch(torch_opt, ref_model, batches[2 * k :], k)
    assert opt.update_count == 4
    assert_params_close(model, ref_model, **FP64)
    assert not any(torch.equal(a, b) for a, b in zip(model[2].parameters(), frozen))


def _group_hypers(opt):
    return [(g["lr"], g.get("betas"), g.get("momentum")) for g in opt.param_groups]


SCHEDULERS = {
    "StepLR": ("SGD", dict(lr=0.1, momentum=0.9), lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "MultiStepLR": ("SGD", dict(lr=0.1), lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 3], gamma=0.3)),
    "LambdaLR": ("Adam", dict(lr=0.02), lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))),
    "ExponentialLR": ("AdamW", dict(lr=0.02), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8)),
    "CosineAnnealingLR": ("AdamW", dict(lr=0.02), lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5)),
    "LinearLR": ("SGD", dict(lr=0.1), lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=3)),
    "OneCycleLR": ("Adam", dict(lr=0.01), lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=6)),
    "CyclicLR": ("SGD", dict(lr=0.1, momentum=0.9),
                 lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2)),
    "ConstantLR": ("SGD", dict(lr=0.1), lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2)),
    "PolynomialLR": ("Adam", dict(lr=0.02), lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=5, power=2.0)),
    "CosineAnnealingWarmRestarts": ("AdamW", dict(lr=0.02),
                                    lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2)),
    "SequentialLR": ("SGD", dict(lr=0.1, momentum=0.9), lambda o: torch.optim.lr_scheduler.SequentialLR(
        o, [torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7)], milestones=[2])),
    "ChainedScheduler": ("Adam", dict(lr=0.02), lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=3),
         torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)])),
    "ReduceLROnPlateau": ("SGD", dict(lr=0.1, momentum=0.9),
                          lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, patience=0)),
}


@pytest.mark.parametrize("scheduler_name", list(SCHEDULERS))
def test_lr_schedulers_step_per_update(backend, scheduler_name):
    name, hyper, make_scheduler = SCHEDULERS[scheduler_name]
    k, num_windows = 4, 6
    plateau_metrics = [5.0, 4.0, 4.0, 4.0, 3.0, 3.0]
    opt, model, torch_opt, ref_model = _pair(name, hyper, backend, k)
    sched, ref_sched = make_scheduler(opt), make_scheduler(torch_opt)
    batches = make_batches([3] * (k * num_windows), dtype=torch.float64)

    def sched_step(s, window_index):
        if scheduler_name == "ReduceLROnPlateau":
            s.step(plateau_metrics[window_index])
        else:
            s.step()

    ours_hypers, ref_hypers = [_group_hypers(opt)], [_group_hypers(torch_opt)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, batch in enumerate(batches):
            opt.zero_grad()
            loss_of(model, batch).backward()
            opt.step()
            if opt.updated:
                sched_step(sched, i // k)
                ours_hypers.append(_group_hypers(opt))
    for w, window in enumerate(windows(batches, k)):
        torch_opt.zero_grad()
        loss_of(ref_model, concat(window)).backward()
        torch_opt.step()
        sched_step(ref_sched, w)
        ref_hypers.append(_group_hypers(torch_opt))
    assert not [str(m.message) for m in caught if "lr_scheduler" in str(m.message)]
    assert ours_hypers == ref_hypers
    assert len(set(h[0][0] for h in ref_hypers)) > 1  # the schedule does change the lr
    assert_params_close(model, ref_model, **FP64)


def test_step_hooks(backend):
    k = 3
    model = make_model(dtype=torch.float64)
    opt = OPTIMIZERS["Adam"][0](model.parameters(), lr=0.01, accumulation_steps=k, backend=backend)
    seen_pre, seen_post = [], []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: seen_pre.append((o.micro_step, kwargs.get("weight"))))
    post = opt.register_step_post_hook(lambda o, args, kwargs: seen_post.append((o.micro_step, o.updated)))
    batches = make_batches([3] * (2 * k), dtype=torch.float64)
    train_accum(opt, model, batches, weighted=True)
    assert seen_pre == [(0, 3), (1, 3), (2, 3)] * 2
    assert seen_post == [(1, False), (2, False), (0, True)] * 2
    pre.remove()
    post.remove()
    train_accum(opt, model, batches[:1])
    assert len(seen_pre) == len(seen_post) == 2 * k


def test_pre_hook_can_rescale_gradients(backend):
    """A pre-hook runs before the micro-batch is accumulated, so it sees and may edit .grad."""
    k = 2
    batches = make_batches([4] * (2 * k), dtype=torch.float64)
    model = make_model(dtype=torch.float64)
    opt = OPTIMIZERS["SGD"][0](model.parameters(), lr=0.1, momentum=0.9, accumulation_steps=k, backend=backend)

    def halve(o, args, kwargs):
        for p in model.parameters():
            p.grad.mul_(0.5)

    opt.register_step_pre_hook(halve)
    train_accum(opt, model, batches)

    ref_model = make_model(dtype=torch.float64)
    ref = OPTIMIZERS["SGD"][0](ref_model.parameters(), lr=0.1, momentum=0.9, accumulation_steps=k, backend=backend)
    for batch in batches:
        ref.zero_grad()
        (loss_of(ref_model, batch) * 0.5).backward()
        ref.step()
    assert_params_equal(model, ref_model)


def test_closure_returns_loss(backend):
    k = 2
    batches = make_batches([4] * (2 * k))
    model = make_model()
    opt = OPTIMIZERS["AdamW"][0](model.parameters(), lr=0.01, accumulation_steps=k, backend=backend)
    returned, produced = [], []
    for batch in batches:
        def closure(batch=batch):
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            produced.append(loss)
            return loss
        returned.append(opt.step(closure))
    assert all(r is p for r, p in zip(returned, produced)) and len(returned) == len(batches)

    ref_model = make_model()
    ref = OPTIMIZERS["AdamW"][0](ref_model.parameters(), lr=0.01, accumulation_steps=k, backend=backend)
    assert train_accum(ref, ref_model, batches) == [None] * len(batches)
    assert_params_equal(model, ref_model)


def test_zero_grad_set_to_none_false_is_equivalent(backend):
    k = 3
    batches = make_batches([4] * (2 * k))
    models, opts = [], []
    for set_to_none in (True, False):
        model = make_model()
        opt = OPTIMIZERS["SGD"][0](model.parameters(), lr=0.1, momentum=0.9, accumulation_steps=k, backend=backend)
        for batch in batches:
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(model, batch).backward()
            opt.step()
        models.append(model)
    assert_params_equal(*models)


def test_window_attributes(backend):
    k = 4
    model = make_model()
    opt = OPTIMIZERS["SGD"][0](model.parameters(), lr=0.1, accumulation_steps=k, backend=backend)
    assert opt.accumulation_steps == k
    assert (opt.micro_step, opt.updated, opt.update_count) == (0, False, 0)
    observed = []
    for batch in make_batches([2] * 10):
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
        observed.append((opt.micro_step, opt.updated, opt.update_count))
    assert observed == [
        (1, False, 0), (2, False, 0), (3, False, 0), (0, True, 1),
        (1, False, 1), (2, False, 1), (3, False, 1), (0, True, 2),
        (1, False, 2), (2, False, 2),
    ]
    assert opt.flush() is True
    assert (opt.micro_step, opt.updated, opt.update_count) == (0, True, 3)


def test_params_untouched_until_window_closes(backend):
    k = 3
    model = make_model()
    initial = copy.deepcopy(model)
    opt = OPTIMIZERS["AdamW"][0](model.parameters(), lr=0.01, weight_decay=0.1, accumulation_steps=k, backend=backend)
    batches = make_batches([2] * k)
    train_accum(opt, model, batches[: k - 1])
    assert_params_equal(model, initial)
    train_accum(opt, model, batches[k - 1 :])
    assert_params_changed(model, initial)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_unusual_shapes_and_layouts(backend, name, hyper, tolerances):
    """Non-contiguous and channels_last parameters, an empty one, an odd-sized large one."""
    ours_cls, torch_cls = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(17)
    init = [
        torch.randn(4, 3, generator=gen).t(),  # transposed: non-contiguous
        torch.randn(0, generator=gen),
        torch.randn(10007, generator=gen),
        torch.randn(2, 3, 4, 5, generator=gen).to(memory_format=torch.channels_last),
        torch.randn(1, generator=gen),
    ]
    ours = [nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in init]
    refs = [nn.Parameter(t.clone(memory_format=torch.preserve_format)) for t in init]
    assert not ours[0].is_contiguous() and not ours[3].is_contiguous()
    k = 2
    opt = ours_cls(ours, accumulation_steps=k, backend=backend, **hyper)
    torch_opt = torch_cls(refs, **hyper)
    for _ in range(2):
        grads = [[torch.randn(p.shape, generator=gen) for p in ours] for _ in range(k)]
        for micro in grads:
            for p, g in zip(ours, micro):
                p.grad = g.clone()
            opt.step()
        for i, p in enumerate(refs):
            p.grad = (grads[0][i] + grads[1][i]) / 2
        torch_opt.step()
    rtol, atol = tolerances[torch.float32]
    for a, b in zip(ours, refs):
        assert a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol)
    assert all(not torch.equal(a, t) for a, t in zip(ours, init) if a.numel())


def test_add_param_group_mid_window(backend):
    """Parameters added mid-window had no gradient in the window's earlier micro-batches: those
    count as zero, and the window gradient is still divided by the whole window's weight."""
    gen = torch.Generator().manual_seed(19)
    a0 = torch.randn(3, generator=gen, dtype=torch.float64)
    b0 = torch.randn(2, generator=gen, dtype=torch.float64)
    grads_a = [torch.randn(3, generator=gen, dtype=torch.float64) for _ in range(3)]
    grads_b = [torch.randn(2, generator=gen, dtype=torch.float64) for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    a, b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
    opt = OPTIMIZERS["Adam"][0]([a], lr=0.1, accumulation_steps=3, backend=backend)
    a.grad = grads_a[0]
    opt.step(weight=weights[0])
    opt.add_param_group({"params": [b], "lr": 0.05})
    for j in (1, 2):
        a.grad, b.grad = grads_a[j], grads_b[j]
        opt.step(weight=weights[j])
    assert opt.updated is True

    ref_a, ref_b = nn.Parameter(a0.clone()), nn.Parameter(b0.clone())
    torch_opt = torch.optim.Adam([{"params": [ref_a]}, {"params": [ref_b], "lr": 0.05}], lr=0.1)
    ref_a.grad = sum(w * g for w, g in zip(weights, grads_a)) / sum(weights)
    ref_b.grad = (weights[1] * grads_b[1] + weights[2] * grads_b[2]) / sum(weights)
    torch_opt.step()
    torch.testing.assert_close(a.detach(), ref_a.detach(), **FP64)
    torch.testing.assert_close(b.detach(), ref_b.detach(), **FP64)


# A param group's "params" replaced by a new list between windows, as accelerate's FSDP2
# prepare does (tests/_fsdp_worker.py's accelerate_fsdp2 runs that with FSDP2 itself): the
# optimizer follows the new parameters, as one built on them would; mid-window it refuses.
MODES = {"plain": {}, "mode A": dict(in_backward=True), "mode B": dict(in_backward=True)}


def _micro_batches(opt, model, batches, mode, k):
    for i, batch in enumerate(batches):
        if mode == "mode B":
            opt.backward(loss_of(model, batch), weight=len(batch[0]))
        elif mode == "mode A":
            loss_of(model, batch).backward()
            if (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()
        else:
            loss_of(model, batch).backward()
            opt.step(weight=len(batch[0]))
            opt.zero_grad()


@pytest.mark.parametrize("mode", list(MODES))
def test_params_list_replaced_between_windows_is_followed(backend, mode):
    k = 3 if mode != "mode A" else 2
    steps = dict(accumulation_steps=1 if mode == "mode A" else k)
    old, new = make_model(seed=0), make_model(seed=5)
    fresh = copy.deepcopy(new)
    opt = accum_fused.AdamW(old.parameters(), lr=0.05, max_grad_norm=0.5, backend=backend, **steps, **MODES[mode])
    ref = accum_fused.AdamW(fresh.parameters(), lr=0.05, max_grad_norm=0.5, backend=backend, **steps, **MODES[mode])
    batches = make_batches([2, 3, 1, 4, 2, 2, 3, 1, 2])
    _micro_batches(opt, old, batches[:k], mode, k)
    old_after = [p.detach().clone() for p in old.parameters()]
    opt.param_groups[0]["params"] = list(new.parameters())
    _micro_batches(opt, new, batches[k:], mode, k)
    _micro_batches(ref, fresh, batches[k:], mode, k)
    assert_params_equal(new, fresh)
    assert all(torch.equal(a, b) for a, b in zip(old.parameters(), old_after))
    if MODES[mode]:  # the old parameters' hooks went with them: theirs are autograd's .grad again
        loss_of(old, batches[0]).backward()
        assert all(p.grad is not None for p in old.parameters())
        accum_fused.AdamW(old.parameters(), lr=0.05, in_backward=True)  # (free for another optimizer)


@pytest.mark.parametrize("mode", list(MODES))
def test_params_list_replaced_mid_window_is_refused(mode):
    old, new = make_model(seed=0), make_model(seed=5)
    twin = copy.deepcopy(old)
    opt = accum_fused.SGD(old.parameters(), lr=0.1, momentum=0.9, accumulation_steps=3, **MODES[mode])
    ref = accum_fused.SGD(twin.parameters(), lr=0.1, momentum=0.9, accumulation_steps=3, **MODES[mode])
    mode = "mode B" if MODES[mode] else "plain"  # (k=3: both in_backward modes close inside backward)
    batches = make_batches([2, 3, 1])
    _micro_batches(opt, old, batches[:1], mode, 3)
    _micro_batches(ref, twin, batches[:1], mode, 3)
    kept = opt.param_groups[0]["params"]
    opt.param_groups[0]["params"] = list(new.parameters())
    with pytest.raises(RuntimeError, match=r'replaced \(its "params" list or one in it\) while SGD\'s window was open \(1 '):
        _micro_batches(opt, new, batches[1:2], mode, 3)
    with pytest.raises(RuntimeError, match="window was open"):
        opt.flush()
    assert opt.micro_step == 1
    opt.param_groups[0]["params"] = kept  # (put back: the window goes on as if nothing happened)
    new.zero_grad()
    _micro_batches(opt, old, batches[1:], mode, 3)
    _micro_batches(ref, twin, batches[1:], mode, 3)
    assert opt.update_count == 1
    assert_params_equal(old, twin)


def _copy_state(opt, model, ref, twin):
    """``opt``'s state of ``model``'s parameters into ``ref``'s of ``twin``'s (state_dict() would
    raise, as torch's does, on the state of a parameter no longer in a param group)."""
    for p, q in zip(model.parameters(), twin.parameters()):
        if p in opt.state:
            ref.state[q] = copy.deepcopy(opt.state[p])


@pytest.mark.parametrize("mode", list(MODES))
def test_parameter_replaced_in_its_list_between_windows_is_followed(backend, mode):
    """``group["params"][i] = new`` (the list kept, one tensor in it replaced), between
    windows: followed as a new list is, whatever the mode: the model with the new parameter
    trains as a fresh optimizer built on it would train it."""
    k = 3 if mode != "mode A" else 2
    steps = dict(accumulation_steps=1 if mode == "mode A" else k)
    model = make_model(seed=0)
    opt = accum_fused.AdamW(model.parameters(), lr=0.05, backend=backend, **steps, **MODES[mode])
    batches = make_batches([2, 3, 1, 4, 2, 2, 3, 1, 2])
    _micro_batches(opt, model, batches[:k], mode, k)
    replaced = model[0].weight
    model[0].weight = nn.Parameter(replaced.detach() * 2)
    opt.param_groups[0]["params"][0] = model[0].weight
    if mode == "mode A":  # (its loss.backward() gives no call before the pass: the next test)
        opt.flush()
    twin = copy.deepcopy(model)
    ref = accum_fused.AdamW(twin.parameters(), lr=0.05, backend=backend, **steps, **MODES[mode])
    _copy_state(opt, model, ref, twin)
    _micro_batches(opt, model, batches[k:], mode, k)
    _micro_batches(ref, twin, batches[k:], mode, k)
    assert_params_equal(model, twin)


@pytest.mark.parametrize("mode", list(MODES))
def test_parameters_appended_to_and_removed_from_a_list_between_windows_are_followed(mode):
    """A param group's list edited in place between windows, as code that skips
    add_param_group does: a parameter appended trains from the next window on, one removed is
    no longer updated (with in_backward its hook goes: autograd's .grad is its gradient again),
    as a fresh optimizer built on the new list would."""
    k = 3 if mode != "mode A" else 2
    steps = dict(accumulation_steps=1 if mode == "mode A" else k)
    model, extra = make_model(seed=0), nn.Linear(OUT_FEATURES, OUT_FEATURES)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, momentum=0.9, **steps, **MODES[mode])
    batches = make_batches([2, 3, 1, 4, 2, 2, 3, 1, 2])
    net = nn.Sequential(model, extra)
    _micro_batches(opt, net, batches[:k], mode, k)
    removed = model[0].bias
    group = opt.param_groups[0]
    group["params"].append(extra.weight)
    del group["params"][next(i for i, p in enumerate(group["params"]) if p is removed)]
    if mode == "mode A":  # (its loss.backward() gives no call before the pass)
        opt.flush()
    net.zero_grad()  # (extra's, which no optimizer cleared so far: deepcopy would not copy them)
    twin = copy.deepcopy(net)
    twin_params = {id(p): q for p, q in zip(net.parameters(), twin.parameters())}
    ref = accum_fused.SGD([twin_params[id(p)] for p in group["params"]], lr=0.1, momentum=0.9, **steps,
                          **MODES[mode])
    for p in group["params"]:
        if p in opt.state:
            ref.state[twin_params[id(p)]] = copy.deepcopy(opt.state[p])
    kept = removed.detach().clone()
    _micro_batches(opt, net, batches[k:], mode, k)
    _micro_batches(ref, twin, batches[k:], mode, k)
    assert opt.update_count == ref.update_count + 1 >= 3 and torch.equal(removed.detach(), kept)
    assert_params_equal(net, twin)
    if MODES[mode]:
        assert removed.grad is not None  # (autograd's again)


@pytest.mark.parametrize("mode", list(MODES))
def test_params_given_as_a_tuple_between_windows_train_as_the_list(mode):
    """``group["params"] = tuple(...)`` (torch.optim steps with it): the same parameters, read
    as a list would be; no window refused, the result bit for bit the unedited optimizer's."""
    k = 3 if mode != "mode A" else 2
    steps = dict(accumulation_steps=1 if mode == "mode A" else k)
    model, twin = make_model(seed=0), make_model(seed=0)
    opt = accum_fused.AdamW(model.parameters(), lr=0.05, **steps, **MODES[mode])
    ref = accum_fused.AdamW(twin.parameters(), lr=0.05, **steps, **MODES[mode])
    batches = make_batches([2, 3, 1, 4, 2, 2, 3, 1, 2])
    _micro_batches(opt, model, batches[:k], mode, k)
    _micro_batches(ref, twin, batches[:k], mode, k)
    opt.param_groups[0]["params"] = tuple(opt.param_groups[0]["params"])
    if mode == "mode A":
        opt.flush()
    for _ in range(3):  # (a window mid-way: each call finds the tuple's parameters the same)
        _micro_batches(opt, model, batches[k:], mode, k)
        _micro_batches(ref, twin, batches[k:], mode, k)
    assert opt.update_count == ref.update_count
    assert_params_equal(model, twin)


@pytest.mark.parametrize("mode", ["mode A", "mode B"])
def test_parameter_replaced_under_in_backward_hooks_is_refused_until_flush(mode):
    """in_backward with the user's own ``loss.backward()``: the new parameter has no hook, and
    the hooks cannot move inside their own pass, so the first pass after the replacement is
    refused by name, nothing taken; ``flush()`` then follows the new parameter, and training
    goes on as with a fresh optimizer built on it."""
    k = 2
    steps = dict(accumulation_steps=1 if mode == "mode A" else k)
    model = make_model(seed=0)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, momentum=0.9, in_backward=True, **steps)
    batches = make_batches([2, 3, 1, 4, 2, 2])

    def window(optimizer, net, pair):
        for batch in pair:
            loss_of(net, batch).backward()
        if mode == "mode A":
            optimizer.step()

    window(opt, model, batches[:2])
    model[2].weight = nn.Parameter(model[2].weight.detach() * 2)
    opt.param_groups[0]["params"][2] = model[2].weight
    twin = copy.deepcopy(model)
    ref = accum_fused.SGD(twin.parameters(), lr=0.1, momentum=0.9, in_backward=True, **steps)
    _copy_state(opt, model, ref, twin)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"replaced \(its \"params\" list or one in it\) after SGD hooked them "
                                           r"\(in_backward=True\).*call opt.flush\(\) once"):
        loss_of(model, batches[2]).backward()
    assert opt.micro_step == 0 and opt.update_count == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.zero_grad()
    assert opt.flush() is False
    window(opt, model, batches[2:4])
    window(opt, model, batches[4:6])
    window(ref, twin, batches[2:4])
    window(ref, twin, batches[4:6])
    assert opt.update_count == 3
    assert_params_equal(model, twin)


def test_params_list_replaced_by_parameters_another_optimizer_takes_is_refused():
    """in_backward: the new parameters' gradients are taken by another live in_backward
    optimizer: refused by name, nothing changed (the old parameters still train)."""
    old, new = make_model(seed=0), make_model(seed=5)
    twin = copy.deepcopy(old)
    opt = accum_fused.SGD(old.parameters(), lr=0.1, accumulation_steps=2, in_backward=True)
    ref = accum_fused.SGD(twin.parameters(), lr=0.1, accumulation_steps=2, in_backward=True)
    other = accum_fused.SGD(new.parameters(), lr=0.1, in_backward=True)  # noqa: F841  (holds new's)
    kept = opt.param_groups[0]["params"]
    opt.param_groups[0]["params"] = list(new.parameters())
    batches = make_batches([2, 3])
    with pytest.raises(RuntimeError, match="already has its gradients taken inside backward"):
        opt.backward(loss_of(new, batches[0]))
    opt.param_groups[0]["params"] = kept
    for batch in batches:
        opt.backward(loss_of(old, batch))
        ref.backward(loss_of(twin, batch))
    assert opt.update_count == 1
    assert_params_equal(old, twin)
