"""Plain mode's step table (csrc/step_table.cpp, window.StepTable) against the Python path it
stands in for (window.plain.add_micro_batch: the spec).

Every case trains the same model twice from the same start, once as it runs (the table takes
the micro-batches that do not close a window) and once with the table switched off (every
micro-batch through add_micro_batch), and requires bit-equal parameters, optimizer state and
window: the table calls the same kernels with the same arguments. Each case also counts the
micro-batches the table took, so that none passes without it. The edges -- a micro-batch the
table must not take (a changed parameter, a sparse or misfit gradient, a new param group, a
replaced parameter, a load mid-window) -- change nothing in the table and go through Python,
which conforms, raises or warns as it always did.
"""
from __future__ import annotations

import copy
import pickle
import weakref

import pytest
import torch
from torch import nn

import accum_fused
from accum_fused import window as window_module
from accum_fused.window import plain as window_plain

from _helpers import built_without_extension, rows_compared_with_window

pytestmark = pytest.mark.skipif(built_without_extension(), reason="the step table is the extension's")


class Counted:
    """Counts the micro-batches the table took, and of them the closing ones (StepTable.close);
    ``off`` switches it off (the spec run)."""

    def __init__(self, monkeypatch, off: bool) -> None:
        self.taken = self.closed = self.rows_compared = 0
        original, original_close = window_plain.take_with_table, window_module.StepTable.close

        def take_with_table(win, *args):
            if off:
                return False
            taken = original(win, *args)
            self.taken += taken
            return taken

        def close(plan, *args):
            self.closed += 1
            return original_close(plan, *args)

        monkeypatch.setattr(window_plain, "take_with_table", take_with_table)
        monkeypatch.setattr(window_module.StepTable, "close", close)


class Net(nn.Module):
    """Two branches: ``side`` gets a gradient only in micro-batches that use it."""

    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.side = nn.Linear(5, 3)
        self.to(dtype)

    def forward(self, x, use_side=True):
        out = self.body(x)
        return out + self.side(x) if use_side else out


def _batches(n, dtype=torch.float32, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 + i % 3, 5, generator=gen).to(dtype), torch.randn(2 + i % 3, 3, generator=gen).to(dtype))
            for i in range(n)]


def _micro_batch(opt, model, i, batch, *, side_every=1, weight=True, scaler=None):
    x, y = batch
    loss = ((model(x, use_side=i % side_every == 0) - y) ** 2).mean()
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt, weight=float(len(x)))
        scaler.update()
    else:
        loss.backward()
        opt.step(weight=float(len(x)) if weight else None)
    opt.zero_grad()


def _state(opt, model):
    win = opt._window
    return {"params": [p.detach().clone() for p in model.parameters()],
            "state": copy.deepcopy({i: s for i, s in enumerate(opt.state.values())}),
            "window": (win.micro_step, win.weight_sum, win.weight_shift, win.update_count, len(win.live)),
            "buffers": [win.buffers[p].clone() for p in model.parameters() if p in win.live]}


def _assert_same(a, b):
    assert a["window"] == b["window"]
    for x, y in zip(a["params"] + a["buffers"], b["params"] + b["buffers"]):
        assert torch.equal(x, y)
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        for key, value in a["state"][i].items():
            assert torch.equal(value, b["state"][i][key]), key


