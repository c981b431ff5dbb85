"""Bad input raises the right exception and changes nothing; torch's own validation is kept."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import accum_fused
from _helpers import (
    OPTIMIZERS,
    cpu_skip_reason,
    assert_params_equal,
    assert_unchanged,
    loss_of,
    make_batches,
    make_model,
    snapshot,
    train_accum,
)

NAMES = ["SGD", "Adam", "AdamW"]
HYPER = {"SGD": dict(lr=0.1, momentum=0.9), "Adam": dict(lr=0.01), "AdamW": dict(lr=0.01, amsgrad=True)}


@pytest.mark.parametrize("value,exc", [
    pytest.param(2.0, TypeError, id="float"),
    pytest.param("2", TypeError, id="str"),
    pytest.param(True, TypeError, id="bool"),
    pytest.param(None, TypeError, id="None"),
    pytest.param(0, ValueError, id="zero"),
    pytest.param(-1, ValueError, id="negative"),
])
@pytest.mark.parametrize("name", NAMES)
def test_bad_accumulation_steps(backend, name, value, exc):
    with pytest.raises(exc):
        OPTIMIZERS[name][0](make_model().parameters(), accumulation_steps=value, backend=backend)


@pytest.mark.parametrize("value,exc", [
    pytest.param(0, ValueError, id="zero"),
    pytest.param(-1, ValueError, id="negative"),
    pytest.param(2.5, TypeError, id="float"),
    pytest.param(True, TypeError, id="bool"),
])
@pytest.mark.parametrize("name", NAMES + ["GradientAccumulator"])
def test_accumulation_steps_assigned_later_is_validated_like_the_constructor(name, value, exc):
    """Issue 29 row 10: ``opt.accumulation_steps = 0`` was accepted and behaved as 1."""
    model = make_model()
    if name == "GradientAccumulator":
        opt = accum_fused.GradientAccumulator(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    else:
        opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=2)
    with pytest.raises(exc, match="accumulation_steps"):
        opt.accumulation_steps = value
    assert opt.accumulation_steps == 2
    opt.accumulation_steps = 3  # a valid change is taken, and survives a copy and a pickle round trip
    import copy
    import pickle
    assert copy.deepcopy(opt).accumulation_steps == 3 and pickle.loads(pickle.dumps(opt)).accumulation_steps == 3


@pytest.mark.parametrize("named", [True, False], ids=["named_parameters", "parameters"])
def test_a_shape_changed_mid_window_is_a_value_error_naming_the_parameter(backend, named):
    """Issue 29 row 7: a RuntimeError naming the parameter by index only. ValueError as the docs
    says; by name where the optimizer was given names; nothing changes."""
    model = make_model()
    params = model.named_parameters() if named else model.parameters()
    opt = accum_fused.AdamW(params, lr=0.01, accumulation_steps=3, backend=backend)
    batches = make_batches([2, 3, 2])
    loss_of(model, batches[0]).backward()
    opt.step()
    held = opt.param_groups[0]["params"][-1]  # the last Linear's bias, shape (3,)
    held.data = torch.zeros(5)
    held.grad = torch.ones(5)
    before = snapshot(opt)
    with pytest.raises(ValueError, match=r"changed shape from \(3,\) in the middle of a window") as info:
        opt.step()
    assert ("'2.bias'" in str(info.value)) == named
    assert ("named_parameters" in str(info.value)) == (not named)
    assert_unchanged(opt, before)


@pytest.mark.parametrize("named", [True, False], ids=["named_parameters", "parameters"])
def test_a_shape_changed_between_windows_names_the_parameter(backend, named):
    """Issue 29 row 8: said "the loaded state_dict belongs to another model" though nothing was
    loaded; now the message names the parameter and both causes."""
    model = make_model()
    params = model.named_parameters() if named else model.parameters()
    opt = accum_fused.AdamW(params, lr=0.01, accumulation_steps=1, backend=backend)
    loss_of(model, make_batches([2])[0]).backward()
    opt.step()
    opt.zero_grad()
    held = opt.param_groups[0]["params"][-1]
    held.data = torch.zeros(5)
    held.grad = torch.ones(5)
    with pytest.raises(ValueError, match="changed shape after the optimizer's last update") as info:
        opt.step()
    assert ("'2.bias'" in str(info.value)) == named


@pytest.mark.parametrize("name", NAMES)
def test_a_step_without_any_gradient_warns_once(backend, name):
    """Issue 29 row 11: a stray step(weight=5) diluted the window by 5/9, silently. It still
    counts (the documented meaning), with one warning naming what it did; a step where only some
    parameters have gradients does not warn."""
    model = make_model()
    opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=3, backend=backend, **HYPER[name])
    batches = make_batches([2, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_of(model, batches[0]).backward()
        model[0].weight.grad = None  # some parameters without a gradient: the documented meaning, no warning
        opt.step()
    with pytest.warns(UserWarning, match="counted as a micro-batch of weight 5 with zero gradients"):
        opt.step(weight=5)
    assert opt.micro_step == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimizer
        opt.step()
    assert opt.update_count == 1


@pytest.mark.parametrize("value", [0, -1.0, float("nan")], ids=["zero", "negative", "nan"])
@pytest.mark.parametrize("name", NAMES)
def test_bad_max_grad_norm(backend, name, value):
    with pytest.raises(ValueError):
        OPTIMIZERS[name][0](make_model().parameters(), max_grad_norm=value, backend=backend)


@pytest.mark.parametrize("name,flag", [
    pytest.param("SGD", "differentiable", id="SGD-differentiable"),
    pytest.param("Adam", "capturable", id="Adam-capturable"),
    pytest.param("Adam", "differentiable", id="Adam-differentiable"),
    pytest.param("AdamW", "capturable", id="AdamW-capturable"),
    pytest.param("AdamW", "differentiable", id="AdamW-differentiable"),
])
def test_unsupported_torch_flags(backend, name, flag):
    with pytest.raises(NotImplementedError):
        OPTIMIZERS[name][0](make_model().parameters(), backend=backend, **{flag: True})


def test_sgd_has_no_capturable_argument_like_torch(backend):
    with pytest.raises(TypeError):
        torch.optim.SGD(make_model().parameters(), capturable=True)
    with pytest.raises(TypeError):
        accum_fused.SGD(make_model().parameters(), capturable=True, backend=backend)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_torch_flags_set_to_false_are_accepted(backend, name):
    from accum_fused.optim import _ADAM_DECOUPLES
    opt = OPTIMIZERS[name][0](make_model().parameters(), capturable=False, differentiable=False, backend=backend)
    # Before torch 2.7 torch's AdamW is no Adam, and ours is a torch.optim.Adam (README "Set up").
    assert isinstance(opt, OPTIMIZERS[name][1] if _ADAM_DECOUPLES or name == "Adam" else torch.optim.Adam)


BAD_WEIGHTS = [
    pytest.param(0, ValueError, id="zero"),
    pytest.param(0.0, ValueError, id="zero-float"),
    pytest.param(-1.0, ValueError, id="negative"),
    pytest.param(float("nan"), ValueError, id="nan"),
    pytest.param(float("inf"), ValueError, id="inf"),
    pytest.param(float("-inf"), ValueError, id="minus-inf"),
    pytest.param("a", TypeError, id="str"),
    pytest.param([1.0], TypeError, id="list"),
]


@pytest.mark.parametrize("weight,exc", BAD_WEIGHTS)
@pytest.mark.parametrize("position", [0, 2], ids=["opening-micro-batch", "closing-micro-batch"])
@pytest.mark.parametrize("name", NAMES)
def test_bad_weight_raises_and_changes_nothing(backend, name, position, weight, exc):
    k = 3
    batches = make_batches([3] * k)
    model = make_model()
    opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=k, backend=backend, **HYPER[name])
    train_accum(opt, model, batches[:position])
    opt.zero_grad()
    loss_of(model, batches[position]).backward()
    before = snapshot(opt)
    with pytest.raises(exc):
        opt.step(weight=weight)
    assert_unchanged(opt, before)
    # The failed call accumulated nothing: retrying with a valid weight gives the clean result.
    opt.step()
    train_accum(opt, model, batches[position + 1 :])
    assert opt.update_count == 1

    ref_model = make_model()
    ref = OPTIMIZERS[name][0](ref_model.parameters(), accumulation_steps=k, backend=backend, **HYPER[name])
    train_accum(ref, ref_model, batches)
    assert_params_equal(model, ref_model)


@pytest.mark.parametrize("name", NAMES)
def test_weight_is_keyword_only(backend, name):
    model = make_model()
    opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=2, backend=backend, **HYPER[name])
    loss_of(model, make_batches([2])[0]).backward()
    before = snapshot(opt)
    with pytest.raises(TypeError):
        opt.step(None, 2.0)
    assert_unchanged(opt, before)


class _SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, sparse=True)
        self.lin = nn.Linear(4, 2)

    def dense_loss(self, x):
        return self.lin(x).pow(2).mean()

    def sparse_loss(self, idx):
        return self.lin(self.emb(idx)).pow(2).mean()


@pytest.mark.parametrize("name", NAMES)
def test_sparse_gradients_raise_and_change_nothing(backend, name):
    model = _SparseModel()
    opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=2, backend=backend, **HYPER[name])
    opt.zero_grad()
    model.sparse_loss(torch.tensor([1, 3, 3])).backward()
    assert model.emb.weight.grad.is_sparse
    before = snapshot(opt)
    with pytest.raises(RuntimeError):
        opt.step()
    assert_unchanged(opt, before)

    # Mid-window: the dense micro-batch already accumulated stays as it was.
    opt.zero_grad()
    model.dense_loss(torch.ones(5, 4)).backward()
    assert model.emb.weight.grad is None
    opt.step()
    assert opt.micro_step == 1
    opt.zero_grad()
    model.sparse_loss(torch.tensor([0, 2])).backward()
    before = snapshot(opt)
    with pytest.raises(RuntimeError):
        opt.step()
    assert_unchanged(opt, before)


@pytest.mark.parametrize("name", ["unknown", "", "TORCH", "reference", "cuda"])
def test_unknown_backend_name(name):
    with pytest.raises(ValueError):
        accum_fused.SGD(make_model().parameters(), lr=0.1, backend=name)


@pytest.mark.parametrize("name", ["cpp", "triton"])
def test_known_backend_name(name):
    if name in accum_fused.available_backends():
        opt = accum_fused.SGD(make_model().parameters(), lr=0.1, backend=name)
        assert isinstance(opt, torch.optim.SGD)
    else:
        with pytest.raises(RuntimeError):
            accum_fused.SGD(make_model().parameters(), lr=0.1, backend=name)


@pytest.mark.parametrize("name", ["torch", "auto"])
@pytest.mark.parametrize("cls", NAMES)
def test_always_available_backend_names(name, cls):
    model = make_model()
    opt = OPTIMIZERS[cls][0](model.parameters(), backend=name, **HYPER[cls])
    train_accum(opt, model, make_batches([2]))
    assert opt.update_count == 1


def _params():
    return list(make_model().parameters())


def _shared_param_groups():
    params = _params()
    return [{"params": params[:2]}, {"params": params[1:]}]


def _non_leaf():
    return [make_model()[0].weight * 2]


# (id, class name, params factory, kwargs): torch raises for each.
TORCH_ERRORS = [
    ("lr-negative", "SGD", _params, dict(lr=-0.1)),
    ("momentum-negative", "SGD", _params, dict(lr=0.1, momentum=-0.5)),
    ("weight_decay-negative", "SGD", _params, dict(lr=0.1, weight_decay=-1.0)),
    ("nesterov-without-momentum", "SGD", _params, dict(lr=0.1, nesterov=True)),
    ("nesterov-with-dampening", "SGD", _params, dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True)),
] + [
    case
    for name in ("Adam", "AdamW")
    for case in [
        ("lr-negative", name, _params, dict(lr=-0.1)),
        ("eps-negative", name, _params, dict(eps=-1e-8)),
        ("beta1-one", name, _params, dict(betas=(1.0, 0.999))),
        ("beta2-negative", name, _params, dict(betas=(0.9, -0.1))),
        ("weight_decay-negative", name, _params, dict(weight_decay=-0.1)),
    ]
] + [
    case
    for name in NAMES
    for case in [
        ("single-tensor", name, lambda: make_model()[0].weight, dict(lr=0.1)),
        ("empty", name, lambda: [], dict(lr=0.1)),
        ("param-in-two-groups", name, _shared_param_groups, dict(lr=0.1)),
        ("tensor-lr-2-elements", name, _params, dict(lr=torch.tensor([0.1, 0.2]))),
        ("non-tensor-param", name, lambda: [1.0], dict(lr=0.1)),
        ("non-leaf-param", name, _non_leaf, dict(lr=0.1)),
    ]
]


@pytest.mark.parametrize("make_params,kwargs,name", [
    pytest.param(make_params, kwargs, name, id=f"{name}-{case}") for case, name, make_params, kwargs in TORCH_ERRORS
])
def test_torch_validation_parity(backend, name, make_params, kwargs):
    ours_cls, torch_cls = OPTIMIZERS[name]
    with pytest.raises(Exception) as torch_err:
        torch_cls(make_params(), **kwargs)
    with pytest.raises(Exception) as ours_err:
        ours_cls(make_params(), backend=backend, **kwargs)
    assert type(ours_err.value) is type(torch_err.value)
    assert str(ours_err.value) == str(torch_err.value)


@pytest.mark.parametrize("name", NAMES)
def test_duplicate_parameters_warn_like_torch(backend, name):
    ours_cls, torch_cls = OPTIMIZERS[name]

    def messages(factory):
        p = nn.Parameter(torch.ones(3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            factory([p, p])
        return [(m.category, str(m.message)) for m in caught if "duplicate" in str(m.message)]

    ref = messages(lambda params: torch_cls(params, lr=0.1))
    assert ref  # torch warns
    assert messages(lambda params: ours_cls(params, lr=0.1, backend=backend)) == ref


@pytest.mark.parametrize("make", [
    lambda ps, **kw: accum_fused.SGD(ps, lr=0.1, **kw),
    lambda ps, **kw: accum_fused.Adam(ps, **kw),
    lambda ps, **kw: accum_fused.AdamW(ps, **kw),
    lambda ps, **kw: accum_fused.GradientAccumulator(torch.optim.SGD(ps, lr=0.1), 2, **kw),
], ids=["SGD", "Adam", "AdamW", "GradientAccumulator"])
def test_group_world_read_before_init_process_group_is_refused(monkeypatch, make):
    """process_group=torch.distributed.group.WORLD before init_process_group() is None: in a job
    a launcher started on several ranks (WORLD_SIZE > 1) it is refused with the listed message
    (issue 44 row 3: it trained every rank alone, silently). No argument, and None in a
    single-process job, still mean no group."""
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"process_group was given but torch.distributed is not initialized: "
                                           r"process_group=None in a job launched on WORLD_SIZE=2 ranks"):
        make([nn.Parameter(torch.ones(3))], process_group=torch.distributed.group.WORLD)
    assert make([nn.Parameter(torch.ones(3))]).process_group is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert make([nn.Parameter(torch.ones(3))], process_group=None).process_group is None
    monkeypatch.delenv("WORLD_SIZE")
    assert make([nn.Parameter(torch.ones(3))], process_group=None).process_group is None


def test_the_bf16_update_message_is_the_one_the_page_quotes():
    """The page quotes it with its values (issue 44 row 4): the message is exactly that text."""
    import os
    import re
    quoted = "bf16_update must be one of ('nearest', 'stochastic', 'kahan'), got 'round'"
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "troubleshooting.md")) as f:
        assert quoted in " ".join(f.read().split())
    with pytest.raises(ValueError, match="^" + re.escape(quoted) + "$"):
        accum_fused.AdamW([nn.Parameter(torch.ones(2))], bf16_update="round")


def _resize_rig(backend, mode, hold_graph=False, use_opt_backward=True):
    """A model, a parameter ``extra`` to resize, their AdamW (k=2; mode A: k=1) and a micro-batch
    step ``micro_batch(batch, closing)``. ``hold_graph``: each micro-batch's loss, and so its
    graph, lives on through the next one's forward (a loop's ``loss = ...`` rebinding; ``held``
    holds it). ``use_opt_backward``: mode A's passes through opt.backward (else loss.backward())."""
    model = make_model()
    extra = nn.Parameter(torch.ones(3))
    opt = accum_fused.AdamW([*model.named_parameters(), ("extra", extra)], lr=0.01,
                            accumulation_steps=1 if mode == "A" else 2, in_backward=mode != "plain", backend=backend)
    held = []

    def micro_batch(batch, closing):
        loss = loss_of(model, batch) + extra.square().sum()
        held[:] = [loss] if hold_graph else []
        if mode == "B" or (mode == "A" and use_opt_backward):
            opt.backward(loss)
        else:
            loss.backward()
        if mode == "plain" or (mode == "A" and closing):
            opt.step()
            opt.zero_grad()

    return model, extra, opt, micro_batch, held


