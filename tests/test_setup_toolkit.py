"""setup.py's decisions about the CUDA kernels and the license metadata (issue 52), without building.

A CUDA toolkit that cannot build for the installed torch (an nvcc of another major CUDA version,
which torch's extension builder refuses; nvcc failing on csrc/cuda) must not fail the install: the
build goes on with the CPU kernels and says so in one line, unless ACCUM_FUSED_REQUIRE_CUDA=1.
setup.py's functions run here against a fake nvcc (a script printing `nvcc --version`), a fake
torch and a fake torch.utils.cpp_extension, as tests/test_install.py does for the arch selection.
"""
from __future__ import annotations

import ast
import copy
import os
import shlex
import shutil
import subprocess
import sys
import types

import pytest
import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP_PY = os.path.join(ROOT, "setup.py")


def _setup_namespace(here, fake_torch=None) -> dict:
    """setup.py's functions and constants (not its top-level code, which would build), with `here`
    (the source tree the package records go into) and `torch` as given."""
    tree = ast.parse(open(SETUP_PY).read())
    nodes = [n for n in tree.body
             if isinstance(n, ast.FunctionDef)
             or (isinstance(n, ast.Assign) and isinstance(n.value, (ast.Constant, ast.List)))]
    namespace = {"os": os, "sys": sys, "shlex": shlex, "shutil": shutil, "copy": copy, "here": str(here),
                 "torch": fake_torch}
    exec(compile(ast.Module(nodes, type_ignores=[]), SETUP_PY, "exec"), namespace)
    return namespace


def _toolkit(tmp_path, version_output: str | None) -> str:
    """A CUDA_HOME whose bin/nvcc prints version_output for --version (None: no nvcc there)."""
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    if version_output is not None:
        nvcc = home / "bin" / "nvcc"
        nvcc.write_text("#!/bin/sh\ncat <<'EOF'\n" + version_output + "\nEOF\n")
        nvcc.chmod(0o755)
    return str(home)


def _nvcc_says(release: str) -> str:
    return ("nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
            f"Cuda compilation tools, release {release}, V{release}.88\nBuild cuda_{release}.r{release}/compiler.1_0")


def _fake_torch(cuda="12.8", version="2.9.1+cu128", gpus=1, archs="sm_80 sm_90"):
    return types.SimpleNamespace(
        __version__=version, version=types.SimpleNamespace(cuda=cuda),
        cuda=types.SimpleNamespace(device_count=lambda: gpus),
        _C=types.SimpleNamespace(_cuda_getArchFlags=lambda: archs))


