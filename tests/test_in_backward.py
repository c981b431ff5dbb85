"""in_backward=True (issue 12): gradients taken into the window inside backward, no .grad held.

Mode A (accumulation_steps=1): the loop owns the window, as with torch.optim; compared with
torch.optim on the same loop. Mode B (accumulation_steps=k): opt.backward(loss, weight=) per
micro-batch, the update applied in the k-th backward; compared with the plain mode on the same
data and weights (bit-exact on the reference backend).
"""
from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
from torch import nn

import accum_fused

from _helpers import (KERNEL_VS_TORCH_TOLERANCE, OPTIMIZERS, assert_matches_torch, assert_params_changed,
                      assert_params_close, assert_params_equal, assert_unchanged, loss_of, make_batches, make_model,
                      save_load, snapshot)

CONFIGS = {
    "SGD": [dict(lr=0.1), dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
            dict(lr=0.1, momentum=0.9, dampening=0.3, maximize=True)],
    "Adam": [dict(lr=0.01), dict(lr=0.01, amsgrad=True, weight_decay=0.1), dict(lr=0.01, maximize=True)],
    "AdamW": [dict(lr=0.01), dict(lr=0.01, amsgrad=True, weight_decay=0.1, betas=(0.8, 0.99))],
}
CASES = [pytest.param(name, i, id=f"{name}-{i}") for name, configs in CONFIGS.items() for i in range(len(configs))]
SIZES = [3, 1, 4, 2, 5, 3, 2, 2, 4, 1]


def _close(model, ref, backend):
    if backend == "torch":
        assert_params_equal(model, ref)
    else:
        assert_params_close(model, ref, **KERNEL_VS_TORCH_TOLERANCE)


# ------------------------------------------------------------------------------ mode A
@pytest.mark.parametrize("name,config", CASES)
def test_mode_a_is_torch_optim_on_the_tutorial_loop(backend, name, config):
    kwargs = CONFIGS[name][config]
    batches = make_batches(SIZES)
    model, ref = make_model(), make_model()
    opt = OPTIMIZERS[name][0](model.parameters(), **kwargs, in_backward=True, backend=backend)
    ref_opt = OPTIMIZERS[name][1](ref.parameters(), **kwargs)
    for i, batch in enumerate(batches):
        (loss_of(model, batch) / 4).backward()
        assert all(p.grad is None for p in model.parameters())
        (loss_of(ref, batch) / 4).backward()
        if (i + 1) % 4 == 0 or i == len(batches) - 1:
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
    assert opt.update_count == 3
    assert_params_changed(model, make_model())
    assert_matches_torch(opt, model, ref_opt, ref, backend)


def test_mode_a_with_clipping_matches_clip_grad_norm(backend):
    batches = make_batches(SIZES[:8])
    model, ref = make_model(), make_model()
    opt = accum_fused.AdamW(model.parameters(), lr=0.01, max_grad_norm=0.05, in_backward=True, backend=backend)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for i, batch in enumerate(batches):
        loss_of(model, batch).backward()
        loss_of(ref, batch).backward()
        if (i + 1) % 4 == 0:
            opt.step()
            opt.zero_grad()
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ref_opt.step()
            ref_opt.zero_grad()
            torch.testing.assert_close(opt.last_grad_norm, norm, rtol=1e-5, atol=0)
    assert_params_close(model, ref, rtol=1e-5, atol=1e-6)


def test_mode_a_zero_grad_discards_and_step_without_backward_does_nothing(backend):
    batches = make_batches([3, 2])
    model = make_model()
    opt = accum_fused.SGD(model.parameters(), lr=0.1, in_backward=True, backend=backend)
    loss_of(model, batches[0]).backward()
    assert opt.micro_step == 1
    opt.zero_grad()  # discards, as it would discard .grad
    assert opt.micro_step == 0
    before = snapshot(opt)
    opt.step()
    assert opt.updated is False and opt.update_count == 0
    assert_unchanged(opt, {**before, "updated": False})
    loss_of(model, batches[1]).backward()
    opt.step()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_of(ref, batches[1]).backward()
    ref_opt.step()
    _close(model, ref, backend)


