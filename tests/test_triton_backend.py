"""What is specific to backend "triton": when it is available, that its kernels compile once
whatever the scalars and sizes, its address-table cache, that its kernels compile for CUDA, and a
quick comparison with the reference over odd sizes, many tensors, dtypes and every option.

The kernels run on CPU tensors through Triton's interpreter, which Triton switches on when a
kernel is defined: run this file with TRITON_INTERPRET=1 in the environment (the README's test
command does). Without it, the tests that need the kernels skip, saying so, unless a CUDA device
is there to run them on; the availability and compilation tests run either way.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import accum_fused
from accum_fused.backends import reference

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


def _device() -> torch.device | None:
    if not HAS_TRITON:
        return None
    if INTERPRET:
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return None


def _kernels_skip_reason() -> str | None:
    if DEVICE is None:
        return ("backend 'triton' needs a CUDA device, or TRITON_INTERPRET=1 in the environment to run its "
                "kernels on CPU through Triton's interpreter (Triton reads it when the kernels are defined)")
    if DEVICE.type == "cpu":  # an interpreter that runs them as a GPU does (tests/_triton_interpreter.py)
        from _helpers import triton_interpreter_problem
        return triton_interpreter_problem()
    return None


DEVICE = _device()
needs_kernels = pytest.mark.skipif(_kernels_skip_reason() is not None, reason=str(_kernels_skip_reason()))


@pytest.fixture(scope="module")
def tb():
    """The backend module (loaded through the registry, as the optimizers load it)."""
    from accum_fused.backends import _load, unavailable_reasons

    module = _load("triton")
    assert module is not None, unavailable_reasons().get("triton")
    return module


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (Triton's mode and the registry are per process)."""
    base = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES")}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**base, **env},
                          capture_output=True, text=True, timeout=600, cwd=ROOT)