def _fake_cpp_extension(cuda_home):
    class BuildExtension:
        @classmethod
        def with_options(cls, **options):
            return cls

    def extension(kind):
        return lambda name, sources, **kwargs: types.SimpleNamespace(kind=kind, name=name, sources=sources, **kwargs)

    return types.SimpleNamespace(CUDA_HOME=cuda_home, CppExtension=extension("cpp"),
                                 CUDAExtension=extension("cuda"), BuildExtension=BuildExtension)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("ACCUM_FUSED_NO_EXTENSION", "ACCUM_FUSED_NO_CUDA", "ACCUM_FUSED_REQUIRE_CUDA",
                 "TORCH_CUDA_ARCH_LIST", "ACCUM_FUSED_MARCH"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- the toolkit check: torch's own rule ---------------------------------------------------------

@pytest.mark.parametrize("release, torch_cuda", [
    ("13.0", "12.8"),  # the report: PyPI's torch 2.9.1 (cu128) on a machine with CUDA 13.0
    ("12.4", "12.8"),  # another minor version: torch only warns
    ("12.8", "12.8"),
    ("11.8", "12.1"),
    ("13.1", "13.0"),
    ("12.6", "13.0"),
])
def test_the_toolkit_check_refuses_what_torchs_extension_builder_refuses(tmp_path, monkeypatch, release,
                                                                        torch_cuda):
    """_toolkit_problem against torch.utils.cpp_extension._check_cuda_version itself, on the same
    fake toolkit: a problem exactly where torch raises (a major version apart)."""
    import torch
    from torch.torch_version import TorchVersion
    from torch.utils import cpp_extension

    home = _toolkit(tmp_path, _nvcc_says(release))
    problem = _setup_namespace(tmp_path)["_toolkit_problem"](torch_cuda, home, "2.9.1+cu128")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", home)
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.setenv("TORCH_DONT_CHECK_COMPILER_ABI", "1")  # torch's host-compiler bounds: not the point
    try:
        cpp_extension._check_cuda_version("gcc", TorchVersion("11.4.0"))
        torch_refuses = False
    except RuntimeError:
        torch_refuses = True
    assert torch_refuses == (release.split(".")[0] != torch_cuda.split(".")[0])
    assert (problem is not None) == torch_refuses, problem
    if problem is not None:
        reason, fix = problem
        assert f"CUDA {release}" in reason and f"CUDA {torch_cuda}" in reason and home in reason
        assert "CUDA_HOME=" in fix and f"cu{release.replace('.', '')}" in fix and "torch==2.9.1 " in fix


def test_the_toolkit_check_without_a_toolkit_or_a_stated_release(tmp_path):
    problem_of = _setup_namespace(tmp_path)["_toolkit_problem"]
    assert "no CUDA toolkit was found" in problem_of("12.8", None, "2.9.1")[0]
    assert "no nvcc at" in problem_of("12.8", _toolkit(tmp_path, None), "2.9.1")[0]
    # an nvcc that does not state its release: torch does not check it, nor does setup.py (a
    # failing build then falls back, below)
    assert problem_of("12.8", _toolkit(tmp_path / "quiet", "nvcc: no version here"), "2.9.1") is None


# --- the build decision ---------------------------------------------------------------------------

def _options(tmp_path, fake_torch, cuda_home, build_ext_options=None):
    """setup.py's extension options; build_ext_options (a dict) gets what its build_ext class was
    made with (cpu_only: the extension to fall back on; cuda_skipped: the record for info)."""
    namespace = _setup_namespace(tmp_path, fake_torch)
    make = namespace["_build_ext_class"]

    def build_ext_class(base, **options):
        (build_ext_options if build_ext_options is not None else {}).update(options)
        return make(base, **options)

    namespace["_build_ext_class"] = build_ext_class
    return namespace["_extension_options"](_fake_cpp_extension(cuda_home))


def test_a_toolkit_of_another_major_version_builds_the_cpu_kernels_and_says_so_once(tmp_path, clean_env, capsys):
    build_ext_options = {}
    options = _options(tmp_path, _fake_torch(cuda="12.8"), _toolkit(tmp_path, _nvcc_says("13.0")), build_ext_options)
    (extension,) = options["ext_modules"]
    assert extension.kind == "cpp" and not any(s.endswith(".cu") for s in extension.sources)
    assert "WITH_CUDA" not in str(getattr(extension, "define_macros", None))
    assert "csrc/cpu/kernels.cpp" in extension.sources and "csrc/hooks.cpp" in extension.sources
    # nothing printed yet: setup.py runs several times in a pip install; the build prints the line
    assert capsys.readouterr() == ("", "")
    record, line = build_ext_options["cuda_skipped"]
    assert record.startswith("the CUDA toolkit at ") and "CUDA_HOME=/usr/local/cuda-12.8" in record  # for info
    assert "\n" not in line and line.startswith("accum_fused: building without the CUDA kernels: the CUDA toolkit at ")
    for part in ("is CUDA 13.0 and this torch was built with CUDA 12.8", "CUDA_HOME=/usr/local/cuda-12.8",
                 "--index-url https://download.pytorch.org/whl/cu130", "ACCUM_FUSED_NO_CUDA=1 silences this",
                 "ACCUM_FUSED_REQUIRE_CUDA=1 makes it an error"):
        assert part in line, line


def test_require_cuda_makes_the_mismatch_an_error_naming_the_fix(tmp_path, clean_env, capsys):
    clean_env.setenv("ACCUM_FUSED_REQUIRE_CUDA", "1")
    with pytest.raises(SystemExit) as raised:
        _options(tmp_path, _fake_torch(cuda="12.8"), _toolkit(tmp_path, _nvcc_says("13.0")))
    message = str(raised.value.code)
    assert "error: ACCUM_FUSED_REQUIRE_CUDA=1, and accum_fused's CUDA kernels cannot be built" in message
    assert "CUDA 13.0" in message and "CUDA 12.8" in message
    assert "Fix: build with a CUDA 12 toolkit (CUDA_HOME=/usr/local/cuda-12.8" in message
    assert capsys.readouterr().err == ""  # the error, not the skip line


def test_a_matching_toolkit_builds_the_cuda_kernels_with_the_cpu_build_to_fall_back_on(tmp_path, clean_env,
                                                                                       capsys):
    build_ext_options = {}
    options = _options(tmp_path, _fake_torch(cuda="12.8"), _toolkit(tmp_path, _nvcc_says("12.6")), build_ext_options)
    (extension,) = options["ext_modules"]
    assert extension.kind == "cuda" and "csrc/cuda/kernels.cu" in extension.sources
    assert extension.define_macros == [("WITH_CUDA", None)]
    fallback = build_ext_options["cpu_only"]
    assert fallback.kind == "cpp" and fallback.name == extension.name
    assert not any(s.endswith(".cu") for s in fallback.sources) and "nvcc" not in fallback.extra_compile_args
    assert "define_macros" not in vars(fallback)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("torch_cuda, no_cuda", [(None, False), ("12.8", True)])
def test_cpu_torch_and_no_cuda_build_the_cpu_kernels_silently_or_fail_under_require_cuda(
        tmp_path, clean_env, capsys, torch_cuda, no_cuda):
    if no_cuda:
        clean_env.setenv("ACCUM_FUSED_NO_CUDA", "1")
    home = _toolkit(tmp_path, _nvcc_says("12.8"))
    (extension,) = _options(tmp_path, _fake_torch(cuda=torch_cuda), home)["ext_modules"]
    assert extension.kind == "cpp"
    assert capsys.readouterr().err == ""
    clean_env.setenv("ACCUM_FUSED_REQUIRE_CUDA", "1")
    with pytest.raises(SystemExit, match="ACCUM_FUSED_REQUIRE_CUDA=1, and accum_fused's CUDA kernels cannot be built: "
                                         + ("ACCUM_FUSED_NO_CUDA=1 was set" if no_cuda else "this torch")):
        _options(tmp_path, _fake_torch(cuda=torch_cuda), home)


def test_no_gpu_and_no_cards_in_common_builds_the_cpu_kernels_naming_torch_cuda_arch_list(tmp_path, clean_env,
                                                                                          capsys):
    home = _toolkit(tmp_path, _nvcc_says("12.8"))  # its --list-gpu-arch prints no compute_* either
    build_ext_options = {}
    (extension,) = _options(tmp_path, _fake_torch(gpus=0, archs=""), home, build_ext_options)["ext_modules"]
    assert extension.kind == "cpp"
    _, line = build_ext_options["cuda_skipped"]
    assert "shows no GPU" in line and 'TORCH_CUDA_ARCH_LIST="8.0;9.0"' in line


# --- nvcc failing on the sources: the build_ext subclass ------------------------------------------

class _Compiler:
    def __init__(self):
        self.linker_so_cxx = [sys.executable]
        self._compile = "setuptools' own"


def _build_ext(tmp_path, monkeypatch, fail_cuda=True, fail_cpu=False, skipped=None):
    """The build_ext class setup.py makes for a CUDA build (or, with skipped, _skip_cuda's (record,
    line), for a CPU build of a CUDA torch), over a fake BuildExtension that fails as told (and
    wraps the compiler, as torch's does) instead of compiling."""
    from setuptools import Extension

    monkeypatch.setenv("CXX", sys.executable)  # the compiler check must pass without one
    seen = []

    class FakeBuildExtension:
        def build_extensions(self):
            (ext,) = self.extensions
            seen.append((list(ext.sources), list(ext.define_macros), self.compiler._compile, ext._full_name))
            self.compiler._compile = "torch's wrapper"
            if fail_cuda and any(s.endswith(".cu") for s in ext.sources):
                raise RuntimeError("Error compiling objects for extension")
            if fail_cpu:
                raise RuntimeError("Error compiling objects for extension")

    cpu_sources = ["csrc/bindings.cpp", "csrc/cpu/kernels.cpp"]
    cpu_only = Extension("accum_fused._C", list(cpu_sources), extra_compile_args={"cxx": ["-O3"]})
    cuda = Extension("accum_fused._C", cpu_sources + ["csrc/cuda/kernels.cu"], define_macros=[("WITH_CUDA", None)],
                     extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]}, libraries=["cudart"])
    namespace = _setup_namespace(tmp_path, _fake_torch(cuda="12.8"))
    if skipped is None:
        cls = namespace["_build_ext_class"](FakeBuildExtension, cpu_only=cpu_only)
    else:
        cls = namespace["_build_ext_class"](FakeBuildExtension, cuda_skipped=skipped)
    command = cls()
    command.extensions = [cuda if skipped is None else cpu_only]
    command.compiler, command.build_lib = _Compiler(), str(tmp_path / "build" / "lib")
    command.extensions[0]._full_name = "accum_fused._C"  # setuptools' finalize_options': must survive a fallback
    for folder in (tmp_path / "accum_fused", tmp_path / "build" / "lib" / "accum_fused"):
        folder.mkdir(parents=True)
    return command, seen, namespace


