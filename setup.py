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
  TORCH_CUDA_ARCH_LIST, MAX_JOBS  honoured by torch's BuildExtension (with no GPU visible and no
                               TORCH_CUDA_ARCH_LIST: the cards this torch was built for that nvcc knows)
  CXX                          the C++ compiler (default c++)
A build without a working C++ compiler stops with a message naming the fix and
ACCUM_FUSED_NO_EXTENSION=1, rather than falling back silently: the fast build was asked for.
"""
import os
import shlex
import shutil
import sys

from setuptools import find_packages, setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# torch is needed at build time for the extension only: with ACCUM_FUSED_NO_EXTENSION=1 the
# package installs without it (the docs build does so, in a venv without torch).
if not _flag("ACCUM_FUSED_NO_EXTENSION"):
    try:
        import torch  # noqa: F401
    except ImportError as exc:  # pragma: no cover - exercised only on a broken machine
        raise SystemExit(
            "accum_fused needs PyTorch installed before it is built: "
            "run `pip install torch==2.13.0`, then `pip install --no-build-isolation .` "
            "(or set ACCUM_FUSED_NO_EXTENSION=1 to install without the extension)"
        ) from exc

here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "accum_fused", "version.py")) as f:
    version = f.read().split('"')[1]


NO_COMPILER_HELP = """\
Install a C++17 compiler and build again:
    Debian/Ubuntu: sudo apt-get install g++      Fedora/RHEL: sudo dnf install gcc-c++
    Alpine: apk add g++                          macOS: xcode-select --install
    conda: conda install -c conda-forge cxx-compiler
  (or point CXX at one: CXX=g++-13 pip install ...)
Or build without the extension (accum_fused then runs on its pure-PyTorch reference backend,
slower: about 3.6x the optimizer time on CPU; `python -m accum_fused info` shows what runs):
    ACCUM_FUSED_NO_EXTENSION=1 pip install --no-build-isolation -e ".[demo]"
"""


def _build_ext_class(base):
    """torch's BuildExtension, failing with the fix (a compiler, or ACCUM_FUSED_NO_EXTENSION=1)
    instead of ninja's bare error when the C++ extension cannot be built."""

    class BuildExtension(base):
        def build_extensions(self):
            from torch.utils import cpp_extension

            if sys.platform != "win32":
                # ninja compiles with $CXX (else c++), setuptools links with linker_so_cxx.
                linker = getattr(self.compiler, "linker_so_cxx", None) or getattr(self.compiler, "linker_so", None)
                for role, command in (("compiler", cpp_extension.get_cxx_compiler()),
                                      ("linker", " ".join(linker or []))):
                    program = (shlex.split(command) or [""])[0]
                    if program and shutil.which(program) is None:
                        raise SystemExit(
                            f"\nerror: accum_fused's C++ extension needs a C++ compiler, and the {role} "
                            f"`{program}` was not found"
                            f"{' (CXX=' + os.environ['CXX'] + ')' if 'CXX' in os.environ else ''}.\n"
                            + NO_COMPILER_HELP)
            try:
                super().build_extensions()
            except Exception as exc:
                raise SystemExit(
                    f"\nerror: building accum_fused's C++ extension failed: {type(exc).__name__}: {exc}\n"
                    "The compiler's output, if it ran, is above. If a compiler or a header (Python.h) is missing:\n"
                    + NO_COMPILER_HELP) from exc

    return BuildExtension


def _cuda_archs_without_a_gpu(cpp_extension) -> str:
    """TORCH_CUDA_ARCH_LIST for a CUDA build on a machine that shows no GPU (a cluster's login
    node, a container build), where torch's BuildExtension would pick the visible cards' and, with
    none, fail with a bare IndexError: the cards this torch itself was built for (its sm_* arch
    flags) that this nvcc can compile for, the newest also as PTX (for newer cards). Empty when
    either is unknown."""
    import re
    import subprocess

    torch_archs = getattr(torch._C, "_cuda_getArchFlags", lambda: "")() or ""
    wanted = [m.groups() for m in re.finditer(r"\bsm_(\d+?)(\d)\b", torch_archs)]  # ("9", "0") for sm_90
    try:
        listed = subprocess.run([os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), "--list-gpu-arch"],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    nvcc_archs = set(re.findall(r"\bcompute_(\d+)\b", listed))
    archs = sorted({(int(major), int(minor)) for major, minor in wanted if major + minor in nvcc_archs})
    return ";".join(f"{major}.{minor}" for major, minor in archs) + "+PTX" if archs else ""


