"""Build script for accum_fused.

Install with ``pip install --no-build-isolation .`` after ``pip install torch==2.13.0``.
torch is deliberately not an install requirement: an unpinned ``torch`` requirement makes pip
download the newest CUDA build (several GB) even where a matching CPU build is installed.

The compiled backend ``accum_fused._C`` (csrc/) is built with torch.utils.cpp_extension and ninja:
CPU kernels always; CUDA kernels too when torch is a CUDA build and nvcc is found (CUDA_HOME).
Environment:
  ACCUM_FUSED_NO_EXTENSION=1   build no extension (the package then runs on the reference backend)
  ACCUM_FUSED_NO_CUDA=1        CPU kernels only, even with a CUDA torch and nvcc
  ACCUM_FUSED_REQUIRE_CUDA=1   the CUDA kernels or an error: without it, a CUDA torch whose CUDA kernels
                               cannot be built here (no nvcc, an nvcc of another major CUDA version
                               than torch's, nvcc failing on csrc/cuda) gets the CPU kernels only, and
                               the build says so in one line (`python -m accum_fused info` repeats why)
  ACCUM_FUSED_MARCH=native     add -march=<value> (only for builds run on the building machine)
  TORCH_CUDA_ARCH_LIST, MAX_JOBS  honoured by torch's BuildExtension (with no GPU visible and no
                               TORCH_CUDA_ARCH_LIST: the cards this torch was built for that nvcc knows)
  CXX                          the C++ compiler (default c++)
A build without a working C++ compiler stops with a message naming the fix and
ACCUM_FUSED_NO_EXTENSION=1, rather than falling back silently: the fast build was asked for.
"""
import copy
import os
import shlex
import shutil
import sys

import setuptools
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


# In the package, beside the extension: why this build has no CUDA kernels though torch is a CUDA
# build (`python -m accum_fused info` shows it). Absent when it has them, or torch is a CPU build.
CUDA_SKIPPED_RECORD = "_C_without_cuda.txt"


def _describe(exc: BaseException) -> str:
    """An exception in one line; torch's RuntimeError(format, *values) (its CUDA version mismatch)
    formatted as it meant."""
    args = exc.args
    if len(args) > 1 and isinstance(args[0], str) and args[0].count("%s") == len(args) - 1:
        text = args[0] % args[1:]
    else:
        text = str(exc)
    return f"{type(exc).__name__}: {' '.join(text.split())}"


def _skip_cuda(reason: str, fix: str, announce: bool = True):
    """Go on without the CUDA kernels, or stop with the fix when ACCUM_FUSED_REQUIRE_CUDA=1. Returns
    the record for `info` and the one line the build prints (None when announce is False: the user
    asked for no CUDA kernels)."""
    if _flag("ACCUM_FUSED_REQUIRE_CUDA"):
        raise SystemExit(
            f"\nerror: ACCUM_FUSED_REQUIRE_CUDA=1, and accum_fused's CUDA kernels cannot be built: {reason}.\n"
            f"Fix: {fix}.\n"
            "(Without ACCUM_FUSED_REQUIRE_CUDA the build goes on with the CPU kernels only; on a GPU accum_fused "
            "then runs Triton's and torch's kernels.)")
    line = (f"accum_fused: building without the CUDA kernels: {reason}. The CPU kernels and hooks are built; on "
            f"a GPU accum_fused runs Triton's and torch's kernels instead. For the CUDA kernels, {fix}. "
            "(ACCUM_FUSED_NO_CUDA=1 silences this; ACCUM_FUSED_REQUIRE_CUDA=1 makes it an error.)")
    return f"{reason}; for the CUDA kernels, {fix}", line if announce else None


def _record_cuda_skip(record, package_dirs) -> None:
    """Write (or, with record None, remove) CUDA_SKIPPED_RECORD in each package directory there is."""
    for folder in package_dirs:
        path = os.path.join(folder, CUDA_SKIPPED_RECORD)
        try:
            if record is None:
                if os.path.exists(path):
                    os.remove(path)
            elif os.path.isdir(folder):
                with open(path, "w") as f:
                    f.write(record + "\n")
        except OSError:  # the record only informs `info`; it never fails a build
            pass