def test_nvcc_failing_on_the_sources_builds_again_without_them_and_records_why(tmp_path, clean_env, capsys):
    command, seen, namespace = _build_ext(tmp_path, clean_env)
    command.build_extensions()
    assert len(seen) == 2
    (first_sources, first_macros, _, _), (sources, macros, compiler, full_name) = seen
    assert "csrc/cuda/kernels.cu" in first_sources and first_macros == [("WITH_CUDA", None)]
    assert sources == ["csrc/bindings.cpp", "csrc/cpu/kernels.cpp"] and macros == []
    assert compiler == "setuptools' own" and full_name == "accum_fused._C"
    assert command.extensions[0].libraries == [] and "nvcc" not in command.extensions[0].extra_compile_args
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("accum_fused: building without the CUDA kernels: building them failed "
                          "(RuntimeError: Error compiling objects for extension;")
    assert "CUDA 12.8" in err and "CUDA_HOME=" in err and "ACCUM_FUSED_REQUIRE_CUDA=1 makes it an error" in err
    from accum_fused.__main__ import CUDA_SKIPPED_RECORD, cuda_skipped_reason
    assert CUDA_SKIPPED_RECORD == namespace["CUDA_SKIPPED_RECORD"]
    for folder in (tmp_path / "accum_fused", tmp_path / "build" / "lib" / "accum_fused"):
        reason = cuda_skipped_reason(str(folder))
        assert reason.startswith("building them failed") and "for the CUDA kernels, use a CUDA toolkit" in reason


