"""Shared helpers: deterministic models and data, torch.optim references, comparisons.

Everything here is deterministic (explicit generators / seeds), CPU-only and small.
"""
from __future__ import annotations

import copy
import functools
import io

import torch
from torch import nn

import accum_fused

IN_FEATURES = 6
OUT_FEATURES = 3

# (accum_fused class, torch.optim class) by name.
OPTIMIZERS = {
    "SGD": (accum_fused.SGD, torch.optim.SGD),
    "Adam": (accum_fused.Adam, torch.optim.Adam),
    "AdamW": (accum_fused.AdamW, torch.optim.AdamW),
}

# Per-parameter state keys torch.optim keeps (those that exist depend on the hyperparameters).
TORCH_STATE_KEYS = ("step", "momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, hidden: int = 8) -> nn.Sequential:
    """A small MLP with deterministic initialisation."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN_FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, OUT_FEATURES))
    return model.to(dtype)


def make_batches(
    sizes: list[int], seed: int = 1, dtype: torch.dtype = torch.float32
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A list of (x, y) micro-batches with the given sizes."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(n, IN_FEATURES, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(n, OUT_FEATURES, generator=gen, dtype=torch.float64).to(dtype),
        )
        for n in sizes
    ]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Plain mean-reduced MSE loss (mean over the batch)."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def concat(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])


def windows(batches: list, k: int) -> list[list]:
    """Split a list of micro-batches into consecutive windows of k."""
    return [batches[i : i + k] for i in range(0, len(batches), k)]


def train_accum(opt, model, batches, weighted: bool = False) -> list:
    """One opt.step() per micro-batch (zero_grad, backward, step); returns the step() results.

    ``weighted``: pass ``weight=len(micro_batch)`` to step().
    """
    results = []
    for batch in batches:
        opt.zero_grad()
        loss_of(model, batch).backward()
        if weighted:
            results.append(opt.step(weight=len(batch[0])))
        else:
            results.append(opt.step())
    return results


def train_big_batch(torch_opt, model, batches, k: int) -> None:
    """The torch.optim reference: one step per window of k micro-batches on their concatenation."""
    for window in windows(batches, k):
        torch_opt.zero_grad()
        loss_of(model, concat(window)).backward()
        torch_opt.step()


def assert_params_equal(model_a: nn.Module, model_b: nn.Module) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name}: max abs diff {(a.double() - b.double()).abs().max().item()}"


def assert_params_close(model_a: nn.Module, model_b: nn.Module, rtol: float, atol: float) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_params_changed(model_a: nn.Module, model_b: nn.Module) -> None:
    """Guard against vacuous comparisons: training must have moved every parameter."""
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        assert not torch.equal(a, b), f"{name} did not change"


def assert_torch_state_equal(opt, torch_opt) -> None:
    """Every per-parameter state entry torch.optim keeps is present in ``opt`` and bit-equal."""
    for p_ours, p_ref in zip(all_params(opt), all_params(torch_opt)):
        ref_state = torch_opt.state[p_ref]
        ours = opt.state[p_ours]
        for key in TORCH_STATE_KEYS:
            if key not in ref_state or ref_state[key] is None:
                continue
            assert key in ours, f"missing state {key!r}"
            a, b = torch.as_tensor(ours[key]), torch.as_tensor(ref_state[key])
            if key == "step":
                assert float(a) == float(b), f"step {float(a)} != {float(b)}"
            else:
                assert a.dtype == b.dtype, (key, a.dtype, b.dtype)
                assert torch.equal(a, b), f"state {key!r} differs"


# Kernel backends against torch.optim (fp32, a few steps): torch's CPU sqrt is not correctly
# rounded (MKL) while the kernels' is, so Adam elements may land an ulp apart and drift a little.
KERNEL_VS_TORCH_TOLERANCE = dict(rtol=1e-6, atol=1e-8)


def assert_matches_torch(opt, model, torch_opt, ref_model, backend: str) -> None:
    """Ours against torch.optim: bit-exact on the reference backend ("torch"), whose op
    sequence is torch's own; within KERNEL_VS_TORCH_TOLERANCE on a kernel backend."""
    if backend == "torch":
        assert_params_equal(model, ref_model)
        assert_torch_state_equal(opt, torch_opt)
        return
    assert_params_close(model, ref_model, **KERNEL_VS_TORCH_TOLERANCE)
    for p_ours, p_ref in zip(all_params(opt), all_params(torch_opt)):
        ref_state, ours = torch_opt.state[p_ref], opt.state[p_ours]
        for key in TORCH_STATE_KEYS:
            if key in ref_state and ref_state[key] is not None:
                a, b = torch.as_tensor(ours[key]), torch.as_tensor(ref_state[key])
                torch.testing.assert_close(a, b, **KERNEL_VS_TORCH_TOLERANCE, msg=lambda m: f"{key}: {m}")


def all_params(opt) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def snapshot(opt) -> dict:
    """A deep copy of everything a failed call must leave untouched."""
    return {
        "params": [p.detach().clone() for p in all_params(opt)],
        "state": copy.deepcopy({i: dict(opt.state[p]) for i, p in enumerate(all_params(opt)) if p in opt.state}),
        "micro_step": opt.micro_step,
        "update_count": opt.update_count,
        "updated": opt.updated,
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[key], b[key]) for key in a)
    return a == b


