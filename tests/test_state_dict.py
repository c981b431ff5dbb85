"""state_dict: mid-window checkpoints resume bit-exactly; torch.optim checkpoints migrate."""
from __future__ import annotations

import copy

import pytest
import torch

import accum_fused

from _helpers import (
    OPTIMIZERS,
    TORCH_STATE_KEYS,
    all_params,
    assert_params_changed,
    assert_params_close,
    assert_matches_torch,
    assert_params_equal,
    assert_torch_state_equal,
    loss_of,
    make_batches,
    make_model,
    save_load,
    train_accum,
    train_big_batch,
)

CONFIGS = [
    pytest.param("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05), id="SGD-momentum"),
    pytest.param("Adam", dict(lr=0.01, weight_decay=0.1), id="Adam"),
    pytest.param("AdamW", dict(lr=0.01, amsgrad=True, weight_decay=0.1), id="AdamW-amsgrad"),
]
STATE_TENSOR_KEYS = [key for key in TORCH_STATE_KEYS if key != "step"]


def _assert_state_equal(opt_a, opt_b) -> None:
    """Every per-parameter entry of opt.state bit-equal, with equal dtypes."""
    for p_a, p_b in zip(all_params(opt_a), all_params(opt_b)):
        state_a, state_b = opt_a.state[p_a], opt_b.state[p_b]
        assert set(state_a) == set(state_b)
        for key in state_a:
            a, b = state_a[key], state_b[key]
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, key
                assert torch.equal(a, b), key
            else:
                assert a == b, key


def _new(name, hyper, backend, k, dtype=torch.float32, seed=123):
    """A fresh model (different initial weights) and optimizer to load a checkpoint into."""
    model = make_model(seed=seed, dtype=dtype)
    return OPTIMIZERS[name][0](model.parameters(), accumulation_steps=k, backend=backend, **hyper), model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_mid_window_state_dict_layout(backend, name, hyper, dtype):
    """torch's layout ("state" holds only torch's keys), plus "accumulation": the counters and
    the open window's fp32 buffers keyed by parameter index, as "state" is."""
    k = 4
    sizes = [3, 5, 1, 7, 2, 6]
    opt, model = _new(name, hyper, backend, k, dtype=dtype, seed=0)
    train_accum(opt, model, make_batches(sizes, dtype=dtype), weighted=True)  # one window and 2 micro-batches
    sd = opt.state_dict()
    assert {"state", "param_groups", "accumulation"} <= set(sd)
    accumulation = sd["accumulation"]
    assert accumulation["micro_step"] == 2
    assert accumulation["update_count"] == 1
    assert accumulation["weight_sum"] == sizes[4] + sizes[5]
    params = list(model.parameters())
    assert sorted(accumulation["buffers"]) == list(range(len(params)))
    for index, p in enumerate(params):
        entry = sd["state"][index]
        assert not any(key.startswith("accum") for key in entry), sorted(entry)
        for key in STATE_TENSOR_KEYS:
            if key in entry:
                assert entry[key].dtype == torch.float32, key
        buffer = accumulation["buffers"][index]
        assert buffer.dtype == torch.float32 and buffer.shape == p.shape


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_mid_window_checkpoint_resumes_bit_exactly(backend, name, hyper):
    k = 4
    sizes = [3, 5, 1, 7, 2, 6, 4, 4, 1, 1, 9, 2, 3, 3]
    batches = make_batches(sizes)
    opt, model = _new(name, hyper, backend, k, seed=0)
    train_accum(opt, model, batches[:6], weighted=True)  # one window and 2 micro-batches
    assert (opt.update_count, opt.micro_step) == (1, 2)
    sd = opt.state_dict()
    checkpoint = save_load({"model": model.state_dict(), "opt": sd})

    resumed, resumed_model = _new(name, hyper, backend, k)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["opt"])
    assert (resumed.update_count, resumed.micro_step) == (1, 2)
    _assert_state_equal(resumed, opt)

    train_accum(opt, model, batches[6:], weighted=True)
    train_accum(resumed, resumed_model, batches[6:], weighted=True)
    assert opt.update_count == resumed.update_count == 3
    assert opt.micro_step == resumed.micro_step == 2
    assert_params_equal(resumed_model, model)
    _assert_state_equal(resumed, opt)
    assert opt.flush() is True and resumed.flush() is True
    assert_params_equal(resumed_model, model)
    _assert_state_equal(resumed, opt)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_checkpoint_before_first_step_round_trips(backend, name, hyper):
    opt, model = _new(name, hyper, backend, 3, seed=0)
    sd = save_load(opt.state_dict())
    assert sd["accumulation"]["micro_step"] == 0
    assert sd["accumulation"]["update_count"] == 0
    resumed, resumed_model = _new(name, hyper, backend, 3)
    resumed_model.load_state_dict(model.state_dict())
    resumed.load_state_dict(sd)
    batches = make_batches([4] * 6)
    train_accum(opt, model, batches)
    train_accum(resumed, resumed_model, batches)
    assert_params_equal(resumed_model, model)