def test_mode_a_bf16_sum_is_fp32_accurate(backend):
    model = make_model(dtype=torch.bfloat16, hidden=32)
    opt = accum_fused.SGD(model.parameters(), lr=1.0, in_backward=True, backend=backend)
    batches = make_batches([2] * 64, dtype=torch.bfloat16)
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for batch in batches:
        grads = torch.autograd.grad(loss_of(model, batch), list(model.parameters()))  # no hooks
        for e, g in zip(exact, grads):
            e += g.double()
        loss_of(model, batch).backward()  # the same gradients, through the hooks
    for p, e in zip(model.parameters(), exact):
        buf = opt._window.buffers[p]
        assert buf.dtype == torch.float32
        torch.testing.assert_close(buf.double(), e, rtol=1e-5, atol=1e-6)  # fp32 sum of 64 terms
    naive = [torch.zeros_like(p) for p in model.parameters()]  # bf16 .grad +=, for contrast
    for batch in batches:
        grads = torch.autograd.grad(loss_of(model, batch), list(model.parameters()))
        for n, g in zip(naive, grads):
            n += g
    assert max(((n.double() - e).abs().max() / e.abs().max()).item() for n, e in zip(naive, exact)) > 1e-3


# ------------------------------------------------------------------------------ mode B
def _run_mode_b_and_plain(backend, name, kwargs, sizes, k, *, clip=None, drop_head_in=()):
    """The same micro-batches and weights through mode B and the plain mode; the head gets no
    gradient in the micro-batches listed in ``drop_head_in``."""
    batches = make_batches(sizes)
    models = make_model(), make_model()
    opt_b = OPTIMIZERS[name][0](models[0].parameters(), **kwargs, accumulation_steps=k, max_grad_norm=clip,
                                in_backward=True, backend=backend)
    opt_p = OPTIMIZERS[name][0](models[1].parameters(), **kwargs, accumulation_steps=k, max_grad_norm=clip,
                                backend=backend)

    def loss(model, i, batch):
        if i in drop_head_in:  # only the first layer: the head gets no gradient
            return model[1](model[0](batch[0])).square().mean()
        return loss_of(model, batch)

    for i, batch in enumerate(batches):
        opt_b.backward(loss(models[0], i, batch), weight=len(batch[0]))
        loss(models[1], i, batch).backward()
        opt_p.step(weight=len(batch[0]))
        opt_p.zero_grad()
        assert (opt_b.updated, opt_b.micro_step, opt_b.update_count) == (opt_p.updated, opt_p.micro_step,
                                                                        opt_p.update_count)
        assert all(p.grad is None for p in models[0].parameters())
    assert opt_b.flush() == opt_p.flush()
    return models, (opt_b, opt_p)


@pytest.mark.parametrize("name,config", CASES)
def test_mode_b_equals_the_plain_mode(backend, name, config):
    (model, plain), (opt_b, opt_p) = _run_mode_b_and_plain(backend, name, CONFIGS[name][config], SIZES, 4)
    assert opt_b.update_count == 3  # two full windows and a flushed partial one
    assert_params_changed(model, make_model())
    _close(model, plain, backend)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_mode_b_with_clipping_and_parameters_missing_from_the_last_micro_batch(backend, name):
    (model, plain), (opt_b, opt_p) = _run_mode_b_and_plain(backend, name, CONFIGS[name][1], SIZES, 3, clip=0.05,
                                                         drop_head_in={2, 4, 5})
    torch.testing.assert_close(opt_b.last_grad_norm, opt_p.last_grad_norm, rtol=0, atol=0)
    _close(model, plain, backend)


