"""GradScaler (mixed precision) and max_grad_norm clipping."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _helpers import (
    OPTIMIZERS,
    all_params,
    assert_params_changed,
    assert_params_close,
    assert_params_equal,
    assert_unchanged,
    concat,
    loss_of,
    make_batches,
    make_model,
    snapshot,
    train_accum,
    train_big_batch,
    windows,
)

FP64 = dict(rtol=1e-10, atol=1e-12)
FP32 = dict(rtol=1e-5, atol=1e-6)
CONFIGS = [
    pytest.param("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.05), id="SGD"),
    pytest.param("AdamW", dict(lr=0.01, amsgrad=True, weight_decay=0.1), id="AdamW"),
]


def _make(name, hyper, backend, k, dtype=torch.float32, **extra):
    model = make_model(dtype=dtype)
    opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=k, backend=backend, **hyper, **extra)
    return opt, model


def _scaler(**kwargs) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    assert scaler.is_enabled()
    return scaler


def train_scaled(opt, model, batches, scaler, poison: dict | None = None, weighted=False, scales=None):
    """The documented loop, one scaler.step per micro-batch. ``poison``: {micro-batch index:
    value} written into one gradient element after backward. ``scales``: {index: scale} set
    through scaler.update(new_scale=...) before that micro-batch (index > 0). Returns
    (scale used, updated) per micro-batch."""
    poison = poison or {}
    scales = scales or {}
    record = []
    for i, batch in enumerate(batches):
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(loss_of(model, batch)).backward()
        if i in poison:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = poison[i]
        if weighted:
            scaler.step(opt, weight=len(batch[0]))
        else:
            scaler.step(opt)
        scaler.update()
        if i + 1 in scales:
            scaler.update(new_scale=scales[i + 1])
        record.append((scale, opt.updated))
    return record


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_scale_growing_inside_windows_matches_unscaled_run(backend, name, hyper, weighted):
    """growth_interval=1 doubles the scale after every micro-batch; each micro-batch is unscaled
    with its own (power-of-two) scale, so the result is bit-identical to the unscaled run."""
    k = 4
    sizes = [3, 5, 1, 7] * 3
    batches = make_batches(sizes)
    opt, model = _make(name, hyper, backend, k)
    record = train_scaled(opt, model, batches, _scaler(init_scale=2.0**8, growth_interval=1), weighted=weighted)
    scales = [s for s, _ in record]
    assert len(set(scales)) == len(batches)  # a new scale for every micro-batch
    assert [u for _, u in record] == [False, False, False, True] * 3

    ref_opt, ref_model = _make(name, hyper, backend, k)
    train_accum(ref_opt, ref_model, batches, weighted=weighted)
    assert_params_equal(model, ref_model)
    assert_params_changed(model, make_model())


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_arbitrary_scales_inside_window_match_big_batch(backend, name, hyper):
    k = 4
    batches = make_batches([4] * (2 * k))
    opt, model = _make(name, hyper, backend, k)
    scaler = _scaler(init_scale=3.0)
    train_scaled(opt, model, batches, scaler, scales={1: 1000.0, 2: 7.5, 3: 12345.0, 5: 0.75, 6: 99.0})
    ref_model = make_model()
    torch_opt = OPTIMIZERS[name][1](ref_model.parameters(), **hyper)
    train_big_batch(torch_opt, ref_model, batches, k)
    assert_params_close(model, ref_model, **FP32)


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("position", [0, 1, 3], ids=["first", "middle", "last"])
@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_non_finite_micro_batch_skips_window(backend, name, hyper, position, value):
    k = 4
    batches = make_batches([3] * (3 * k))
    opt, model = _make(name, hyper, backend, k)
    scaler = _scaler(init_scale=2.0**10)
    w1, w2, w3 = windows(batches, k)

    train_scaled(opt, model, w1, scaler)
    assert opt.update_count == 1
    before = snapshot(opt)
    record = train_scaled(opt, model, w2, scaler, poison={position: value})
    # The window was skipped: nothing changed but the scaler's scale.
    assert [u for _, u in record] == [False] * k
    assert opt.micro_step == 0
    assert_unchanged(opt, dict(before, updated=False))
    assert record[position][0] == 2.0**10
    expected_after = 2.0**10 * 0.5
    assert scaler.get_scale() == expected_after
    assert all(s == expected_after for s, _ in record[position + 1 :])

    # The next window is correct (the poisoned window left nothing behind).
    train_scaled(opt, model, w3, scaler)
    assert opt.update_count == 2
    assert opt.updated is True
    ref_opt, ref_model = _make(name, hyper, backend, k)
    train_accum(ref_opt, ref_model, w1 + w3)
    assert_params_equal(model, ref_model)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_a_skipped_window_run_again_is_the_window_the_skip_dropped(backend, name, hyper):
    """The checkpoint guide's claim (issue 45): under a GradScaler, a window skipped for a
    non-finite micro-batch and then run again (its micro-batches unpoisoned) ends bit for bit as
    the run in which nothing was skipped; the halved scale is a power of two and changes no
    unscaled gradient."""
    k = 4
    batches = make_batches([3] * (3 * k))
    w1, w2, w3 = windows(batches, k)
    opt, model = _make(name, hyper, backend, k)
    scaler = _scaler(init_scale=2.0**10)
    train_scaled(opt, model, w1, scaler)
    train_scaled(opt, model, w2, scaler, poison={1: float("inf")})
    assert opt.update_count == 1 and scaler.get_scale() == 2.0**9
    train_scaled(opt, model, w2 + w3, scaler)  # the skipped window again, then the next
    clean_opt, clean_model = _make(name, hyper, backend, k)
    train_scaled(clean_opt, clean_model, w1 + w2 + w3, _scaler(init_scale=2.0**10))
    assert opt.update_count == clean_opt.update_count == 3
    assert_params_equal(model, clean_model)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_flush_of_poisoned_partial_window_returns_false(backend, name, hyper):
    k = 4
    batches = make_batches([3] * (2 * k + 2))
    opt, model = _make(name, hyper, backend, k)
    scaler = _scaler(init_scale=2.0**10)
    train_scaled(opt, model, batches[:k], scaler)
    before = snapshot(opt)
    train_scaled(opt, model, batches[k : k + 2], scaler, poison={1: float("inf")})
    assert opt.micro_step == 2
    assert opt.flush() is False
    assert opt.updated is False
    assert opt.micro_step == 0
    assert_unchanged(opt, dict(before, updated=False))
    train_scaled(opt, model, batches[k + 2 :], scaler)
    ref_opt, ref_model = _make(name, hyper, backend, k)
    train_accum(ref_opt, ref_model, batches[:k] + batches[k + 2 :])
    assert opt.update_count == ref_opt.update_count == 2
    assert_params_equal(model, ref_model)


class _WithUnusedLayer(nn.Module):
    """make_model()'s MLP plus a layer that is never in the loss (its grads stay None)."""

    def __init__(self, dtype=torch.float64):
        super().__init__()
        self.net = make_model(dtype=dtype)
        self.unused = nn.Linear(2, 2).to(dtype)

    def forward(self, x):
        return self.net(x)