def _build_ext_class(base, cuda_skipped=None, cpu_only=None):
    """torch's BuildExtension, failing with the fix (a compiler, or ACCUM_FUSED_NO_EXTENSION=1)
    instead of ninja's bare error when the C++ extension cannot be built.

    cpu_only: the extension without its CUDA sources, for a CUDA build. When building the CUDA one
    fails (nvcc on csrc/cuda, its link, or torch's own toolkit checks), the build goes on with
    cpu_only and says so, unless ACCUM_FUSED_REQUIRE_CUDA=1. cuda_skipped: _skip_cuda's (record,
    line) when a CUDA torch's build has no CUDA kernels (decided before it, in _extension_options),
    the line printed when the build starts (setup.py runs several times in a pip install; it builds
    once). The outcome is recorded in the package (CUDA_SKIPPED_RECORD) for `python -m accum_fused
    info`."""
    def failed(exc):
        return SystemExit(
            f"\nerror: building accum_fused's C++ extension failed: {_describe(exc)}\n"
            "The compiler's output, if it ran, is above. If a compiler or a header (Python.h) is missing:\n"
            + NO_COMPILER_HELP)

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
            # torch's build_extensions wraps the compiler's methods: a second build starts from these
            compiler_state = dict(vars(self.compiler))
            record, line = cuda_skipped or (None, None)
            if line:
                print(line, file=sys.stderr)
            try:
                super().build_extensions()
            except Exception as exc:
                if cpu_only is None:
                    raise failed(exc) from exc
                record, line = _skip_cuda(
                    f"building them failed ({_describe(exc)}; the compiler's output is in the build log: "
                    "pip install -v)",
                    f"use a CUDA toolkit that builds for this torch (CUDA {torch.version.cuda}) with a host compiler "
                    "it supports (CUDA_HOME=/path/to/it pip install --no-build-isolation -e .)")
                print(line, file=sys.stderr)
                vars(self.compiler).clear()
                vars(self.compiler).update(compiler_state)
                for extension in self.extensions:
                    if extension.name == cpu_only.name:
                        for attr, value in vars(cpu_only).items():
                            if not attr.startswith("_") and attr != "name":
                                setattr(extension, attr, copy.deepcopy(value))
                try:
                    super().build_extensions()
                except Exception as exc2:
                    raise failed(exc2) from exc2
            _record_cuda_skip(record, [os.path.join(here, "accum_fused"), os.path.join(self.build_lib, "accum_fused")])

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


def _nvcc_release(nvcc: str):
    """The CUDA version `nvcc --version` states ("13.0"), read as torch's extension builder reads
    it; None when nvcc does not run or does not say."""
    import re
    import subprocess

    try:
        output = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+[.]\d+)", output)
    return match.group(1) if match else None


def _toolkit_problem(torch_cuda: str, cuda_home, torch_version: str):
    """(what is wrong, the fix) when torch's extension builder would refuse the CUDA toolkit at
    cuda_home for a torch built with CUDA torch_cuda, else None. Its rule
    (torch.utils.cpp_extension._check_cuda_version): nvcc must be at CUDA_HOME/bin/nvcc; an nvcc of
    another major CUDA version than torch's is an error, of another minor version a warning only,
    and one that does not state its release is not checked."""
    major = torch_cuda.split(".")[0]
    if cuda_home is None:
        return ("no CUDA toolkit was found (no nvcc on PATH, CUDA_HOME unset)",
                f"install a CUDA {major} toolkit and point CUDA_HOME at it")
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    if not os.path.exists(nvcc):
        return (f"there is no nvcc at {nvcc}",
                f"point CUDA_HOME at a CUDA {major} toolkit (CUDA_HOME=/usr/local/cuda-{torch_cuda})")
    release = _nvcc_release(nvcc)
    if release is None or release.split(".")[0] == major:
        return None
    return (f"the CUDA toolkit at {cuda_home} is CUDA {release} and this torch was built with CUDA {torch_cuda} "
            f"(torch builds extensions only with a toolkit of its own major version)",
            f"build with a CUDA {major} toolkit (CUDA_HOME=/usr/local/cuda-{torch_cuda} pip install "
            f"--no-build-isolation -e .) or install the torch built for CUDA {release} (pip install "
            f"torch=={torch_version.split('+')[0]} --index-url "
            f"https://download.pytorch.org/whl/cu{release.replace('.', '')})")