CASES = {
    "adamw": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, weight_decay=0.1, accumulation_steps=4)),
    "adamw_clip": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, accumulation_steps=4, max_grad_norm=0.5)),
    "adam_amsgrad_k3": dict(make=lambda ps: accum_fused.Adam(ps, lr=1e-2, amsgrad=True, accumulation_steps=3)),
    "sgd_momentum": dict(make=lambda ps: accum_fused.SGD(ps, lr=0.1, momentum=0.9, accumulation_steps=4)),
    "unweighted": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, accumulation_steps=4), weight=False),
    "some_params_without_grad": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, accumulation_steps=4),
                                     side_every=3),
    "bf16": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, accumulation_steps=4), dtype=torch.bfloat16),
    "fp16": dict(make=lambda ps: accum_fused.SGD(ps, lr=0.1, accumulation_steps=4), dtype=torch.float16),
    "wrapper": dict(make=lambda ps: accum_fused.GradientAccumulator(torch.optim.AdamW(ps, lr=1e-2),
                                                                   accumulation_steps=4, backend="cpp")),
    "grad_scaler": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, accumulation_steps=4), scaler=True),
    "adamw_k1": dict(make=lambda ps: accum_fused.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    "sgd_nesterov_clip": dict(make=lambda ps: accum_fused.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                                              accumulation_steps=4, max_grad_norm=0.5)),
    "two_groups": dict(make=lambda ps: _two_groups(ps, accumulation_steps=4, max_grad_norm=0.5)),
    # (a parameter in the optimizer that never gets a gradient: a frozen embedding, a LoRA base)
    "frozen_param": dict(make=lambda ps: _with_frozen(ps, accumulation_steps=4)),
}
# The cases whose windows the step table closes (every parameter has a gradient in every
# micro-batch), with how many at least: the others close in Python (a parameter without a
# gradient in the closing micro-batch, GradientAccumulator).
# (windows 2.. of 23 micro-batches: the first allocates the buffers in Python)
PLANNED = {"adamw": 4, "adamw_clip": 4, "adam_amsgrad_k3": 6, "sgd_momentum": 4, "unweighted": 4, "bf16": 4,
           "fp16": 4, "grad_scaler": 4, "adamw_k1": 22, "sgd_nesterov_clip": 4, "two_groups": 4, "frozen_param": 4}


def _with_frozen(params, **kwargs):
    params = list(params)
    params[0].requires_grad_(False)
    return accum_fused.AdamW(params, lr=1e-2, weight_decay=0.1, **kwargs)


def _two_groups(params, **kwargs):
    params = list(params)
    return accum_fused.AdamW([{"params": params[:2], "lr": 3e-2, "weight_decay": 0.0},
                              {"params": params[2:], "amsgrad": True}], lr=1e-2, **kwargs)


def _train(monkeypatch, case, off, micro_batches=23):
    spec = CASES[case]
    dtype = spec.get("dtype", torch.float32)
    counted = Counted(monkeypatch, off)
    model = Net(dtype)
    opt = spec["make"](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=3) if spec.get("scaler") else None
    for i, batch in enumerate(_batches(micro_batches, dtype)):
        _micro_batch(opt, model, i, batch, side_every=spec.get("side_every", 1), weight=spec.get("weight", True),
                     scaler=scaler)
        counted.rows_compared += rows_compared_with_window(opt)  # (the table's rows are the window's)
    mid = _state(opt, model)  # (23 = 5 windows of 4 + 3: an open window)
    opt.flush()
    return counted, mid, _state(opt, model)


@pytest.mark.parametrize("case", list(CASES))
def test_the_table_takes_micro_batches_as_the_python_path_does(monkeypatch, case):
    counted, mid, end = _train(monkeypatch, case, off=False)
    with monkeypatch.context() as m:
        spec, spec_mid, spec_end = _train(m, case, off=True)
    assert spec.taken == spec.closed == 0
    # Windows 2.. take every micro-batch but the closing one (the first window allocates buffers).
    assert counted.taken >= 8, counted.taken
    assert counted.rows_compared >= 8, counted.rows_compared
    assert counted.closed >= PLANNED.get(case, 0), counted.closed
    _assert_same(mid, spec_mid)
    _assert_same(end, spec_end)


@pytest.mark.parametrize("how", ["unfrozen", "grad_set_by_hand"])
def test_a_gradient_on_a_frozen_parameter_goes_through_python(monkeypatch, how):
    """The table leaves frozen parameters out (their windows close with the table's plan), and
    looks at their .grad: a gradient there (the parameter unfrozen, or .grad set by hand, which
    torch.optim would step too) is Python's to take, and trains as the spec does."""
    results = []
    for off in (False, True):
        with monkeypatch.context() as m:
            counted = Counted(m, off)
            model = Net()
            opt = _with_frozen(model.parameters(), accumulation_steps=4)
            frozen = next(model.parameters())
            for i, batch in enumerate(_batches(16)):
                if i == 9 and how == "unfrozen":
                    frozen.requires_grad_(True)
                x, y = batch
                ((model(x) - y) ** 2).mean().backward()
                if how == "grad_set_by_hand" and i in (5, 9):
                    frozen.grad = torch.full_like(frozen, 0.5)
                opt.step(weight=float(len(x)))
                opt.zero_grad()
                counted.rows_compared += rows_compared_with_window(opt)
            results.append((counted, _state(opt, model)))
    (fast, fast_state), (spec, spec_state) = results
    assert fast.taken >= 4 and fast.closed >= 1 and spec.taken == 0
    _assert_same(fast_state, spec_state)
    assert not torch.equal(fast_state["params"][0], Net().body[0].weight)  # (its gradients were taken)