def _resized_between_windows(backend, mode, hold_graph=False):
    """Two windows, then a parameter resized (``.data =``) and the micro-batches of a third:
    (the calls made up to the one that raised, its type and message, the parameters before it);
    mode A through loss.backward()."""
    model, extra, _, step, _ = _resize_rig(backend, mode, hold_graph, use_opt_backward=False)
    calls = 0

    def micro_batch(batch, closing):
        nonlocal calls
        calls += 1
        step(batch, closing)

    for i, batch in enumerate(make_batches([2, 3, 2, 3])):
        micro_batch(batch, i % 2 == 1)
    extra.data = torch.ones(5)
    before = [p.detach().clone() for p in [*model.parameters(), extra]]
    try:
        for i, batch in enumerate(make_batches([2, 3, 2, 3])):
            micro_batch(batch, i % 2 == 1)
    except Exception as exc:  # noqa: BLE001 (compared below)
        return calls, type(exc), str(exc), before, [*model.parameters(), extra]
    pytest.fail(f"{backend}, mode {mode}: a parameter resized between windows was not refused")


@pytest.mark.parametrize("mode", ["plain", "A", "B"])
def test_a_shape_changed_between_windows_is_refused_by_every_path_as_the_spec_does(backend, mode):
    """Issue 44 row 5: the step table's closing plan kept a conformed state from before the
    resize, and the kernel said "exp_avgs[3] must have the shape of buffers[3]". Every backend
    (step table, closing plan, C++ hooks included) refuses at the same call as the reference
    backend's Python path, with its message, and the failed call updates no parameter."""
    expected = _resized_between_windows("torch", mode)
    calls, kind, message, before, params = _resized_between_windows(backend, mode)
    assert (calls, kind, message) == expected[:3]
    assert kind is ValueError and "'extra'" in message and "changed shape" in message
    for old, new in zip(before, params):
        assert torch.equal(old, new.detach())


