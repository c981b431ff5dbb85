"""Build script for accum_fused.

Install with ``pip install --no-build-isolation .`` after ``pip install torch==2.13.0``.
torch is deliberately not an install requirement: an unpinned ``torch`` requirement makes pip
download the newest CUDA build (several GB) even where a matching CPU build is installed.
"""
import os

from setuptools import find_packages, setup

try:
    import torch  # noqa: F401  (needed at build time for the extension)
except ImportError as exc:  # pragma: no cover - exercised only on a broken machine
    raise SystemExit(
        "accum_fused needs PyTorch installed before it is built: "
        "run `pip install torch==2.13.0`, then `pip install --no-build-isolation .`"
    ) from exc

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "accum_fused", "version.py")) as f:
    version = f.read().split('"')[1]

setup(
    name="accum_fused",
    version=version,
    description="Gradient accumulation inside the optimizer: fused, fp32-accurate, drop-in for torch.optim",
    long_description=open(os.path.join(here, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["accum_fused", "accum_fused.*"]),
    python_requires=">=3.9",
    extras_require={"test": ["pytest>=7", "numpy"]},
)