def _extension_options() -> dict:
    """ext_modules/cmdclass for accum_fused._C, or nothing with ACCUM_FUSED_NO_EXTENSION."""
    if _flag("ACCUM_FUSED_NO_EXTENSION"):
        return {}
    from torch.utils import cpp_extension

    sources = ["csrc/bindings.cpp", "csrc/hooks.cpp", "csrc/step_table.cpp", "csrc/cpu/driver.cpp",
               "csrc/cpu/kernels.cpp", "csrc/cpu/kernels_avx2.cpp"]
    # -ffp-contract=off: the kernels fuse a multiply-add only where torch's kernels do
    # (csrc/math.h); letting the compiler contract others would break bit-equality with torch.
    # -g0: Python's own flags ask for debug information, which made the build ~40% slower (a
    # translation unit with torch's headers: 112 s against 68 s on a 2-core VM) and the objects
    # 40x larger; torch's own wheels ship without it.
    cxx = ["-O3", "-g0", "-ffp-contract=off", "-fno-math-errno", "-Wno-unknown-pragmas"]
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
    if build_cuda and not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() and torch.cuda.device_count() == 0:
        archs = _cuda_archs_without_a_gpu(cpp_extension)
        if not archs:
            raise SystemExit(
                "\nerror: accum_fused's CUDA kernels are to be built (a CUDA torch and nvcc were found), but this "
                "machine shows no GPU to build them for, and neither this torch's CUDA architectures nor "
                f"{cpp_extension.CUDA_HOME}/bin/nvcc's could be read. Name the cards the build is for, e.g.\n"
                "    TORCH_CUDA_ARCH_LIST=\"8.0;9.0\" pip install --no-build-isolation -e .\n"
                "or build the CPU kernels only (CUDA then runs on torch's and Triton's kernels):\n"
                "    ACCUM_FUSED_NO_CUDA=1 pip install --no-build-isolation -e .")
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        print(f"accum_fused: no GPU visible; building the CUDA kernels for this torch's cards that nvcc supports: "
              f"TORCH_CUDA_ARCH_LIST={archs} (set TORCH_CUDA_ARCH_LIST to your cards' for a faster build)",
              file=sys.stderr)
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
        cmdclass={"build_ext": _build_ext_class(cpp_extension.BuildExtension.with_options(use_ninja=True))},
    )


HF_TRANSFORMERS, HF_ACCELERATE, LIGHTNING = "transformers==5.23.0", "accelerate==1.15.0", "lightning==2.6.6"

setup(
    name="accum_fused",
    version=version,
    description="Gradient accumulation inside the optimizer: fused, fp32-accurate, drop-in for torch.optim",
    long_description=open(os.path.join(here, "README.md")).read(),
    long_description_content_type="text/markdown",
    # PEP 639: an SPDX expression; setuptools >= 77 refuses "License ::" classifiers beside it.
    # LICENSE is picked up by setuptools' default license_files patterns (LICEN[CS]E*).
    license_expression="BSD-3-Clause",
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: C++",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3 :: Only",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: Software Development :: Libraries :: Python Modules",
    ],
    packages=find_packages(include=["accum_fused", "accum_fused.*"]),
    python_requires=">=3.11",  # CI runs 3.11; the GPU image 3.12 (README "Set up")
    extras_require={
        "demo": ["tqdm", "matplotlib"],
        "triton": ["triton"],
        # The framework versions accum_fused.integrations is tested with (tests/test_integration_*).
        "transformers": [HF_TRANSFORMERS, HF_ACCELERATE],
        "accelerate": [HF_ACCELERATE],
        "lightning": [LIGHTNING],
        # The docs site (mkdocs.yml): needs no torch, griffe reads the source statically (ruff formats
        # the API signatures). Build it with
        # ACCUM_FUSED_NO_EXTENSION=1 pip install -e ".[docs]" && mkdocs build --strict (docs/index.md).
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8", "mkdocstrings-python==2.0.11",
                 "griffelib==2.4.1", "pymdown-extensions==13.1.2", "ruff==0.17.6"],
        # expecttest: torch.testing._internal (PyTorch's own test_optim.py, tests/upstream) imports it.
        # build: CI's sdist smoke test (.ci/sdist_smoke.sh: python -m build --sdist --no-isolation).
        # pytest-xdist: the suite runs on every core (-n auto --dist loadfile: a file's tests, and its
        # module fixtures, stay in one worker).
        "test": ["pytest>=7", "pytest-xdist>=3.5", "numpy", "tqdm", "matplotlib", "triton", "expecttest", "build",
                 HF_TRANSFORMERS, HF_ACCELERATE, LIGHTNING],
    },
    **_extension_options(),
)
