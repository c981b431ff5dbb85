"""The CLI (python -m accum_fused demo/bench/info) in subprocesses with tiny settings, and the
demo's claim in-process: accum_fused matches the full-batch run, the tutorial loop does not."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from accum_fused import bench
from accum_fused.demo import run_demo

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# Runs `python -m accum_fused ...` as if the modules named in argv[1] (comma-separated) were not
# installed: every finder on sys.meta_path is wrapped so that none finds them or their submodules
# (importlib.util.find_spec returns None, import raises ModuleNotFoundError: No module named ...).
WITHOUT_MODULES = """
import runpy, sys
blocked = set(filter(None, sys.argv[1].split(",")))
class Hide:
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            return None
        return self.finder.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.finder, attr)
sys.meta_path[:] = [Hide(finder) for finder in sys.meta_path]
sys.argv = ["accum_fused", *sys.argv[2:]]
runpy.run_module("accum_fused", run_name="__main__", alter_sys=True)
"""


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600, without: tuple[str, ...] = (),
            check: bool = True) -> subprocess.CompletedProcess:
    """``without``: modules to hide from the subprocess. Its stderr goes into stdout (unbuffered, so
    in the order written) when ``without`` is given, to check that notes come before the training."""
    env = dict(os.environ)
    # The subprocess imports accum_fused from this checkout whatever its working directory.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "Agg")
    command = [sys.executable, "-m", "accum_fused", *args]
    streams = dict(capture_output=True)
    if without:
        command = [sys.executable, "-c", WITHOUT_MODULES, ",".join(without), *args]
        env["PYTHONUNBUFFERED"] = "1"
        streams = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc = subprocess.run(command, text=True, timeout=timeout, cwd=cwd or REPO, env=env, **streams)
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def assert_png(path: Path) -> None:
    assert path.is_file(), f"{path} not written"
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000, f"{path}: not a PNG ({len(data)} bytes)"


def table_header(stdout: str, first_column: str) -> list[str]:
    for line in stdout.splitlines():
        if line.split()[:1] == [first_column]:
            return line.split()
    raise AssertionError(f"no table starting with {first_column!r} in:\n{stdout}")


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["info"]], ids=["main", "demo", "bench", "info"])
def test_help(command):
    out = run_cli(*command, "--help").stdout
    assert out.startswith("usage: python -m accum_fused")
    for option in {"demo": ["--device", "--backend", "--epochs", "--output", "--no-plot", "--no-progress"],
                   "bench": ["--device", "--backends", "--dtypes", "--k", "--sizes", "--shapes", "--repeats",
                             "--quick", "--output-dir"],
                   "info": [], "main": ["demo", "bench", "info"]}[command[0] if command else "main"]:
        assert option in out


def test_info_lists_every_backend():
    out = run_cli("info").stdout
    assert out.startswith("accum_fused ")
    for name in ("torch", "cpp", "triton"):
        assert any(line.startswith(f"backend {name}: ") for line in out.splitlines()), out
    assert "backend torch: available" in out
    assert "auto on cpu: " in out


def test_info_says_which_fast_paths_the_extension_holds():
    """The torch the extension was compiled against, and each fast path that reaches into torch
    internals in or out (csrc/torch_compat.h): the pinned torch holds every one."""
    from accum_fused import backends
    from accum_fused.__main__ import FAST_PATHS
    cpp_backend = backends._load("cpp")
    if cpp_backend is None:
        pytest.skip("the extension is not built")
    lines = run_cli("info").stdout.splitlines()
    assert f"extension compiled against torch {cpp_backend._C.torch_headers}; C++ in-backward hooks and plain mode's step table: in" in lines
    assert set(cpp_backend._C.fast_paths) == set(FAST_PATHS)
    for name, (what, without) in FAST_PATHS.items():
        held = cpp_backend._C.fast_paths[name]
        assert f"fast path {name}: {'in' if held else 'out (' + without + ')'}: {what}" in lines
    if torch.__version__ >= (2, 10):  # (TorchVersion compares with tuples; CI's suite runs 2.13)
        assert all(cpp_backend._C.fast_paths.values())


def test_demo_writes_table_and_png(tmp_path):
    png = tmp_path / "demo.png"
    out = run_cli("demo", "--device", "cpu", "--epochs", "3", "--no-progress", "--output", str(png)).stdout
    header = " ".join(table_header(out, "run"))
    for column in ("final loss", "max |Δparam| vs full batch", "MB", "ms/epoch"):
        assert column in header, header
    for run in ("torch.optim.AdamW, full batch", "tutorial loop (loss / k)", "accum_fused.AdamW"):
        assert run in out
    assert_png(png)


DEMO_RUNS = ("torch.optim.AdamW, full batch", "tutorial loop (loss / k)", "accum_fused.AdamW")
TINY_DEMO = ("demo", "--device", "cpu", "--epochs", "2", "--backend", "torch")


def test_demo_hide_module_works():
    # The harness itself: a hidden module raises ModuleNotFoundError, as when it is not installed.
    proc = run_cli("info", without=("tqdm", "matplotlib"))
    # (installed without the extension, the reference fallback's one warning comes first)
    assert any(line.startswith("accum_fused ") for line in proc.stdout.splitlines()), proc.stdout
    code = "import tqdm"
    hidden = subprocess.run([sys.executable, "-c", WITHOUT_MODULES.replace("runpy.run_module", code + " #"), "tqdm"],
                            capture_output=True, text=True, timeout=600)
    assert "ModuleNotFoundError: No module named 'tqdm'" in hidden.stderr, hidden.stderr


@pytest.mark.parametrize("no_progress", [False, True], ids=["progress", "no-progress"])
def test_demo_without_tqdm_runs_without_a_progress_bar(tmp_path, no_progress):
    png = tmp_path / "demo.png"
    flags = ["--no-progress"] if no_progress else []
    out = run_cli(*TINY_DEMO, *flags, "--output", str(png), without=("tqdm",)).stdout
    assert all(run in out for run in DEMO_RUNS), out
    assert_png(png)
    if no_progress:
        assert "note:" not in out and "pip install" not in out, out  # no bar asked for: nothing to say
    else:
        note = out.index("note: tqdm is not installed")
        assert "pip install tqdm" in out and note < out.index("accum_fused demo on cpu"), out


def test_demo_without_matplotlib_prints_the_table_and_says_what_to_install(tmp_path):
    out = run_cli(*TINY_DEMO, cwd=tmp_path, without=("matplotlib",)).stdout
    note = out.index("note: matplotlib is not installed")
    assert note < out.index("accum_fused demo on cpu"), out  # said before training, not after
    assert "pip install matplotlib" in out and "pip install tqdm matplotlib" in out, out
    assert all(run in out for run in DEMO_RUNS), out
    assert "loss curves: not plotted" in out, out
    assert not list(tmp_path.iterdir())


def test_demo_without_matplotlib_refuses_an_explicit_output_before_training(tmp_path):
    png = tmp_path / "demo.png"
    proc = run_cli(*TINY_DEMO, "--output", str(png), without=("matplotlib",), check=False)
    assert proc.returncode == 2, proc.stdout
    assert "error: --output" in proc.stdout and "pip install matplotlib" in proc.stdout, proc.stdout
    assert "accum_fused demo on cpu" not in proc.stdout and not png.exists(), proc.stdout


def test_demo_without_either_extra_runs_with_no_plot(tmp_path):
    out = run_cli(*TINY_DEMO, "--no-plot", cwd=tmp_path, without=("tqdm", "matplotlib")).stdout
    assert all(run in out for run in DEMO_RUNS), out
    assert "loss curves" not in out and "matplotlib is not" not in out, out  # --no-plot: none asked for
    assert "note: tqdm is not installed" in out, out
    assert not list(tmp_path.iterdir())


def test_demo_output_in_a_missing_directory_fails_before_training(tmp_path):
    proc = run_cli(*TINY_DEMO, "--output", str(tmp_path / "nope" / "demo.png"), check=False)
    assert proc.returncode == 2 and "no directory" in proc.stderr, proc.stderr
    assert "accum_fused demo on cpu" not in proc.stdout, proc.stdout


def test_bench_quick_writes_table_json_and_png(tmp_path):
    # Run from outside the checkout: --output-dir decides where files go, nothing lands in the repo.
    out = run_cli("bench", "--quick", "--no-progress", "--output-dir", str(tmp_path), cwd=tmp_path).stdout
    assert table_header(out, "backend") == ["backend", "dtype", "size", "params", "k", "clip", "ms/window", "GB/s",
                                            "%", "copy", "%", "add_", "vs", "native"]
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["native"], ["torch"], ["cpp"])]
    assert {r[0] for r in rows} >= {"native", "torch"} and {r[5] for r in rows} == {"1", "off"}, out

    [json_path] = tmp_path.glob("bench_cpu_*.json")
    record = json.loads(json_path.read_text())
    assert set(bench.RECORD_KEYS) <= set(record), sorted(record)
    assert record["benchmark"] == "bench" and record["schema_version"] == bench.SCHEMA_VERSION
    assert record["device"]["type"] == "cpu" and record["device"]["threads"] >= 1
    assert {"torch", "accum_fused", "python", "git_commit"} <= set(record["versions"])
    assert record["command"].startswith("python -m accum_fused bench --quick")
    assert record["config"]["quick"] is True and record["config"]["sizes"] == [100_000]
    assert record["copy_bandwidth"]["gbps"] > 0
    measurements = record["measurements"]
    assert len(measurements) == len(rows)
    for m in measurements:
        assert set(bench.MEASUREMENT_KEYS) <= set(m), sorted(set(bench.MEASUREMENT_KEYS) - set(m))
        assert m["numel"] == 100_000 and m["k"] == 4 and m["dtype"] == "fp32"
        assert len(m["times_ms"]) == record["config"]["repeats"] == 2
        assert m["median_ms"] > 0 and m["gbps"] > 0
        # "% copy" is of copy_ measured on the case's own size (write-allocate counted on CPU)
        assert m["pct_copy_bandwidth"] == pytest.approx(100 * m["gbps"] / m["copy_gbps_at_size"])
    native = [m for m in measurements if m["contender"] == "native"]
    assert all(m["median_ratio_vs_native"] == 1.0 for m in native) and len(native) == 2
    assert_png(tmp_path / record["plot"])
    assert json_path.with_suffix(".png").name == record["plot"]


def test_bench_rejects_an_unknown_backend(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "accum_fused", "bench", "--quick", "--backends", "nope",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode != 0 and "unknown backend 'nope'" in proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("text, numel", [("100k", 100_000), ("1M", 1 << 20), ("256M", 1 << 28), ("2^24", 1 << 24),
                                         ("12345", 12345)])
def test_bench_sizes_parse(text, numel):
    assert bench.parse_size(text) == numel


def test_demo_claim_accum_fused_matches_full_batch_tutorial_loop_does_not():
    full, tutorial, fused = run_demo(device="cpu", backend="torch", epochs=5, progress=False)
    assert full.max_param_diff == 0.0
    assert fused.max_param_diff < 1e-4, fused.max_param_diff
    assert tutorial.max_param_diff > 1e-2, tutorial.max_param_diff
    assert abs(fused.losses[-1] - full.losses[-1]) < 1e-4 * full.losses[-1]


def test_demo_progress_bars_count_the_epochs_each_run_does(tmp_path):
    pytest.importorskip("tqdm")
    proc = run_cli("demo", "--device", "cpu", "--epochs", "3", "--no-plot", cwd=tmp_path)
    bars = proc.stderr.replace("\r", "\n")
    for run in DEMO_RUNS:  # one bar per run, out of the 3 epochs it trains (not 3 x the runs)
        assert any(line.startswith(run) and "3/3" in line for line in bars.splitlines()), proc.stderr
    assert "/9 " not in bars, proc.stderr


def test_bench_outside_the_checkout_writes_into_a_temporary_directory_it_prints(tmp_path):
    out = run_cli("bench", "--quick", "--no-progress", cwd=tmp_path).stdout
    written = [Path(line.removeprefix("wrote ")) for line in out.splitlines() if line.startswith("wrote ")]
    assert [p.suffix for p in written] == [".json", ".png"], out
    assert all(p.is_file() and tempfile.gettempdir() in str(p) for p in written), written
    assert not list(tmp_path.iterdir())  # nothing in the current directory
    shutil.rmtree(written[0].parent)