@pytest.mark.parametrize("mode", ["plain", "A", "B"])
def test_a_resize_while_the_last_graph_lives_is_refused_as_torch_refuses_it(backend, mode):
    """The last micro-batch's graph still alive through the resized parameter's next forward:
    that forward uses the parameter's old accumulator node (torch gives it a new one on a new
    dtype or device, not a new shape), and autograd refuses the gradient itself, before any hook,
    whichever backend or mode: the same refusal as the reference backend's, nothing updated."""
    expected = _resized_between_windows("torch", mode, hold_graph=True)
    calls, kind, message, before, params = _resized_between_windows(backend, mode, hold_graph=True)
    assert (calls, kind, message) == expected[:3]
    assert kind is RuntimeError and "expected shape compatible with [3]" in message
    for old, new in zip(before, params):
        assert torch.equal(old, new.detach())


@pytest.mark.parametrize("mode", ["plain", "A", "B"])
def test_a_resize_before_the_first_backward_trains_as_the_spec_does(backend, mode, tolerances):
    """A parameter resized after the optimizer was built, before any gradient: nothing of it is
    held yet (no buffer, no state), and the reference backend trains it at its new shape. So do
    the others: the extension's hooks kept an accumulator node from construction on, whose old
    shape made autograd refuse the first gradient (issue 44 row 5)."""
    def run(backend):
        model = make_model()
        extra = nn.Parameter(torch.ones(3))
        opt = accum_fused.AdamW([*model.parameters(), extra], lr=0.01, accumulation_steps=1 if mode == "A" else 2,
                                in_backward=mode != "plain", backend=backend)
        extra.data = torch.ones(5)
        for i, batch in enumerate(make_batches([2, 3, 2, 3])):
            loss = loss_of(model, batch) + extra.square().sum()
            if mode == "B":
                opt.backward(loss)
                continue
            loss.backward()
            if mode == "plain" or i % 2 == 1:
                opt.step()
                opt.zero_grad()
        assert opt.update_count == 2 and extra.shape == (5,)
        return [p.detach().clone() for p in [*model.parameters(), extra]]
    rtol, atol = tolerances[torch.float32]
    for ours, spec in zip(run(backend), run("torch")):
        torch.testing.assert_close(ours, spec, rtol=rtol, atol=atol)


