"""Backend registry.

A backend is a module with the keyword-only functions of ``reference.py`` (``accumulate``,
``window_norms``, ``sgd_update``, ``adam_update``, ``write_window_grads``) and
``supports(device, dtype)``. Backends are loaded lazily, on first use, so importing accum_fused
never builds, loads or touches anything beyond PyTorch itself.
"""
from __future__ import annotations

import importlib
import itertools
import operator
import warnings
from types import ModuleType

import torch

from ..framework_guard import user_stacklevel
from . import reference

BACKEND_NAMES = ("torch", "cpp", "triton")
AUTO = "auto"

# Why each optional backend is unavailable; filled in by _load on first use.
_unavailable: dict[str, str] = {}
_loaded: dict[str, ModuleType] = {"torch": reference}
_warned_auto_fallback = False

# The fix quoted in every error about an optional backend. A backend without a module here is
# not part of this release: it is reported unavailable but never warned about.
_FIX = {
    "cpp": (
        "reinstall accum_fused with its extension: `pip install --no-build-isolation --force-reinstall .` "
        "from the source tree, after installing torch and with ACCUM_FUSED_NO_EXTENSION unset"
    ),
    "triton": (
        "install Triton (`pip install triton`; PyTorch's CUDA wheels include it) and use CUDA tensors, "
        "or set TRITON_INTERPRET=1 before importing accum_fused to run the Triton kernels on CPU "
        "through Triton's interpreter (slow; for testing)"
    ),
}
_SHIPPED: tuple[str, ...] = ("torch", "cpp", "triton")


def _load(name: str) -> ModuleType | None:
    if name in _loaded:
        return _loaded[name]
    if name in _unavailable:
        return None
    if name not in _SHIPPED:
        _unavailable[name] = "not built"
        return None
    try:
        module = importlib.import_module(f"{__name__}.{name}_backend")
    except Exception as exc:  # noqa: BLE001
        # ImportError: not installed, not built, no device. Anything else is a package installed
        # but not one this backend can use (a Triton whose API its kernels' module does not find,
        # say): unavailable all the same, with the reason, rather than an error out of every
        # optimizer that asks for "auto".
        _unavailable[name] = f"{type(exc).__name__}: {exc}"
        return None
    _loaded[name] = module
    return module


def available_backends() -> list[str]:
    """Names of the backends that load on this machine, in order of preference."""
    return [name for name in BACKEND_NAMES if _load(name) is not None]


def unavailable_reasons() -> dict[str, str]:
    """For each backend that does not load: why, and the command that fixes it."""
    available_backends()
    return {name: f"{_unavailable[name]} ({_FIX[name]})" for name in _unavailable}


def check_name(name: str) -> None:
    """Validate a user-given backend name; raise if it is unknown or cannot load."""
    if not isinstance(name, str) or (name != AUTO and name not in BACKEND_NAMES):
        raise ValueError(
            f"unknown backend {name!r}: choose one of {(AUTO,) + BACKEND_NAMES}; "
            f"available here: {available_backends()}"
        )
    if name != AUTO and _load(name) is None:
        raise RuntimeError(
            f"accum_fused backend {name!r} is not available: {_unavailable[name]}. "
            f"Fix: {_FIX[name]}; or use backend='auto'."
        )


def extension() -> ModuleType | None:
    """The extension's backend (cpp_backend), where it loads: the fast paths' own calls
    (window.table's checks, the update's step counts) whatever the user's backend choice."""
    return _load("cpp")


def same_objects(lists: list[list], objects: tuple) -> bool:
    """Whether ``lists`` hold exactly ``objects``, in order, by identity (base.py's
    _wiring_stands): in the extension where it loads, ~5 us at 5,000 parameters."""
    cpp = extension()
    if cpp is not None:
        return cpp.same_objects(lists, objects)
    return (sum(map(len, lists)) == len(objects)
            and all(map(operator.is_, itertools.chain.from_iterable(lists), objects)))


def extension_paths(name: str, *, table: bool = False) -> ModuleType | None:
    """The extension's backend (cpp_backend) where the user's backend choice ``name`` lets its
    host-side paths run, else None. Each path takes only what it runs exactly as the choice
    would: in_backward's C++ hooks take the cpp backend's parameters and, on a GPU, every
    gradient (added with torch's ops whatever the backend), so "triton" gets them too; plain
    mode's step table (``table``) runs the cpp backend's kernels only. The reference, the spec,
    keeps Python's paths alone."""
    return None if name not in ((AUTO, "cpp") if table else (AUTO, "cpp", "triton")) else extension()


def _auto_candidates(device: torch.device) -> tuple[str, ...]:
    # Fastest first. On CPU, Triton runs only through its interpreter (for tests): never "auto".
    # On CUDA, cpp comes before triton until a benchmark on the device says otherwise.
    return ("cpp", "triton", "torch") if device.type == "cuda" else ("cpp", "torch")


def resolve(name: str, device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The backend module that runs tensors of (device, dtype) for the user's choice ``name``
    (a complex dtype as its real one). Asked once per parameter per micro-batch by the
    in-backward hooks: deciding costs 4-5 us, the kept answer a fraction.

    A named backend that does not support the pair (fp64 on a kernel backend, say) hands it
    to the reference, which supports every floating dtype. "auto" takes the first of
    ``_auto_candidates(device)`` that loads and supports the pair, warning once when it falls
    back to the reference because a backend it would have used failed to load.
    """
    key = (name, device, dtype)
    module = _resolved.get(key)
    if module is None:
        module = _resolved[key] = _decide(name, device, dtype.to_real())
    return module


# resolve's answers: they stand for the process's life, since a backend that loaded (or failed
# to) stays so (_load).
_resolved: dict[tuple, ModuleType] = {}


def _decide(name: str, device: torch.device, dtype: torch.dtype) -> ModuleType:
    global _warned_auto_fallback
    candidates = _auto_candidates(device) if name == AUTO else (name,)
    for candidate in candidates:
        module = _load(candidate)
        if module is not None and module is not reference and module.supports(device, dtype):
            return module
    # The reference, by choice, for a dtype no kernel backend supports, or as a fallback.
    failed = {n: _unavailable[n] for n in candidates if n in _unavailable and n in _SHIPPED}
    if name == AUTO and failed and not _warned_auto_fallback:
        _warned_auto_fallback = True
        reasons = "; ".join(f"{n}: {why} (fix: {_FIX[n]})" for n, why in failed.items())
        warnings.warn(f"accum_fused: using the slower reference backend ({reasons})", stacklevel=user_stacklevel())
    return reference
