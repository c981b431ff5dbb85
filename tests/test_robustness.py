"""The traps of real training loops (issue 10): each was silently wrong, stuck or a crash.

torch.compile(opt.step), auto's fallback warning, failed boundary updates, a forgotten
zero_grad(), parameter dtype changes, extreme weights, empty windows and complex parameters.
Every case runs on every backend that loads. DTensor (FSDP2) parameters: tests/test_fsdp2.py.
"""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import accum_fused
from accum_fused import backends

from _helpers import (OPTIMIZERS, all_params, assert_params_changed, assert_params_close,
                      assert_params_equal, assert_unchanged, concat, loss_of, make_batches, make_model, snapshot,
                      train_big_batch, windows)

NAMES = list(OPTIMIZERS)
HYPER = {"SGD": dict(lr=0.1, momentum=0.9), "Adam": dict(lr=0.01), "AdamW": dict(lr=0.01, weight_decay=0.1)}


def _accum(name, model, backend, k, **kwargs):
    return OPTIMIZERS[name][0](model.parameters(), **HYPER[name], accumulation_steps=k, backend=backend, **kwargs)


def _big_batch_model(name, batches, k, seed=0):
    ref = make_model(seed)
    train_big_batch(OPTIMIZERS[name][1](ref.parameters(), **HYPER[name]), ref, batches, k)
    return ref


# ------------------------------------------------------------------- 1. torch.compile(opt.step)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_compiled_step_trains(backend, name, k):
    torch._dynamo.reset()
    batches = make_batches([2, 3, 4, 2, 5, 1])
    model = make_model()
    opt = _accum(name, model, backend, k)
    step = torch.compile(opt.step)
    for batch in batches:
        loss_of(model, batch).backward()
        step(weight=len(batch[0]))
        opt.zero_grad()
    assert opt.update_count == len(batches) // k and opt.micro_step == 0
    ref = _big_batch_model(name, batches, k)
    assert_params_changed(model, make_model())
    assert_params_close(model, ref, rtol=1e-5, atol=1e-6)