def test_mode_b_clipping_takes_the_norm_from_the_last_accumulate_pass(backend, monkeypatch):
    """No separate norm pass over the window: the last micro-batch's accumulate calls return the
    norms (issue 22's fused clip norm), and the clip equals the plain mode's bit for bit."""
    module = accum_fused.backends.resolve(backend, torch.device("cpu"), torch.float32)
    calls = []
    original = module.window_norms
    monkeypatch.setattr(module, "window_norms", lambda **kw: calls.append(1) or original(**kw))
    (model, plain), (opt_b, opt_p) = _run_mode_b_and_plain(backend, "AdamW", CONFIGS["AdamW"][0], SIZES[:8], 4,
                                                         clip=0.05)
    assert opt_b.update_count == 2
    if backend != "torch":  # (the reference's accumulate computes its norms by calling window_norms)
        assert calls == []
    torch.testing.assert_close(opt_b.last_grad_norm, opt_p.last_grad_norm, rtol=0, atol=0)
    _close(model, plain, backend)


def test_mode_b_head_missing_from_the_last_micro_batch_without_clipping(backend):
    (model, plain), _ = _run_mode_b_and_plain(backend, "AdamW", CONFIGS["AdamW"][1], SIZES, 3, drop_head_in={2, 8})
    _close(model, plain, backend)


def test_mode_b_plain_backward_counts_with_weight_one(backend):
    batches = make_batches([2, 2, 2, 2])
    model, plain = make_model(), make_model()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=2, in_backward=True, backend=backend)
    opt_p = accum_fused.AdamW(plain.parameters(), accumulation_steps=2, backend=backend)
    for batch in batches:
        loss_of(model, batch).backward()  # no opt.backward: weight 1
        loss_of(plain, batch).backward()
        opt_p.step()
        opt_p.zero_grad()
    assert opt.update_count == 2
    _close(model, plain, backend)


def test_mode_b_mid_window_resume_is_exact(backend):
    batches = make_batches(SIZES[:6])
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), lr=0.01, accumulation_steps=4, in_backward=True, backend=backend)
    for batch in batches[:5]:
        opt.backward(loss_of(model, batch), weight=len(batch[0]))
    saved = save_load({"model": model.state_dict(), "opt": opt.state_dict()})
    assert saved["opt"]["accumulation"]["micro_step"] == 1
    clone = make_model(seed=7)
    clone.load_state_dict(saved["model"])
    clone_opt = accum_fused.AdamW(clone.parameters(), lr=0.01, accumulation_steps=4, in_backward=True,
                                  backend=backend)
    clone_opt.load_state_dict(saved["opt"])
    for m, o in ((model, opt), (clone, clone_opt)):
        o.backward(loss_of(m, batches[5]), weight=3)
        o.flush()
    assert_params_equal(model, clone)


def test_mode_b_bad_weight_changes_nothing(backend):
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=2, in_backward=True, backend=backend)
    before = snapshot(opt)
    with pytest.raises(ValueError, match="weight"):
        opt.backward(loss_of(model, make_batches([2])[0]), weight=-1.0)
    assert_unchanged(opt, before)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------ misuse
def test_step_in_mode_b_raises():
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=2, in_backward=True)
    opt.backward(loss_of(model, make_batches([2])[0]))
    before = snapshot(opt)
    with pytest.raises(RuntimeError, match="opt.backward"):
        opt.step()
    assert_unchanged(opt, before)


def test_mode_a_refuses_a_step_weight_and_backward_weight():
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), in_backward=True)
    loss_of(model, make_batches([2])[0]).backward()
    with pytest.raises(ValueError, match="scale the loss"):
        opt.step(weight=2.0)
    with pytest.raises(ValueError, match="weight must be 1"):
        opt.backward(loss_of(model, make_batches([2])[0]), weight=2.0)
    assert opt.micro_step == 1


