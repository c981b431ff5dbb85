"""GPU paths that no other test runs on CUDA: GradScaler with fp16 autocast on CUDA, and
checkpoints and models moved between devices (CUDA -> CPU, CPU -> CUDA) in the middle of a
window, for every backend that runs CUDA tensors.

The CUDA cases are marked ``cuda`` and skip without a CUDA device (benchmarks/gpu_check.sh runs
them on a GPU machine). The device-to-device tests also run CPU -> CPU, unmarked, so that CI
exercises the test code itself.
"""
from __future__ import annotations

import copy

import pytest
import torch

import accum_fused
from accum_fused import backends

from _helpers import loss_of, make_batches, make_model, save_load

HAS_CUDA = torch.cuda.is_available()
FP32 = dict(rtol=1e-5, atol=1e-6)  # a few roundings apart: CPU and CUDA kernels sum in other orders


def _device_pair(source: str, target: str):
    marks = [pytest.mark.cuda] if "cuda" in (source, target) else []
    return pytest.param(source, target, marks=marks, id=f"{source}-to-{target}")


DEVICE_PAIRS = [_device_pair("cpu", "cpu"), _device_pair("cuda", "cpu"), _device_pair("cpu", "cuda")]


def _require(backend: str, *devices: str) -> None:
    for device in devices:
        if device == "cuda" and not HAS_CUDA:
            pytest.skip("no CUDA device")
        # A kernel backend that does not run this device would hand it to the reference:
        # the case would silently test the reference, so skip it instead.
        if backend != "torch" and backends.resolve(backend, torch.device(device), torch.float32) is backends.reference:
            pytest.skip(f"backend {backend!r} does not run float32 parameters on {device}")


def _adamw(model, backend: str, k: int, **extra):
    return accum_fused.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, amsgrad=True, accumulation_steps=k,
                             backend=backend, **extra)


def _on(batch, device):
    return tuple(t.to(device) for t in batch)


def _assert_close_across(model_a, model_b) -> None:
    for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters()):
        torch.testing.assert_close(a.detach().cpu(), b.detach().cpu(), msg=lambda m: f"{name}: {m}", **FP32)


# ------------------------------------------------------------------------- GradScaler + fp16
@pytest.mark.cuda
def test_grad_scaler_fp16_autocast_on_cuda(backend):
    """The documented AMP loop on CUDA: fp32 parameters, fp16 autocast forward, GradScaler
    ("cuda"), scales changed inside windows and an inf in one micro-batch. The backend skips the
    same window as the reference backend and ends within fp32 roundings of it."""
    _require(backend, "cuda")
    k = 4
    batches = [_on(b, "cuda") for b in make_batches([5, 3, 8, 1, 4, 6, 2, 7, 3, 3, 5, 1], seed=3)]
    new_scales = {2: 2.0**6, 6: 2.0**12, 9: 2.0**9}  # before micro-batch i: a scale change inside a window
    poisoned = 5  # the second window's second micro-batch

    def run(name):
        model = make_model(seed=4, hidden=32).cuda()
        opt = _adamw(model, name, k, max_grad_norm=1.0)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10, growth_interval=2**30)
        updated = []
        for i, batch in enumerate(batches):
            if i in new_scales:
                scaler.update(new_scale=new_scales[i])
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_of(model, batch)
            scaler.scale(loss).backward()
            if i == poisoned:
                with torch.no_grad():
                    model[0].weight.grad[0, 0] = float("inf")
            scaler.step(opt, weight=len(batch[0]))
            scaler.update()
            updated.append(opt.updated)
        return model, opt, updated

    model, opt, updated = run(backend)
    ref_model, ref_opt, ref_updated = run("torch")
    assert updated == ref_updated == [False, False, False, True] + [False] * 4 + [False, False, False, True]
    assert opt.update_count == ref_opt.update_count == 2
    assert all(p.device.type == "cuda" and p.dtype == torch.float32 for p in model.parameters())
    _assert_close_across(model, ref_model)
    assert not any(torch.equal(p, q) for p, q in zip(model.parameters(), make_model(seed=4, hidden=32).cuda().parameters()))


# ------------------------------------------------------------------- checkpoints across devices
def _train(opt, model, batches, device, scaler=None, poison_at=None):
    updated = []
    for i, batch in enumerate(batches):
        x, y = _on(batch, device)
        opt.zero_grad()
        loss = loss_of(model, (x, y))
        (scaler.scale(loss) if scaler else loss).backward()
        if i == poison_at:
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
        if scaler:
            scaler.step(opt, weight=len(x))
            scaler.update()
        else:
            opt.step(weight=len(x))
        updated.append(opt.updated)
    return updated