def _resized_mid_window(backend, mode, restore, use_opt_backward=True, hold_graph=False):
    """One window (k=2), then the next window's first micro-batch, ``extra`` resized
    (``.data =``) and its second. Returns (the type and message the second raised, or None; the
    parameters after the run). ``restore``: the old data put back after the refusal and the micro-batch run again,
    then one more window: a refused call that changed nothing trains on as the run never
    resized. ``use_opt_backward``: mode A's passes through opt.backward (else loss.backward())."""
    model, extra, opt, micro_batch, held = _resize_rig(backend, mode, hold_graph, use_opt_backward)
    batches = make_batches([2, 3, 2, 3, 2, 3])
    for i, batch in enumerate(batches[:3]):
        micro_batch(batch, i % 2 == 1)
    raised = None
    if restore is not None:
        kept = extra.data
        extra.data = torch.ones(5)
        try:
            micro_batch(batches[3], True)
        except Exception as exc:  # noqa: BLE001 (compared by the callers)
            raised = (type(exc), str(exc))  # (not the exception: its traceback holds the graph)
        extra.data = kept
        held.clear()
        if mode == "plain":
            opt.zero_grad()  # the refused micro-batch's .grad, of the new shape (the window keeps its sums)
    if restore is not False:
        for i, batch in enumerate(batches[3:], start=3):
            micro_batch(batch, i % 2 == 1)
        assert opt.update_count == 3
    return raised, [p.detach().clone() for p in [*model.parameters(), extra]]