def test_a_cuda_torch_built_without_the_cuda_kernels_says_why_once_and_records_it(tmp_path, clean_env, capsys):
    command, seen, namespace = _build_ext(tmp_path, clean_env, skipped=("the reason; for the CUDA kernels, the fix",
                                                                         "accum_fused: building without ..."))
    command.build_extensions()
    assert len(seen) == 1 and capsys.readouterr().err == "accum_fused: building without ...\n"
    from accum_fused.__main__ import cuda_skipped_reason
    for folder in (tmp_path / "accum_fused", tmp_path / "build" / "lib" / "accum_fused"):
        assert cuda_skipped_reason(str(folder)) == "the reason; for the CUDA kernels, the fix"
    # ACCUM_FUSED_NO_CUDA=1: recorded, not printed
    command, seen, namespace = _build_ext(tmp_path / "quiet", clean_env,
                                          skipped=("ACCUM_FUSED_NO_CUDA=1 was set", None))
    command.build_extensions()
    assert capsys.readouterr().err == ""
    assert cuda_skipped_reason(str(tmp_path / "quiet" / "accum_fused")) == "ACCUM_FUSED_NO_CUDA=1 was set"


def test_require_cuda_makes_a_failing_nvcc_an_error(tmp_path, clean_env, capsys):
    clean_env.setenv("ACCUM_FUSED_REQUIRE_CUDA", "1")
    command, seen, _ = _build_ext(tmp_path, clean_env)
    with pytest.raises(SystemExit) as raised:
        command.build_extensions()
    assert len(seen) == 1
    message = str(raised.value.code)
    assert "ACCUM_FUSED_REQUIRE_CUDA=1, and accum_fused's CUDA kernels cannot be built: building them failed" in message
    assert "Fix: use a CUDA toolkit that builds for this torch (CUDA 12.8)" in message and "CUDA_HOME=" in message