def _state_devices(opt) -> set[tuple[str, str]]:
    """(key, device type) of every tensor of the optimizer's per-parameter state and open window."""
    found = set()
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                found.add((key, value.device.type))
    for value in opt.state_dict()["accumulation"]["buffers"].values():
        found.add(("accumulation buffer", value.device.type))
    return found


@pytest.mark.parametrize("source,target", DEVICE_PAIRS)
def test_mid_window_checkpoint_resumes_on_another_device(backend, source, target):
    """Saved on one device in the middle of a window (torch.save / torch.load, no map_location),
    loaded into an optimizer whose parameters live on the other: state and buffers move to the
    parameters' device (``step`` stays on the CPU, as torch keeps it), and the resumed run
    matches the uninterrupted one."""
    _require(backend, source, target)
    k = 3
    batches = make_batches([4, 2, 5, 3, 1, 6, 2, 4, 3, 5, 2], seed=11)
    cut = k + 2  # one closed window, then two micro-batches of the next

    model = make_model(seed=2).to(source)
    opt = _adamw(model, backend, k, max_grad_norm=0.5)
    _train(opt, model, batches[:cut], source)
    checkpoint = save_load({"model": model.state_dict(), "opt": opt.state_dict()})
    assert opt.micro_step == 2 and opt.update_count == 1

    resumed_model = make_model(seed=9).to(target)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = _adamw(resumed_model, backend, k, max_grad_norm=0.5)
    resumed.load_state_dict(checkpoint["opt"])
    assert resumed.micro_step == 2 and resumed.update_count == 1
    for key, device in _state_devices(resumed):
        assert device == ("cpu" if key == "step" else target), (key, device)

    rest = _train(opt, model, batches[cut:], source)
    resumed_rest = _train(resumed, resumed_model, batches[cut:], target)
    assert rest == resumed_rest and resumed.update_count == opt.update_count == 3
    assert all(p.device.type == target for p in resumed_model.parameters())
    _assert_close_across(resumed_model, model)


@pytest.mark.parametrize("source,target", DEVICE_PAIRS)
def test_poisoned_window_checkpoint_stays_poisoned_on_another_device(backend, source, target):
    """GradScaler saw an inf in the open window on one device; resumed on the other, the window
    is still skipped, and the next one updates."""
    _require(backend, source, target)
    k = 3
    batches = make_batches([3] * (3 * k), seed=12)
    cut = k + 2

    model = make_model(seed=2).to(source)
    opt = _adamw(model, backend, k)
    scaler = torch.amp.GradScaler(source, init_scale=2.0**8)
    _train(opt, model, batches[:cut], source, scaler, poison_at=k)
    checkpoint = save_load({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict()})

    resumed_model = make_model(seed=9).to(target)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed = _adamw(resumed_model, backend, k)
    resumed.load_state_dict(checkpoint["opt"])
    resumed_scaler = torch.amp.GradScaler(target)
    resumed_scaler.load_state_dict(checkpoint["scaler"])
    updated = _train(resumed, resumed_model, batches[cut:], target, resumed_scaler)
    assert updated == [False] + [False, False, True]  # the poisoned window closes skipped; the next updates
    assert resumed.update_count == 2

    _train(opt, model, batches[cut:], source, scaler)
    _assert_close_across(resumed_model, model)


@pytest.mark.parametrize("source,target", DEVICE_PAIRS)
def test_model_moved_between_devices_mid_window(backend, source, target):
    """``model.to(other device)`` between two micro-batches of a window: the optimizer carries
    its buffers and state along, and ends where a run that never moved ends."""
    _require(backend, source, target)
    k = 3
    batches = make_batches([4, 2, 5, 3, 1, 6, 2, 4, 3], seed=13)
    cut = k + 1

    model = make_model(seed=5).to(source)
    still = copy.deepcopy(model)
    opt, still_opt = _adamw(model, backend, k, max_grad_norm=0.5), _adamw(still, backend, k, max_grad_norm=0.5)
    _train(opt, model, batches[:cut], source)
    model.to(target)  # moves each parameter's data in place: the optimizer keeps the same parameters
    updated = _train(opt, model, batches[cut:], target)
    still_updated = _train(still_opt, still, batches, source)[cut:]
    assert updated == still_updated and opt.update_count == still_opt.update_count == 3
    for key, device in _state_devices(opt):
        assert device == ("cpu" if key == "step" else target), (key, device)
    _assert_close_across(model, still)