@pytest.mark.parametrize("name,hyper", CONFIGS + [
    pytest.param("SGD", dict(lr=0.1), id="SGD-plain"),
    pytest.param("AdamW", dict(lr=0.01), id="AdamW"),
])
def test_torch_optim_checkpoint_migrates(backend, name, hyper):
    """A torch.optim state_dict of the same class loads, and k=1 continues exactly like torch."""
    torch_cls = OPTIMIZERS[name][1]
    ref_model = make_model()
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    batches = make_batches([5] * 6)
    for batch in batches[:3]:
        torch_opt.zero_grad()
        loss_of(ref_model, batch).backward()
        torch_opt.step()
    checkpoint = save_load({"model": ref_model.state_dict(), "opt": torch_opt.state_dict()})

    opt, model = _new(name, hyper, backend, 1)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    assert_torch_state_equal(opt, torch_opt)  # loading itself is exact on every backend
    for batch in batches[3:]:
        for o, m in ((opt, model), (torch_opt, ref_model)):
            o.zero_grad()
            loss_of(m, batch).backward()
            o.step()
        assert_matches_torch(opt, model, torch_opt, ref_model, backend)
    assert opt.state_dict()["state"].keys() == torch_opt.state_dict()["state"].keys()


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_torch_optim_checkpoint_migrates_into_accumulation(backend, name, hyper):
    k = 3
    torch_cls = OPTIMIZERS[name][1]
    ref_model = make_model(dtype=torch.float64)
    torch_opt = torch_cls(ref_model.parameters(), **hyper)
    batches = make_batches([4] * (4 * k), dtype=torch.float64)
    train_big_batch(torch_opt, ref_model, batches[: 2 * k], k)
    checkpoint = save_load({"model": ref_model.state_dict(), "opt": torch_opt.state_dict()})

    opt, model = _new(name, hyper, backend, k, dtype=torch.float64)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    train_accum(opt, model, batches[2 * k :])
    train_big_batch(torch_opt, ref_model, batches[2 * k :], k)
    assert_params_close(model, ref_model, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,hyper", [CONFIGS[0], CONFIGS[2]])
def test_bf16_params_keep_fp32_state_through_save_load(backend, name, hyper):
    k = 2
    opt, model = _new(name, hyper, backend, k, dtype=torch.bfloat16, seed=0)
    initial = copy.deepcopy(model)
    batches = make_batches([4] * 9, dtype=torch.bfloat16)
    train_accum(opt, model, batches[:5])  # two windows and one micro-batch
    assert_params_changed(model, initial)

    def check_dtypes(o):
        for p in all_params(o):
            assert p.dtype == torch.bfloat16
            keys = [key for key in STATE_TENSOR_KEYS if key in o.state[p]]
            assert keys
            for key in keys:
                assert o.state[p][key].dtype == torch.float32, key

    check_dtypes(opt)
    sd = opt.state_dict()
    checkpoint = save_load({"model": model.state_dict(), "opt": sd})

    resumed, resumed_model = _new(name, hyper, backend, k, dtype=torch.bfloat16)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["opt"])
    check_dtypes(resumed)
    _assert_state_equal(resumed, opt)

    train_accum(opt, model, batches[5:])
    train_accum(resumed, resumed_model, batches[5:])
    assert opt.update_count == 4
    assert_params_equal(resumed_model, model)
    _assert_state_equal(resumed, opt)