@pytest.mark.parametrize("mode", ["plain", "A", "B"])
@pytest.mark.parametrize("hold_graph", [False, True], ids=["graph-freed", "graph-held"])
def test_a_shape_changed_mid_window_is_refused_before_anything_changes_on_every_backend(backend, mode, hold_graph):
    """Issue 44 row 5, in the middle of a window: on the cpp backend modes A and B met autograd's
    shape error (the extension keeps each parameter's accumulator node through the window, and
    torch gives a parameter a new node for a new dtype or device, not a new shape); the reference
    backend refused inside the pass, after other gradients were added (mode B: updates begun on
    the window's last micro-batch). opt.backward now refuses before its pass on every backend
    with the window's ValueError, and plain mode at step() as before: nothing changes, and the
    run, given its old data back, trains on bit for bit as if nothing had happened."""
    raised, _ = _resized_mid_window("torch", mode, restore=False, hold_graph=hold_graph)
    ours, _ = _resized_mid_window(backend, mode, restore=False, hold_graph=hold_graph)
    assert ours == raised
    if mode == "plain" and hold_graph:  # (no call of ours before backward: autograd's own, as without accum_fused)
        assert raised[0] is RuntimeError and "expected shape compatible with [3]" in raised[1]
        return
    assert raised[0] is ValueError and "'extra'" in raised[1] and "in the middle of a window" in raised[1]
    _, uninterrupted = _resized_mid_window(backend, mode, restore=None)
    _, resumed = _resized_mid_window(backend, mode, restore=True, hold_graph=hold_graph)
    for a, b in zip(uninterrupted, resumed):
        assert torch.equal(a, b)


def test_a_loss_backward_after_a_mid_window_resize_meets_autograds_refusal_on_cpp():
    """Mode A through a plain ``loss.backward()`` gives the optimizer no call before the pass:
    the reference backend's hook refuses with the window's ValueError, the cpp backend's kept
    accumulator node gets autograd's own error first (as a graph holding the parameter would
    without accum_fused). Both refuse; troubleshooting.md names both messages."""
    import os

    if cpu_skip_reason("cpp"):
        pytest.skip(cpu_skip_reason("cpp"))
    spec, _ = _resized_mid_window("torch", "A", restore=False, use_opt_backward=False)
    ours, _ = _resized_mid_window("cpp", "A", restore=False, use_opt_backward=False)
    assert spec[0] is ValueError and "in the middle of a window" in spec[1]
    assert ours[0] is RuntimeError and "expected shape compatible with [3]" in ours[1]
    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "troubleshooting.md")) as f:
        page = " ".join(f.read().split())
    assert "returned an invalid gradient at index" in page and "in the middle of a window" in page
