"""FSDP2 (``fully_shard``): two processes with gloo on 127.0.0.1 against the single-process
big batch. The scenarios live in ``_fsdp_worker.py``; one pair of processes runs all of them
(starting processes and importing FSDP2 costs seconds) and every case is its own test here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this PyTorch build has no torch.distributed"
)

from _fsdp_worker import case_ids  # noqa: E402  (imports torch.distributed)
from _helpers import run_ranks, worker_backends  # noqa: E402

WORKER = Path(__file__).with_name("_fsdp_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("fsdp"), WORLD_SIZE, TIMEOUT_S)


@pytest.mark.parametrize("case", case_ids(worker_backends()))
def test_two_ranks(rank_results, case):
    for rank, results in enumerate(rank_results):
        assert case in results, f"rank {rank} did not run {case}"
        assert results[case] == "ok", f"rank {rank}:\n{results[case]}"


def test_readme_fsdp2_example_runs():
    """The README's `torchrun --nproc-per-node 2 examples/fsdp2.py`, as written (it checks
    itself against a single-process AdamW on the big batch)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "fsdp2.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the FSDP2 example did not finish within 300 s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ": OK" in proc.stdout, proc.stdout