def _opt_with_table(monkeypatch):
    counted = Counted(monkeypatch, off=False)
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=4)
    batches = _batches(12)
    for i in range(5):  # a whole window (buffers allocated), then one micro-batch into the next
        _micro_batch(opt, model, i, batches[i])
    return counted, model, opt, batches


def test_a_parameter_changed_mid_window_goes_through_python(monkeypatch):
    counted, model, opt, batches = _opt_with_table(monkeypatch)
    taken = counted.taken
    model.double()  # the buffers follow in Python (Window.conform), as without the table
    _micro_batch(opt, model, 5, tuple(t.double() for t in batches[5]))
    assert counted.taken == taken
    assert all(opt._window.buffers[p].dtype == torch.float64 for p in model.parameters())
    with pytest.raises(ValueError, match="changed shape"):
        model.side.bias.data = torch.zeros(4, dtype=torch.float64)
        model.side.bias.grad = torch.zeros(4, dtype=torch.float64)
        opt.step()


def test_a_sparse_or_misfit_gradient_is_refused_by_python_and_nothing_changes(monkeypatch):
    counted, model, opt, _ = _opt_with_table(monkeypatch)
    before = _state(opt, model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.side.weight.grad = model.side.weight.grad.to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    _assert_same(_state(opt, model), before)
    # A gradient in another layout than its buffer (a transposed one): Python re-lays it out.
    model.side.weight.grad = torch.ones(5, 3).t()
    taken = counted.taken
    opt.step()
    assert counted.taken == taken and opt.micro_step == 2


def test_a_new_param_group_and_a_replaced_parameter_are_seen(monkeypatch):
    counted, model, opt, batches = _opt_with_table(monkeypatch)
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra]})
    taken = counted.taken
    loss = model(batches[5][0]).sum() + (extra * 2).sum()
    loss.backward()
    opt.step()
    # (the tables are built anew on the groups' new parameters: this one takes the new one too)
    assert counted.taken == taken + 1 and extra in opt._window.live
    # A parameter replaced inside a group's list mid-window: refused by name (the window holds
    # the old one's gradients), nothing changed; between windows, followed: its gradient is not lost.
    replacement = nn.Parameter(model.side.bias.detach().clone())
    group = opt.param_groups[0]
    at = next(i for i, q in enumerate(group["params"]) if q is model.side.bias)
    group["params"][at] = replacement
    model.body(batches[6][0]).sum().backward()
    replacement.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"replaced \(its \"params\" list or one in it\) while AdamW's window was open"):
        opt.step()
    assert opt.micro_step == 2 and replacement not in opt._window.live
    group["params"][at] = model.side.bias  # (put back: the window goes on)
    opt.step()
    opt.flush()
    group["params"][at] = replacement
    opt.zero_grad()
    model.body(batches[7][0]).sum().backward()
    replacement.grad = torch.ones(3)
    opt.step()
    assert replacement in opt._window.live and model.side.bias not in opt._window.buffers


def test_loading_a_mid_window_state_dict_and_copies_keep_the_window(monkeypatch):
    counted, model, opt, batches = _opt_with_table(monkeypatch)
    _micro_batch(opt, model, 5, batches[5])
    saved = copy.deepcopy(opt.state_dict())
    twin_model = copy.deepcopy(model)
    twin = accum_fused.AdamW(twin_model.parameters(), lr=1e-2, accumulation_steps=4)
    twin.load_state_dict(saved)
    copies = [copy.deepcopy((model, opt)), pickle.loads(pickle.dumps((model, opt)))]
    for i in range(6, 12):
        for m, o in [(model, opt), (twin_model, twin)] + copies:
            _micro_batch(o, m, i, batches[i])
    for m, o in [(twin_model, twin)] + copies:
        assert o._window.micro_step == opt._window.micro_step == 0 and o.update_count == opt.update_count == 3
        for p, q in zip(model.parameters(), m.parameters()):
            assert torch.equal(p, q)
    assert counted.taken >= 4 + 3 * 4  # the loaded and copied optimizers took theirs through the table too


def test_no_gradient_still_warns(monkeypatch):
    counted, model, opt, _ = _opt_with_table(monkeypatch)
    with pytest.warns(UserWarning, match="found no gradient"):
        opt.step()
    assert opt.micro_step == 2


