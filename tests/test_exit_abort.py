"""Issue 29 row 5: torch 2.13's gloo exit-time abort, pinned.

A 2-rank DDP job on gloo sometimes dies after ``destroy_process_group()``, in interpreter
teardown ("terminate called without an active exception", SIGABRT), so torchrun reports a job
that did all its work as failed. torch does it alone; an interleaved A/B over hundreds of
launches found no difference with accum_fused in the process (benchmarks/exit_abort_ab.py,
results/exit_abort_ab_torch2.13_cpu*.json). This test runs that A/B through the same script
(torchrun, the launcher users run) and holds both sides to what was measured:

- every launch finishes its work on both ranks, and any non-zero exit is that abort, nothing else;
- accum_fused's abort rate is not above ``PINNED_RATE`` (binomial tail under 1e-3 fails);
- accum_fused's rate is not above torch's own in the same interleaved run (one-sided Fisher exact
  test, p under 1e-3 fails).

A meaningful rate takes ~100 launches per arm at ~10 s each, more than CI's budget: CI runs
``ACCUM_FUSED_EXIT_AB_LAUNCHES`` launches per arm (default 2: the job, the script and both
checks run end to end); the pin itself is

    ACCUM_FUSED_EXIT_AB_LAUNCHES=100 python -m pytest tests/test_exit_abort.py   # ~35 min
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "exit_abort_ab.py"
# The abort rate pinned, per launch. Measured on the 2-core CI VM class (torch 2.13.0+cpu), see
# the json files above; the reports were 5% (torch) and 18% (with accum_fused) on a
# loaded machine. With 100 launches the binomial tail crosses 1e-3 at 14 aborts, so the reported
# 18% fails the pin with probability ~0.88 and a clean 1% passes it with certainty.
PINNED_RATE = 0.05
SIGNIFICANCE = 1e-3


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def fisher_one_sided(a_hits: int, a_n: int, b_hits: int, b_n: int) -> float:
    """P(B has >= b_hits of the hits | the margins): one-sided Fisher exact test that arm B's
    rate is above arm A's."""
    hits, total = a_hits + b_hits, a_n + b_n
    denom = math.comb(total, hits)
    return sum(math.comb(b_n, i) * math.comb(a_n, hits - i) for i in range(b_hits, min(hits, b_n) + 1)) / denom


def test_statistics_helpers():
    assert binomial_tail(0, 10, 0.3) == pytest.approx(1.0)
    assert binomial_tail(10, 10, 0.5) == pytest.approx(0.5 ** 10)
    assert binomial_tail(14, 100, PINNED_RATE) < SIGNIFICANCE < binomial_tail(13, 100, PINNED_RATE)
    # Fisher: equal counts are not significant; 18/100 against 0/100 is.
    assert fisher_one_sided(1, 100, 1, 100) > 0.5
    assert fisher_one_sided(0, 100, 18, 100) < 1e-5
    assert fisher_one_sided(3, 3, 0, 3) == pytest.approx(1.0)


def test_exit_abort_rate_is_torchs(tmp_path):
    launches = int(os.environ.get("ACCUM_FUSED_EXIT_AB_LAUNCHES", "2"))
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(SCRIPT), "--n", str(launches), "--arms", "A,B", "--seed", "29",
           "--timeout", "300", "--out", str(out)]
    # The script prints a line per launch; a launch that hangs is killed by its own timeout.
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300 * 2 * launches + 120)
    assert out.exists(), f"exit_abort_ab.py wrote no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    record = json.loads(out.read_text())
    summary = record["summary"]
    for arm in ("A", "B"):
        assert summary[arm]["launches"] == launches, summary
    failures = [run for run in record["runs"] if run["other_failure"] or run["done_ranks"] != 2]
    assert not failures, "launches that failed other than by the exit abort:\n" + "\n\n".join(
        f"{run['arm']} rc={run['rc']} done_ranks={run['done_ranks']}\n{run['stderr_tail']}" for run in failures)
    torch_aborts, ours = summary["A"]["aborts"], summary["B"]["aborts"]
    assert binomial_tail(ours, launches, PINNED_RATE) >= SIGNIFICANCE, (
        f"accum_fused's launches aborted at exit {ours}/{launches} times, above the pinned {PINNED_RATE:.0%} "
        f"(torch alone in the same run: {torch_aborts}/{launches})")
    assert fisher_one_sided(torch_aborts, launches, ours, launches) >= SIGNIFICANCE, (
        f"exit aborts with accum_fused {ours}/{launches} against torch alone {torch_aborts}/{launches}: "
        "accum_fused raises torch's rate")