def test_compiled_model_with_eager_step(backend):
    torch._dynamo.reset()
    batches = make_batches([4, 4, 4, 4])
    model = make_model()
    compiled = torch.compile(model)
    opt = _accum("AdamW", model, backend, 2)
    for batch in batches:
        loss_of(compiled, batch).backward()
        opt.step()
        opt.zero_grad()
    assert opt.update_count == 2
    assert_params_close(model, _big_batch_model("AdamW", batches, 2), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ 2. auto's fallback warning
def test_auto_warns_when_the_extension_does_not_load(monkeypatch):
    monkeypatch.setitem(backends._unavailable, "cpp", "ImportError: simulated")
    monkeypatch.delitem(backends._loaded, "cpp", raising=False)
    monkeypatch.setattr(backends, "_resolved", {})
    monkeypatch.setattr(backends, "_warned_auto_fallback", False)
    with pytest.warns(UserWarning, match="slower reference backend.*cpp: ImportError: simulated"):
        module = backends.resolve("auto", torch.device("cpu"), torch.float32)
    assert module is backends.reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        backends.resolve("auto", torch.device("cpu"), torch.float32)


def test_auto_fallback_warning_points_at_the_users_line(monkeypatch):
    """Where the user's optimizer first resolves its backend (its first step here), the warning
    names that line, not accum_fused's (it named update.py)."""
    monkeypatch.setitem(backends._unavailable, "cpp", "ImportError: simulated")
    monkeypatch.delitem(backends._loaded, "cpp", raising=False)
    monkeypatch.setattr(backends, "_resolved", {})
    monkeypatch.setattr(backends, "_warned_auto_fallback", False)
    model = make_model()
    with pytest.warns(UserWarning, match="slower reference backend") as record:
        opt = accum_fused.AdamW(model.parameters(), lr=0.01, accumulation_steps=2)
        loss_of(model, make_batches([2])[0]).backward()
        opt.step()
    assert [w.filename for w in record] == [__file__]


def test_auto_does_not_warn_when_the_reference_is_the_right_choice(monkeypatch):
    if "cpp" not in accum_fused.available_backends():
        pytest.skip("needs the cpp extension")
    monkeypatch.setattr(backends, "_resolved", {})
    monkeypatch.setattr(backends, "_warned_auto_fallback", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backends.resolve("auto", torch.device("cpu"), torch.float64) is backends.reference
        assert backends.resolve("auto", torch.device("cpu"), torch.float32).name == "cpp"


# -------------------------------------------------- 3. a failed boundary update changes nothing
@pytest.mark.parametrize("name", NAMES)
def test_state_of_another_model_raises_at_the_boundary_and_changes_nothing(backend, name):
    other = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    other_opt = OPTIMIZERS[name][1](other.parameters(), **HYPER[name])
    loss_of(other, make_batches([2])[0]).backward()
    other_opt.step()
    model = make_model()
    opt = _accum(name, model, backend, 2)
    opt.load_state_dict(other_opt.state_dict())  # torch.optim loads it too: shapes are not checked
    batches = make_batches([2, 3, 2, 3])
    loss_of(model, batches[0]).backward()
    opt.step()
    loss_of(model, batches[1]).backward()
    before = snapshot(opt)
    grads = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):  # raises every time, and never counts the micro-batch
        with pytest.raises(ValueError, match="another model"):
            opt.step()
        assert_unchanged(opt, before)
        assert opt._window.weight_sum == 1.0
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    # The cause fixed (state of this model's optimizer), the optimizer works again.
    fresh = _accum(name, make_model(), backend, 2)
    opt.load_state_dict(fresh.state_dict())
    opt.zero_grad()
    for batch in batches:
        loss_of(model, batch).backward()
        opt.step()
    assert opt.update_count == 2 and opt.micro_step == 0


# --------------------------------------------------------------- 4. forgotten zero_grad()
@pytest.mark.parametrize("name", NAMES)
def test_forgotten_zero_grad_between_micro_batches_is_harmless(backend, name):
    batches = make_batches([3, 1, 4, 2, 5, 3, 2, 2])
    model = make_model()
    opt = _accum(name, model, backend, 4)
    for batch in batches:  # the tutorial habit: zero_grad() only after an update
        loss_of(model, batch).backward()
        opt.step(weight=len(batch[0]))
        assert all(p.grad is None for p in model.parameters())  # taken into the buffer
        if opt.updated:
            opt.zero_grad()
    assert opt.update_count == 2
    assert_params_close(model, _big_batch_model(name, batches, 4), rtol=1e-5, atol=1e-6)


def test_k1_leaves_grad_as_torch_does(backend):
    model = make_model()
    opt = _accum("AdamW", model, backend, 1)
    loss_of(model, make_batches([3])[0]).backward()
    grads = [p.grad for p in model.parameters()]
    opt.step()
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_wrapper_takes_the_window_gradient_back(backend):
    batches = make_batches([3, 1, 4, 2])
    model = make_model()
    opt = accum_fused.GradientAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2, backend=backend)
    for batch in batches:  # never calls zero_grad(): the next window must not see this one's .grad
        loss_of(model, batch).backward()
        opt.step(weight=len(batch[0]))
        assert all(p.grad is None for p in model.parameters())
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    train_big_batch(ref_opt, ref, batches, 2)
    assert_params_close(model, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- 5. parameter dtype changed after construction
@pytest.mark.parametrize("name", NAMES)
def test_model_double_mid_window_follows_the_new_dtype(backend, name):
    batches = make_batches([2, 3, 4, 1, 3, 2], dtype=torch.float64)
    first = (batches[0][0].float(), batches[0][1].float())
    model, ref = make_model(), make_model()
    opt = _accum(name, model, backend, 2)
    ref_opt = OPTIMIZERS[name][1](ref.parameters(), **HYPER[name])
    loss_of(model, first).backward()
    opt.step(weight=2)
    loss_of(ref, first).backward()
    model.double()  # mid-window: the fp32 buffers and later the state follow to fp64
    ref.double()
    first_grads = [p.grad.double() * 2 for p in ref.parameters()]  # exact: the buffer holds 2 * g
    ref.zero_grad()
    loss_of(model, batches[1]).backward()
    opt.step(weight=3)
    loss_of(ref, batches[1]).backward()
    for p, g in zip(ref.parameters(), first_grads):
        p.grad = (g + p.grad * 3) / 5  # the reference backend's arithmetic, in fp64
    ref_opt.step()
    for p in model.parameters():
        # (a buffer kept between windows follows; the cpp backend's step table adopted the
        # window's first gradients, weighted too, and let go of them as the window ended)
        buffer = opt._window.buffers.get(p)
        assert p.dtype == torch.float64 and (buffer is None or buffer.dtype == torch.float64)
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in opt.state[p]:
                assert opt.state[p][key].dtype == torch.float64
    assert_params_close(model, ref, rtol=1e-13, atol=1e-15)
    for window in windows(batches[2:], 2):  # later windows stay in fp64: no rounding through fp32
        for micro in window:
            loss_of(model, micro).backward()
            opt.step(weight=len(micro[0]))
        ref_opt.zero_grad()
        loss_of(ref, concat(window)).backward()
        ref_opt.step()
    assert_params_changed(model, make_model().double())
    assert_params_close(model, ref, rtol=1e-12, atol=1e-14)


def test_model_to_another_dtype_with_a_process_group_is_refused_clearly():
    # Covered in the distributed worker; here: nothing changes without a process group.
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=2, backend="torch")
    loss_of(model, make_batches([2])[0]).backward()
    opt.step()
    model.half()
    loss_of(model, tuple(t.half() for t in make_batches([2])[0])).backward()
    opt.step()
    assert all(opt._window.buffers[p].dtype == torch.float32 for p in model.parameters())
    assert opt.update_count == 1