def test_a_stale_buffer_that_no_longer_fits_is_dropped_when_the_table_is_built(monkeypatch):
    """A parameter resized between windows whose stale buffer is still there when a table is
    built (here: after add_param_group made the old one miss) and whose gradient comes only in
    the window's closing micro-batch, which trusts the table for every buffer: the buffer is
    dropped at the build, as Window.conform drops it, and the window takes the new shape."""
    counted = Counted(monkeypatch, off=False)
    body, extra = nn.Linear(3, 2), nn.Parameter(torch.ones(4))
    opt = accum_fused.SGD([*body.parameters(), extra], lr=0.1, accumulation_steps=3)

    held = []

    def micro_batch(with_extra):
        loss = body(torch.ones(2, 3)).sum()
        if with_extra:
            loss = loss + (extra * extra).sum()
        loss.backward()
        # (gradients held here are copied: the buffers are fresh ones, kept between windows)
        held.extend(p.grad for p in [*body.parameters(), extra] if p.grad is not None)
        opt.step(weight=0.5)

    for _ in range(3):
        micro_batch(True)
    held.clear()
    assert extra in opt._window.buffers and not opt._window.adopted
    extra.data = torch.ones(6)  # resized between windows
    opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    micro_batch(False)  # a table is built here, with extra's stale buffer in the window
    micro_batch(False)
    # (the first window's three, and these two: the new group makes the table stale, and it is
    # built anew at the first of them)
    assert counted.taken == 5 and extra not in opt._window.buffers
    micro_batch(True)  # the closing micro-batch: extra's first gradient since the resize
    # (two of the window's three micro-batches gave extra no gradient: they count as zeros)
    assert opt.update_count == 2 and torch.allclose(extra.detach(), torch.full((6,), 1 - 0.1 * 2 / 3))


