"""The extension's in-backward hooks (csrc/hooks.cpp) against the Python hooks they stand in
for (accum_fused/in_backward.py, the spec): the same optimizer built twice, once with the
extension's hooks and once with Python's only, must end bit-identical, and the extension must
actually have taken the gradients it was armed for."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import accum_fused
from accum_fused import in_backward

pytestmark = pytest.mark.skipif("cpp" not in accum_fused.available_backends(), reason="needs the extension")

K = 4


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 9), nn.Tanh(), nn.Linear(9, 3)).to(dtype)


def _optimizer(name, params, **kw):
    if name == "SGD":
        return accum_fused.SGD(params, lr=0.05, momentum=0.9, backend="cpp", in_backward=True, **kw)
    return accum_fused.AdamW(params, lr=0.01, weight_decay=0.1, backend="cpp", in_backward=True, **kw)


def _train(python_only, monkeypatch, *, dtype, mode, clip, name="AdamW", windows=3, step_fn=None):
    """Train a fresh model; returns (parameters, gradients the extension took)."""
    if python_only:
        monkeypatch.setattr(in_backward.FastPath, "for_optimizer", staticmethod(lambda opt: None))
    else:
        monkeypatch.undo()
    model = _model(dtype)
    k = K if mode == "B" else 1
    opt = _optimizer(name, model.parameters(), accumulation_steps=k, max_grad_norm=clip)
    gen = torch.Generator().manual_seed(1)
    for i in range(windows * K):
        x = torch.randn(3 + i % 4, 7, generator=gen).to(dtype)
        loss = (step_fn or (lambda m, x: m(x)))(model, x).float().square().mean()
        if mode == "B":
            opt.backward(loss, weight=float(1 + i % 3))
        else:
            loss.backward()
            if (i + 1) % K == 0:
                opt.step()
                opt.zero_grad()
    taken = 0 if opt._fast_path is None else opt._fast_path.state.taken
    opt.close()
    # The fp32 state too: a bf16 parameter can round a small difference away.
    state = [t for p in model.parameters() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + state, taken


@pytest.mark.parametrize("name", ["SGD", "AdamW"])
@pytest.mark.parametrize("mode,clip", [("A", None), ("A", 1.0), ("B", None), ("B", 0.05)],
                         ids=["modeA", "modeA-clip", "modeB", "modeB-clip"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_extension_hooks_match_python_hooks(monkeypatch, dtype, mode, clip, name):
    fast, taken = _train(False, monkeypatch, dtype=dtype, mode=mode, clip=clip, name=name)
    slow, slow_taken = _train(True, monkeypatch, dtype=dtype, mode=mode, clip=clip, name=name)
    assert slow_taken == 0
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    # Each pass's first gradient, and every parameter not yet live in the window (its first
    # micro-batch adopts or overwrites its buffer), are Python's; mode B's last pass updates
    # inside its hooks without clipping (Python's too). 6 parameters.
    passes_taken = (K - 1 if mode == "A" else K - 2 + (clip is not None)) * 3
    assert taken == 5 * passes_taken


def test_second_gradient_and_reentrant_checkpoint_go_to_python(monkeypatch):
    """A parameter reached twice in one pass (inside and outside a reentrant checkpoint, whose
    inner backward is another autograd graph task) is Python's second time round."""
    def twice(model, x):
        x = x.detach().requires_grad_()  # (a reentrant checkpoint needs an input that requires grad)
        h = checkpoint(model[:2], x, use_reentrant=True)  # the first layer inside ...
        return model[2:](h) + model[0](x)[:, :3]  # ... and outside
    fast, taken = _train(False, monkeypatch, dtype=torch.float32, mode="B", clip=1.0, step_fn=twice)
    slow, _ = _train(True, monkeypatch, dtype=torch.float32, mode="B", clip=1.0, step_fn=twice)
    assert taken > 0
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_failed_pass_after_the_extension_took_gradients(monkeypatch):
    """A backward that raises after the extension added gradients into the window's sums: the
    window is discarded with a warning, as with Python's hooks, and the next pass works."""
    results = []
    for python_only in (False, True):
        if python_only:
            monkeypatch.setattr(in_backward.FastPath, "for_optimizer", staticmethod(lambda opt: None))
        model = _model(torch.float32)
        opt = _optimizer("AdamW", model.parameters(), accumulation_steps=K)

        class Boom(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                raise RuntimeError("simulated out of memory")

        x = torch.randn(4, 7)
        opt.backward(model(x).square().mean())
        opt.backward(model(x).square().mean())
        # The last layer's gradients arrive (the extension takes most), then the first
        # layer's input path raises.
        with pytest.warns(RuntimeWarning, match="window was discarded"), pytest.raises(RuntimeError, match="simulated"):
            opt.backward(model[2:](Boom.apply(model[:2](x))).square().mean())
        if not python_only:
            assert opt._fast_path.state.taken > 0 and not opt._fast_path.state.armed
        assert opt.micro_step == 0
        for _ in range(K):
            opt.backward(model(x).square().mean())
        assert opt.update_count == 1
        results.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_close_disarms_and_other_backends_have_python_hooks():
    model = _model(torch.float32)
    opt = _optimizer("AdamW", model.parameters(), accumulation_steps=K)
    assert isinstance(opt._fast_path, in_backward.FastPath)
    opt.close()
    assert not opt._fast_path.state.armed
    # Another backend than the extension's: Python's hooks alone.
    opt = accum_fused.AdamW(model.parameters(), backend="torch", in_backward=True)
    assert opt._fast_path is None
    opt.close()