def test_backward_without_in_backward_weights_the_next_step(backend):
    """opt.backward(loss, weight=w) then step() is step(weight=w) after loss.backward() (the
    form FSDP2 needs); a second backward before step(), or a weight given twice, is refused."""
    batches = make_batches([3, 1, 4, 2])
    model, ref = make_model(), make_model()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=2, backend=backend)
    ref_opt = accum_fused.AdamW(ref.parameters(), accumulation_steps=2, backend=backend)
    for batch in batches:
        opt.backward(loss_of(model, batch), weight=len(batch[0]))
        opt.step()
        loss_of(ref, batch).backward()
        ref_opt.step(weight=len(batch[0]))
    assert opt.update_count == 2
    assert_params_equal(model, ref)
    opt.backward(loss_of(model, batches[0]))
    with pytest.raises(RuntimeError, match="twice without step"):
        opt.backward(loss_of(model, batches[1]))
    with pytest.raises(ValueError, match="without weight="):
        opt.step(weight=2.0)
    assert opt.micro_step == 0  # refused calls changed nothing
    opt.step()
    assert opt.micro_step == 1


def test_grad_scaler_is_refused_clearly():
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), in_backward=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(loss_of(model, make_batches([2])[0])).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)
    assert opt.update_count == 0


def test_in_backward_must_be_a_bool():
    with pytest.raises(TypeError, match="in_backward"):
        accum_fused.SGD(make_model().parameters(), lr=0.1, in_backward=1)


def test_pickle_and_deepcopy_are_refused():
    opt = accum_fused.AdamW(make_model().parameters(), in_backward=True)
    with pytest.raises(TypeError, match="state_dict"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="state_dict"):
        pickle.dumps(opt)


def test_hooks_go_with_the_optimizer():
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), in_backward=True)
    ref = weakref.ref(opt)
    del opt
    gc.collect()
    assert ref() is None
    loss_of(model, make_batches([2])[0]).backward()
    assert all(p.grad is not None for p in model.parameters())  # no hook left behind


def test_add_param_group_gets_hooks(backend):
    first, second = make_model(), nn.Linear(3, 2)
    opt = accum_fused.SGD(first.parameters(), lr=0.1, in_backward=True, backend=backend)
    opt.add_param_group({"params": second.parameters(), "lr": 1.0})
    before = second.weight.detach().clone()
    second(torch.ones(1, 3)).sum().backward()
    assert second.weight.grad is None
    opt.step()
    torch.testing.assert_close(second.weight, before - 1.0)


def test_compiled_model_with_mode_b(backend):
    torch._dynamo.reset()
    batches = make_batches(SIZES[:8])
    model, plain = make_model(), make_model()
    compiled = torch.compile(model)
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=4, in_backward=True, backend=backend)
    opt_p = accum_fused.AdamW(plain.parameters(), accumulation_steps=4, backend=backend)
    for batch in batches:
        opt.backward(loss_of(compiled, batch), weight=len(batch[0]))
        loss_of(plain, batch).backward()
        opt_p.step(weight=len(batch[0]))
        opt_p.zero_grad()
    assert opt.update_count == 2
    assert_params_close(model, plain, rtol=1e-5, atol=1e-6)


def test_parameter_without_requires_grad_is_left_alone(backend):
    model = make_model()
    model[0].bias.requires_grad_(False)
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=2, in_backward=True, backend=backend)
    bias = model[0].bias.detach().clone()
    for batch in make_batches([2, 3]):
        opt.backward(loss_of(model, batch))
    assert opt.update_count == 1 and torch.equal(model[0].bias, bias)
    assert model[0].bias not in opt.state


def test_adopted_gradients_are_not_held_between_windows(backend):
    """fp32 mode A: the window's first gradient is the buffer itself (no copy), and it is let go
    when the window closes, so nothing beyond parameters and state is resident between windows."""
    model = make_model()
    opt = accum_fused.AdamW(model.parameters(), in_backward=True, backend=backend)
    loss_of(model, make_batches([3])[0]).backward()
    assert set(opt._window.adopted) == set(model.parameters())
    buffers = [opt._window.buffers[p] for p in model.parameters()]
    loss_of(model, make_batches([2])[0]).backward()  # added into the adopted tensors
    assert all(opt._window.buffers[p] is b for p, b in zip(model.parameters(), buffers))
    opt.step()
    opt.zero_grad()
    assert opt._window.buffers == {} and not opt._window.adopted