# ------------------------------------------------------------------- 6. extreme weights
@pytest.mark.parametrize("scale,k", [(1e-46, 3), (1e-300, 3), (1e38, 3), (1e39, 3), (1e36, 1000), (1e300, 3)],
                         ids=["1e-46", "1e-300", "1e38", "1e39", "1e36-k1000", "1e300"])
def test_uniform_extreme_weights_give_the_plain_mean(backend, scale, k):
    if k == 1000 and backend == "triton":
        pytest.skip("1000 interpreted launches: the torch and cpp runs cover it")
    batch = make_batches([4])[0]
    model, plain = make_model(), make_model()
    opt = _accum("AdamW", model, backend, k)
    plain_opt = _accum("AdamW", plain, backend, k)
    for _ in range(k):
        loss_of(model, batch).backward()
        opt.step(weight=scale)
        loss_of(plain, batch).backward()
        plain_opt.step(weight=1.0)
    assert opt.update_count == 1
    assert_params_changed(model, make_model())
    assert_params_close(model, plain, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
def test_weights_far_apart_give_the_weighted_mean(backend, name):
    # 1e-30, 1, 1e30: the window moves to the larger weights' band when they arrive.
    weights = [1e-30, 1.0, 1e30, 3e30]
    batches = make_batches([2, 3, 4, 5])
    model = make_model()
    opt = _accum(name, model, backend, 4)
    for w, batch in zip(weights, batches):
        loss_of(model, batch).backward()
        opt.step(weight=w)
    ref = make_model()
    ref_opt = OPTIMIZERS[name][1](ref.parameters(), **HYPER[name])
    total = sum(weights)
    for w, batch in zip(weights, batches):
        loss_of(ref, batch).mul(w / total).backward()
    ref_opt.step()
    assert_params_close(model, ref, rtol=1e-5, atol=1e-6)


def test_extreme_weights_resume_mid_window(backend):
    batches = make_batches([2, 3, 4])
    model = make_model()
    opt = _accum("AdamW", model, backend, 3)
    loss_of(model, batches[0]).backward()
    opt.step(weight=1e-40)
    loss_of(model, batches[1]).backward()
    opt.step(weight=1e-40)
    saved = opt.state_dict()
    assert saved["accumulation"]["weight_shift"] == -160
    clone = make_model()
    clone.load_state_dict(model.state_dict())
    clone_opt = _accum("AdamW", clone, backend, 3)
    clone_opt.load_state_dict(saved)
    for m, o in ((model, opt), (clone, clone_opt)):
        loss_of(m, batches[2]).backward()
        o.step(weight=2e-40)
    assert_params_equal(model, clone)


# ------------------------------------------------------------------- 7. empty windows
@pytest.mark.parametrize("name", NAMES)
def test_a_window_without_gradients_is_not_an_update(backend, name):
    model = make_model()
    opt = _accum(name, model, backend, 2)
    before = snapshot(opt)
    with pytest.warns(UserWarning, match="found no gradient on any parameter") as record:
        for _ in range(2):
            opt.step()  # no backward: every grad is None
    assert len(record) == 1  # once per optimizer
    assert record[0].filename == __file__  # (the user's line, not a torch wrapper's)
    assert opt.updated is False and opt.update_count == 0 and opt.micro_step == 0
    opt.step()
    assert opt.flush() is False and opt.update_count == 0
    assert_unchanged(opt, {**before, "updated": False})
    assert opt.state_dict()["state"] == {}


# ------------------------------------------------------------------- 8/9. state_dict details
def test_sgd_without_momentum_keeps_no_state(backend):
    model = make_model()
    opt = accum_fused.SGD(model.parameters(), lr=0.1, backend=backend)
    loss_of(model, make_batches([2])[0]).backward()
    opt.step()
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_load_state_dict_hooks_see_what_torch_shows_them(name):
    results = {}
    for impl in (0, 1):
        model = make_model()
        cls = OPTIMIZERS[name][impl]
        opt = cls(model.parameters(), **HYPER[name])
        loss_of(model, make_batches([2])[0]).backward()
        opt.step()
        saved = opt.state_dict()
        seen = {}

        def pre_hook(optimizer, state_dict):
            state = state_dict["state"][0]
            seen["pre"] = sorted(state)
            key = "momentum_buffer" if name == "SGD" else "exp_avg"
            state_dict["state"][0] = {**state, key: torch.full_like(state[key], 7.0)}

        def post_hook(optimizer):
            seen["post"] = sorted(optimizer.state[all_params(optimizer)[0]])
            optimizer.state["ran_post_hook"] = True  # a non-dict value in state

        opt.register_load_state_dict_pre_hook(pre_hook)
        opt.register_load_state_dict_post_hook(post_hook)
        opt.load_state_dict(saved)
        key = "momentum_buffer" if name == "SGD" else "exp_avg"
        assert torch.all(opt.state[all_params(opt)[0]][key] == 7.0)  # the pre hook's edit is loaded
        assert opt.state["ran_post_hook"] is True
        results[impl] = seen
    assert results[0] == results[1]


def test_bf16_state_stays_fp32_through_load_state_dict():
    model = make_model(dtype=torch.bfloat16)
    opt = accum_fused.AdamW(model.parameters(), backend="torch")
    loss_of(model, make_batches([2], dtype=torch.bfloat16)[0]).backward()
    opt.step()
    saved = opt.state_dict()
    exp_avg = saved["state"][0]["exp_avg"].clone()
    fresh = accum_fused.AdamW(make_model(dtype=torch.bfloat16).parameters(), backend="torch")
    fresh.load_state_dict(saved)
    loaded = fresh.state[all_params(fresh)[0]]["exp_avg"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, exp_avg)


# ------------------------------------------------------------------- 10. complex parameters
def _complex_model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return nn.ParameterList([nn.Parameter(torch.randn(5, 3, dtype=torch.complex64, generator=gen)),
                             nn.Parameter(torch.randn(7, dtype=torch.complex64, generator=gen))])


def _complex_loss(params, x):
    return (params[0] @ x[:3]).abs().pow(2).sum() + (params[1] * x[3]).real.sum() + (params[1].imag ** 2).sum()


COMPLEX_HYPER = {"SGD": dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
                 "Adam": dict(lr=0.01, amsgrad=True, weight_decay=0.1), "AdamW": dict(lr=0.01, maximize=True)}


@pytest.mark.parametrize("name", NAMES)
def test_complex_parameters_step_like_torch(backend, name):
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, dtype=torch.complex64, generator=gen) for _ in range(4)]
    ours, ref = _complex_model(), _complex_model()
    opt = OPTIMIZERS[name][0](ours.parameters(), **COMPLEX_HYPER[name], backend=backend)
    ref_opt = OPTIMIZERS[name][1](ref.parameters(), **COMPLEX_HYPER[name])
    for x in xs:
        for params, o in ((ours, opt), (ref, ref_opt)):
            o.zero_grad()
            _complex_loss(params, x).backward()
            o.step()
    # Not bit for bit, even on the reference: torch's complex kernels (SGD, Adam's L2 weight
    # decay) round a + alpha * b in two steps where its real kernels fuse them.
    assert_params_close(ours, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(ours.parameters(), ref.parameters()):
        for key, value in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], value, rtol=1e-5, atol=1e-6)
    for p in ours.parameters():
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in opt.state[p]:
                assert opt.state[p][key].dtype == torch.complex64


