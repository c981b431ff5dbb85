"""accum_fused.nn.fuse_linear_gradients: Linear weight gradients written by the GEMM into the
window buffers, against the unfused path (the same model and optimizer without it) on every
backend, in mode A and mode B, with and without clipping, under checkpointing and autocast."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import accum_fused
from accum_fused import in_backward
from accum_fused.nn import fuse_linear_gradients, linear

from _helpers import RaisingBackward, rows_compared_with_window

K = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 16)
        self.mid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 5, bias=False)
        self.norm = nn.LayerNorm(16)

    def forward(self, x, ckpt=None):
        h = torch.nn.functional.gelu(self.inp(x))
        if ckpt is None:
            h = self.mid(h)
        else:
            h = checkpoint(self.mid, h, use_reentrant=ckpt == "reentrant")
        return self.out(self.norm(torch.nn.functional.gelu(h)))


def _train(fuse, *, backend="auto", mode="B", clip=None, ckpt=None, autocast=False, windows=3, stop_before=None):
    torch.manual_seed(0)
    model = Net()
    k = K if mode == "B" else 1
    opt = accum_fused.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, accumulation_steps=k,
                            in_backward=True, backend=backend, max_grad_norm=clip)
    handle = fuse_linear_gradients(model, opt) if fuse else None
    gen = torch.Generator().manual_seed(1)
    for i in range(windows * K):
        if i == stop_before:
            break
        x = torch.randn(2, 3 + i % 3, 7, generator=gen)
        if ckpt == "reentrant":
            x.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x, ckpt).float().square().mean()
        if mode == "B":
            opt.backward(loss, weight=float(1 + i % 2))
        else:
            loss.backward()
            if (i + 1) % K == 0:
                opt.step()
                opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        rows_compared_with_window(opt)  # (the fused writes keep the extension's rows the window's)
    buffers = {n: opt._window.buffers[p].clone() for n, p in model.named_parameters() if p in opt._window.live}
    result = dict(params=[p.detach().clone() for p in model.parameters()], updates=opt.update_count,
                  buffers=buffers, fused=None if handle is None else handle.fused)
    opt.close()
    return result


def _assert_grads_are_autograds(model, x):
    """A backward outside the optimizer's micro-batches leaves .grad as plain autograd gives it."""
    model(x).sum().backward()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _close(a, b, rtol):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=rtol * y.abs().max().item())


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("mode", ["A", "B"])
def test_fused_matches_the_unfused_path(backend, mode, clip):  # (backend: every one that loads, conftest)
    fused = _train(True, backend=backend, mode=mode, clip=clip)
    plain = _train(False, backend=backend, mode=mode, clip=clip)
    assert fused["fused"] == ["inp", "mid", "out"]
    assert fused["updates"] == plain["updates"] == 3
    _close(fused["params"], plain["params"], rtol=1e-5)  # the same sums up to summation order


def test_the_weight_and_bias_gradients_go_through_the_gemm(monkeypatch):
    calls, in_python = [], []
    take, take_written = linear._Fused.take, in_backward.take_written

    def counted(self, param, saved, gradient):
        calls.append(tuple(param.shape))
        return take(self, param, saved, gradient)

    def counted_in_python(opt, p, writer):
        in_python.append(tuple(p.shape))
        return take_written(opt, p, writer)
    monkeypatch.setattr(linear._Fused, "take", counted)
    monkeypatch.setattr(in_backward, "take_written", counted_in_python)
    _train(True, windows=1)
    # three fused weights and two biases (`out` has none) per backward pass, none of them
    # handed to autograd (_train asserts that no .grad appears)
    assert sorted(calls) == sorted([(16, 7), (16,), (16, 16), (16,), (5, 16)] * K)
    # With the extension its hooks write all but each pass's first (the last layer's weight,
    # whose gradient arms them), the window's first pass too (weight 1: they start the buffers),
    # and but the window's last pass, whose updates (mode B, no clipping) the hooks fold in.
    if "cpp" in accum_fused.available_backends():
        assert sorted(in_python) == sorted([(5, 16)] * K + [(16, 7), (16,), (16, 16), (16,)]), in_python
    # Mid-window, the buffers hold the weighted sums the unfused path holds.
    fused = _train(True, stop_before=K - 1, windows=1)
    plain = _train(False, stop_before=K - 1, windows=1)
    assert fused["buffers"].keys() == plain["buffers"].keys()
    for name, buf in plain["buffers"].items():
        torch.testing.assert_close(fused["buffers"][name], buf, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_checkpointed_layers(ckpt):
    fused = _train(True, ckpt=ckpt, clip=1.0)
    plain = _train(False, ckpt=ckpt, clip=1.0)
    _close(fused["params"], plain["params"], rtol=1e-5)


def test_autocast_bf16():
    """Under bf16 autocast the fused GEMM accumulates in fp32 from the bf16 operands (the
    unfused path rounds each weight gradient to bf16 first): the window's sums agree to bf16
    precision."""
    fused = _train(True, autocast=True, stop_before=K - 1, windows=1)
    plain = _train(False, autocast=True, stop_before=K - 1, windows=1)
    for name, buf in plain["buffers"].items():
        torch.testing.assert_close(fused["buffers"][name], buf, rtol=2e-2, atol=2e-2 * buf.abs().max().item())


def test_refusals():
    model = Net()
    with pytest.raises(ValueError, match="in_backward=True"):
        fuse_linear_gradients(model, accum_fused.AdamW(model.parameters(), accumulation_steps=K))
    tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    opt = accum_fused.AdamW(tied.parameters(), accumulation_steps=K, in_backward=True)
    with pytest.raises(ValueError, match="shared with"):
        fuse_linear_gradients(tied, opt)
    opt.close()


def test_remove_gives_the_layers_their_forward_back():
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=K, in_backward=True)
    handle = fuse_linear_gradients(model, opt)
    assert "forward" in model.mid.__dict__
    handle.remove()
    assert "forward" not in model.mid.__dict__ and handle.fused == ["inp", "mid", "out"]
    opt.close()