@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_checkpoint_keeps_which_params_are_live(backend, name, hyper):
    """A parameter without a gradient so far in the open window stays "no gradient all window"
    after a resume: it is left alone (no weight decay) when the window closes."""
    ours_cls = OPTIMIZERS[name][0]
    k = 3
    gen = torch.Generator().manual_seed(9)
    init = [torch.randn(n, generator=gen) for n in (4, 3, 5)]
    grads = [[torch.randn(n, generator=gen) for n in (4, 3, 5)] for _ in range(2 * k)]
    # Second window, per micro-batch: the parameters that get a gradient (param 1: none).
    live = {k: (0,), k + 1: (0, 2), k + 2: (0,)}

    def make():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        return params, ours_cls(params, accumulation_steps=k, backend=backend, **hyper)

    def feed(params, opt, indices):
        for j in indices:
            for i, p in enumerate(params):
                p.grad = grads[j][i].clone() if i in live.get(j, (0, 1, 2)) else None
            opt.step()

    params, opt = make()
    feed(params, opt, range(k + 1))
    checkpoint = save_load({"params": [p.detach().clone() for p in params], "opt": opt.state_dict()})
    feed(params, opt, range(k + 1, 2 * k))
    assert opt.update_count == 2
    assert torch.equal(params[1].detach(), checkpoint["params"][1])  # left alone

    resumed_params, resumed = make()
    with torch.no_grad():
        for p, saved in zip(resumed_params, checkpoint["params"]):
            p.copy_(saved)
    resumed.load_state_dict(checkpoint["opt"])
    feed(resumed_params, resumed, range(k + 1, 2 * k))
    assert resumed.update_count == 2
    for a, b in zip(resumed_params, params):
        assert torch.equal(a.detach(), b.detach())
    _assert_state_equal(resumed, opt)