def assert_every_rank_ran(rank_results: list[dict[str, str]], case: str) -> None:
    """A worker case (run_worker_cases) ran on every rank and passed there."""
    for rank, results in enumerate(rank_results):
        assert case in results, f"rank {rank} did not run {case}"
        assert results[case] == "ok", f"rank {rank}:\n{results[case]}"


def assert_unchanged(opt, before: dict) -> None:
    after = snapshot(opt)
    for i, (a, b) in enumerate(zip(before["params"], after["params"])):
        assert torch.equal(a, b), f"param {i} changed"
    assert _same(before["state"], after["state"]), "optimizer state changed"
    for key in ("micro_step", "update_count", "updated"):
        assert before[key] == after[key], f"{key}: {before[key]} -> {after[key]}"


def save_load(obj):
    """Round-trip through torch.save / torch.load in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _ordered_bits16(x: torch.Tensor) -> torch.Tensor:
    """Map bf16/fp16 values onto integers so that adjacent representable values differ by 1."""
    assert x.dtype in (torch.bfloat16, torch.float16), x.dtype
    bits = x.view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of their (16-bit float) dtype a and b are apart, per element
    (+0 and -0 count as equal)."""
    assert a.dtype == b.dtype
    return (_ordered_bits16(a) - _ordered_bits16(b)).abs()


