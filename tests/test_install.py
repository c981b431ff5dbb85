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
