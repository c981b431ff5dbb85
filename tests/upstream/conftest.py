"""PyTorch's optimizer test suite (its ``test/test_optim.py``, unmodified, as ``test_optim.py``
in this folder) run on accum_fused's SGD, Adam and AdamW.

What runs
    ``TestOptimRenewedCPU`` restricted to SGD, Adam and AdamW on CPU; every other optimizer,
    every non-CPU device class and the tests that do not go through ``optim_db``
    (``test_adamw_serialization``, ``test_step_iteration``: torch.optim only) are deselected.
    The ``differentiable=True`` configurations are dropped, because accum_fused refuses
    ``differentiable=True`` by design: "differentiable" is removed from the three
    ``OptimizerInfo.supported_impls`` (so ``_get_optim_inputs_including_global_cliquey_kwargs``
    never adds it) and the error inputs that pass ``differentiable=True`` are filtered out of
    ``optim_error_inputs_func``. The same selection runs in the baseline (below).

How accum_fused is substituted
    The upstream tests take the optimizer class from ``optim_info.optim_cls`` when they run,
    and ``@optims(optim_db)`` keeps references to the very ``OptimizerInfo`` objects of
    ``torch.testing._internal.common_optimizers.optim_db``. So nothing depends on import
    order and no list is replaced: the ``optim_cls`` attribute of those three objects is
    swapped in ``setUp`` and restored by a cleanup after each test. The classes swapped in are
    subclasses of ``accum_fused.SGD`` / ``Adam`` / ``AdamW`` that pin ``accumulation_steps=1``
    and one ``backend=``; they keep the names ``SGD`` / ``Adam`` / ``AdamW`` because the
    upstream tests branch on ``optim_cls.__name__`` (and the test ids are built from it).

One run per backend
    pytest's fixture parametrization does not apply to ``unittest.TestCase`` classes, so the
    repetition is done at collection: ``pytest_pycollect_makeitem`` replaces
    ``TestOptimRenewedCPU`` by one subclass per backend, ``TestOptimRenewedCPU_backend_torch``,
    ``..._cpp`` and ``..._triton``, whose ``setUp`` activates that backend's classes. A backend
    that does not load here (triton without ``TRITON_INTERPRET=1`` or CUDA) is skipped with
    the reason, as in ``tests/conftest.py``. Select one with ``-k backend_cpp``. The triton
    copy runs a subset by default (``TRITON_SUBSET_DROP``: Triton's interpreter is ~6x slower);
    ``ACCUM_FUSED_UPSTREAM_TRITON=full`` runs all of it.

Baseline
    ``ACCUM_FUSED_UPSTREAM_BASELINE=1`` runs the same selection on torch.optim itself (no
    substitution, no expected failures): the set of tests accum_fused is measured against.

Expected failures
    ``EXPECTED_FAILURES`` (test name -> reason, exception) lists the upstream tests that
    cannot pass on accum_fused by design; each is marked ``xfail(strict=True, raises=...)``,
    so CI fails when anything else breaks, when one of these fails otherwise, *and* when one
    starts passing (then remove it from the list). An
    entry that matches no collected test is an error when the whole file is collected, so
    the list cannot go stale when the vendored file is updated.

``test_optim.py`` imports ``TestLRScheduler``, ``TestDifferentiableOptimizer`` and
``TestSWAUtils`` from PyTorch's ``test/optim/`` package to re-export them; those suites do not
exercise ``optim_db`` (schedulers, ``differentiable=True``, SWA) and are not vendored: empty
stand-ins are registered as ``optim.test_*`` modules (only if no such module is importable).

Without ``test_optim.py`` in this folder this conftest does nothing. It needs ``expecttest``
(imported by ``torch.testing._internal.common_utils``).
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
import types
from pathlib import Path

import pytest

HERE = Path(os.path.abspath(__file__)).parent
UPSTREAM_FILE = HERE / "test_optim.py"
ACTIVE = UPSTREAM_FILE.exists()

BASELINE = os.environ.get("ACCUM_FUSED_UPSTREAM_BASELINE", "") not in ("", "0")
BACKENDS = ("torch", "cpp", "triton")
OPTIMIZERS = ("SGD", "Adam", "AdamW")
UPSTREAM_CLASS = "TestOptimRenewedCPU"
CLASS_PREFIX = f"{UPSTREAM_CLASS}_backend_"

# Upstream test name (the method name, without class) -> (why it cannot pass on accum_fused,
# the exception accum_fused raises there). Applied to every backend; any other exception fails.
# Only principled refusals belong here; defects are fixed instead.
_SPARSE = ("accum_fused refuses sparse gradients by design (RuntimeError at step): it "
           "accumulates every micro-batch into dense fp32 buffers", RuntimeError)
EXPECTED_FAILURES: dict[str, tuple[str, type[BaseException]]] = {
    "test_rosenbrock_sparse_with_lrsched_True_SGD_cpu_float64": _SPARSE,
    "test_rosenbrock_sparse_with_lrsched_False_SGD_cpu_float64": _SPARSE,
}

# Triton's interpreter (how the triton backend runs on CPU) makes the backend_triton copy ~6x
# slower than the others (~9-14 min on 2 cores for the whole selection). By default it runs
# every upstream test but only one value of the parameters that cannot reach a kernel;
# ACCUM_FUSED_UPSTREAM_TRITON=full runs all of it. Pattern (searched in the test name) -> why.
TRITON_FULL = os.environ.get("ACCUM_FUSED_UPSTREAM_TRITON", "") == "full"
TRITON_SUBSET_DROP: dict[str, str] = {
    r"^test_forloop_goes_right_direction_\w+_with_lrsched_True_":
        "LR schedulers only change lr between steps; with_lrsched_False runs, and "
        "test_param_group_with_lrscheduler_goes_right_direction keeps schedulers on triton",
    r"_is_named_optim[01]?_True_":
        "parameter names are state_dict bookkeeping; the is_named_..._False variants run",
    r"^test_tensor_lr_num_dim_[12]_": "the shape of a tensor lr is read on the host; num_dim_0 runs",
    r"_cpu_float64$": "the triton backend hands fp64 to the reference backend: backend_torch's run",
}

# test_<name>[_<params>]_<Optimizer>_cpu_<dtype>; the optimizer is the part before _cpu_.
_TEST_NAME = re.compile(r"^test_\w+?_(?P<optim>[A-Za-z]+)_cpu_[a-z0-9]+$")


def _install_test_optim_import_stand_ins() -> None:
    """Empty stand-ins for PyTorch's test/optim/ modules that test_optim.py re-exports."""
    stand_ins = {
        "optim.test_lrscheduler": "TestLRScheduler",
        "optim.test_optim": "TestDifferentiableOptimizer",
        "optim.test_swa_utils": "TestSWAUtils",
    }
    try:
        real = importlib.util.find_spec("optim") is not None
    except (ImportError, ValueError):
        real = False
    if real or "optim" in sys.modules:
        return
    package = types.ModuleType("optim")
    package.__path__ = []  # a package without files
    package.__doc__ = "Stand-in for PyTorch's test/optim/ package (tests/upstream/conftest.py)."
    sys.modules["optim"] = package
    for module_name, class_name in stand_ins.items():
        module = types.ModuleType(module_name)
        module.__doc__ = f"Stand-in: {class_name} is not vendored (see tests/upstream/conftest.py)."
        # __test__ = False: pytest must not collect the empty stand-in where it is re-exported.
        setattr(module, class_name, type(class_name, (), {"__test__": False}))
        sys.modules[module_name] = module
        setattr(package, module_name.rsplit(".", 1)[1], module)