@pytest.mark.parametrize("name,hyper", CONFIGS)
def test_checkpoint_of_poisoned_window_stays_poisoned(backend, name, hyper):
    """GradScaler saw inf in the open window, then a checkpoint: the resumed run still skips it."""
    k = 4
    batches = make_batches([3] * (3 * k))

    def micro_batch(opt, model, scaler, batch, poison=False):
        opt.zero_grad()
        scaler.scale(loss_of(model, batch)).backward()
        if poison:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()

    opt, model = _new(name, hyper, backend, k, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for j, batch in enumerate(batches[: k + 2]):
        micro_batch(opt, model, scaler, batch, poison=(j == k))
    checkpoint = save_load({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})
    for batch in batches[k + 2 :]:
        micro_batch(opt, model, scaler, batch)

    resumed, resumed_model = _new(name, hyper, backend, k)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed.load_state_dict(checkpoint["opt"])
    resumed_scaler = torch.amp.GradScaler("cpu")
    resumed_scaler.load_state_dict(checkpoint["scaler"])
    for j, batch in enumerate(batches[k + 2 :], start=k + 2):
        micro_batch(resumed, resumed_model, resumed_scaler, batch)
        if j == 2 * k - 1:
            assert resumed.updated is False  # the poisoned window is skipped
    assert opt.update_count == resumed.update_count == 2
    assert_params_equal(resumed_model, model)
    _assert_state_equal(resumed, opt)

    ref_opt, ref_model = _new(name, hyper, backend, k, seed=0)
    train_accum(ref_opt, ref_model, batches[:k] + batches[2 * k :])
    assert_params_equal(model, ref_model)


@pytest.mark.parametrize("name,hyper", [CONFIGS[0], CONFIGS[2]])
def test_torch_checkpoint_of_bf16_model_is_widened(backend, name, hyper):
    """torch.optim keeps bf16 state for bf16 parameters; loading it gives fp32 state, same values."""
    ref_model = make_model(dtype=torch.bfloat16)
    torch_opt = OPTIMIZERS[name][1](ref_model.parameters(), **hyper)
    for batch in make_batches([4] * 2, dtype=torch.bfloat16):
        torch_opt.zero_grad()
        loss_of(ref_model, batch).backward()
        torch_opt.step()
    checkpoint = save_load(torch_opt.state_dict())
    opt, model = _new(name, hyper, backend, 2, dtype=torch.bfloat16)
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(checkpoint)
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        ref_state = torch_opt.state[ref_p]
        keys = [key for key in STATE_TENSOR_KEYS if key in ref_state]
        assert keys
        for key in keys:
            assert ref_state[key].dtype == torch.bfloat16
            assert opt.state[p][key].dtype == torch.float32, key
            assert torch.equal(opt.state[p][key], ref_state[key].float()), key
    train_accum(opt, model, make_batches([4] * 2, seed=5, dtype=torch.bfloat16))
    assert opt.update_count == 1
    for p in model.parameters():
        for key in STATE_TENSOR_KEYS:
            if key in opt.state[p]:
                assert opt.state[p][key].dtype == torch.float32, key


# ------------------------------------------- torch.distributed.checkpoint's state_dict API
def test_torch_dcp_state_dict_api_on_a_plain_model():
    """get/set_optimizer_state_dict (torch.distributed.checkpoint.state_dict) work without
    FSDP too. Their zero-gradient "init step" on a stateless optimizer must not count as a
    micro-batch, and since they keep only "state" and "param_groups", an open window must be
    refused rather than silently dropped (FSDP2 optimizers carry it: tests/test_fsdp2.py)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = accum_fused.AdamW(model.parameters(), lr=0.1, accumulation_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    saved = get_optimizer_state_dict(model, opt)  # init step: state created, nothing counted
    assert (opt.micro_step, opt.update_count) == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(int(s["step"]) == 0 for s in opt.state.values())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="window boundary"):
        get_optimizer_state_dict(model, opt)
    assert opt.micro_step == 1
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    saved = get_optimizer_state_dict(model, opt)  # at the boundary
    fresh = accum_fused.AdamW(model.parameters(), lr=0.1, accumulation_steps=2)
    set_optimizer_state_dict(model, fresh, saved)
    assert all(torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in model.parameters())
    assert fresh.micro_step == 0


def test_a_window_pickled_with_flat_records_loads_into_them():
    """A window pickled before its records were grouped (in_backward's pass records, recovery's
    transaction and the fast paths' mirrors as flat fields) loads into the records; the mirrors
    are rebuilt, never carried by a copy."""
    import pickle

    from accum_fused.window import Window

    win = Window()
    win.transaction.parts_left, win.transaction.part_serial, win.passes.owned = 2, 5, True
    win.caches.epoch = 7
    copied = pickle.loads(pickle.dumps(win))
    assert (copied.transaction.parts_left, copied.transaction.part_serial, copied.passes.owned) == (2, 5, True)
    assert copied.caches.epoch == 0 and copied.caches.step_table is None

    flat = {k: v for k, v in Window().__dict__.items() if k not in ("passes", "transaction", "caches")}
    flat.update(parts_left=1, complete=set(), transaction=True, part_serial=3, closings=4, backward_pass=None,
                own_backward=False, backward_owned=True, step_table=None, table_blocked=True, version=9,
                buffers_version=2, update_plan=None, hook_state=None)
    old = Window.__new__(Window)
    old.__setstate__(flat)
    assert (old.transaction.parts_left, old.transaction.active, old.transaction.part_serial,
            old.transaction.closings, old.passes.owned) == (1, True, 3, 4, True)
    assert old.caches.epoch == 0 and not old.caches.table_blocked
    assert not {"parts_left", "transaction_active", "version", "buffers_version", "backward_owned"} & set(vars(old))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name,hyper", CONFIGS + [pytest.param("wrapped", {}, id="GradientAccumulator-Adagrad")])
def test_mid_window_copy_continues_bit_exactly(backend, name, hyper, how):
    """copy.deepcopy((model, opt)) or a pickle round trip in the middle of a plain-mode window
    (EMA/SWA copies, multiprocessing): the copy continues exactly as the original (issue 21,
    row 7: the copy's first step() used to raise AttributeError)."""
    import pickle

    k = 4
    batches = make_batches([3, 5, 1, 7, 2, 6, 4, 4, 1, 1, 9])
    model = make_model(seed=0)
    if name == "wrapped":
        opt = accum_fused.GradientAccumulator(torch.optim.Adagrad(model.parameters(), lr=0.1), k, backend=backend)
    else:
        opt = OPTIMIZERS[name][0](model.parameters(), accumulation_steps=k, backend=backend, **hyper)
    train_accum(opt, model, batches[:6], weighted=True)  # one window and 2 micro-batches
    copied_model, copied = (copy.deepcopy((model, opt)) if how == "deepcopy"
                            else pickle.loads(pickle.dumps((model, opt))))
    assert all_params(copied)[0] is next(copied_model.parameters())  # the copy updates its own model
    for o, m in ((opt, model), (copied, copied_model)):
        train_accum(o, m, batches[6:], weighted=True)
        assert (o.update_count, o.micro_step) == (2, 3)
        assert o.flush() is True
    assert_params_equal(copied_model, model)
    _assert_state_equal(copied, opt)
