"""Host work per micro-batch, counted on the CPU by the same code paths a GPU runs (issue 43).

On CUDA a gradient's in-backward work must be what autograd's AccumulateGrad does: an add into
a buffer on the gradient's stream, nothing that waits for the device. Only a GPU shows the time;
what makes the time can be counted anywhere:

* **host-device synchronisations**: every read of a tensor's value on the host -- ``item()``,
  ``float()``/``int()``/``bool()`` of a tensor (aten ``_local_scalar_dense`` / ``is_nonzero``,
  seen by a dispatch mode), ``tolist()`` and ``numpy()`` -- except reads of the optimizer's
  ``step`` tensors, which live on the CPU for CUDA parameters too (as torch's own non-capturable
  Adam keeps them), and reads the extension makes inside its own CPU kernels' calls (its CUDA
  kernels read those scalars from device memory: ``device_scalar``);
* **Python on the gradient path**: calls of ``in_backward.take_grad`` (each gradient that reaches
  Python instead of the extension's C++ hooks);
* **kernel calls**: calls into the extension's update and accumulate entry points from Python.

Asserted per micro-batch, for every mode, on the backends ``auto`` can pick on CPU, and marked
``cuda`` on a GPU (there under ``torch.cuda.set_sync_debug_mode("error")`` too).
"""
from __future__ import annotations

import collections
import traceback

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import accum_fused
from accum_fused import in_backward

K = 4
PARAMS = 12  # six Linear layers
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::item"}