def run_ranks(worker, out_dir, world_size: int, stall_s: int, env: dict | None = None) -> list[dict]:
    """Start ``python WORKER RANK WORLD_SIZE PORT OUT_DIR`` for every rank (gloo on a free
    127.0.0.1 port; tests/ on PYTHONPATH), wait, and return each rank's OUT_DIR/rank<R>.json
    (scenario results). Fails the test when the ranks make no progress for ``stall_s`` seconds (a
    hung collective), or a rank crashed, never leaving a rank behind.

    Progress: a case finished (``run_worker_cases`` appends it to OUT_DIR/rank<R>.progress) or a
    rank exited. So a loaded machine only makes the run longer: the limit bounds one case, not
    the whole worker (a fixed 600 s for the whole FSDP2 worker failed 96 tests on a busy 2-core
    machine, where it ran 462 s alone)."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import time

    import pytest

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")])}
    log_paths = [os.path.join(out_dir, f"rank{rank}.log") for rank in range(world_size)]
    progress_paths = [os.path.join(out_dir, f"rank{rank}.progress") for rank in range(world_size)]

    def tail(path: str, chars: int = 4000) -> str:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]

    def finished_cases() -> list[list[str]]:
        return [tail(path, 10**6).split() if os.path.exists(path) else [] for path in progress_paths]

    procs = []
    try:
        for rank, log_path in enumerate(log_paths):
            with open(log_path, "w") as log:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(
                    [sys.executable, str(worker), str(rank), str(world_size), str(port), str(out_dir)],
                    env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
        seen, since = None, time.monotonic()
        while any(proc.poll() is None for proc in procs):
            progress = (sum(map(len, finished_cases())), sum(proc.poll() is not None for proc in procs))
            if progress != seen:
                seen, since = progress, time.monotonic()
            elif time.monotonic() - since > stall_s:
                last = [cases[-1] if cases else "none" for cases in finished_cases()]
                pytest.fail(f"the {world_size} gloo ranks made no progress for {stall_s} s (a collective hung?); "
                            f"last case finished per rank: {last}\n" +
                            "\n".join(f"rank {r} log:\n{tail(path, 2000)}" for r, path in enumerate(log_paths)))
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        # (whether the rank had written its results tells a crash in its work from one in teardown)
        wrote = os.path.exists(os.path.join(out_dir, f"rank{rank}.json"))
        assert proc.returncode == 0, (f"rank {rank} exited with {proc.returncode} "
                                      f"({'after' if wrote else 'before'} writing its results):\n"
                                      f"{tail(log_paths[rank])}")
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def built_without_extension() -> bool:
    """ACCUM_FUSED_NO_EXTENSION=1 at install time leaves no accum_fused._C at all (setup.py fails
    loudly when a build it attempts fails), also when the variable is not set for the tests."""
    import importlib.util
    import os
    return os.environ.get("ACCUM_FUSED_NO_EXTENSION") == "1" or importlib.util.find_spec("accum_fused._C") is None


def worker_backends() -> list[str]:
    """The backends a two-rank worker runs every scenario on (CPU tensors): those that run them here."""
    return [b for b in ("torch", "cpp", "triton") if cpu_skip_reason(b) is None]


def worker_case_ids(scenarios: dict, backends) -> list[str]:
    """"<scenario>-<name>[<backend>]" for every case of a worker's ``scenarios``
    ({scenario: (run, [names])}), in the order the worker runs them."""
    return [f"{scenario}-{name}[{backend}]" for scenario, (_, names) in scenarios.items()
            for name in names for backend in backends]


def run_worker_cases(scenarios: dict, rank: int, out_dir: str, call, backends=None) -> None:
    """One rank's side of run_ranks: ``call(run, name, backend)`` for every case (on
    ``backends``, default worker_backends()), recording "ok" or the traceback (the ranks stay in
    step: the same code path, a barrier after each case), then OUT_DIR/rank<RANK>.json."""
    import json
    import os
    import traceback

    import torch.distributed as dist

    results = {}
    for scenario, (run, names) in scenarios.items():
        for name in names:
            for backend in backends or worker_backends():
                case = f"{scenario}-{name}[{backend}]"
                try:
                    call(run, name, backend)
                    results[case] = "ok"
                except Exception:
                    results[case] = traceback.format_exc()
                dist.barrier()
                with open(os.path.join(out_dir, f"rank{rank}.progress"), "a") as f:
                    f.write(case + "\n")  # run_ranks' sign of life
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def finished_apart_from_gloo_exit_abort(proc, done_marker: str, ranks: int = 2) -> bool:
    """Whether a torchrun launch succeeded, allowing for torch 2.13's gloo exit-time abort: a
    process that ran autograd and gloo collectives sometimes aborts in interpreter teardown
    ("terminate called without an active exception"; reproduced without accum_fused), after its
    work is done. Such a launch counts when every rank printed ``done_marker`` and nothing
    but that abort went wrong."""
    if proc.returncode == 0:
        return True
    # torchrun's agent reports the aborted child with a traceback of its own (ending in
    # ChildFailedError); any other traceback is a rank's exception.
    rank_tracebacks = proc.stderr.count("Traceback") - proc.stderr.count("errors.ChildFailedError")
    return (proc.stdout.count(done_marker) >= ranks and rank_tracebacks <= 0
            and "terminate called without an active exception" in proc.stderr)


class RaisingBackward(torch.autograd.Function):
    """Identity whose backward raises (a caught out-of-memory error midway through backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated out of memory")


def cpu_skip_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run the suite's CPU tensors here, or None. Triton runs CPU
    tensors only through its interpreter: on a GPU machine (no TRITON_INTERPRET) a CPU test with
    backend="triton" would silently run the reference backend and check nothing of Triton's."""
    from accum_fused.backends import _load
    available = accum_fused.available_backends()
    if name not in available:
        return f"backend {name!r} not available here (available: {available})"
    if not _load(name).supports(torch.device("cpu"), torch.float32):
        return f"backend {name!r} does not run CPU tensors here (Triton: only under TRITON_INTERPRET=1)"
    if name == "triton":
        return triton_interpreter_problem()
    return None


@functools.cache
def triton_interpreter_problem() -> str | None:
    """Why Triton's CPU interpreter does not run the kernels as a GPU does, or None (tests/_triton_interpreter.py)."""
    import _triton_interpreter
    return _triton_interpreter.problem()


def fsdp2_on_cpu_skip_reason() -> str | None:
    """Why FSDP2 (fully_shard) cannot run on CPU with this torch, or None. Before 2.7,
    fully_shard records stream events on its device's streams, and torch.cpu.Stream has no
    record_event (torch's own AttributeError, in its all-gather); on CUDA 2.6 runs it."""
    if hasattr(torch.cpu.Stream, "record_event"):
        return None
    return (f"FSDP2 on CPU needs torch >= 2.7: torch {torch.__version__}'s fully_shard calls "
            "torch.cpu.Stream.record_event, which it lacks (on CUDA it runs)")



def needs_fsdp2_on_cpu(what: str = ""):
    """The skip mark of a test that runs FSDP2 on CPU (``what``: the part of it that does)."""
    import pytest
    reason = fsdp2_on_cpu_skip_reason()
    return pytest.mark.skipif(reason is not None, reason=f"{what}{reason}")


def rows_compared_with_window(opt) -> int:
    """Compare the extension's rows (csrc/ops.h's Row: plain mode's step table, the in-backward
    hooks' slots) with the window's state and the routes, where the rows say they are true to the
    window (their layout epoch, between passes): every writer (the extension's takes, Python's,
    the window's end) must keep them so. Returns how many tables were compared (0 or more)."""
    from accum_fused.in_backward import by_torch_ops
    from accum_fused.window.table import route, row_lists

    win, compared = opt._window, 0
    tables = []
    table = win.caches.step_table
    if table is not None and table.current(win):
        tables.append((table.cpp.rows(), table.params, lambda p: False))
    fast = getattr(opt, "_hooks", None) and opt._hooks.fast_path
    if fast is not None and fast.state.epoch == win.caches.epoch and not fast.state.armed:
        tables.append((fast.state.rows(), fast.params, by_torch_ops))
    for rows, params, torch_ops in tables:
        expected = row_lists(win, params, [route(opt, win, p, torch_ops(p)) for p in params],
                             [win.buffers.get(p) for p in params])
        assert rows.keys() == expected.keys()
        for key in expected:
            if key == "buffers":  # (the very tensor the window holds, or none)
                mismatched = [i for i, (a, b) in enumerate(zip(rows[key], expected[key])) if a is not b]
            else:
                mismatched = [i for i, (a, b) in enumerate(zip(rows[key], expected[key])) if a != b]
            assert len(rows[key]) == len(expected[key]) and not mismatched, (key, mismatched)
        compared += 1
    return compared