def test_a_foreign_backward_leaves_grad_as_torch_does():
    """Once opt.backward is used, another backward through the model (a GAN's other loss) is
    not a micro-batch: the fused layers hand autograd their weight gradient, into .grad."""
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=K, in_backward=True)
    fuse_linear_gradients(model, opt)
    x = torch.randn(3, 7)
    opt.backward(model(x).square().mean())
    _assert_grads_are_autograds(model, x)
    assert opt.micro_step == 1
    opt.close()


def test_a_fused_layer_called_twice():
    """Its weight gets two gradients per pass, summed into the window like autograd sums them,
    also in mode B's last micro-batch without clipping (a written gradient waits for the update
    at the end of the pass)."""
    for clip in (1.0, None):
        torch.manual_seed(0)
        layer = nn.Linear(5, 5)
        reference = nn.Linear(5, 5)
        reference.load_state_dict(layer.state_dict())
        opt = accum_fused.AdamW(layer.parameters(), accumulation_steps=2, in_backward=True, max_grad_norm=clip)
        ref_opt = accum_fused.AdamW(reference.parameters(), accumulation_steps=2, max_grad_norm=clip)
        fuse_linear_gradients(layer, opt)
        x = torch.randn(3, 5)
        for _ in range(4):
            opt.backward(layer(layer(x)).square().mean())
            reference(reference(x)).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        assert opt.update_count == ref_opt.update_count == 2
        for p, q in zip(layer.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        opt.close()


def test_memory_between_windows_is_the_native_loops():
    """A buffer a GEMM started is let go when its window closes (as an adopted gradient is):
    between windows mode B holds parameters and state only."""
    torch.manual_seed(0)
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=K, in_backward=True)
    fuse_linear_gradients(model, opt)
    for _ in range(K):
        opt.backward(model(torch.randn(3, 7)).square().mean(), weight=2.0)  # (weight 2: nothing adopted)
    assert opt.update_count == 1
    assert not any(p in opt._window.buffers for p in (model.inp.weight, model.mid.weight, model.out.weight))
    opt.close()


def test_a_failed_backward_with_fused_layers():
    """A backward that raises after fused layers wrote into the window's sums discards the
    window with a warning, as with hooks alone, and training goes on as the unfused path's."""
    results = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = Net()
        opt = accum_fused.AdamW(model.parameters(), accumulation_steps=K, in_backward=True)
        if fuse:
            fuse_linear_gradients(model, opt)
        x = torch.randn(3, 7)
        opt.backward(model(x).square().mean(), weight=2.0)
        h = RaisingBackward.apply(torch.nn.functional.gelu(model.inp(x)))  # the last layers' gradients arrive first
        with pytest.warns(RuntimeWarning, match="discarded"), pytest.raises(RuntimeError, match="simulated"):
            opt.backward(model.out(model.norm(model.mid(h))).square().mean(), weight=2.0)
        assert opt.micro_step == 0
        for _ in range(K):
            opt.backward(model(x).square().mean())
        assert opt.update_count == 1
        results.append([p.detach().clone() for p in model.parameters()])
        opt.close()
    _close(results[0], results[1], rtol=1e-5)


