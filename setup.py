"""Build script for accum_fused.

Install with ``pip install --no-build-isolation .`` after ``pip install torch==2.13.0``.
torch is deliberately not an install requirement: an unpinned ``torch`` requirement makes pip
download the newest CUDA build (several GB) even where a matching CPU build is installed.

The compiled backend ``accum_fused._C`` (csrc/) is built with torch.utils.cpp_extension and ninja:
CPU kernels always; CUDA kernels too when torch is a CUDA build and nvcc is found (CUDA_HOME).
Environment:
  ACCUM_FUSED_NO_EXTENSION=1   build no extension (the package then runs on the reference backend)
  ACCUM_FUSED_NO_CUDA=1        CPU kernels only, even with a CUDA torch and nvcc
  ACCUM_FUSED_MARCH=native     add -march=<value> (only for builds run on the building machine)
  TORCH_CUDA_ARCH_LIST, MAX_JOBS  honoured by torch's BuildExtension
"""
import os
import sys

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



def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _extension_options() -> dict:
    """ext_modules/cmdclass for accum_fused._C, or nothing with ACCUM_FUSED_NO_EXTENSION."""
    if _flag("ACCUM_FUSED_NO_EXTENSION"):
        return {}
    from torch.utils import cpp_extension

    sources = ["csrc/bindings.cpp", "csrc/cpu/driver.cpp", "csrc/cpu/kernels.cpp", "csrc/cpu/kernels_avx2.cpp"]
    # -ffp-contract=off: the kernels fuse a multiply-add only where torch's kernels do
    # (csrc/math.h); letting the compiler contract others would break bit-equality with torch.
    cxx = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-unknown-pragmas"]
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is a header template: without OpenMP in this library it runs on one
        # thread (measured: 1.0 CPUs used). libgomp.so.1 resolves to the copy torch has loaded.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    march = os.environ.get("ACCUM_FUSED_MARCH", "").strip()
    if march:
        cxx.append(f"-march={march}")
    build_cuda = (
        torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None and not _flag("ACCUM_FUSED_NO_CUDA")
    )
    kwargs = dict(include_dirs=[os.path.join(here, "csrc")], extra_compile_args={"cxx": cxx}, extra_link_args=link)
    if build_cuda:
        sources.append("csrc/cuda/kernels.cu")
        # -fmad=false: the CUDA kernels contract exactly where the CPU kernels do (math.h).
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++17", "-fmad=false"]
        kwargs["define_macros"] = [("WITH_CUDA", None)]
        extension = cpp_extension.CUDAExtension("accum_fused._C", sources, **kwargs)
    else:
        extension = cpp_extension.CppExtension("accum_fused._C", sources, **kwargs)
    return dict(
        ext_modules=[extension],
        cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
    )


setup(
    name="accum_fused",
    version=version,
    description="Gradient accumulation inside the optimizer: fused, fp32-accurate, drop-in for torch.optim",
    long_description=open(os.path.join(here, "README.md")).read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["accum_fused", "accum_fused.*"]),
    python_requires=">=3.9",
    extras_require={
        "demo": ["tqdm", "matplotlib"],
        "triton": ["triton"],
        "test": ["pytest>=7", "numpy", "tqdm", "matplotlib", "triton"],
    },
    **_extension_options(),
)