class _HostReads(TorchDispatchMode):
    """Counts the host reads of tensor values (see the module docstring) while active."""

    def __init__(self, opt):
        super().__init__()
        self.opt = opt
        self.reads: list[str] = []

    def note(self, tensor, what: str) -> None:
        if any(state.get("step") is tensor for state in self.opt.state.values()):
            return
        frames = [f for f in traceback.extract_stack() if "accum_fused" in f.filename and "/tests/" not in f.filename]
        line = (frames[-1].line or "") if frames else ""
        if "_C." in line:  # (inside an extension call: its CPU kernel's own scalar read)
            return
        if frames and frames[-1].name == "step_counts":  # (the step counts, stacked: CPU tensors)
            return
        self.reads.append(f"{what} at {frames[-1].name}:{frames[-1].lineno} [{line}]" if frames else what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in _SYNC_OPS:
            self.note(args[0], func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counters(monkeypatch):
    """(host reads, Python gradient takes, extension kernel calls) of the code run under it."""
    state = {"reads": None, "takes": 0, "kernels": collections.Counter()}
    for name in ("tolist", "numpy"):
        real = getattr(torch.Tensor, name)

        def wrapped(self, *a, _real=real, _name=name, **kw):
            if state["reads"] is not None:
                state["reads"].note(self, _name)
            return _real(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, wrapped)
    take_grad = in_backward.take_grad

    def counted_take(opt, p):
        state["takes"] += 1
        return take_grad(opt, p)
    monkeypatch.setattr(in_backward, "take_grad", counted_take)
    from accum_fused.backends import cpp_backend
    for name in ("accumulate", "window_norms", "sgd_update", "adam_update"):
        real = getattr(cpp_backend._C, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            state["kernels"][_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(cpp_backend._C, name, wrapped)
    return state


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(PARAMS // 2)]).to(device)


def _per_micro_batch(counters, backend, mode, clip, device="cpu", windows=3):
    """Each micro-batch's (host reads, Python takes, extension kernel calls)."""
    model = _model(device)
    opt = accum_fused.AdamW(model.parameters(), lr=1e-3, accumulation_steps=1 if mode == "A" else K,
                            in_backward=mode != "plain", max_grad_norm=clip, backend=backend)
    x = torch.randn(8, 16, device=device)
    out = []
    for i in range(windows * K):
        reads = counters["reads"] = _HostReads(opt)
        counters["takes"] = 0
        counters["kernels"].clear()
        with reads:
            loss = model(x * (i + 1)).square().mean()
            if mode == "B":
                opt.backward(loss, weight=float(i % 3 + 1))
            else:
                loss.backward()
                if mode == "plain":
                    opt.step(weight=float(i % 3 + 1))
                    opt.zero_grad()
                elif i % K == K - 1:
                    opt.step()
                    opt.zero_grad()
        counters["reads"] = None
        out.append((reads.reads, counters["takes"], sum(counters["kernels"].values())))
    assert opt.update_count == windows
    return out


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("mode", ["plain", "A", "B"])
@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_no_micro_batch_reads_a_device_value_on_the_host(counters, backend, mode, clip):
    """Not one host read of a value that would live on the GPU, in any micro-batch: neither the
    gradients' way into the window nor the window's close waits for the device."""
    for i, (reads, _, _) in enumerate(_per_micro_batch(counters, backend, mode, clip)):
        assert reads == [], f"micro-batch {i}: {reads}"


def _needs_cuda_and_extension(device):
    """On CUDA the extension's hooks take gradients whether or not it was built with CUDA (they
    add with torch's ops there: in_backward.by_torch_ops); it must load."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if "cpp" not in accum_fused.available_backends():
        pytest.skip("the extension is not built")


@pytest.mark.parametrize("device", ["cpu", "cpu-as-gpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("mode", ["A", "B"])
def test_the_extensions_hooks_leave_python_one_gradient_a_pass(counters, monkeypatch, mode, clip, device):
    """cpp, on CPU and (marked cuda) CUDA parameters, whose C++ hooks run on autograd's device
    thread: past the first window (whose close creates the optimizer state in Python), each
    backward pass runs Python for its first gradient only (it arms the C++ hooks), and Python
    calls the extension at most once for that gradient and, at a window's close, once for the
    update of the group (and once for the norms of mode A's clipped close): no Python and no
    Python-side launch per gradient, whatever the number of parameters. ``cpu-as-gpu``: the
    per-gradient path a GPU takes (torch's ops in the hooks, no update folded into them), on CPU;
    on CUDA it is taken whether or not the extension was built with CUDA."""
    _needs_cuda_and_extension(device)
    if device == "cpu-as-gpu":
        monkeypatch.setattr(in_backward, "TORCH_OPS_ON_CPU", True)
        device = "cpu"
    per = _per_micro_batch(counters, "cpp", mode, clip, device=device)
    for i, (_, takes, kernels) in enumerate(per[K:], start=K):
        closing = i % K == K - 1
        assert takes == 1, f"micro-batch {i}: {takes} gradients through Python"
        assert kernels <= 1 + closing + (closing and clip is not None and mode == "A"), \
            f"micro-batch {i}: {kernels} extension calls from Python"


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["auto", "cpp", "triton", "torch"])
@pytest.mark.parametrize("mode", ["plain", "A", "B"])
def test_no_host_device_sync_on_cuda(counters, mode, backend):
    """On a GPU: torch's own sync detector, set to raise, through three windows of each mode on
    each backend (the extension's CUDA kernels where it was built with them), with clipping (the
    close's norm and coefficient stay on the device)."""
    _needs_cuda_and_extension("cuda")
    if backend not in accum_fused.available_backends() and backend != "auto":
        pytest.skip(f"backend {backend!r} not available")
    _per_micro_batch(counters, backend, mode, 1.0, device="cuda", windows=1)  # (warm: state, tables)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        per = _per_micro_batch(counters, backend, mode, 1.0, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(reads == [] for reads, _, _ in per)


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active: on a GPU each one a kernel launch (the
    extension's C++ hooks dispatch theirs through torch too, where they add with torch's ops)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _ops_per_micro_batch(kind, weight=None):
    """Each micro-batch's aten ops, forward and backward included: the native loop (``.grad``
    accumulated by AccumulateGrad, torch.optim.AdamW) or accum_fused's mode A or B on cpp."""
    model = _model("cpu")
    if kind == "native":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = accum_fused.AdamW(model.parameters(), lr=1e-3, accumulation_steps=1 if kind == "A" else K,
                                in_backward=True, backend="cpp")
    x = torch.randn(8, 16)
    out = []
    for i in range(3 * K):
        ops = _AtenOps()
        with ops:
            loss = model(x * (i + 1)).square().mean()
            if kind == "B":
                opt.backward(loss, weight=weight)
            else:
                loss.backward()
                if i % K == K - 1:
                    opt.step()
                    opt.zero_grad()
        out.append(ops.ops)
    return out


@pytest.mark.parametrize("mode,weight", [("A", None), ("B", None), ("B", 3.0)], ids=["A", "B", "B-weighted"])
def test_a_gpus_gradient_launches_what_accumulate_grad_does(monkeypatch, mode, weight):
    """The per-gradient path a GPU takes (torch's ops in the extension's hooks, in_backward.
    by_torch_ops), run on CPU and counted in aten ops, each a kernel launch on a GPU: a middle
    micro-batch launches what the native loop's does (forward, backward, AccumulateGrad's one
    add per parameter) and one op more (the detach of the one gradient Python arms the hooks
    with). A weight other than 1 costs a multiply per parameter more (g * w, then the add, as
    the spec rounds it), which the native loop puts in its loss instead."""
    if "cpp" not in accum_fused.available_backends():
        pytest.skip("the extension is not built")
    monkeypatch.setattr(in_backward, "TORCH_OPS_ON_CPU", True)
    native = _ops_per_micro_batch("native")
    ours = _ops_per_micro_batch(mode, weight)
    for i in range(K + 1, 2 * K - 1):  # (the second window's middle micro-batches)
        extra = ours[i] - native[i]
        assert not native[i] - ours[i], f"micro-batch {i}: fewer ops than native? {native[i] - ours[i]}"
        # A detach is a view (a new TensorImpl, no kernel): one per pass, for the one gradient
        # Python takes; torch 2.6 (run by hand; 2.11 and 2.13 make one) makes it two, AccumulateGrad's own
        # detach of that gradient as it stores it. Never one per parameter.
        detaches = extra.pop("aten.detach.default", 0)
        assert 1 <= detaches <= 2, f"micro-batch {i}: {detaches} detaches more than the native loop's"
        allowed = collections.Counter()
        if weight is not None:
            allowed["aten.mul.Scalar"] = PARAMS - 1
            allowed["aten.mul.Tensor"] = 1
        assert extra == allowed, f"micro-batch {i}: {dict(extra)} more than the native loop's"