def test_misuse_is_refused_before_anything_changes():
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), accumulation_steps=K, in_backward=True)
    other = accum_fused.AdamW(Net().parameters(), accumulation_steps=K, in_backward=True)
    with pytest.raises(ValueError, match="no nn.Linear"):
        fuse_linear_gradients(model, other)  # the optimizer of another model
    assert "forward" not in model.mid.__dict__
    handle = fuse_linear_gradients(model, opt)
    with pytest.raises(ValueError, match="fused already"):
        fuse_linear_gradients(model, opt)
    handle.remove()
    other.close()
    with pytest.raises(RuntimeError, match="closed"):
        fuse_linear_gradients(model, other)
    opt.close()


def test_after_close_the_gradients_land_in_grad():
    """close() gives .grad back (as for a model without fused layers): the fused layers hand
    autograd their weight gradients once their optimizer is closed (mode A: every backward
    would otherwise be one of its micro-batches)."""
    model = Net()
    opt = accum_fused.AdamW(model.parameters(), in_backward=True)
    fuse_linear_gradients(model, opt)
    x = torch.randn(3, 7)
    model(x).square().mean().backward()
    opt.step()
    opt.close()
    _assert_grads_are_autograds(model, x)


def test_a_bias_the_optimizer_does_not_hold_keeps_its_path():
    torch.manual_seed(0)
    model = Net()
    reference = Net()
    reference.load_state_dict(model.state_dict())
    held = [p for n, p in model.named_parameters() if n != "inp.bias"]
    opt = accum_fused.AdamW(held, lr=1e-2, accumulation_steps=K, in_backward=True)
    handle = fuse_linear_gradients(model, opt)
    x = torch.randn(3, 7)
    opt.backward(model(x).square().mean())
    reference(x).square().mean().backward()
    assert handle.fused == ["inp", "mid", "out"]
    assert model.inp.weight.grad is None and model.mid.bias.grad is None  # taken by the window
    torch.testing.assert_close(model.inp.bias.grad, reference.inp.bias.grad, rtol=0, atol=0)
    opt.close()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_cuda_gemm_takes_low_precision_operands_with_an_fp32_output(dtype):
    # torch.addmm(out_dtype=) has no CPU kernel. On a CUDA machine the call runs and is compared
    # with the fp32 product; elsewhere torch's meta kernel checks it (dtypes, shapes, out=). The
    # meta check alone is not enough everywhere: torch 2.11's meta decomposition of this call
    # raises "addmm() got multiple values for argument 'beta'" (H100 run, 2026-11-26). Before
    # torch 2.8 there is no out_dtype: the operands are widened and multiplied in fp32.
    from accum_fused.nn.linear import _ADDMM_HAS_OUT_DTYPE, _gemm_into
    calls = []
    real_addmm = torch.addmm

    def addmm(*args, **kwargs):
        calls.append(kwargs.get("out_dtype"))
        return real_addmm(*args, **kwargs)
    device = "cuda" if torch.cuda.is_available() else "meta"
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(3, 4, generator=gen)
    a, b = torch.randn(3, 5, generator=gen).to(dtype), torch.randn(5, 4, generator=gen).to(dtype)
    buffer = start.to(device)
    try:
        torch.addmm = addmm
        _gemm_into(buffer, a.to(device), b.to(device), beta=1.0, alpha=0.5, native_out_dtype=True)
    except TypeError as exc:
        if device != "meta" or "multiple values for argument 'beta'" not in str(exc):
            raise
        pytest.skip(f"torch {torch.__version__}'s meta decomposition of addmm(out_dtype=) is broken (the CUDA case runs it)")
    finally:
        torch.addmm = real_addmm
    assert calls == ([torch.float32] if _ADDMM_HAS_OUT_DTYPE else []) and buffer.dtype == torch.float32
    if device == "cuda":
        expected = start.double() + 0.5 * (a.double() @ b.double())
        torch.testing.assert_close(buffer.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def _fused_against_unfused(mode, clip, loss_of, windows=3):
    """The same training with fuse_linear_gradients and without (mode A: a step every K passes):
    each run's parameters and how often the extension's hook lists were built (None without it)."""
    runs = []
    for fuse in (True, False):
        torch.manual_seed(0)
        model = Net()
        opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=K if mode == "B" else 1,
                                in_backward=True, max_grad_norm=clip)
        if fuse:
            fuse_linear_gradients(model, opt)
        gen = torch.Generator().manual_seed(1)
        for i in range(windows * K):
            loss = loss_of(model, torch.randn(3, 7, generator=gen))
            if mode == "B":
                opt.backward(loss)
            else:
                loss.backward()
                if (i + 1) % K == 0:
                    opt.step()
                    opt.zero_grad()
        assert opt.update_count == windows
        runs.append(([p.detach().clone() for p in model.parameters()],
                     None if opt._hooks.fast_path is None else opt._hooks.fast_path.built))
        opt.close()
    return runs