def test_a_build_failing_without_cuda_too_stops_with_the_compiler_fix(tmp_path, clean_env, capsys):
    command, seen, _ = _build_ext(tmp_path, clean_env, fail_cpu=True)
    with pytest.raises(SystemExit) as raised:
        command.build_extensions()
    assert len(seen) == 2
    message = str(raised.value.code)
    assert "error: building accum_fused's C++ extension failed: RuntimeError: Error compiling objects" in message
    assert "ACCUM_FUSED_NO_EXTENSION=1" in message and "install g++" in message.replace("apt-get ", "")


def test_a_cuda_build_that_succeeds_removes_an_earlier_record(tmp_path, clean_env, capsys):
    command, seen, namespace = _build_ext(tmp_path, clean_env, fail_cuda=False)
    stale = [tmp_path / "accum_fused" / namespace["CUDA_SKIPPED_RECORD"],
             tmp_path / "build" / "lib" / "accum_fused" / namespace["CUDA_SKIPPED_RECORD"]]
    for path in stale:
        path.write_text("an earlier build's reason\n")
    command.build_extensions()
    assert len(seen) == 1 and not any(path.exists() for path in stale)
    assert capsys.readouterr().err == ""


def test_torchs_mismatch_error_reads_as_one_sentence(tmp_path):
    from torch.utils import cpp_extension
    describe = _setup_namespace(tmp_path)["_describe"]
    text = describe(RuntimeError(cpp_extension.CUDA_MISMATCH_MESSAGE, "13.0", "12.8"))
    assert text.startswith("RuntimeError: The detected CUDA version (13.0) mismatches") and "(12.8)" in text
    assert "'%s'" not in text and "('" not in text


def test_info_shows_why_the_extension_has_no_cuda_kernels(monkeypatch):
    import accum_fused
    from accum_fused import __main__ as cli
    if "cpp" not in accum_fused.available_backends():
        pytest.skip("the extension does not load here")
    monkeypatch.setattr(cli, "cuda_skipped_reason", lambda: "nvcc 13.0 for a CUDA 12.8 torch; for the CUDA ...")
    (line,) = [line for line in cli.info_lines() if line.startswith("backend cpp:")]
    from accum_fused.backends import cpp_backend
    if cpp_backend.with_cuda:
        assert line.endswith("extension built with CUDA: True")
    else:
        assert line.endswith("extension built with CUDA: False (nvcc 13.0 for a CUDA 12.8 torch; for the CUDA ...)")


# --- the license with an old setuptools -------------------------------------------------------------

@pytest.mark.parametrize("version, expected", [
    ("65.5.0", {"license": "BSD-3-Clause"}),  # the report's: no license_expression before 77
    ("76.1.0", {"license": "BSD-3-Clause"}),
    ("77.0.3", {"license_expression": "BSD-3-Clause"}),
    ("84.2.1", {"license_expression": "BSD-3-Clause"}),
])
def test_the_license_in_the_terms_of_the_setuptools_that_builds(tmp_path, version, expected):
    namespace = _setup_namespace(tmp_path)
    options = namespace["_license_options"](version, namespace["CLASSIFIERS"])
    classifiers = options.pop("classifiers")
    assert options == expected
    license_classifiers = [c for c in classifiers if c.startswith("License ::")]
    # setuptools >= 77 refuses a License classifier beside license_expression
    bsd = ["License :: OSI Approved :: BSD License"]
    assert license_classifiers == ([] if "license_expression" in expected else bsd)
    assert set(namespace["CLASSIFIERS"]) <= set(classifiers)


def test_the_metadata_names_the_license(tmp_path):
    """setup.py's metadata with this environment's setuptools (no torch needed without the
    extension): the license is in it, and setuptools knew every option it was given."""
    env = dict(os.environ, ACCUM_FUSED_NO_EXTENSION="1")
    result = subprocess.run([sys.executable, SETUP_PY, "-q", "egg_info", "--egg-base", str(tmp_path)], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Unknown distribution option" not in result.stderr
    (pkg_info,) = tmp_path.glob("*.egg-info/PKG-INFO")
    metadata = pkg_info.read_text()
    if int(setuptools.__version__.split(".")[0]) >= 77:
        assert "License-Expression: BSD-3-Clause" in metadata
    else:
        assert "License: BSD-3-Clause" in metadata and "License :: OSI Approved :: BSD License" in metadata