def _pinned_class(base: type, backend: str) -> type:
    def __init__(self, params, *args, **kwargs):
        for pinned in ("accumulation_steps", "backend"):
            if pinned in kwargs:
                raise TypeError(f"{pinned} is pinned by tests/upstream/conftest.py")
        base.__init__(self, params, *args, accumulation_steps=1, backend=backend, **kwargs)

    cls = type(base.__name__, (base,), {
        "__init__": __init__,
        "__module__": __name__,
        "__doc__": f"accum_fused.{base.__name__} pinned to accumulation_steps=1, backend={backend!r}.",
    })
    cls.__qualname__ = f"{base.__name__}[{backend}]"
    return cls


if ACTIVE:
    _install_test_optim_import_stand_ins()
    try:
        from torch.testing._internal import common_optimizers
    except ModuleNotFoundError as exc:  # expecttest, most likely
        raise ImportError(
            f"tests/upstream needs {exc.name!r} for torch.testing._internal "
            f"(pip install {exc.name}); it belongs in the [test] extra"
        ) from exc

    import accum_fused

    INFOS = {info.name: info for info in common_optimizers.optim_db if info.name in OPTIMIZERS}
    assert sorted(INFOS) == sorted(OPTIMIZERS), f"optim_db lacks one of {OPTIMIZERS}: {sorted(INFOS)}"
    TORCH_CLASSES = {name: info.optim_cls for name, info in INFOS.items()}
    PINNED = {
        backend: {name: _pinned_class(getattr(accum_fused, name), backend) for name in OPTIMIZERS}
        for backend in BACKENDS
    }

    def _drop_differentiable(error_inputs_func):
        def error_inputs(device, dtype):
            return [e for e in error_inputs_func(device, dtype)
                    if not e.optimizer_error_input.kwargs.get("differentiable", False)]
        return error_inputs

    for _info in INFOS.values():
        _info.supported_impls = tuple(i for i in _info.supported_impls if i != "differentiable")
        if _info.optim_error_inputs_func is not None:
            _info.optim_error_inputs_func = _drop_differentiable(_info.optim_error_inputs_func)

    def _activate(backend: str | None) -> None:
        for name, info in INFOS.items():
            info.optim_cls = TORCH_CLASSES[name] if backend is None else PINNED[backend][name]

    def _backend_class(upstream_cls: type, backend: str) -> type:
        def setUp(self):
            upstream_cls.setUp(self)
            if backend not in accum_fused.available_backends():
                self.skipTest(f"backend {backend!r} not available here: "
                              f"{accum_fused.backends.unavailable_reasons().get(backend, '')}")
            _activate(backend)
            self.addCleanup(_activate, None)

        return type(f"{CLASS_PREFIX}{backend}", (upstream_cls,), {
            "setUp": setUp,
            "accum_fused_backend": backend,
            "__module__": upstream_cls.__module__,
        })