@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("mode", ["A", "B"])
def test_a_fused_weight_with_another_gradient_through_autograd(mode, clip):
    """A penalty on a fused layer's weight in the loss: its gradient reaches the weight through
    autograd, after the GEMM has written the buffer in the same pass (AccumulateGrad waits for
    every edge into it), in every pass of the window (its first too, where the extension's
    hooks would otherwise adopt it over the GEMM's sum). The window holds both, as the unfused
    path's does."""
    def loss_of(model, x):
        return model(x).square().mean() + 1e-2 * model.mid.weight.square().sum() + model.out.weight.sum()
    (fused, _), (unfused, _) = _fused_against_unfused(mode, clip, loss_of)
    _close(fused, unfused, rtol=1e-5)


@pytest.mark.skipif("cpp" not in accum_fused.available_backends(), reason="needs the extension's hooks")
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
def test_fused_writes_keep_the_hooks_lists(clip):
    """The fused layers' gradients are written by the extension's hooks (or, Python's, told to
    them: HookState.python_took), so the extension's rows stay true to the window instead of a
    Python loop over the parameters building them, window after window (before: every pass
    rebuilt them), and the result is the unfused path's."""
    (fused, fused_builds), (unfused, unfused_builds) = _fused_against_unfused(
        "B", clip, lambda model, x: model(x).square().mean(), windows=5)
    _close(fused, unfused, rtol=1e-5)
    assert fused_builds <= unfused_builds + 1 and fused_builds <= 3, (fused_builds, unfused_builds)


@pytest.mark.skipif("cpp" not in accum_fused.available_backends(), reason="needs the extension's hooks")
@pytest.mark.parametrize("clip", [None, 1.0], ids=["noclip", "clip"])
@pytest.mark.parametrize("mode", ["A", "B"])
def test_the_extensions_writes_are_take_writtens(monkeypatch, mode, clip):
    """HookState.write_linear against Python's take_written (the spec, the extension's hooks
    switched off): the same buffers mid-window and the same parameters after three windows,
    bit for bit (the same GEMM, sum and norm ops), with weights."""
    runs = []
    for spec in (False, True):
        monkeypatch.undo()
        if spec:
            monkeypatch.setattr(in_backward.FastPath, "for_optimizer", staticmethod(lambda opt: None))
        mid = _train(True, backend="cpp", mode=mode, clip=clip, stop_before=K + 2)
        runs.append((_train(True, backend="cpp", mode=mode, clip=clip), mid))
    (fast, fast_mid), (python, python_mid) = runs
    assert fast["updates"] == python["updates"] == 3
    for a, b in zip(fast["params"], python["params"]):
        assert torch.equal(a, b)
    assert fast_mid["buffers"].keys() == python_mid["buffers"].keys()
    for name, buf in python_mid["buffers"].items():
        assert torch.equal(fast_mid["buffers"][name], buf), name


@pytest.mark.skipif("cpp" not in accum_fused.available_backends(), reason="needs the extension's hooks")
@pytest.mark.parametrize("device", ["cpu", "cpu-as-gpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_extensions_writes_on_each_device(monkeypatch, device):
    """HookState.write_linear on the device's own autograd thread (CUDA: the device thread, its
    GEMM on the current stream) against take_written, bit for bit, in mode B with clipping and
    weights; and the extension wrote most of the gradients. On a GPU (and ``cpu-as-gpu``, the
    GPU's per-gradient path on CPU: in_backward.by_torch_ops) a clipped window's norms are
    torch's ops in both, whether or not the extension was built with CUDA (its CUDA norm kernel
    raised in backward without it)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch_ops = device == "cpu-as-gpu"
    device = "cpu" if torch_ops else device
    runs, written = [], []
    write_linear = in_backward.FastPath.write_linear

    def counted(fast, p, grad_out, inp):
        done = write_linear(fast, p, grad_out, inp)
        written.append(done)
        return done
    for spec in (False, True):
        monkeypatch.undo()
        monkeypatch.setattr(in_backward.FastPath, "write_linear", counted)
        monkeypatch.setattr(in_backward, "TORCH_OPS_ON_CPU", torch_ops)
        if spec:
            monkeypatch.setattr(in_backward.FastPath, "for_optimizer", staticmethod(lambda opt: None))
        torch.manual_seed(0)
        model = Net().to(device)
        opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=K, in_backward=True, backend="cpp",
                                max_grad_norm=1.0)
        fuse_linear_gradients(model, opt)
        gen = torch.Generator().manual_seed(1)
        for i in range(3 * K):
            opt.backward(model(torch.randn(3, 7, generator=gen).to(device)).square().mean(), weight=float(1 + i % 2))
        assert opt.update_count == 3
        runs.append([p.detach().cpu() for p in model.parameters()])
        opt.close()
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    # (the first run's: the second had no hooks to ask) each pass's four gradients after its first
    assert written.count(True) == 3 * K * 4
