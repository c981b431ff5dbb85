"""FSDP2 (``fully_shard``): two processes with gloo on 127.0.0.1 (a 1-D mesh, and FSDP2's
``replicate()``), and four on HSDP's 2-D mesh (2 replicas of 2 shards) and on tensor parallel +
FSDP2 (dp 2 x tp 2) and both on a 3-D mesh, against the single-process big batch. The scenarios
live in ``_fsdp_worker.py``; one set of processes runs all of a mesh's (starting processes and
importing FSDP2 costs seconds) and every case is its own test here.
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

from _fsdp_worker import case_ids, hsdp_case_ids, replicate_case_ids, tp_case_ids  # noqa: E402  (imports torch.distributed)
from _helpers import (assert_every_rank_ran, finished_apart_from_gloo_exit_abort, needs_fsdp2_on_cpu,  # noqa: E402
                      run_ranks, worker_backends)

WORKER = Path(__file__).with_name("_fsdp_worker.py")
WORLD_SIZE = 2
TIMEOUT_S = 600  # without progress: one case (run_ranks), not the whole worker


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("fsdp"), WORLD_SIZE, TIMEOUT_S)


@needs_fsdp2_on_cpu()
@pytest.mark.parametrize("case", case_ids(worker_backends()))
def test_two_ranks(rank_results, case):
    assert_every_rank_ran(rank_results, case)


@pytest.fixture(scope="module")
def hsdp_rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("hsdp"), 4, TIMEOUT_S)


@needs_fsdp2_on_cpu()
@pytest.mark.parametrize("case", hsdp_case_ids())
def test_hsdp_four_ranks(hsdp_rank_results, case):
    """HSDP: the weight total and the flush check over all 4 ranks, the clip norm over the
    shards with each replica's copy counted once (counted twice, SGD's clipped big batch fails),
    non-finite skips, DCP mid-window, modes A and B."""
    assert_every_rank_ran(hsdp_rank_results, case)


@pytest.fixture(scope="module")
def tp_rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("tp"), 4, TIMEOUT_S, env={"FSDP_MESH": "tp"})


@needs_fsdp2_on_cpu()
@pytest.mark.parametrize("case", tp_case_ids())
def test_tensor_parallel_and_fsdp2_four_ranks(tp_rank_results, case):
    """Tensor parallel (an MLP column- then row-wise parallel over "tp") + FSDP2 over "dp", 2 x 2:
    the weight total over the data-parallel ranks only (over the tensor-parallel ones too, the
    big batch fails), the clip norm with tensor-parallel shards summed and replicated parameters
    counted once (counted on every tensor-parallel rank, it fails), modes A and B, DCP."""
    assert_every_rank_ran(tp_rank_results, case)


@pytest.fixture(scope="module")
def hsdp_tp_rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("hsdp_tp"), 4, TIMEOUT_S, env={"FSDP_MESH": "hsdp_tp"})


@needs_fsdp2_on_cpu()
@pytest.mark.parametrize("case", tp_case_ids())
def test_hsdp_and_tensor_parallel_3d_mesh_four_ranks(hsdp_tp_rank_results, case):
    """HSDP x tensor parallel, a 3-D mesh (replicate 2, shard 1, "tp" 2): the weight total over
    the replicas, the clip norm with each replica's copy counted once (counted twice, SGD's
    clipped big batch fails) and tensor-parallel shards summed. (Run by hand on 8 ranks, shard 2:
    tests/_fsdp_worker.py with FSDP_MESH=hsdp_tp.)"""
    assert_every_rank_ran(hsdp_tp_rank_results, case)


@pytest.fixture(scope="module")
def replicate_rank_results(tmp_path_factory) -> list[dict[str, str]]:
    return run_ranks(WORKER, tmp_path_factory.mktemp("replicate"), 2, TIMEOUT_S, env={"FSDP_MESH": "replicate"})


def _replicate_skip_reason() -> str | None:
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no FSDP2 replicate() (torch.distributed._composable.replicate_with_fsdp)"
    return None


@needs_fsdp2_on_cpu()
@pytest.mark.skipif(_replicate_skip_reason() is not None, reason=str(_replicate_skip_reason()))
@pytest.mark.parametrize("case", replicate_case_ids())
def test_replicate_two_ranks(replicate_rank_results, case):
    """FSDP2's replicate() (whole parameters on every rank, gradients all-reduced): the clip norm
    from one rank's copy (counted on both, the big batch fails), the weight total, flush check
    and non-finite skip over both ranks, modes A and B, DCP mid-window."""
    assert_every_rank_ran(replicate_rank_results, case)


@needs_fsdp2_on_cpu()
@pytest.mark.parametrize("launch", [["--nproc-per-node", "2"], ["--nproc-per-node", "4", "--replicas", "2"],
                                    ["--nproc-per-node", "4", "--tp", "2"],
                                    ["--nproc-per-node", "8", "--replicas", "2", "--tp", "2"]],
                         ids=["1-D", "HSDP", "TP", "HSDP-TP-3-D"])
def test_readme_fsdp2_example_runs(launch):
    """`torchrun --nproc-per-node 2 examples/fsdp2.py`, its HSDP and tensor-parallel (--tp 2)
    runs on 4 ranks and both on 8 (a 3-D mesh), as docs/guides/fsdp2.md writes them (it checks
    itself against a single-process AdamW on the big batch)."""
    example = Path(__file__).resolve().parents[1] / "examples" / "fsdp2.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", *launch[:2], str(example), *launch[2:]]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the FSDP2 example did not finish within 900 s")
    assert finished_apart_from_gloo_exit_abort(proc, ": OK", ranks=1), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ": OK" in proc.stdout, proc.stdout


@needs_fsdp2_on_cpu()
@pytest.mark.parametrize("layout,pattern", [("hsdp", "a"), ("tp", "c")])
def test_a_rank_killed_mid_window_resumes_from_dcp_bit_for_bit(tmp_path, layout, pattern):
    """4 ranks under `torchrun --max-restarts 1` (tests/_fsdp_resume.py), checkpointing with DCP
    after every micro-batch: rank 1 SIGKILLs itself one micro-batch into a window's middle;
    torchrun restarts every rank, which resume from the newest complete checkpoint (one
    micro-batch into the window), and the trained model equals the uninterrupted run's, bit for
    bit. HSDP in plain mode, tensor parallel + FSDP2 in mode B."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # (torchrun's rendezvous store shared with the workers' group can hand a restarted worker the
    # previous attempt's gloo addresses: pytorch/pytorch#135712; a store of their own)
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")]))
    finals = {}
    for kill in (-1, 1):
        out = tmp_path / f"kill{kill}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               "--max-restarts", "1", "--monitor-interval=0.2", str(WORKER.with_name("_fsdp_resume.py")), str(out),
               layout, pattern, str(kill)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        log = proc.stdout[-3000:] + proc.stderr[-4000:]
        # (torch 2.13's gloo exit-time abort after the work is done: final.pt is written by then)
        assert proc.returncode == 0 or (
            (out / "final.pt").exists() and "terminate called without an active exception" in proc.stderr), log
        if kill >= 0:
            assert proc.stdout.count("resumed at micro-batch 4, micro_step 1") == 4, log
        finals[kill] = torch.load(out / "final.pt")
    for a, b in zip(finals[-1], finals[1]):
        assert torch.equal(a, b), (a - b).abs().max()


