"""bf16_update: how SGD/Adam/AdamW write bf16 parameters ("nearest", "stochastic", "kahan").

The reference backend is the spec (its stochastic bits are a hash of each element's memory
offset and the tensor's key, so every backend draws the same bits); kernels are compared with it
on the same inputs, odd sizes, fused and unfused last micro-batches. The rounding modes are
checked for what they are for (unbiased; no stall where nearest stalls; Kahan tracks fp32), and
the option through the optimizers: plain and in-backward modes alike, checkpoints, copies,
validation."""
from __future__ import annotations

import copy

import pytest
import torch

import accum_fused
from accum_fused.backends import _load, reference

from _helpers import cpu_skip_reason, ulp_distance

SIZES = [0, 1, 3, 4097, 70003]


@pytest.fixture(params=["cpp", "triton"])
def kernel(request):
    reason = cpu_skip_reason(request.param)  # these cases run on CPU tensors
    if reason:
        pytest.skip(reason)
    return _load(request.param)


def _inputs(sizes, seed, fold):
    gen = torch.Generator().manual_seed(seed)
    params = [(torch.randn(n, generator=gen) * 3).to(torch.bfloat16) for n in sizes]
    buffers = [torch.randn(n, generator=gen) for n in sizes]
    grads = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes] if fold else None
    comps = [(torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16) for n in sizes]
    keys = torch.randint(0, 2**32, (len(sizes),), generator=gen).tolist()
    state = [torch.randn(n, generator=gen).abs() for n in sizes]
    return params, buffers, grads, comps, keys, state


def _call(backend, kind, mode, inputs, **extra):
    params, buffers, grads, comps, keys, state = inputs
    rounding = dict(bf16_update=mode, rounding_keys=keys if mode == "stochastic" else None,
                    compensations=comps if mode == "kahan" else None)
    window = dict(weight_sum=3.0, clip_coef=None, grads=grads, weight=1.5, overwrite=False, **rounding, **extra)
    if kind == "sgd":
        backend.sgd_update(params=params, buffers=buffers, momentum_buffers=list(state), lr=0.05, momentum=0.9,
                           dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False, **window)
    else:
        backend.adam_update(params=params, buffers=buffers, exp_avgs=[s.clone() * 0.1 for s in state],
                            exp_avg_sqs=list(state), max_exp_avg_sqs=[], step=3, lr=0.01, beta1=0.9, beta2=0.999,
                            eps=1e-8, weight_decay=0.1, amsgrad=False, maximize=False,
                            decoupled_weight_decay=kind == "adamw", **window)
    return params, comps