def _groups(model):
    return [
        {"params": list(model.net[0].parameters()) + list(model.unused.parameters()), "lr": 0.05},
        {"params": model.net[2].parameters()},
    ]


@pytest.mark.parametrize("max_norm", [0.05, 100.0], ids=["clipping", "not-clipping"])
@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_clipping_matches_clip_grad_norm_on_big_batch(backend, name, hyper, max_norm):
    k = 3
    model = _WithUnusedLayer()
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS[name][0](_groups(model), accumulation_steps=k, max_grad_norm=max_norm, backend=backend, **hyper)
    torch_opt = OPTIMIZERS[name][1](_groups(ref_model), **hyper)
    batches = make_batches([2, 5, 3] * 3, dtype=torch.float64)
    unused_before = [p.detach().clone() for p in model.unused.parameters()]
    for window in windows(batches, k):
        assert opt.last_grad_norm is None or opt.update_count > 0
        train_accum(opt, model, window[:-1], weighted=True)
        if opt.update_count == 0:
            assert opt.last_grad_norm is None
        train_accum(opt, model, window[-1:], weighted=True)
        assert opt.updated is True

        torch_opt.zero_grad()
        loss_of(ref_model, concat(window)).backward()
        total = torch.nn.utils.clip_grad_norm_(all_params(torch_opt), max_norm)
        torch_opt.step()
        assert (total.item() > max_norm) == (max_norm < 1.0)  # the case does (not) clip

        assert isinstance(opt.last_grad_norm, torch.Tensor)
        assert opt.last_grad_norm.dim() == 0
        torch.testing.assert_close(opt.last_grad_norm.double(), total.double(), **FP64)
        assert_params_close(model, ref_model, **FP64)
    assert all(torch.equal(a, b) for a, b in zip(model.unused.parameters(), unused_before))


