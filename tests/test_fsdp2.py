"""FSDP2 (``fully_shard``): two processes with gloo on 127.0.0.1 against the single-process
big batch. The scenarios live in ``_fsdp_worker.py``; one pair of processes runs all of them
(starting processes and importing FSDP2 costs seconds) and every case is its own test here.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="this PyTorch build has no torch.distributed"
)

from _fsdp_worker import backends_to_test, case_ids  # noqa: E402  (imports torch.distributed)

WORKER = Path(__file__).with_name("_fsdp_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict[str, str]]:
    out = tmp_path_factory.mktemp("fsdp")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(rank), str(WORLD_SIZE), str(port), str(out)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD_SIZE)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"the two gloo ranks did not finish within {TIMEOUT_S} s (a collective hung?)")
    finally:
        for proc in procs:  # never leave a rank behind
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{log[-4000:]}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("case", case_ids(backends_to_test()))
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