@pytest.mark.parametrize("fold", [False, True], ids=["buffers", "fused_last"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("mode", ["nearest", "stochastic", "kahan"])
def test_kernels_match_the_reference(kernel, mode, kind, fold):
    ref = _call(reference, kind, mode, _inputs(SIZES, 0, fold))
    out = _call(kernel, kind, mode, _inputs(SIZES, 0, fold))
    for (r_params, r_comps), (o_params, o_comps) in [(ref, out)]:
        for r, o in zip(r_params + r_comps, o_params + o_comps):
            if kind == "sgd":
                assert torch.equal(r, o)  # the same fp32 arithmetic and the same random bits
            else:
                # Adam's CPU kernels take an IEEE square root where torch's is within 1 ulp
                # (math.h): the fp32 result may differ by an ulp, so a rounded bit may too.
                assert ulp_distance(r, o).max().item() <= 1 if r.numel() else True
                assert (r != o).float().mean().item() < 1e-3 if r.numel() else True


def test_stochastic_rounding_is_unbiased():
    ulp = 2.0**-7  # at 1.0
    for fraction in (0.1, 0.5, 0.93):
        x = torch.full((1 << 16,), 1.0 + fraction * ulp)
        rounded = reference._stochastic_bf16(x, key=12345).float()
        assert set(rounded.unique().tolist()) == {1.0, 1.0 + ulp}
        mean_fraction = ((rounded - 1.0) / ulp).mean().item()
        assert abs(mean_fraction - fraction) < 4 * (fraction * (1 - fraction) / x.numel()) ** 0.5 + 1e-4
    # Exact values, infinities and NaN are kept; other keys draw other bits.
    special = torch.tensor([1.0, -2.5, float("inf"), float("-inf"), float("nan"), 0.0])
    kept = reference._stochastic_bf16(special, key=7).float()
    assert torch.equal(kept[:4], special[:4]) and kept[4].isnan() and kept[5] == 0
    x = torch.full((4096,), 1.0 + 0.5 * ulp)
    assert not torch.equal(reference._stochastic_bf16(x, 1), reference._stochastic_bf16(x, 2))


def _train(mode, backend, steps=400, lr=1e-4, in_backward=False, k=2, opt_cls=accum_fused.SGD):
    """Updates far below half a bf16 ulp of the weights (|w| ~ 1, ulp/2 = 2**-8): the fp32 truth
    moves by steps * lr."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(8192, dtype=torch.bfloat16))
    opt = opt_cls([p], lr=lr, accumulation_steps=k, backend=backend, bf16_update=mode, in_backward=in_backward)
    for _ in range(steps * k):
        loss = p.float().sum()  # gradient 1 everywhere
        if in_backward:
            opt.backward(loss)
        else:
            loss.backward()
            opt.step()
    return p, opt


def test_nearest_stalls_stochastic_and_kahan_do_not(backend):
    truth = 1.0 - 400 * 1e-4
    nearest, _ = _train("nearest", backend)
    assert torch.all(nearest == 1.0)  # every update was rounded away
    stochastic, _ = _train("stochastic", backend)
    assert abs(stochastic.float().mean().item() - truth) < 1e-3  # unbiased: the mean tracks the truth
    kahan, opt = _train("kahan", backend)
    high = kahan.float() + opt.state[kahan]["bf16_compensation"].float()
    # c is bf16 too: its own rounding (~2**-17 per update here) leaves p + c within 1% of the
    # distance moved (measured 2.4e-4 of 0.04), where nearest loses all of it.
    torch.testing.assert_close(high, torch.full_like(high, truth), rtol=0, atol=4e-4)
    assert torch.all((kahan.float() - truth).abs() <= 2.0**-8)  # p itself: the nearest bf16 to p + c


def test_in_backward_modes_match_the_plain_mode(backend):
    # (on every backend: it used cpp alone, without the skip, and failed without the extension)
    for mode in ("stochastic", "kahan"):
        for opt_cls in (accum_fused.SGD, accum_fused.AdamW):
            plain, _ = _train(mode, backend, steps=20, lr=1e-3, opt_cls=opt_cls)
            mode_b, _ = _train(mode, backend, steps=20, lr=1e-3, in_backward=True, opt_cls=opt_cls)
            mode_a, _ = _train(mode, backend, steps=20, lr=1e-3, in_backward=True, k=1, opt_cls=opt_cls)
            assert torch.equal(plain, mode_b), (mode, opt_cls)
            assert not torch.equal(plain, mode_a)  # (k=1: another window length, another run)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _run(opt, model, steps, start=0):
    for i in range(start, start + steps):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(i), dtype=torch.bfloat16)
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("mode", ["stochastic", "kahan"])
@pytest.mark.parametrize("opt_cls", [accum_fused.SGD, accum_fused.Adam])
def test_checkpoints_and_copies_continue_exactly(mode, opt_cls):
    torch.manual_seed(0)
    model = _Net().to(torch.bfloat16)
    opt = opt_cls(model.parameters(), lr=1e-3, accumulation_steps=2, bf16_update=mode)
    _run(opt, model, 5)  # two updates and a half window
    key = "bf16_rounding_seed" if mode == "stochastic" else "bf16_compensation"
    saved = copy.deepcopy(opt.state_dict())
    assert all(key in s for s in saved["state"].values())
    assert all(g["bf16_update"] == mode for g in saved["param_groups"])
    resumed_model = copy.deepcopy(model)
    resumed = opt_cls(resumed_model.parameters(), lr=1e-3, accumulation_steps=2)  # the saved mode wins
    resumed.load_state_dict(saved)
    copied_model, copied = copy.deepcopy((model, opt))
    for o, m in ((opt, model), (resumed, resumed_model), (copied, copied_model)):
        _run(o, m, 7, start=5)
    for p, q, r in zip(model.parameters(), resumed_model.parameters(), copied_model.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)


def test_a_torch_state_dict_keeps_the_constructors_mode():
    model = _Net().to(torch.bfloat16)
    native = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = accum_fused.SGD(model.parameters(), lr=0.1, bf16_update="kahan")
    opt.load_state_dict(native.state_dict())
    assert all(g["bf16_update"] == "kahan" for g in opt.param_groups)


def test_other_dtypes_are_written_as_before(backend):
    torch.manual_seed(0)
    results = []
    for mode in ("nearest", "kahan", "stochastic"):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 999))
        opt = accum_fused.AdamW([p], lr=1e-3, backend=backend, bf16_update=mode)
        for _ in range(3):
            p.grad = torch.cos(p.detach() * 3)
            opt.step()
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}  # no rounding state for fp32
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_misuse_is_refused_before_anything_changes():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"bf16_update must be one of \('nearest', 'stochastic', 'kahan'\)"):
        accum_fused.AdamW([p], bf16_update="round")
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16 parameters"):
        accum_fused.SGD([half], lr=0.1, bf16_update="stochastic")
    opt = accum_fused.SGD([p], lr=0.1, bf16_update="kahan")
    groups = [{**g, "params": list(g["params"])} for g in opt.param_groups]
    with pytest.raises(ValueError, match="float16 parameters"):
        opt.add_param_group({"params": [half]})  # the optimizer's default applies to the new group
    with pytest.raises(ValueError, match="must be one of"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "bf16_update": "up"})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"][0] is p
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == {
        k: v for k, v in groups[0].items() if k != "params"}
    opt.add_param_group({"params": [half], "bf16_update": "nearest"})  # per group: fine
    with pytest.raises(TypeError):
        accum_fused.GradientAccumulator(torch.optim.SGD([p], lr=0.1), bf16_update="kahan")


def test_stochastic_bits_do_not_depend_on_torchs_generator():
    # Replicas on ranks seeded apart (seed + rank, a common recipe for data order) must round
    # alike: identical gradients must give identical parameters on every rank.
    runs = []
    for rank_seed in (0, 1):
        torch.manual_seed(rank_seed)
        p = torch.nn.Parameter(torch.full((4097,), 1.0, dtype=torch.bfloat16))
        opt = accum_fused.AdamW([p], lr=1e-4, bf16_update="stochastic")
        for _ in range(5):
            p.grad = torch.ones_like(p)
            opt.step()
        runs.append((p.detach().clone(), opt.state[p]["bf16_rounding_seed"].item()))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert 0 < (runs[0][0] != 1.0).sum() < p.numel()  # (the bits are random across elements)