@pytest.mark.parametrize("name", NAMES)
def test_complex_window_equals_the_big_batch(backend, name):
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(4, dtype=torch.complex64, generator=gen) for _ in range(6)]
    weights = [1.0, 3.0, 2.0, 1.0, 5.0, 2.0]
    ours, ref = _complex_model(), _complex_model()
    opt = OPTIMIZERS[name][0](ours.parameters(), **COMPLEX_HYPER[name], accumulation_steps=3,
                              max_grad_norm=0.5, backend=backend)
    ref_opt = OPTIMIZERS[name][1](ref.parameters(), **COMPLEX_HYPER[name])
    for x, w in zip(xs, weights):
        _complex_loss(ours, x).backward()
        opt.step(weight=w)
    for window in (slice(0, 3), slice(3, 6)):
        ref_opt.zero_grad()
        total = sum(weights[window])
        for x, w in zip(xs[window], weights[window]):
            _complex_loss(ref, x).mul(w / total).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
    assert opt.update_count == 2
    assert_params_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_complex_parameters_in_the_wrapper(backend):
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(4, dtype=torch.complex64, generator=gen) for _ in range(4)]
    ours, ref = _complex_model(), _complex_model()
    opt = accum_fused.GradientAccumulator(torch.optim.RMSprop(ours.parameters(), lr=0.01), 2, backend=backend)
    ref_opt = torch.optim.RMSprop(ref.parameters(), lr=0.01)
    for x in xs:
        _complex_loss(ours, x).backward()
        opt.step()
    for pair in (xs[:2], xs[2:]):
        ref_opt.zero_grad()
        for x in pair:
            _complex_loss(ref, x).mul(0.5).backward()
        ref_opt.step()
    assert_params_close(ours, ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------- a weight given before step() (frameworks)
def test_set_micro_batch_weight_from_inside_the_closure(backend):
    """Lightning runs training_step inside step(closure): a weight set there must apply to
    that micro-batch, not the next one."""
    batches = make_batches([3, 1, 4, 2])
    model, ref = make_model(), make_model()
    opt = _accum("AdamW", model, backend, 2)
    ref_opt = _accum("AdamW", ref, backend, 2)
    for batch in batches:
        def closure(batch=batch):
            opt.zero_grad()
            loss = loss_of(model, batch)
            loss.backward()
            opt.set_micro_batch_weight(len(batch[0]))
            return loss
        opt.step(closure)
        loss_of(ref, batch).backward()
        ref_opt.step(weight=len(batch[0]))
    assert opt.update_count == 2
    assert_params_equal(model, ref)


def test_set_micro_batch_weight_validates_and_is_used_once():
    model = make_model()
    opt = accum_fused.SGD(model.parameters(), lr=0.1, accumulation_steps=3)
    with pytest.raises(ValueError, match="weight"):
        opt.set_micro_batch_weight(0.0)
    opt.set_micro_batch_weight(5.0)
    loss_of(model, make_batches([2])[0]).backward()
    opt.step()
    loss_of(model, make_batches([2])[0]).backward()
    opt.step()
    assert opt._window.weight_sum == 6.0  # 5, then the default 1


def test_a_close_that_raises_does_not_leave_the_last_windows_updated():
    """Window.close sets ``updated`` before it tells the listeners: an update or a listener that
    raises must not leave the previous window's True behind (with k=1 no micro-batch between two
    closes resets it)."""
    model = nn.Linear(3, 2)
    opt = accum_fused.SGD(model.parameters(), lr=0.1)

    class Raises:
        def window_closed(self, opt, applied):
            raise RuntimeError("listener failed")

    def micro_batch(x=1.0):
        model(torch.full((1, 3), x)).sum().backward()

    micro_batch()
    opt.step()
    assert opt.updated
    opt._window.listeners.append(Raises())
    micro_batch(float("nan"))
    opt.zero_grad()
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    opt.found_inf = torch.ones(())  # as GradScaler hands it: this window is skipped, not applied
    with pytest.raises(RuntimeError, match="listener failed"):
        opt.step()
    del opt.found_inf
    assert not opt.updated
    opt._window.listeners.pop()
    micro_batch()
    opt.step()
    assert opt.updated
    class FailingUpdate(type(opt.update_spec)):
        def update(self, *a, **kw):
            raise RuntimeError("update failed")
    opt.update_spec = FailingUpdate()
    with pytest.raises(RuntimeError, match="update failed"):
        opt.step()
    assert not opt.updated