def test_mode_a_checkpoint_between_backward_and_step_resumes_bit_exactly(backend):
    """Mode A: a checkpoint saved after the window's backward passes but before step() (any
    number of them: the caller's loop owns the window) loads into a fresh mode-A optimizer and
    resumes bit-exactly (issue 21, row 9: it used to raise "does not fit accumulation_steps=1")."""
    import io

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = accum_fused.AdamW(model.parameters(), lr=0.05, in_backward=True, max_grad_norm=0.5, backend=backend)
    xs = [torch.randn(5, 4, generator=torch.Generator().manual_seed(i)) for i in range(7)]

    def window(model, opt, batch):
        for x in batch:
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    window(model, opt, xs[:2])
    for x in xs[2:4]:  # two backward passes of the next window, then the checkpoint
        model(x).square().mean().backward()
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    resumed_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    resumed_model.load_state_dict(saved["model"])
    resumed = accum_fused.AdamW(resumed_model.parameters(), lr=0.05, in_backward=True, max_grad_norm=0.5,
                                backend=backend)
    resumed.load_state_dict(saved["opt"])
    assert resumed.micro_step == opt.micro_step == 2
    for m, o in ((model, opt), (resumed_model, resumed)):
        window(m, o, xs[4:5])  # the window's third backward, then step()
        window(m, o, xs[5:7])
        assert o.update_count == 3
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b), (a - b).abs().max()


def _bytes_held_per_parameter(opt, model) -> float:
    """What the optimizer and the model hold between windows, per parameter: parameters, their
    .grad, the optimizer's state tensors and the window's buffers (each storage once)."""
    storages = {}
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()),
               *opt._window.buffers.values()]
    for t in tensors:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) / sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("mode, weighted", [("plain", False), ("plain", True), ("A", False), ("B", False),
                                            ("B", True)])
def test_fp32_adamw_holds_12_bytes_per_parameter_between_windows_with_any_weight(backend, mode, weighted):
    """The memory guide's number, computed: fp32 AdamW holds 12 B/param between windows
    (parameter 4, state 8) in every mode, with weights too (issue 44 row 2: any weight other
    than 1 copied the window's first gradients, and 16 B/param stayed); plain mode on the torch
    and triton backends, which have no step table, 16. And a weighted window
    that adopts is bit for bit the copying one: the buffer holds g * w, the same float product."""
    results = []
    from accum_fused import in_backward, window
    for adopt in (True, False):
        mp = pytest.MonkeyPatch()
        if not adopt:  # the copying path: Python's hooks and plain mode's Python path, no adoption
            mp.setattr(in_backward, "_can_adopt", lambda *a: False)
            mp.setattr(in_backward.FastPath, "for_optimizer", staticmethod(lambda opt: None))
            mp.setattr(window.StepTable, "build", staticmethod(lambda *a: None))
        model = make_model()
        opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=1 if mode == "A" else 2,
                                in_backward=mode != "plain", backend=backend)
        try:
            for i, batch in enumerate(make_batches([2, 3, 4, 5])):
                weight = float(len(batch[0])) if weighted else None
                loss = loss_of(model, batch)
                if mode == "B":
                    opt.backward(loss, weight=weight)
                else:
                    loss.backward()
                    if mode == "plain":
                        opt.step(weight=weight)
                        opt.zero_grad()
                    elif i % 2 == 1:
                        opt.step()
                        opt.zero_grad()
                if i % 2 == 1 and adopt:
                    assert opt.update_count == (i + 1) // 2
                    # (plain mode adopts through the extension's step table: cpp, auto on CPU)
                    copies = mode == "plain" and backend in ("torch", "triton")
                    assert _bytes_held_per_parameter(opt, model) == (16.0 if copies else 12.0)
        finally:
            opt.close()
            mp.undo()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b), (a - b).abs().max()
