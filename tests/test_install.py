"""The install gave what the README promises, so backend tests cannot skip their way to green.

The compiled backend must load unless the build was skipped on purpose
(ACCUM_FUSED_NO_EXTENSION=1); the Triton backend must load when the suite runs, as the README
says, with TRITON_INTERPRET=1 (or on a GPU machine).
"""
from __future__ import annotations

import os

import pytest
import torch

import accum_fused
from accum_fused import backends

from _helpers import built_without_extension


@pytest.mark.skipif(built_without_extension(), reason="installed without the extension (ACCUM_FUSED_NO_EXTENSION=1)")
def test_compiled_backend_loads():
    assert "cpp" in accum_fused.available_backends(), backends.unavailable_reasons().get("cpp")
    assert backends.resolve("auto", torch.device("cpu"), torch.float32).name == "cpp"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                    reason="run the suite with TRITON_INTERPRET=1 (README) to test the Triton backend on CPU")
def test_triton_backend_loads():
    assert "triton" in accum_fused.available_backends(), backends.unavailable_reasons().get("triton")


def test_auto_never_picks_the_triton_interpreter_on_cpu():
    assert backends.resolve("auto", torch.device("cpu"), torch.float32).name != "triton"


def _setup_function(name: str):
    """A function of setup.py, without running setup.py (which would build)."""
    import ast
    path = os.path.join(os.path.dirname(__file__), os.pardir, "setup.py")
    tree = ast.parse(open(path).read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"os": os}
    exec(compile(ast.Module([node], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


@pytest.mark.parametrize("torch_archs, nvcc_lists, expected", [
    # torch 2.11+cu130's own list, nvcc 13.0's: every card, the newest also as PTX
    ("sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
     "compute_75 compute_80 compute_86 compute_87 compute_89 compute_90 compute_100 compute_103 compute_120",
     "7.5;8.0;8.6;9.0;10.0;12.0+PTX"),
    # an older nvcc that knows no Blackwell; arch-specific variants (sm_90a) are not a card list's
    ("sm_80 sm_90 sm_90a sm_100 sm_120", "compute_80 compute_90", "8.0;9.0+PTX"),
    ("sm_100", "compute_80 compute_90", ""),  # nothing in common: the build must say so
    ("", "compute_90", ""),                   # a torch that does not say
])
def test_a_build_with_no_gpu_visible_targets_the_cards_torch_and_nvcc_share(tmp_path, torch_archs, nvcc_lists,
                                                                           expected):
    """setup.py with a CUDA torch, nvcc and no GPU visible (where torch's BuildExtension fails with
    a bare IndexError): TORCH_CUDA_ARCH_LIST from the cards the torch was built for that nvcc can
    compile for."""
    import types
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n" + "".join(f"echo {arch}\n" for arch in nvcc_lists.split()))
    nvcc.chmod(0o755)
    archs_for = _setup_function("_cuda_archs_without_a_gpu")
    fake_torch = types.SimpleNamespace(_C=types.SimpleNamespace(_cuda_getArchFlags=lambda: torch_archs))
    archs_for.__globals__["torch"] = fake_torch
    assert archs_for(types.SimpleNamespace(CUDA_HOME=str(tmp_path))) == expected
    # no nvcc there at all
    assert archs_for(types.SimpleNamespace(CUDA_HOME=str(tmp_path / "none"))) == ""


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton backend runs on CPU only under TRITON_INTERPRET=1")
def test_tritons_interpreter_runs_the_kernels_as_a_gpu_does():
    """Where it does not (Triton 3.6's, torch 2.11's pin: tl.fma rounded twice, loop bounds through a
    numpy conversion numpy refuses), the Triton backend's CPU cases skip with the reason: this test
    fails once, saying it, so such a run is not green by skipping them."""
    from _helpers import triton_interpreter_problem
    assert triton_interpreter_problem() is None, triton_interpreter_problem()
