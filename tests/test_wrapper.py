"""GradientAccumulator: any torch.optim optimizer, accumulated, against that optimizer on the big batch."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch

import accum_fused
from _helpers import concat, loss_of, make_batches, make_model, save_load, windows

SIZES = [3, 5, 2, 7, 4, 1, 6, 2]  # k=3: two full windows and a partial one of 2

# name -> factory(params) of the inner optimizer
INNER = {
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, weight_decay=0.01),
    "RMSprop-momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.02, weight_decay=0.01),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.01),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def big_batch_run(make_inner, model, batches, k, clip=None):
    """The inner optimizer alone, one step per window on the window's concatenated batch."""
    opt = make_inner(model.parameters())
    for window in windows(batches, k):
        opt.zero_grad()
        loss_of(model, concat(window)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return opt


def accumulated_run(make_inner, model, batches, k, backend, clip=None, weighted=True):
    opt = accum_fused.GradientAccumulator(make_inner(model.parameters()), k, max_grad_norm=clip, backend=backend)
    for i, batch in enumerate(batches):
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step(weight=len(batch[0]) if weighted else 1.0)
        assert opt.updated == ((i + 1) % k == 0)
    assert opt.flush() is (len(batches) % k != 0)
    return opt


@pytest.mark.parametrize("clip", [None, 0.3], ids=["no-clip", "clip"])
@pytest.mark.parametrize("inner", list(INNER))
def test_matches_inner_optimizer_on_the_big_batch(inner, clip, backend):
    batches = make_batches(SIZES)
    model, reference = make_model(), make_model()
    opt = accumulated_run(INNER[inner], model, batches, 3, backend, clip)
    big_batch_run(INNER[inner], reference, batches, 3, clip)
    assert opt.update_count == 3
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(a, make_model().state_dict()[name]), f"{name} did not move"
    if clip is not None:
        assert opt.last_grad_norm > clip  # clipping was active, not vacuous


@pytest.mark.parametrize("inner", ["Adagrad", "AdamW"])
def test_k1_weight1_is_the_inner_optimizer_bit_for_bit(inner, backend):
    batches = make_batches([4, 3, 5])
    model, reference = make_model(), make_model()
    accumulated_run(INNER[inner], model, batches, 1, backend, weighted=False)
    big_batch_run(INNER[inner], reference, batches, 1)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


def test_grad_holds_the_window_gradient_in_the_param_dtype(backend):
    """At the boundary .grad is Σ w·g / Σ w, rounded once to the parameter's dtype."""
    model = make_model(dtype=torch.bfloat16)
    batches = make_batches([3, 5], dtype=torch.bfloat16)
    seen = []
    inner = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: only look at .grad
    inner.register_step_pre_hook(lambda o, a, k: seen.append([p.grad.clone() for p in model.parameters()]))
    opt = accum_fused.GradientAccumulator(inner, 2, backend=backend)
    expected = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for batch in batches:
        opt.zero_grad()
        loss_of(model, batch).backward()
        for e, p in zip(expected, model.parameters()):
            e += len(batch[0]) * p.grad.double()
        opt.step(weight=len(batch[0]))
    assert len(seen) == 1
    for grad, e in zip(seen[0], expected):
        assert grad.dtype == torch.bfloat16
        torch.testing.assert_close(grad, (e / 8).to(torch.bfloat16), rtol=0, atol=0)


def test_param_without_gradient_all_window_is_left_alone(backend):
    used, unused = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    inner = torch.optim.AdamW(list(used.parameters()) + list(unused.parameters()), lr=0.1, weight_decay=0.5)
    opt = accum_fused.GradientAccumulator(inner, 2, backend=backend)
    before = [p.detach().clone() for p in unused.parameters()]
    for _ in range(2):
        opt.zero_grad()
        used(torch.ones(2, 3)).sum().backward()
        opt.step()
    assert opt.updated
    assert all(torch.equal(a, b) for a, b in zip(before, unused.parameters()))  # no weight decay either
    assert all(p not in inner.state for p in unused.parameters())
    assert all(p.grad is None for p in unused.parameters())


def test_grad_scaler_inf_skips_the_window_and_the_inner_step(backend):
    model = make_model()
    inner = torch.optim.Adagrad(model.parameters(), lr=0.1)
    calls = []
    inner.register_step_post_hook(lambda *a: calls.append(1))
    opt = accum_fused.GradientAccumulator(inner, 2, backend=backend)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batches = make_batches([2, 3, 4, 1])
    before = [p.detach().clone() for p in model.parameters()]
    for i, batch in enumerate(batches[:2]):
        opt.zero_grad()
        loss = loss_of(model, batch) * (float("inf") if i == 0 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt, weight=len(batch[0]))
        scaler.update()
    assert not opt.updated and opt.update_count == 0 and calls == []
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the next window (with a smaller scale) equals the inner optimizer on the big batch
    for batch in batches[2:]:
        opt.zero_grad()
        scaler.scale(loss_of(model, batch)).backward()
        scaler.step(opt, weight=len(batch[0]))
        scaler.update()
    assert opt.updated and calls == [1]
    reference = make_model()
    big_batch_run(lambda p: torch.optim.Adagrad(p, lr=0.1), reference, batches[2:], 2)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_dict_resumes_mid_window_exactly(backend):
    batches = make_batches(SIZES)
    make_inner = INNER["RMSprop-momentum"]

    def build(model):
        return accum_fused.GradientAccumulator(make_inner(model.parameters()), 3, max_grad_norm=0.3, backend=backend)

    model = make_model()
    opt = build(model)
    for batch in batches:
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step(weight=len(batch[0]))
    opt.flush()

    resumed = make_model()
    opt2 = build(resumed)
    for i, batch in enumerate(batches):
        if i == 4:  # one micro-batch into the second window
            saved = save_load({"model": resumed.state_dict(), "opt": opt2.state_dict()})
            assert saved["opt"]["accumulation"]["micro_step"] == 1
            resumed = make_model(seed=5)
            resumed.load_state_dict(saved["model"])
            opt2 = build(resumed)
            opt2.load_state_dict(saved["opt"])
        opt2.zero_grad()
        loss_of(resumed, batch).backward()
        opt2.step(weight=len(batch[0]))
    opt2.flush()
    assert opt2.update_count == opt.update_count == 3
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_loads_a_plain_inner_state_dict(backend):
    model = make_model()
    inner = torch.optim.NAdam(model.parameters(), lr=0.01)
    opt = accum_fused.GradientAccumulator(inner, 2, backend=backend)
    donor_model = make_model()
    donor = torch.optim.NAdam(donor_model.parameters(), lr=0.01)
    loss_of(donor_model, make_batches([4])[0]).backward()
    donor.step()
    opt.load_state_dict(donor.state_dict())
    assert opt.micro_step == 0
    for p, q in zip(model.parameters(), donor_model.parameters()):
        assert torch.equal(inner.state[p]["exp_avg"], donor.state[q]["exp_avg"])


@pytest.mark.parametrize("attach_to", ["inner", "wrapper"])
def test_lr_scheduler_counts_updates(attach_to, backend):
    model = make_model()
    inner = torch.optim.Adagrad(model.parameters(), lr=1.0)
    opt = accum_fused.GradientAccumulator(inner, 2, backend=backend)
    scheduler = torch.optim.lr_scheduler.StepLR(inner if attach_to == "inner" else opt, step_size=1, gamma=0.5)
    for batch in make_batches([2, 3, 1, 4, 2, 2]):
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
        if opt.updated:
            scheduler.step()
    assert inner.param_groups[0]["lr"] == 0.125
    assert opt.param_groups is inner.param_groups


def test_add_param_group_and_zero_grad_reach_the_inner_optimizer(backend):
    first, second = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(first.parameters(), lr=0.1)
    opt = accum_fused.GradientAccumulator(inner, 1, backend=backend)
    opt.add_param_group({"params": second.parameters(), "lr": 1.0})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["lr"] == 1.0
    before = second.weight.detach().clone()
    second(torch.ones(1, 2)).sum().backward()
    opt.step()
    torch.testing.assert_close(second.weight, before - 1.0)
    opt.zero_grad()
    assert second.weight.grad is None


def test_deepcopy_and_pickle_keep_the_open_window(backend):
    model = make_model()
    opt = accum_fused.GradientAccumulator(torch.optim.Adagrad(model.parameters(), lr=0.1), 3, backend=backend)
    loss_of(model, make_batches([3])[0]).backward()
    opt.step(weight=3)
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert copied.micro_step == 1 and copied._window.weight_sum == 3.0
        assert len(copied._window.live) == len(list(model.parameters()))
        assert isinstance(copied.optimizer, torch.optim.Adagrad)


def test_rejects_bad_input():
    model = make_model()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        accum_fused.GradientAccumulator(model.parameters())
    with pytest.raises(TypeError, match="already accumulates"):
        accum_fused.GradientAccumulator(accum_fused.SGD(model.parameters(), lr=0.1), 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="accumulation_steps"):
        accum_fused.GradientAccumulator(inner, 0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        accum_fused.GradientAccumulator(inner, 2, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="unknown backend"):
        accum_fused.GradientAccumulator(inner, 2, backend="cuda")
    opt = accum_fused.GradientAccumulator(inner, 2)
    with pytest.raises(ValueError, match="weight"):
        opt.step(weight=0.0)
    assert opt.micro_step == 0


@pytest.mark.parametrize("name", ["Adam", "AdamW", "NAdam", "Adamax"])
def test_bf16_parameters_run_as_the_wrapped_optimizer_does(name):
    """bf16 parameters: the wrapped optimizer keeps the state it created (bf16 moments, as
    torch.optim makes them) and steps on the window gradient rounded to bf16, exactly as it
    steps natively on bf16 parameters given that gradient (issue 21, row 8: the second update
    used to raise, the moments having been widened to fp32 under it)."""
    make = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "NAdam": torch.optim.NAdam,
            "Adamax": torch.optim.Adamax}[name]
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3).to(torch.bfloat16)
    native = copy.deepcopy(model)
    opt = accum_fused.GradientAccumulator(make(model.parameters(), lr=1e-2), accumulation_steps=2)
    ref = make(native.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = []
        for _ in range(2):
            x = torch.randn(4, 5, generator=gen).to(torch.bfloat16)
            model(x).square().mean().backward()
            grads.append([p.grad.float() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        for p, g1, g2 in zip(native.parameters(), *grads):
            p.grad = ((g1 + g2) / 2).to(torch.bfloat16)
        ref.step()
        assert opt.updated
    for p, q in zip(model.parameters(), native.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), (p - q).abs().max()
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values() if v.dim() > 0)