def test_clipping_on_flushed_partial_window(backend):
    k = 4
    max_norm = 0.05
    model = make_model(dtype=torch.float64)
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS["Adam"][0](model.parameters(), lr=0.01, accumulation_steps=k, max_grad_norm=max_norm,
                                backend=backend)
    torch_opt = torch.optim.Adam(ref_model.parameters(), lr=0.01)
    batches = make_batches([3] * (k + 2), dtype=torch.float64)
    train_accum(opt, model, batches)
    assert opt.flush() is True
    for window in (batches[:k], batches[k:]):
        torch_opt.zero_grad()
        loss_of(ref_model, concat(window)).backward()
        total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
        assert total.item() > max_norm
        torch_opt.step()
    torch.testing.assert_close(opt.last_grad_norm.double(), total.double(), **FP64)
    assert_params_close(model, ref_model, **FP64)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_clipping_with_grad_scaler_uses_unscaled_gradients(backend, name, hyper):
    k = 3
    max_norm = 0.05
    batches = make_batches([4] * (2 * k))
    opt, model = _make(name, hyper, backend, k, max_grad_norm=max_norm)
    train_scaled(opt, model, batches, _scaler(init_scale=2.0**12, growth_interval=1))
    ref_opt, ref_model = _make(name, hyper, backend, k, max_grad_norm=max_norm)
    train_accum(ref_opt, ref_model, batches)
    assert ref_opt.last_grad_norm.item() > max_norm
    assert torch.equal(opt.last_grad_norm, ref_opt.last_grad_norm)
    assert_params_equal(model, ref_model)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_clipping_with_gradients_missing_in_some_micro_batches(backend, name, hyper):
    """The global norm covers every parameter with a gradient anywhere in the window, also
    those without one in the window's last micro-batch (None counts as zero)."""
    ours_cls, torch_cls = OPTIMIZERS[name]
    k, max_norm = 3, 0.5
    gen = torch.Generator().manual_seed(13)
    init = [torch.randn(n, generator=gen, dtype=torch.float64) for n in (4, 3, 5)]
    ours = [nn.Parameter(t.clone()) for t in init]
    refs = [nn.Parameter(t.clone()) for t in init]
    opt = ours_cls(ours, accumulation_steps=k, max_grad_norm=max_norm, backend=backend, **hyper)
    torch_opt = torch_cls(refs, **hyper)
    weights = [2.0, 1.0, 0.5]
    for _ in range(2):
        # param 0: every micro-batch; param 1: first only; param 2: never.
        grads = [[torch.randn(4, generator=gen, dtype=torch.float64),
                  torch.randn(3, generator=gen, dtype=torch.float64) if j == 0 else None, None] for j in range(k)]
        for micro, w in zip(grads, weights):
            for p, g in zip(ours, micro):
                p.grad = g
            opt.step(weight=w)
        for i, p in enumerate(refs):
            present = [(w, micro[i]) for w, micro in zip(weights, grads) if micro[i] is not None]
            p.grad = sum(w * g for w, g in present) / sum(weights) if present else None
        total = torch.nn.utils.clip_grad_norm_(refs, max_norm)
        assert total.item() > max_norm
        torch_opt.step()
        torch.testing.assert_close(opt.last_grad_norm.double(), total, **FP64)
        for a, b in zip(ours, refs):
            torch.testing.assert_close(a.detach(), b.detach(), **FP64)
    assert torch.equal(ours[2].detach(), init[2])


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_k1_grad_scaler_matches_torch(backend, name, hyper):
    """k=1 under GradScaler (an inf step included) is torch.optim under GradScaler, bit for bit."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = OPTIMIZERS[name][0](model.parameters(), backend=backend, **hyper)
    torch_opt = OPTIMIZERS[name][1](ref_model.parameters(), **hyper)
    scaler, ref_scaler = _scaler(init_scale=2.0**10, growth_interval=2), _scaler(init_scale=2.0**10, growth_interval=2)
    for j, batch in enumerate(make_batches([3] * 6)):
        for o, m, s in ((opt, model, scaler), (torch_opt, ref_model, ref_scaler)):
            o.zero_grad()
            s.scale(loss_of(m, batch)).backward()
            if j == 2:
                with torch.no_grad():
                    m[0].weight.grad[0, 0] = float("inf")
            s.step(o)
            s.update()
        assert opt.updated is (j != 2)
        assert scaler.get_scale() == ref_scaler.get_scale()
        assert_params_equal(model, ref_model)
    assert opt.update_count == 5


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_explicit_unscale_before_step(backend, name, hyper):
    """scaler.unscale_(opt) before scaler.step(opt) (to inspect or clip .grad) also works:
    the gradients are already unscaled and a non-finite micro-batch still poisons the window."""
    k = 2
    batches = make_batches([3] * (3 * k))
    opt, model = _make(name, hyper, backend, k)
    scaler = _scaler(init_scale=2.0**10, growth_interval=1)
    for j, batch in enumerate(batches):
        opt.zero_grad()
        scaler.scale(loss_of(model, batch)).backward()
        if j == 2:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("nan")
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert opt.update_count == 2
    ref_opt, ref_model = _make(name, hyper, backend, k)
    train_accum(ref_opt, ref_model, batches[:2] + batches[4:])
    assert_params_equal(model, ref_model)