def _run_windows(monkeypatch, off, *, windows=6, side_in=lambda i: True, between=None):
    """AdamW k=4 over ``windows`` windows; ``side_in(i)``: micro-batch i uses ``side``;
    ``between(opt, w)`` runs after window w closes."""
    counted = Counted(monkeypatch, off)
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, accumulation_steps=4)
    for i, (x, y) in enumerate(_batches(4 * windows)):
        loss = ((model(x, use_side=side_in(i)) - y) ** 2).mean()
        loss.backward()
        opt.step(weight=float(len(x)))
        opt.zero_grad()
        if between is not None and i % 4 == 3:
            between(opt, i // 4 + 1)
    return counted, _state(opt, model)


def test_step_counts_that_differ_close_in_python(monkeypatch):
    # side has no gradient in window 3: its step count then trails the others' for good, and
    # the plan (one call per group: one step count) must leave those windows to Python.
    side_in = lambda i: not 8 <= i < 12  # noqa: E731
    counted, end = _run_windows(monkeypatch, False, side_in=side_in)
    with monkeypatch.context() as m:
        _, spec_end = _run_windows(m, True, side_in=side_in)
    assert counted.closed == 2  # windows 1 and 2 (the table gives window 1 its buffers; 3 lacks side; 4.. differ)
    _assert_same(end, spec_end)


def test_the_plan_follows_a_loaded_state(monkeypatch):
    # A state_dict loaded between windows replaces every state tensor: the kept lists must not
    # update the old ones (nor keep them alive). torch.optim's: it keeps the window and its
    # table as they are (accum_fused's own reopens a window, which rebuilds the table).
    donor_model = Net()
    donor = torch.optim.AdamW(donor_model.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in _batches(6, seed=7):
        ((donor_model(x) - y) ** 2).mean().backward()
        donor.step()
        donor.zero_grad()
    saved = donor.state_dict()

    def between(opt, w):
        if w == 3:
            opt.load_state_dict(copy.deepcopy(saved))

    counted, end = _run_windows(monkeypatch, False, between=between)
    with monkeypatch.context() as m:
        _, spec_end = _run_windows(m, True, between=between)
    assert counted.closed >= 4
    _assert_same(end, spec_end)


def test_a_closing_micro_batch_the_plan_refuses_is_not_kept_alive(monkeypatch):
    # side has no gradient in the closing micro-batch: the plan refuses it after the table's
    # check found the others' gradients; the table must let go of them, or one micro-batch's
    # gradients stay alive into the next window.

    counted = Counted(monkeypatch, off=False)
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=2)
    for i, (x, y) in enumerate(_batches(6)):
        ((model(x, use_side=i % 2 == 0) - y) ** 2).mean().backward()
        grad = weakref.ref(model.body[0].weight.grad)
        opt.step()
        opt.zero_grad()
        if i % 2 == 0:  # (a window's first gradient became its buffer: alive until the window ends)
            assert grad() is opt._window.buffers[model.body[0].weight]
        else:
            assert grad() is None, f"micro-batch {i}: its gradient is still alive after step()"
    assert counted.closed == 0 and opt.update_count == 3


@pytest.mark.parametrize("swap", ["entry", "dict"])
def test_the_plan_follows_state_replaced_by_hand(monkeypatch, swap):
    # torch.optim reads opt.state at every step, so a state entry or dict replaced by hand
    # between windows is what the next update must use; the kept lists must not update the old.
    def between(opt, w):
        if w == 3:
            p = next(iter(opt.state))
            if swap == "entry":
                opt.state[p]["exp_avg"] = torch.full_like(opt.state[p]["exp_avg"], 0.5)
            else:
                opt.state[p] = {key: value.clone() if key == "step" else value * 2
                                for key, value in opt.state[p].items()}

    counted, end = _run_windows(monkeypatch, False, between=between)
    with monkeypatch.context() as m:
        _, spec_end = _run_windows(m, True, between=between)
    assert counted.closed >= 4
    _assert_same(end, spec_end)


def _count_builds(monkeypatch) -> list:
    builds = []
    original = window_module.StepTable.build

    def build(opt, win):
        builds.append(1)
        return original(opt, win)

    monkeypatch.setattr(window_module.StepTable, "build", staticmethod(build))
    return builds


def _train_unweighted(monkeypatch, make, off, micro_batches, before_step=None, after_step=None, device="cpu"):
    counted = Counted(monkeypatch, off)
    model = Net().to(device)
    # (on CUDA the extension's backend by name: "auto" may choose Triton there)
    opt = make(model.parameters()) if device == "cpu" else make(model.parameters(), backend="cpp")
    for i, (x, y) in enumerate(_batches(micro_batches)):
        x, y = x.to(device), y.to(device)
        ((model(x) - y) ** 2).mean().backward()
        if before_step is not None:
            before_step(i, model)
        opt.step()
        if after_step is not None:
            after_step(i, model, opt)
    return counted, opt, _state(opt, model)


UNWEIGHTED = {
    "adamw": lambda ps, **kw: accum_fused.AdamW(ps, lr=1e-2, weight_decay=0.1, accumulation_steps=4, **kw),
    "sgd_momentum_clip": lambda ps, **kw: accum_fused.SGD(ps, lr=0.1, momentum=0.9, accumulation_steps=4,
                                                          max_grad_norm=0.5, **kw),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", list(UNWEIGHTED))
def test_a_windows_first_gradients_become_its_buffers_and_go_with_the_window(monkeypatch, case, device):
    """Weight 1, nothing else holding the gradient: the table takes autograd's fp32 gradient as
    the buffer (zero-copy, as the native loop's first micro-batch), and the window lets go of
    it as it ends: between windows only the parameters and the state are held (12 B per fp32
    AdamW parameter, the native loop's after zero_grad). The table outlives the windows (built
    once), and training is bit for bit the Python path's, which copies. On CUDA parameters too
    (the same checks on device memory)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    builds = _count_builds(monkeypatch)
    seen = {}

    def before_step(i, model):
        if i % 4 == 0:
            seen["grads"] = [p.grad.data_ptr() for p in model.parameters()]

    def after_step(i, model, opt):
        win = opt._window
        if i % 4 == 0:
            assert [win.buffers[p].data_ptr() for p in model.parameters()] == seen["grads"]
            assert len(win.adopted) == len(list(model.parameters()))
        if i % 4 == 3:
            assert not win.buffers and not win.adopted and opt.update_count == i // 4 + 1

    counted, opt, end = _train_unweighted(monkeypatch, UNWEIGHTED[case], False, 13, before_step, after_step,
                                          device=device)
    assert len(builds) == 1 and counted.taken == 13 and counted.closed == 3  # (every micro-batch)
    with monkeypatch.context() as m:
        _, _, spec_end = _train_unweighted(m, UNWEIGHTED[case], True, 13, device=device)
    _assert_same(end, spec_end)


def test_a_gradient_held_elsewhere_is_copied_not_adopted(monkeypatch):
    """A gradient someone else can still see -- a reference kept to it, a view of it, a tensor
    on its memory, a gradient with a graph (backward(create_graph=True)) -- is copied into a buffer of its own,
    so that what the window adds later changes no tensor anyone holds; the others are adopted."""
    model_ref = {}
    held = {}

    def before_step(i, model):
        if i == 4:  # the second window's first micro-batch
            held["reference"] = model.body[0].weight.grad
            held["view"] = model.side.weight.grad.view(-1)
            held["storage"] = torch.empty(0).set_(model.body[2].bias.grad.untyped_storage())  # (its memory, no view)
            held["values"] = [held["reference"].clone(), held["view"].clone(), held["storage"].clone()]
            # A weakref to a gradient's storage (a memory tracker's) holds nothing: adopted.
            held["weak"] = weakref.finalize(model.body[2].weight.grad.untyped_storage(), lambda: None)
            model_ref["model"] = model

    def after_step(i, model, opt):
        if i == 4:
            win = opt._window
            assert win.buffers[model.body[0].weight].data_ptr() != held["reference"].data_ptr()
            assert win.buffers[model.side.weight].data_ptr() != held["view"].data_ptr()
            assert win.buffers[model.body[2].bias].data_ptr() != held["storage"].data_ptr()
            assert not {model.body[0].weight, model.side.weight, model.body[2].bias} & win.adopted
            assert model.body[2].weight in win.adopted and held["weak"].alive

    counted, opt, end = _train_unweighted(monkeypatch, UNWEIGHTED["adamw"], False, 9, before_step, after_step)
    assert counted.taken == 9  # (every micro-batch)
    for name, value in zip(("reference", "view", "storage"), held["values"]):
        assert torch.equal(held[name], value), name
    with monkeypatch.context() as m:
        _, _, spec_end = _train_unweighted(m, UNWEIGHTED["adamw"], True, 9)
    _assert_same(end, spec_end)

    # A gradient with a graph: copied (adding into it would change a tensor of the graph).
    model = Net()
    opt = UNWEIGHTED["adamw"](model.parameters())
    ((model(torch.ones(2, 5)) - 1) ** 2).mean().backward(create_graph=True)
    grads = [p.grad for p in model.parameters()]
    del grads  # (no reference left: only the graph makes it not adoptable)
    opt.step()
    assert not opt._window.adopted and len(opt._window.live) == len(list(model.parameters()))


def test_buffers_loaded_mid_window_go_with_the_window_too():
    """A window reopened from a mid-window state_dict holds loaded buffers only it uses: they
    are let go of when it ends, as adopted gradients are (kept, the optimizer would hold 16 B per
    fp32 AdamW parameter between windows for good, and copy into them), and the next windows
    adopt again. Training equals the optimizer that was never saved."""
    models = [Net(), Net()]
    opts = [UNWEIGHTED["adamw"](m.parameters()) for m in models]
    batches = _batches(16)
    for i, (x, y) in enumerate(batches):
        if i == 6:  # mid-window: the second optimizer is rebuilt from the first's checkpoint
            opts[1] = UNWEIGHTED["adamw"](models[1].parameters())
            opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
            assert len(opts[1]._window.live) == len(list(models[1].parameters()))
        for model, opt in zip(models, opts):
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if i % 4 == 3:
                assert not opt._window.buffers and not opt._window.adopted
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p, q)
    assert opts[1]._window.caches.step_table is not None and opts[1].update_count == 4


def test_same_objects_in_the_extension_agrees_with_python(monkeypatch):
    """backends.same_objects (base.py's one check of "the same parameters"): the extension's
    and the Python fallback's answers, on lists and tuples, replaced, appended, missing and
    reordered parameters."""
    from accum_fused import backends
    if backends.extension() is None:
        pytest.skip("the extension does not load here")
    a, b, c = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    wired = (a, b, c)
    cases = {
        "same": ([[a, b], [c]], True), "tuple": ([(a, b), [c]], True), "empty group": ([[a, b, c], []], True),
        "replaced": ([[a, b], [nn.Parameter(torch.zeros(2))]], False), "appended": ([[a, b], [c, a]], False),
        "missing": ([[a, b], []], False), "reordered": ([[b, a], [c]], False), "no groups": ([], False),
    }
    for name, (lists, expected) in cases.items():
        assert backends.same_objects(lists, wired) is expected, name
    monkeypatch.setattr(backends, "extension", lambda: None)
    for name, (lists, expected) in cases.items():
        assert backends.same_objects(lists, wired) is expected, name
