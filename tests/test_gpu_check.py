"""benchmarks/gpu_check.sh --dry-run: the GPU machine's one command, run on CPU with tiny sizes,
so that the script cannot rot between the rare sessions that are lent a GPU. Checks what the
device tool needs of its output: summary.md and the JSON files written, at most 8 flat files of
at most 16 MiB, and every stage ok (or skipped, in a dry run: the sanitizers)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _helpers import built_without_extension, needs_fsdp2_on_cpu

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"

# The dry run's build stage checks the installed package the way the GPU run checks its build:
# the compiled backend must load.
needs_extension = pytest.mark.skipif(built_without_extension(),
                                     reason="installed without the extension: the dry run's build check would fail")

# Its fsdp stage runs FSDP2 on CPU (a GPU run, on CUDA).
needs_fsdp2_on_dry_run_cpu = needs_fsdp2_on_cpu("the dry run's fsdp stage: ")

pytestmark = [
    pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash"),
    pytest.mark.skipif(os.environ.get("GPU_CHECK_RUNNING") == "1", reason="inside gpu_check.sh: no recursion"),
]


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_usage_error_without_outdir():
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "usage:" in proc.stderr


@needs_extension
@needs_fsdp2_on_dry_run_cpu
def test_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True,
                          timeout=2400, cwd=tmp_path, env=env)  # (the dry run's own deadline: 2400 s)
    log = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, log

    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, [p.name for p in files]  # the device tool brings back 8 files at most
    assert all(p.parent == out for p in files), files
    assert all(p.stat().st_size <= 16 << 20 for p in files)
    names = {p.name for p in files}
    assert {"summary.md", "gpu_check.json", "junit.xml", "bench.json", "bench.png", "train.json", "logs.txt"} <= names

    record = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s["status"] for s in record["stages"]}
    assert stages == {"env": "ok", "build": "ok", "tests": "ok", "bench": "ok", "train": "ok", "model": "ok",
                      "fsdp": "ok", "parity": "ok", "oom": "skipped", "memcheck": "skipped",
                      "racecheck": "skipped"}, log
    assert record["env"]["dry_run"] is True
    assert record["tests"]["failed"] == record["tests"]["errors"] == 0 and record["tests"]["passed"] > 0

    bench = json.loads((out / "bench.json").read_text())
    contenders = {m["contender"] for m in bench["measurements"]}
    assert {"native", "torch"} <= contenders
    assert all("peak_memory_bytes" in m for m in bench["measurements"])
    assert json.loads((out / "train.json").read_text())["results"]
    fsdp = record["fsdp"]
    assert [r["pattern"] for r in fsdp["rows"]] == ["native", "a", "b", "c"]
    assert all(r["bytes_rank0"].get("all_reduce", 0) > 0 for r in fsdp["rows"] if r["pattern"] != "native")
    model = record["model"]  # the GPT-2 step's contenders: each timed, or skipped with why (triton without Triton)
    timed = {r["contender"]: r for r in model["results"]}
    skipped = {s["contender"]: s["reason"] for s in model["skipped"]}
    assert {"native", "plain:cpp", "mode_a:cpp", "mode_b:cpp", "fb_only"} <= set(timed), (timed, skipped)
    modes = {f"{mode}:{backend}" for mode in ("plain", "mode_a", "mode_b") for backend in ("cpp", "triton")}
    assert set(timed) | set(skipped) == {"native", "fb_only", "plain:torch", "mode_b:torch"} | modes
    assert all(r["check"] is None for r in timed.values()), timed
    assert timed["plain:cpp"]["resolved_backend"] == "cpp" and timed["plain:cpp"]["optimizer_side_ms"] is not None
    assert model["config"]["autocast"] == "bf16" and model["config"]["tie"]
    parity = record["parity"]  # the reference backend on torch's gradients: torch.optim's update bit for bit
    torch_row = next(r for r in parity["rows"] if r["backend"] == "torch")
    assert all(w["ours_vs_single_tensor"] == 0.0 for w in torch_row["windows"])

    summary = (out / "summary.md").read_text()
    assert "**Result: all stages passed**" in summary
    for section in ("## Tests", "## compute-sanitizer", "## Window benchmark", "## Training benchmark",
                    "## Model step", "## FSDP2 benchmark"):
        assert section in summary
    assert "| plain:cpp | cpp |" in summary and "| fb_only | - |" in summary  # the model step's table
    assert "dry run: compute-sanitizer memcheck skipped" in summary


@needs_extension
@needs_fsdp2_on_dry_run_cpu
def test_failing_stage_is_recorded_and_fails_the_run(tmp_path):
    """A stage that fails does not stop the later ones; summary.md says which, and the exit
    status is non-zero. (Bench arguments that argparse refuses make the bench stage fail fast.)"""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_BENCH_ARGS": "--no-such-option",
           "GPU_CHECK_PYTEST_ARGS": "tests/test_install.py::test_auto_never_picks_the_triton_interpreter_on_cpu"}
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True,
                          timeout=2400, cwd=tmp_path, env=env)  # (the dry run's own deadline: 2400 s)
    assert proc.returncode == 1, proc.stdout[-4000:]
    record = json.loads((out / "gpu_check.json").read_text())
    stages = {s["stage"]: s["status"] for s in record["stages"]}
    assert stages["bench"] == "failed" and stages["train"] == "ok", stages
    assert record["failed_stages"] == ["bench"]
    assert "FAILED: bench (failed)" in (out / "summary.md").read_text()