# ------------------------------------------------------------------------------ availability
def test_unavailable_on_cpu_without_interpreter():
    # No CUDA device and no TRITON_INTERPRET: unavailable with the reason and the fix, decided
    # without importing Triton (so "auto" does not pay for it), and "auto" still trains.
    result = _python(
        """
        import sys, torch, accum_fused
        from accum_fused.backends import unavailable_reasons
        names = accum_fused.available_backends()
        reason = unavailable_reasons()["triton"]
        imported = "triton" in sys.modules  # (torch.optim itself may import it later)
        try:
            accum_fused.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, backend="triton")
            error = None
        except RuntimeError as exc:
            error = str(exc)
        p = torch.nn.Parameter(torch.ones(2))
        opt = accum_fused.SGD([p], lr=0.1)
        p.grad = torch.ones(2)
        opt.step()
        print(repr((names, reason, error, imported, p.tolist())))
        """,
        {"CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr
    names, reason, error, imported, p = eval(result.stdout.strip().splitlines()[-1])
    assert "triton" not in names
    assert "TRITON_INTERPRET=1" in reason and "no CUDA device" in reason
    assert error is not None and "'triton' is not available" in error and "TRITON_INTERPRET=1" in error
    assert not imported
    assert p == [torch.tensor(0.9).item()] * 2  # "auto" trained it


def test_unavailable_when_triton_is_not_installed():
    result = _python(
        """
        import sys
        import torch  # (first: torch 2.15 looks for Triton itself at import, and would meet the block)
        for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
            del sys.modules[name]
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("No module named 'triton'")
        sys.meta_path.insert(0, Block())
        import accum_fused
        from accum_fused.backends import unavailable_reasons
        print(repr((accum_fused.available_backends(), unavailable_reasons()["triton"])))
        """,
        {"TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr
    names, reason = eval(result.stdout.strip().splitlines()[-1])
    assert "triton" not in names
    assert "Triton is not installed" in reason and "pip install triton" in reason


@needs_triton
def test_import_is_lazy_and_interpreter_makes_it_available():
    result = _python(
        """
        import sys, accum_fused
        before = "triton" in sys.modules
        names = accum_fused.available_backends()
        print(repr((before, names, "triton" in sys.modules)))
        """,
        {"TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr
    before, names, after = eval(result.stdout.strip().splitlines()[-1])
    assert not before  # importing accum_fused never imports Triton
    assert "triton" in names and after


@needs_kernels
def test_supports(tb):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert tb.supports(DEVICE, dtype)
    assert not tb.supports(DEVICE, torch.float64)
    if INTERPRET:
        # The interpreter cannot follow device addresses kept in the tables.
        assert not tb.supports(torch.device("cuda"), torch.float32)
    else:
        assert not tb.supports(torch.device("cpu"), torch.float32)


def _triton_version() -> str:
    import triton
    return triton.__version__


# ------------------------------------------------------------------ compilation and caching
class _Recorder:
    """Wraps ``triton_backend._launch``: records (kernel, args, constexprs) of every launch."""

    def __init__(self, tb, monkeypatch):
        self.launches = []
        real = tb._launch

        def launch(kernel, grid, *args, **constexprs):
            self.launches.append((kernel, grid, args, constexprs))
            real(kernel, grid, *args, **constexprs)

        monkeypatch.setattr(tb, "_launch", launch)

    def take(self):
        out, self.launches = self.launches, []
        return out


def _compile_keys(tb, launches) -> dict[str, set]:
    """Per kernel, the keys Triton's JIT would look its compiled binaries up by (the same
    binder JITFunction.run uses: argument types, specialisations, constexprs, options)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    keys: dict[str, set] = {}
    for kernel, _, args, constexprs in launches:
        if isinstance(kernel, JITFunction):
            jit = kernel
        else:  # interpreter: rebuild the JITFunction the same decorator arguments would give
            options = {k: v for k, v in kernel.kwargs.items() if k in ("do_not_specialize",
                                                                     "do_not_specialize_on_alignment")}
            jit = JITFunction(kernel.fn, **options)
            # The interpreter scales the tiles with the call (free there); compiled kernels use
            # fixed tile sizes.
            if "CHUNK" in constexprs:
                constexprs = {**constexprs, "BLOCK": tb.K.BLOCK, "CHUNK": tb.K.CHUNK}
        binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
        _, specialization, options = binder(*args, **constexprs, **tb.K.LAUNCH_OPTIONS)
        keys.setdefault(kernel.fn.__name__, set()).add(str(specialization) + str(sorted(options.items())))
    return keys


def _adam_state(params):
    return ([torch.zeros_like(p, dtype=torch.float32) for p in params],
            [torch.zeros_like(p, dtype=torch.float32) for p in params])


@needs_kernels
def test_scalars_and_sizes_do_not_recompile(tb, monkeypatch):
    rec = _Recorder(tb, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    for call, sizes in enumerate(([5, 4097], [1, 3, 64], [16, 2048])):
        params = [torch.randn(n, generator=gen).to(DEVICE) for n in sizes]
        buffers = [torch.empty_like(p) for p in params]
        exp_avgs, exp_avg_sqs = _adam_state(params)
        for j in range(3):  # weights 1, 2, 3: an int-valued 1 must not specialise
            grads = [torch.randn(n, generator=gen).to(DEVICE) for n in sizes]
            tb.accumulate(grads=grads, buffers=buffers, weight=j + 1, overwrite=j == 0,
                          grad_scale=torch.tensor([2.0**(call + j)], device=DEVICE),
                          norm_weight_sum=float(j + 1) if j == 2 else None)
        tb.window_norms(buffers=buffers, weight_sum=call + 1)
        tb.adam_update(params=params, buffers=buffers, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
                       max_exp_avg_sqs=[], step=call + 1, weight_sum=call + 1,
                       clip_coef=torch.tensor(1.0 / (call + 1)), lr=[1e-3, 1, torch.tensor(0.5)][call],
                       beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=[0.1, 1, 0.01][call], amsgrad=False,
                       maximize=False, decoupled_weight_decay=True)
        tb.sgd_update(params=params, buffers=buffers, momentum_buffers=[None] * len(params),
                      weight_sum=call + 1, clip_coef=None, lr=[0.1, 1, 2][call], momentum=0.9, dampening=call / 4,
                      weight_decay=1e-4, nesterov=False, maximize=False, grads=grads, weight=call + 1,
                      overwrite=False, grad_scale=None)
    launches = rec.take()
    names = [k.fn.__name__ for k, *_ in launches]
    assert names.count("accumulate_kernel") == 9 and names.count("adam_kernel") == 3
    for name, keys in _compile_keys(tb, launches).items():
        # accumulate: one variant with overwrite, one without, one with norms.
        assert len(keys) == (3 if name == "accumulate_kernel" else 1), (name, keys)


@needs_kernels
def test_tables_are_cached_and_launches_are_few(tb, monkeypatch):
    rec = _Recorder(tb, monkeypatch)
    params = [torch.randn(n).to(DEVICE) for n in [7] * 150 + [4097, 0, 1]]
    buffers = [torch.empty_like(p) for p in params]
    exp_avgs, exp_avg_sqs = _adam_state(params)
    args = dict(params=params, buffers=buffers, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, max_exp_avg_sqs=[],
                weight_sum=2.0, clip_coef=None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                amsgrad=False, maximize=False, decoupled_weight_decay=False)
    tb._plans.clear()
    tb._grad_tables.clear()
    plans, grad_tables = tb._plans, tb._grad_tables
    hits, misses, grad_misses = plans.hits, plans.misses, grad_tables.misses

    grads = [torch.randn_like(p) for p in params]
    tb.accumulate(grads=grads, buffers=buffers, weight=1.0, overwrite=True)
    assert (plans.misses - misses, grad_tables.misses - grad_misses) == (1, 1)
    tb.accumulate(grads=grads, buffers=buffers, weight=1.0, overwrite=False, norm_weight_sum=2.0)
    tb.adam_update(step=1, **args)
    tb.adam_update(step=2, grads=grads, **args)
    assert plans.misses - misses == 2  # the buffers' table, then the Adam tensors' table
    assert plans.hits - hits == 2 and grad_tables.misses - grad_misses == 1
    table = next(reversed(plans.values()))
    tb.adam_update(step=3, **args)
    assert next(reversed(plans.values())) is table  # steady state: the same device tables

    # New gradient tensors at new addresses: only the small gradient table is rebuilt.
    tb.accumulate(grads=[g.clone() for g in grads], buffers=buffers, weight=1.0, overwrite=True)
    assert plans.misses - misses == 2 and grad_tables.misses - grad_misses == 2

    # One launch per call whatever the number of tensors (153), two with norms.
    per_call = [k.fn.__name__ for k, *_ in rec.take()]
    assert per_call == ["accumulate_kernel", "accumulate_kernel", "norm_finish_kernel", "adam_kernel",
                        "adam_kernel", "adam_kernel", "accumulate_kernel"]


@needs_triton
def test_kernels_compile_for_cuda(tmp_path):
    # The interpreter does not type-check like the compiler does: compile every kernel, with
    # every option on, for sm_80 and sm_90 (no GPU needed), and check that full tiles use
    # 128-bit loads. It drives Triton's compiler through its internals (the JIT's binder and
    # argument packing, 3.6 to 3.9 here): where those differ (Triton 3.2, torch 2.6's pin), the
    # check is skipped saying so; a kernel that fails to compile fails it.
    result = _python(
        """
        import json, re, sys, torch, triton, triton.language as tl
        from accum_fused.backends import _triton_kernels as K
        try:
            from triton.backends.compiler import GPUTarget
            from triton.compiler import make_backend
            from triton.runtime.jit import create_function_from_signature
        except ImportError as exc:
            print(json.dumps({"internals": f"{type(exc).__name__}: {exc}"}))
            sys.exit(0)

        class Arg:  # what the binder reads of a tensor argument
            def __init__(self, dtype): self.dtype = dtype
            def data_ptr(self): return 0

        I64, F32 = Arg(torch.int64), Arg(torch.float32)
        tables = dict(ALIGNED=True, CHUNK=K.CHUNK, BLOCK=K.BLOCK)
        update = dict(FUSE=True, OVERWRITE=False, HAS_SCALE=True, HAS_CLIP=True, HAS_WD=True, MAXIMIZE=True)
        cases = {
            "accumulate": (K.accumulate_kernel, (I64, I64, I64, F32, F32, 2.0, 3.0),
                           dict(G_DTYPE=tl.bfloat16, OVERWRITE=False, HAS_SCALE=True, NORM=True, META=5, **tables)),
            "sumsq": (K.sumsq_kernel, (I64, I64, F32, 3.0), dict(META=5, **tables)),
            "norm_finish": (K.norm_finish_kernel, (I64, F32, F32), dict(META=5, BLOCK=K.FINISH_BLOCK)),
            "sgd": (K.sgd_kernel, (I64, I64, I64, I64, F32, F32) + (0.5,) * 6,
                    dict(ROUNDING=0, P_DTYPE=tl.bfloat16, G_DTYPE=tl.float16, HAS_MOMENTUM=True, NESTEROV=True,
                         META=8, **update, **tables)),
            "adam": (K.adam_kernel, (I64, I64, I64, I64, F32, F32) + (0.5,) * 10,
                     dict(ROUNDING=0, P_DTYPE=tl.float16, G_DTYPE=tl.bfloat16, DECOUPLED=True, AMSGRAD=True,
                          META=10, **update, **tables)),
            # bf16_update: stochastic (uint32 hash arithmetic) and Kahan (the compensation column)
            "sgd_stochastic": (K.sgd_kernel, (I64, I64, I64, I64, F32, F32) + (0.5,) * 6,
                               dict(ROUNDING=1, P_DTYPE=tl.bfloat16, G_DTYPE=tl.bfloat16, HAS_MOMENTUM=True,
                                    NESTEROV=False, META=8, **update, **tables)),
            "adam_kahan": (K.adam_kernel, (I64, I64, I64, I64, F32, F32) + (0.5,) * 10,
                           dict(ROUNDING=2, P_DTYPE=tl.bfloat16, G_DTYPE=tl.float32, DECOUPLED=True, AMSGRAD=False,
                                META=10, **update, **tables)),
        }
        out = {}
        for arch in (80, 90):
            target = GPUTarget("cuda", arch, 32)
            backend = make_backend(target)
            for name, (kernel, args, kwargs) in cases.items():
                kwargs = {**kwargs, **K.LAUNCH_OPTIONS}
                try:
                    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
                    bound, spec, opts = binder(*args, **kwargs)
                    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, opts)
                except (AttributeError, TypeError, ValueError) as exc:
                    print(json.dumps({"internals": f"{type(exc).__name__}: {exc}"}))
                    sys.exit(0)
                src = triton.compiler.ASTSource(kernel, signature, constexprs, attrs)
                ptx = triton.compile(src, target=target, options=options.__dict__).asm["ptx"]
                out[f"{name}-sm{arch}"] = dict(v4=ptx.count("ld.global.v4"), fma=len(re.findall(r"\\bfma\\.", ptx)),
                                               approx=len(re.findall(r"\\.approx", ptx)))
        print(json.dumps(out))
        """,
        {"TRITON_CACHE_DIR": str(tmp_path)},
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("Triton's CUDA toolchain (ptxas) is not installed")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if "internals" in report:
        pytest.skip(f"Triton {_triton_version()}'s JIT internals differ from those this check drives: {report['internals']}")
    assert len(report) == 14
    for name, found in report.items():
        assert found["approx"] == 0, (name, found)  # correctly rounded div and sqrt
        if name.startswith(("accumulate", "sumsq")):
            # No implicit contraction (acc + g * w, sq + x * x): rounding as in the interpreter.
            assert found["fma"] == 0, (name, found)
        if not name.startswith("norm_finish"):
            assert found["v4"] > 0, (name, found)  # full tiles use 128-bit loads


# ------------------------------------------------------------------------- vs the reference
SIZES = [0, 1, 3, 4097]
KERNEL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rand(sizes, dtype, gen, positive=False):
    out = [torch.randn(n, generator=gen, dtype=torch.float64) for n in sizes]
    return [(t.abs() if positive else t).to(dtype).to(DEVICE) for t in out]


def _clone(tensors):
    return [None if t is None else t.clone() for t in tensors]


def _close(ours, ref, tolerances, what):
    assert len(ours) == len(ref), what
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, i)
        rtol, atol = tolerances[a.dtype]
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}[{i}]: {m}")


def _window(backend, grads_per_step, buffers, weights, scales, norms):
    """Accumulate a window of micro-batches; returns the norms of the last call."""
    out = None
    for j, (grads, w, s) in enumerate(zip(grads_per_step, weights, scales)):
        last = j == len(grads_per_step) - 1
        out = backend.accumulate(grads=grads, buffers=buffers, weight=w, overwrite=j == 0, grad_scale=s,
                                 norm_weight_sum=sum(weights) if norms and last else None)
    return out


@needs_kernels
@pytest.mark.parametrize("k", [1, 2, 7])
@pytest.mark.parametrize("grad_dtype", KERNEL_DTYPES, ids=str)
def test_accumulate_window(tb, tolerances, grad_dtype, k):
    gen = torch.Generator().manual_seed(k)
    grads = [_rand(SIZES, grad_dtype, gen) for _ in range(k)]
    weights = [float(j % 3 + 1) for j in range(k)]
    scales = [None if j % 2 else torch.tensor([2.0**(j + 4)], device=DEVICE) for j in range(k)]
    buffers = [torch.full((n,), float("nan"), device=DEVICE) for n in SIZES]  # overwritten, never read
    ref_buffers = _clone(buffers)
    norms = _window(tb, grads, buffers, weights, scales, norms=True)
    ref_norms = _window(reference, grads, ref_buffers, weights, scales, norms=True)
    _close(buffers, ref_buffers, tolerances, "buffers")
    _close([norms.cpu()], [ref_norms.cpu()], tolerances, "norms")
    _close([tb.window_norms(buffers=buffers, weight_sum=3.0).cpu()],
           [reference.window_norms(buffers=ref_buffers, weight_sum=3.0).cpu()], tolerances, "window_norms")


@needs_kernels
def test_accumulate_many_small_tensors_and_mixed_grad_dtypes(tb, tolerances):
    gen = torch.Generator().manual_seed(1)
    sizes = torch.randint(0, 40, (200,), generator=gen).tolist()
    grads = _rand(sizes, torch.float32, gen)
    grads = [g.to(KERNEL_DTYPES[i % 3]) for i, g in enumerate(grads)]  # split by the launcher
    buffers = _rand(sizes, torch.float32, gen)
    ref_buffers = _clone(buffers)
    norms = tb.accumulate(grads=grads, buffers=buffers, weight=0.5, overwrite=False, norm_weight_sum=4.0)
    ref_norms = reference.accumulate(grads=grads, buffers=ref_buffers, weight=0.5, overwrite=False,
                                     norm_weight_sum=4.0)
    _close(buffers, ref_buffers, tolerances, "buffers")
    _close([norms.cpu()], [ref_norms.cpu()], tolerances, "norms")


def _last_micro_batch(fuse, sizes, gen, grad_dtype):
    if not fuse:
        return {}
    return dict(grads=_rand(sizes, grad_dtype, gen), weight=3.0, overwrite=fuse == "overwrite",
                grad_scale=torch.tensor([1024.0], device=DEVICE))


SGD_OPTIONS = {
    "plain": dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
    "momentum-dampening": dict(momentum=0.9, dampening=0.25, weight_decay=0.0, nesterov=False, maximize=False),
    "nesterov-wd-maximize": dict(momentum=0.8, dampening=0.0, weight_decay=0.1, nesterov=True, maximize=True),
}


@needs_kernels
@pytest.mark.parametrize("fuse", [None, "add", "overwrite"])
@pytest.mark.parametrize("options", list(SGD_OPTIONS), ids=str)
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16),
                                                    (torch.float16, torch.bfloat16)], ids=str)
def test_sgd_update(tb, tolerances, param_dtype, grad_dtype, options, fuse):
    gen = torch.Generator().manual_seed(2)
    sizes = SIZES
    params = _rand(sizes, param_dtype, gen)
    buffers = _rand(sizes, torch.float32, gen)
    # Mixed first and later updates in one call: a None gets a new buffer holding g.
    momentum_buffers = [None if i % 2 else b for i, b in enumerate(_rand(sizes, torch.float32, gen))]
    last = _last_micro_batch(fuse, sizes, gen, grad_dtype)
    clip = torch.tensor(0.25, device=DEVICE) if fuse != "add" else None
    ref = dict(params=_clone(params), buffers=_clone(buffers), momentum_buffers=_clone(momentum_buffers))
    common = dict(weight_sum=5.0, clip_coef=clip, lr=0.1, **SGD_OPTIONS[options], **last)
    tb.sgd_update(params=params, buffers=buffers, momentum_buffers=momentum_buffers, **common)
    reference.sgd_update(**ref, **common)
    _close(params, ref["params"], tolerances, "params")
    if SGD_OPTIONS[options]["momentum"]:
        assert all(b is not None and b.dtype == torch.float32 for b in momentum_buffers)
        _close(momentum_buffers, ref["momentum_buffers"], tolerances, "momentum_buffers")
    else:
        assert momentum_buffers[1] is None


ADAM_OPTIONS = {
    "adam": dict(amsgrad=False, maximize=False, decoupled_weight_decay=False, weight_decay=0.0),
    "adam-wd-amsgrad": dict(amsgrad=True, maximize=False, decoupled_weight_decay=False, weight_decay=0.1),
    "adamw-amsgrad-maximize": dict(amsgrad=True, maximize=True, decoupled_weight_decay=True, weight_decay=0.1),
}


@needs_kernels
@pytest.mark.parametrize("fuse", [None, "add", "overwrite"])
@pytest.mark.parametrize("options", list(ADAM_OPTIONS), ids=str)
@pytest.mark.parametrize("param_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float16),
                                                    (torch.float16, torch.bfloat16)], ids=str)
def test_adam_update(tb, tolerances, param_dtype, grad_dtype, options, fuse):
    gen = torch.Generator().manual_seed(3)
    sizes = SIZES
    params = _rand(sizes, param_dtype, gen)
    buffers = _rand(sizes, torch.float32, gen)
    exp_avgs = _rand(sizes, torch.float32, gen)
    exp_avg_sqs = _rand(sizes, torch.float32, gen, positive=True)
    amsgrad = ADAM_OPTIONS[options]["amsgrad"]
    maxes = _rand(sizes, torch.float32, gen, positive=True) if amsgrad else []
    last = _last_micro_batch(fuse, sizes, gen, grad_dtype)
    clip = torch.tensor(0.25, device=DEVICE) if fuse != "add" else None
    lr = torch.tensor(0.01) if fuse == "overwrite" else 0.01  # a tensor lr: its value is used
    state = dict(params=params, buffers=buffers, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, max_exp_avg_sqs=maxes)
    ref = {k: _clone(v) for k, v in state.items()}
    common = dict(step=4, weight_sum=5.0, clip_coef=clip, lr=lr, beta1=0.8, beta2=0.95, eps=1e-6,
                  **ADAM_OPTIONS[options], **last)
    tb.adam_update(**state, **common)
    reference.adam_update(**ref, **common)
    for key in ("params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"):
        _close(state[key], ref[key], tolerances, key)


@needs_kernels
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_reduced_precision_params_round_to_nearest_even(tb, param_dtype):
    # W = lr = 1: p + (-1) * g is one fp32 rounding in both backends, so the parameters must be
    # bit-equal; a truncating cast (Triton 3.9's interpreter for bf16) is 1 ulp off half the time.
    gen = torch.Generator().manual_seed(6)
    params = _rand([4097], param_dtype, gen)
    grads = [torch.randn(4097, generator=gen).mul_(1e-2).to(DEVICE)]
    ref_params = _clone(params)
    common = dict(weight_sum=1.0, clip_coef=None, lr=1.0, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  nesterov=False, maximize=False)
    tb.sgd_update(params=params, buffers=grads, momentum_buffers=[None], **common)
    reference.sgd_update(params=ref_params, buffers=_clone(grads), momentum_buffers=[None], **common)
    assert torch.equal(params[0], ref_params[0])


@needs_kernels
def test_many_tensors_one_fused_adamw_step(tb, tolerances):
    gen = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 64, (200,), generator=gen).tolist() + [4097]
    params = _rand(sizes, torch.bfloat16, gen)
    buffers = _rand(sizes, torch.float32, gen)
    exp_avgs, exp_avg_sqs = _adam_state(params)
    state = dict(params=params, buffers=buffers, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs, max_exp_avg_sqs=[])
    ref = {k: _clone(v) for k, v in state.items()}
    common = dict(step=1, weight_sum=2.0, clip_coef=None, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                  weight_decay=0.1, amsgrad=False, maximize=False, decoupled_weight_decay=True,
                  grads=_rand(sizes, torch.bfloat16, gen), weight=1.0, overwrite=False, grad_scale=None)
    tb.adam_update(**state, **common)
    reference.adam_update(**ref, **common)
    for key in ("params", "exp_avgs", "exp_avg_sqs"):
        _close(state[key], ref[key], tolerances, key)


@needs_kernels
def test_transposed_parameter_layout(tb, tolerances):
    # A parameter stored transposed: its buffer follows its layout; a contiguous gradient is
    # staged into that layout.
    gen = torch.Generator().manual_seed(5)
    param = torch.randn(40, 30, generator=gen).to(DEVICE).t()
    buffer = torch.empty_like(param)
    grad = torch.randn(30, 40, generator=gen).to(DEVICE)
    momentum_buffers, ref_momentum = [None], [None]
    ref_param, ref_buffer = param.clone(memory_format=torch.preserve_format), buffer.clone()
    common = dict(weight_sum=1.0, clip_coef=None, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0,
                  nesterov=False, maximize=False, grads=[grad], weight=1.0, overwrite=True, grad_scale=None)
    tb.sgd_update(params=[param], buffers=[buffer], momentum_buffers=momentum_buffers, **common)
    reference.sgd_update(params=[ref_param], buffers=[ref_buffer], momentum_buffers=ref_momentum, **common)
    _close([param, momentum_buffers[0]], [ref_param, ref_momentum[0]], tolerances, "transposed")


@needs_kernels
def test_optimizer_window_matches_reference_backend(tolerances):
    # End to end through the front: k=3 with clipping, uneven weights and a partial last window.
    # (fp32: with bf16 parameters a 1-ulp rounding flip in the first update changes the next
    # window's gradients; the kernel tests above cover bf16 parameters.)
    from _helpers import loss_of, make_batches, make_model

    models = [make_model().to(DEVICE) for _ in range(2)]
    opts = [accum_fused.AdamW(m.parameters(), lr=1e-2, accumulation_steps=3, max_grad_norm=0.05, backend=b)
            for m, b in zip(models, ("triton", "torch"))]
    norms = []
    for batch in make_batches([3, 1, 4, 1, 5, 9, 2, 6]):
        for model, opt in zip(models, opts):
            opt.zero_grad()
            loss_of(model, tuple(t.to(DEVICE) for t in batch)).backward()
            opt.step(weight=len(batch[0]))
        if opts[0].updated:
            norms.append((opts[0].last_grad_norm, opts[1].last_grad_norm))
    assert all(opt.flush() for opt in opts)
    norms.append((opts[0].last_grad_norm, opts[1].last_grad_norm))
    assert opts[0].update_count == 3 and len(norms) == 3
    rtol, atol = tolerances[torch.float32]
    for ours, ref in norms:
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@needs_kernels
@pytest.mark.parametrize("numel", [0, 1, 4097])
@pytest.mark.parametrize("overwrite", [True, False])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_one_tensor_accumulate_needs_no_table_and_matches_the_table_kernel(tb, numel, overwrite, scaled, gdtype):
    """The in-backward hooks' call (one gradient): launched with direct pointers, no table built
    or uploaded (each gradient is a new tensor, which missed the table cache every pass); bit for
    bit the table kernel's result on the same tensor, norms included."""
    gen = torch.Generator().manual_seed(numel)
    grad = torch.randn(numel, generator=gen).to(gdtype).to(DEVICE)
    start = torch.randn(numel, generator=gen).to(DEVICE)
    other_g, other_b = torch.randn(3, device=DEVICE).to(gdtype), torch.randn(3, device=DEVICE)  # a second tensor
    scale = torch.tensor([4.0], device=DEVICE) if scaled else None
    one, two = start.clone(), start.clone()
    plans = len(tb._plans), len(tb._grad_tables)
    norm_one = tb.accumulate(grads=[grad], buffers=[one], weight=0.75, overwrite=overwrite, grad_scale=scale,
                             norm_weight_sum=3.0)
    assert (len(tb._plans), len(tb._grad_tables)) == plans  # no table for it
    norms = tb.accumulate(grads=[grad, other_g], buffers=[two, other_b.clone()], weight=0.75, overwrite=overwrite,
                          grad_scale=scale, norm_weight_sum=3.0)
    assert torch.equal(one, two)
    assert torch.equal(norm_one.reshape(()), norms[0])
    assert tb.accumulate(grads=[grad], buffers=[one], weight=0.75, overwrite=overwrite, grad_scale=scale) is None


@needs_triton
def test_a_triton_before_3_4_loads_interpreted_as_its_jit_reads_it():
    """Triton < 3.4 has no ``triton.knobs`` (torch 2.6 pins 3.2): the kernels' module read it at
    import and the backend failed to load. Whether the kernels are interpreted is then read from
    TRITON_INTERPRET, as that Triton's jit reads it."""
    result = _python(
        """
        import triton
        if hasattr(triton, "knobs"):
            del triton.knobs
        import accum_fused
        from accum_fused.backends import _load, unavailable_reasons
        print(repr((accum_fused.available_backends(), unavailable_reasons().get("triton"),
                    _load("triton").INTERPRETED)))
        """,
        {"TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr
    names, reason, interpreted = eval(result.stdout.strip().splitlines()[-1])
    assert "triton" in names, reason
    assert interpreted


@needs_triton
def test_a_triton_the_kernels_cannot_use_is_unavailable_with_the_reason():
    """A Triton that is installed but breaks the kernels' module at import (not an ImportError):
    the backend is unavailable with that reason, "auto" trains on another backend, and naming it
    raises with the reason, as for a missing Triton."""
    result = _python(
        """
        import torch, triton
        def jit(*args, **kwargs):
            raise RuntimeError("simulated: this Triton cannot compile these kernels")
        triton.jit = jit
        import accum_fused
        from accum_fused.backends import unavailable_reasons
        p = torch.nn.Parameter(torch.ones(2))
        opt = accum_fused.SGD([p], lr=0.1, accumulation_steps=1)
        p.grad = torch.ones(2)
        opt.step()
        try:
            accum_fused.SGD([p], lr=0.1, backend="triton")
            error = None
        except RuntimeError as exc:
            error = str(exc)
        print(repr((accum_fused.available_backends(), unavailable_reasons()["triton"], error, p.tolist())))
        """,
        {"TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr
    names, reason, error, p = eval(result.stdout.strip().splitlines()[-1])
    assert "triton" not in names
    assert "RuntimeError: simulated: this Triton cannot compile these kernels" in reason
    assert error is not None and "'triton' is not available" in error and "simulated" in error
    assert p == [torch.tensor(0.9).item()] * 2
