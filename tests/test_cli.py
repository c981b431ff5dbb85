"""The CLI (python -m accum_fused demo/bench/info) in subprocesses with tiny settings, and the
demo's claim in-process: accum_fused matches the full-batch run, the tutorial loop does not."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accum_fused import bench
from accum_fused.demo import run_demo

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # The subprocess imports accum_fused from this checkout whatever its working directory.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("MPLBACKEND", "Agg")
    proc = subprocess.run([sys.executable, "-m", "accum_fused", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or REPO, env=env)
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
    for option in {"demo": ["--device", "--backend", "--epochs", "--output", "--no-progress"],
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


def test_demo_writes_table_and_png(tmp_path):
    png = tmp_path / "demo.png"
    out = run_cli("demo", "--device", "cpu", "--epochs", "3", "--no-progress", "--output", str(png)).stdout
    header = " ".join(table_header(out, "run"))
    for column in ("final loss", "max |Δparam| vs full batch", "MB", "ms/epoch"):
        assert column in header, header
    for run in ("torch.optim.AdamW, full batch", "tutorial loop (loss / k)", "accum_fused.AdamW"):
        assert run in out
    assert_png(png)


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
    native = [m for m in measurements if m["contender"] == "native"]
    assert all(m["median_ratio_vs_native"] == 1.0 for m in native) and len(native) == 2
    assert_png(tmp_path / record["plot"])
    assert json_path.with_suffix(".png").name == record["plot"]


def test_bench_rejects_an_unknown_backend(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "accum_fused", "bench", "--quick", "--backends", "nope",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True, timeout=60, env=env)
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