def _is_upstream(collector_or_item) -> bool:
    path = getattr(collector_or_item, "path", None)
    return path is not None and Path(path).resolve() == UPSTREAM_FILE.resolve()


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    if not ACTIVE or BASELINE or name != UPSTREAM_CLASS or not _is_upstream(collector):
        return None
    collectors = []
    for backend in BACKENDS:
        sub = _backend_class(obj, backend)
        # pytest's collectors look their class up by name in the module: publish it there.
        setattr(collector.obj, sub.__name__, sub)
        result = collector.ihook.pytest_pycollect_makeitem(collector=collector, name=sub.__name__, obj=sub)
        collectors.extend(result if isinstance(result, list) else [result])
    return collectors


def pytest_collection_modifyitems(config, items):
    if not ACTIVE:
        return
    kept, deselected, matched = [], [], set()
    for item in items:
        if not _is_upstream(item):
            kept.append(item)
            continue
        cls = getattr(item, "cls", None)
        cls_name = getattr(cls, "__name__", "")
        on_cpu = cls_name == UPSTREAM_CLASS if BASELINE else cls_name.startswith(CLASS_PREFIX)
        match = _TEST_NAME.match(item.name)
        if not (on_cpu and match and match.group("optim") in OPTIMIZERS):
            deselected.append(item)
            continue
        if (getattr(cls, "accum_fused_backend", None) == "triton" and not TRITON_FULL
                and any(re.search(pattern, item.name) for pattern in TRITON_SUBSET_DROP)):
            deselected.append(item)
            continue
        kept.append(item)
        expected = None if BASELINE else EXPECTED_FAILURES.get(item.name)
        if expected is not None:
            matched.add(item.name)
            reason, raises = expected
            item.add_marker(pytest.mark.xfail(strict=True, raises=raises, reason=reason))
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    whole_file = not (config.option.keyword or config.option.markexpr
                      or any("::" in str(arg) for arg in config.args))
    stale = set(EXPECTED_FAILURES) - matched
    if not BASELINE and whole_file and stale and any(_is_upstream(i) for i in kept):
        raise pytest.UsageError(
            "tests/upstream/conftest.py: EXPECTED_FAILURES entries match no collected test "
            f"(renamed upstream?): {sorted(stale)}"
        )