def _extension_options(cpp_extension=None) -> dict:
    """ext_modules/cmdclass for accum_fused._C, or nothing with ACCUM_FUSED_NO_EXTENSION."""
    if _flag("ACCUM_FUSED_NO_EXTENSION"):
        return {}
    if cpp_extension is None:
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
    kwargs = dict(include_dirs=[os.path.join(here, "csrc")], extra_compile_args={"cxx": cxx}, extra_link_args=link)
    cpu_only = cpp_extension.CppExtension("accum_fused._C", list(sources), **copy.deepcopy(kwargs))
    cmdclass = lambda **options: {"build_ext": _build_ext_class(  # noqa: E731
        cpp_extension.BuildExtension.with_options(use_ninja=True), **options)}

    # Whether the CUDA kernels can be built: where they cannot, the build goes on without them
    # (_skip_cuda: a line saying why and the fix, which build_ext prints, or an error with
    # ACCUM_FUSED_REQUIRE_CUDA=1).
    if torch.version.cuda is None:
        _skip_cuda(f"this torch ({torch.__version__}) is a CPU build",
                   "install a CUDA build of torch (https://pytorch.org/get-started/locally/)", announce=False)
        return dict(ext_modules=[cpu_only], cmdclass=cmdclass())
    if _flag("ACCUM_FUSED_NO_CUDA"):
        skipped = _skip_cuda("ACCUM_FUSED_NO_CUDA=1 was set", "unset ACCUM_FUSED_NO_CUDA", announce=False)
        return dict(ext_modules=[cpu_only], cmdclass=cmdclass(cuda_skipped=skipped))
    problem = _toolkit_problem(torch.version.cuda, cpp_extension.CUDA_HOME, torch.__version__)
    if problem is None and not os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip() and torch.cuda.device_count() == 0:
        archs = _cuda_archs_without_a_gpu(cpp_extension)
        if archs:
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
            print(f"accum_fused: no GPU visible; building the CUDA kernels for this torch's cards that nvcc "
                  f"supports: TORCH_CUDA_ARCH_LIST={archs} (set TORCH_CUDA_ARCH_LIST to your cards' for a faster "
                  "build)", file=sys.stderr)
        else:
            problem = ("this machine shows no GPU to build them for, and the cards this torch was built for and "
                       f"those {cpp_extension.CUDA_HOME}/bin/nvcc compiles for have none in common or could not be "
                       "read",
                       "name the cards to build for (TORCH_CUDA_ARCH_LIST=\"8.0;9.0\" pip install "
                       "--no-build-isolation -e .)")
    if problem is not None:
        return dict(ext_modules=[cpu_only], cmdclass=cmdclass(cuda_skipped=_skip_cuda(*problem)))
    # -fmad=false: the CUDA kernels contract exactly where the CPU kernels do (math.h).
    kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++17", "-fmad=false"]
    kwargs["define_macros"] = [("WITH_CUDA", None)]
    extension = cpp_extension.CUDAExtension("accum_fused._C", sources + ["csrc/cuda/kernels.cu"], **kwargs)
    return dict(ext_modules=[extension], cmdclass=cmdclass(cpu_only=cpu_only))


HF_TRANSFORMERS, HF_ACCELERATE, LIGHTNING = "transformers==5.23.0", "accelerate==1.15.0", "lightning==2.6.6"

CLASSIFIERS = [
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
]


def _license_options(setuptools_version: str, classifiers: list) -> dict:
    """The license and classifiers in the terms of the setuptools that builds. From setuptools 77:
    PEP 639's SPDX license_expression (which refuses a "License ::" classifier beside it). Before:
    the license field and the classifier; pyproject.toml asks for setuptools>=77, but
    `pip install --no-build-isolation` builds with the environment's, and an older one ignored
    license_expression ("Unknown distribution option") and lost the license from the metadata.
    LICENSE is picked up by setuptools' default license_files patterns (LICEN[CS]E*) in both."""
    import re

    match = re.match(r"\d+", setuptools_version)
    if match is None or int(match.group()) >= 77:
        return dict(license_expression="BSD-3-Clause", classifiers=list(classifiers))
    return dict(license="BSD-3-Clause", classifiers=list(classifiers) + ["License :: OSI Approved :: BSD License"])


setup(
    name="accum_fused",
    version=version,
    description="Gradient accumulation inside the optimizer: fused, fp32-accurate, drop-in for torch.optim",
    long_description=open(os.path.join(here, "README.md")).read(),
    long_description_content_type="text/markdown",
    **_license_options(setuptools.__version__, CLASSIFIERS),
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