def test_layouts_other_than_fsdp2_are_refused():
    """Layouts other than FSDP2's raise at construction, naming what is unsupported: Shard on
    both dimensions of a 2-D mesh without a "tp" dimension, Replicate on the data dimension of a
    tensor-parallel mesh, 3-D meshes, Shard and Replicate mixed on a 1-D mesh; HSDP's 2-D layout
    and replicate()'s 1-D one are accepted (a one-process gloo group in a fresh interpreter)."""
    script = """
import socket, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
import accum_fused
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
mesh_2d = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
accum_fused.AdamW([torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh_2d, [Replicate(), Shard(0)]))])
cases = {
    "other than HSDP's": (mesh_2d, [Shard(0), Shard(1)]),
    "tensor-parallel mesh": (init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp")), [Replicate(), Shard(0)]),
    "3-D device mesh": (init_device_mesh("cpu", (1, 1, 1)), [Replicate(), Replicate(), Shard(0)]),
    "Shard or replicate()'s Replicate (one of them)": (init_device_mesh("cpu", (1,)), [Replicate()]),
}
mesh_1d = cases["Shard or replicate()'s Replicate (one of them)"][0]
accum_fused.AdamW([torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh_1d, [Replicate()]))])
for expected, (mesh, placements) in cases.items():
    params = [torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, placements))]
    if mesh is mesh_1d:  # (a mix of the two 1-D layouts)
        params.append(torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])))
    try:
        accum_fused.AdamW(params)
    except NotImplementedError as exc:
        assert expected in str(exc), exc
    else:
        raise AssertionError(expected + " accepted")
dist.destroy_process_group()
print("refused")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and "refused" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_out_of_memory_recovery_is_refused_clearly():
    """opt.run() (issue 30) under a real fully_shard model: FSDP2 reduce-scatters inside every
    backward, so a rank that split its micro-batch would run collectives the others do not: run()
    raises NotImplementedError naming what to do, before anything runs (a one-process gloo group
    in a fresh interpreter)."""
    script = """
import socket, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
import accum_fused
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model)
opt = accum_fused.AdamW(model.parameters(), lr=0.1, accumulation_steps=2)
calls = []
try:
    opt.run((torch.ones(3, 4), torch.ones(3, 2)), lambda b: calls.append(1) or model(b[0]).sum())
except NotImplementedError as exc:
    assert "FSDP2" in str(exc) and "opt.backward(loss, weight=" in str(exc), exc
else:
    raise AssertionError("run() accepted under FSDP2")
assert calls == [] and opt.micro_step == 0
dist.destroy_process_group()
print("refused")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert finished_apart_from_gloo_exit_abort(proc, "refused", ranks=1), proc.stdout[-3000:] + proc.stderr[-3000:]
