"""accumulation_steps=1 (the default) is torch.optim, step for step, bit for bit on CPU."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import accum_fused
from accum_fused.optim import _ADAM_DECOUPLES
from _helpers import (
    OPTIMIZERS,
    TORCH_STATE_KEYS,
    assert_params_changed,
    assert_matches_torch,
    loss_of,
    make_batches,
    make_model,
)

SGD_CASES = {
    "plain": dict(lr=0.1),
    "momentum": dict(lr=0.1, momentum=0.9),
    "momentum-dampening": dict(lr=0.1, momentum=0.9, dampening=0.3),
    "nesterov": dict(lr=0.1, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.1, weight_decay=0.05),
    "momentum-weight_decay": dict(lr=0.1, momentum=0.9, weight_decay=0.05),
    "maximize": dict(lr=0.05, maximize=True),
    "nesterov-weight_decay-maximize": dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.1, maximize=True),
}
ADAM_CASES = {
    "default": dict(),
    "lr": dict(lr=0.01),
    "amsgrad": dict(lr=0.01, amsgrad=True),
    "weight_decay": dict(lr=0.01, weight_decay=0.1),
    "betas-eps": dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6),
    "maximize": dict(lr=0.01, maximize=True),
    "amsgrad-weight_decay-maximize": dict(lr=0.01, amsgrad=True, weight_decay=0.1, maximize=True),
}
CASES = [pytest.param("SGD", hyper, id=f"SGD-{case}") for case, hyper in SGD_CASES.items()] + [
    pytest.param(name, hyper, id=f"{name}-{case}") for name in ("Adam", "AdamW") for case, hyper in ADAM_CASES.items()
] + [pytest.param("Adam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
                  id="Adam-decoupled_weight_decay")]
# One representative configuration per class, for the narrower tests below.
REPRESENTATIVE = [
    pytest.param("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.05), id="SGD"),
    pytest.param("Adam", dict(lr=0.01, amsgrad=True, weight_decay=0.1), id="Adam"),
    pytest.param("AdamW", dict(lr=0.01, amsgrad=True, weight_decay=0.1), id="AdamW"),
]
NUM_STEPS = 5


def _run_both(opt, model, torch_opt, ref_model, batches, backend) -> None:
    """Step both optimizers on the same batches, checking params and state after every step."""
    for n, batch in enumerate(batches, start=1):
        for o, m in ((opt, model), (torch_opt, ref_model)):
            o.zero_grad()
            loss_of(m, batch).backward()
            o.step()
        assert opt.updated is True
        assert opt.micro_step == 0
        assert opt.update_count == n
        assert_matches_torch(opt, model, torch_opt, ref_model, backend)


@pytest.mark.parametrize("name,hyper", CASES)
def test_k1_matches_torch_step_for_step(backend, name, hyper):
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.parameters(), backend=backend, **hyper)
    if hyper.get("decoupled_weight_decay") and not _ADAM_DECOUPLES:  # (torch < 2.7: AdamW is that Adam)
        torch_cls, hyper = torch.optim.AdamW, {k: v for k, v in hyper.items() if k != "decoupled_weight_decay"}
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    _run_both(opt, model, torch_opt, ref_model, make_batches([5] * NUM_STEPS), backend)
    assert_params_changed(model, make_model())


@pytest.mark.parametrize("name,hyper", REPRESENTATIVE)
def test_k1_matches_torch_fp64(backend, name, hyper):
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model(dtype=torch.float64)
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.parameters(), backend=backend, **hyper)
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    _run_both(opt, model, torch_opt, ref_model, make_batches([5] * NUM_STEPS, dtype=torch.float64), backend)
    for p in model.parameters():
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert value.dtype == torch.float64, key


@pytest.mark.parametrize("name,hyper", REPRESENTATIVE)
def test_k1_tensor_lr_matches_torch(backend, name, hyper):
    ours_cls, torch_cls = OPTIMIZERS[name]
    hyper = dict(hyper, lr=torch.tensor(0.02))
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.parameters(), backend=backend, **hyper)
    if hyper.get("decoupled_weight_decay") and not _ADAM_DECOUPLES:  # (torch < 2.7: AdamW is that Adam)
        torch_cls, hyper = torch.optim.AdamW, {k: v for k, v in hyper.items() if k != "decoupled_weight_decay"}
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    _run_both(opt, model, torch_opt, ref_model, make_batches([5] * NUM_STEPS), backend)
    assert_params_changed(model, make_model())


@pytest.mark.parametrize("name,hyper", REPRESENTATIVE)
def test_k1_named_parameters_match_torch(backend, name, hyper):
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.named_parameters(), backend=backend, **hyper)
    torch_opt = torch_cls(ref_model.named_parameters(), **hyper)
    _run_both(opt, model, torch_opt, ref_model, make_batches([5] * 3), backend)
    ours_groups = opt.state_dict()["param_groups"]
    ref_groups = torch_opt.state_dict()["param_groups"]
    assert [g["param_names"] for g in ours_groups] == [g["param_names"] for g in ref_groups]
    assert ours_groups[0]["param_names"] == [name for name, _ in model.named_parameters()]


@pytest.mark.parametrize("flag", [dict(foreach=True), dict(foreach=False), dict(fused=True), dict(fused=False)],
                         ids=["foreach=True", "foreach=False", "fused=True", "fused=False"])
@pytest.mark.parametrize("name,hyper", REPRESENTATIVE)
def test_foreach_and_fused_are_accepted_and_ignored(backend, name, hyper, flag):
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.parameters(), backend=backend, **hyper, **flag)
    torch_opt = torch_cls(ref_model.parameters(), **hyper)  # torch's default (single-tensor) path
    _run_both(opt, model, torch_opt, ref_model, make_batches([5] * 3), backend)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_is_a_torch_optimizer_with_torch_defaults(backend, name):
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model()
    opt = ours_cls(model.parameters(), backend=backend)
    torch_opt = torch_cls(make_model().parameters())
    # (torch < 2.7's AdamW is not an Adam, and cannot be a base beside it: accum_fused.AdamW is an Adam there)
    assert isinstance(opt, torch_cls if _ADAM_DECOUPLES or name != "AdamW" else torch.optim.Adam)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.accumulation_steps == 1
    assert opt.micro_step == 0
    assert opt.update_count == 0
    assert opt.updated is False
    assert opt.last_grad_norm is None
    assert opt._step_supports_amp_scaling is True
    ref_group = torch_opt.param_groups[0]
    ours_group = opt.param_groups[0]
    for key, value in ref_group.items():
        if key in ("params", "foreach", "fused"):
            continue
        assert key in ours_group, key
        assert ours_group[key] == value, key


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_constructor_signature_extends_torch(name):
    """torch's arguments with torch's kinds and defaults, plus six keyword-only additions."""
    ours_cls, torch_cls = OPTIMIZERS[name]
    ours = inspect.signature(ours_cls.__init__).parameters
    ref = inspect.signature(torch_cls.__init__).parameters
    for arg, param in ref.items():
        assert arg in ours, arg
        assert ours[arg].kind == param.kind, arg
        assert ours[arg].default == param.default, arg
    extras = {arg: (p.kind, p.default) for arg, p in ours.items() if arg not in ref}
    expected = {
        "accumulation_steps": (inspect.Parameter.KEYWORD_ONLY, 1),
        "max_grad_norm": (inspect.Parameter.KEYWORD_ONLY, None),
        "backend": (inspect.Parameter.KEYWORD_ONLY, "auto"),
        # (not given: told apart from an explicit None, which group.WORLD is before init_process_group)
        "process_group": (inspect.Parameter.KEYWORD_ONLY, accum_fused.distributed.NOT_GIVEN),
        "in_backward": (inspect.Parameter.KEYWORD_ONLY, False),
        "bf16_update": (inspect.Parameter.KEYWORD_ONLY, "nearest"),
    }
    if name == "Adam" and not _ADAM_DECOUPLES:  # (torch >= 2.7's argument, kept before it too)
        expected["decoupled_weight_decay"] = (inspect.Parameter.KEYWORD_ONLY, False)
    assert extras == expected
    step = inspect.signature(ours_cls.step).parameters
    assert list(step) == ["self", "closure", "weight"]
    assert step["closure"].default is None
    # None: the weight given by set_micro_batch_weight, else 1.0
    assert step["weight"].kind == inspect.Parameter.KEYWORD_ONLY and step["weight"].default is None


@pytest.mark.parametrize("name,hyper", REPRESENTATIVE)
def test_k1_state_dict_layout_matches_torch(backend, name, hyper):
    ours_cls, torch_cls = OPTIMIZERS[name]
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = ours_cls(model.parameters(), backend=backend, **hyper)
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    _run_both(opt, model, torch_opt, ref_model, make_batches([5] * 2), backend)
    ours, ref = opt.state_dict(), torch_opt.state_dict()
    assert set(ours) == set(ref) | {"accumulation"}
    assert isinstance(ours["accumulation"], dict)
    assert ours["accumulation"]["micro_step"] == 0
    assert ours["accumulation"]["update_count"] == 2
    assert ours["state"].keys() == ref["state"].keys()
    for index, ref_state in ref["state"].items():
        # The window is closed: no accumulation entries, exactly torch's per-parameter keys.
        assert set(ours["state"][index]) == set(ref_state), index
        for key in TORCH_STATE_KEYS:
            if key in ref_state:
                a, b = ours["state"][index][key], ref_state[key]
                assert torch.as_tensor(a).dtype == b.dtype, key  # values: checked by _run_both
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in ref["param_groups"]]


def test_available_backends_includes_torch():
    names = accum_fused.available_backends()
    assert isinstance(names, list)
    assert "torch" in names
    assert set(names) <= {"torch", "cpp", "triton"}
