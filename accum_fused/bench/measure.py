"""Measurement for the window benchmarks: timers, contenders, rounds, and what the record says.

Owns: the timer (wall clock, CUDA events), bandwidth probes, the two contenders (``Native``: the
hand-written torch loop; ``AccumFused``: accum_fused.AdamW as the documented loop), interleaved
timing rounds (``time_contenders``) and their summary against the byte model, which backends to
time, and the environment a record carries (device, versions, git commit, load average).
Must not: parse command lines, print tables or write files (``cli.py``).
"""
from __future__ import annotations

import gc
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from .. import backends as af_backends
from ..optim import AdamW
from ..version import __version__
from .model import bytes_per_param

# The accum_fused package directory (its git checkout, when there is one, is its parent).
PACKAGE_DIR = Path(__file__).resolve().parent.parent
LR, WEIGHT_DECAY = 1e-3, 1e-2


# ------------------------------------------------------------------------ device helpers
class Timer:
    """Wall time of a callable; on CUDA measured with events around it (launch gaps included)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn) -> float:
        """Milliseconds."""
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()

def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30

def resolve_device(name: str) -> tuple[torch.device, str]:
    """(device, its name in words); exits with a message when CUDA is asked for and absent."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible to this torch build")
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
        return device, torch.cuda.get_device_name(device)
    if device.type != "cpu":
        raise SystemExit(f"--device must be cpu or cuda, got {name!r}")
    return device, cpu_model()

def bandwidth_probes(device: torch.device, numel: int, timer: Timer, repeats: int = 10) -> dict[str, dict]:
    """Streaming bandwidths on fp32 tensors of ``numel``, as bytes moved / median time: "copy"
    dst.copy_(src), the reference of "% copy"; "add_" a.add_(b) (12 B/element), the in-place
    read-modify-write that every accumulate pass is.

    A copy moves 8 B/element on CUDA, 12 on CPU: a CPU's stores to lines not in cache read them
    first (write-allocate). Counting 8 there made "% copy" read 150-230% in the 2026-11-21 sweep
    (copy_ 33 GB/s, add_ 55 GB/s, fused AdamW 60-78 GB/s of modelled bytes at 33.6M parameters
    on a 2-core EPYC VM): the bytes model of the windows was right, the copy probe's was not.
    Kernels streaming several tensors at once (AdamW: four read, three written) can still draw
    somewhat more than a two-tensor probe, so a few percent above 100 remain possible."""
    a = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a).uniform_()
    copy_bytes = 8 if device.type == "cuda" else 12
    probes = {"copy": (lambda: b.copy_(a), copy_bytes), "add_": (lambda: a.add_(b, alpha=1e-9), 12)}
    out = {}
    for name, (fn, bytes_per_element) in probes.items():
        for _ in range(3):
            fn()
        times = [timer(fn) for _ in range(repeats)]
        nbytes = bytes_per_element * numel
        med = statistics.median(times)
        out[name] = {"numel": numel, "bytes": nbytes, "times_ms": times, "median_ms": med,
                     "gbps": nbytes / (med * 1e-3) / 1e9, "best_gbps": nbytes / (min(times) * 1e-3) / 1e9}
    return out

def native_adamw_impl(device: torch.device, dtype: torch.dtype) -> str:
    """"fused" where torch.optim.AdamW(fused=True) steps on this (device, dtype), else "foreach"."""
    p = torch.nn.Parameter(torch.zeros(4, device=device, dtype=dtype))
    p.grad = torch.ones_like(p)
    try:
        torch.optim.AdamW([p], lr=LR, fused=True).step()
        return "fused"
    except (RuntimeError, ValueError, NotImplementedError):
        return "foreach"

def held_tensor_bytes(params, opt) -> int:
    """Bytes of the distinct storages behind ``params`` and every tensor an optimizer holds
    between windows: its ``state`` and whatever else hangs off it two levels deep (accum_fused's
    accumulation buffers, wherever the optimizer keeps them). Views of one storage count once."""
    seen, total = set(), 0

    def add(t) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()

    def walk(obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
        elif depth <= 0:
            return
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(key, depth - 1)
                walk(value, depth - 1)
        elif isinstance(obj, (list, tuple, set)):
            for value in obj:
                walk(value, depth - 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            walk(vars(obj), depth - 1)

    for p in params:
        add(p)
    walk(opt.state, 3)
    walk({k: v for k, v in vars(opt).items() if k not in ("state", "param_groups")}, 4)
    return total

# ---------------------------------------------------------------------------- contenders
class Native:
    name = "native"

    def __init__(self, init, grads, k, max_grad_norm, impl):
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        self.scratch = [g.clone() for g in grads[0]]  # micro-batch 1's "fresh" grad, mutated in place
        self.grads, self.k, self.max_grad_norm, self.impl = grads, k, max_grad_norm, impl
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, **{impl: True})
        self.label = f"torch.optim.AdamW({impl}=True)"

    @torch.no_grad()
    def window(self) -> None:
        for p, g in zip(self.params, self.scratch):
            p.grad = g
        for i in range(1, self.k):
            for p, g in zip(self.params, self.grads[i % len(self.grads)]):
                p.grad.add_(g)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad()

    def resident_bytes(self) -> int:
        return held_tensor_bytes(self.params, self.opt)

    def check(self, windows: int) -> None:
        steps = {int(self.opt.state[p]["step"]) for p in self.params}
        assert steps == {windows}, f"native: expected {windows} updates, state says {steps}"

class AccumFused:
    def __init__(self, backend, init, grads, k, max_grad_norm):
        self.name = backend
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        self.grads, self.k = grads, k
        self.opt = AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=k,
                         max_grad_norm=max_grad_norm, backend=backend)
        self.label = f"accum_fused.AdamW(backend={backend!r})"

    def window(self) -> None:
        for i in range(self.k):
            for p, g in zip(self.params, self.grads[i % len(self.grads)]):
                p.grad = g
            self.opt.step()
            self.opt.zero_grad()

    def resident_bytes(self) -> int:
        return held_tensor_bytes(self.params, self.opt)

    def check(self, windows: int) -> None:
        assert self.opt.micro_step == 0 and self.opt.update_count == windows, (
            f"{self.name}: expected {windows} closed windows, got update_count={self.opt.update_count}, "
            f"micro_step={self.opt.micro_step}")

class BandwidthProbe:
    """dst.copy_(src) or a.add_(b) over fp32 tensors of a case's size, timed in the same rounds
    as the case's contenders: the reference of its "% copy" / "% add_". Timed once before the
    case instead, a probe read 25.7 GB/s where the case's kernels then drew 33 (16M parameters,
    2-core VM: the bandwidth a VM gets drifts between moments). Bytes as ``bandwidth_probes``."""

    def __init__(self, kind: str, numel: int, device: torch.device):
        self.name, self.label = f"{kind}_probe", f"{kind} over {numel:,} fp32"
        a = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
        b = torch.empty_like(a).uniform_()
        if kind == "copy":
            self.bytes = (8 if device.type == "cuda" else 12) * numel
            self.window = lambda: b.copy_(a)
        else:
            self.bytes = 12 * numel
            self.window = lambda: a.add_(b, alpha=1e-9)

    def gbps(self, times_ms: list[float]) -> dict:
        return {"bytes": self.bytes, "gbps": self.bytes / (statistics.median(times_ms) * 1e-3) / 1e9,
                "times_ms": times_ms}

    def resident_bytes(self) -> int:
        return 0

    def check(self, windows: int) -> None:
        pass

def pick_backends(requested: list[str] | None, device: torch.device, dtype: torch.dtype) -> tuple[list[str], dict]:
    """accum_fused backends to time, and why the others were left out."""
    skipped = {}
    names = requested if requested is not None else af_backends.available_backends()
    chosen = []
    for name in names:
        if requested is not None:
            try:
                af_backends.check_name(name)  # names the cause and the fix
            except (RuntimeError, ValueError) as exc:
                raise SystemExit(str(exc)) from None
        # A named backend that does not support (device, dtype) silently runs the reference:
        # timing it under its own name would be a lie.
        if name != "torch" and af_backends.resolve(name, device, dtype) is af_backends.reference:
            why = f"does not support ({device.type}, {dtype})"
            if requested is not None:
                raise SystemExit(f"backend {name!r} {why}")
            skipped[name] = why
            continue
        if requested is None and name == "triton" and device.type == "cpu":
            # TRITON_INTERPRET=1 runs the kernels in numpy: a correctness path, 100x+ slower.
            skipped[name] = "Triton on CPU is its interpreter (a test path); name it in --backends to time it"
            continue
        chosen.append(name)
    if requested is None:
        skipped.update(af_backends.unavailable_reasons())
    return chosen, skipped

def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(PACKAGE_DIR), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None

def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"accum_fused": __version__, "accum_fused_path": str(PACKAGE_DIR), "git_commit": git_commit(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
            "python": platform.python_version(), "platform": platform.platform()}

def loadavg():
    return os.getloadavg() if hasattr(os, "getloadavg") else None

def minor_page_faults() -> int:
    """This process's minor page faults so far (0 where getrusage does not exist): fresh
    memory mapped in and zeroed, e.g. gradient storage freed and re-allocated."""
    try:
        import resource
    except ImportError:  # (Windows)
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def quantiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]

# --------------------------------------------------------------------- one measured case
def make_tensors(shapes, device, dtype, grad_sets: int, seed: int):
    """Initial parameters (normal, std 0.02) and ``grad_sets`` gradient sets (uniform ±1e-3)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    init = [torch.empty(s, device=device, dtype=dtype).normal_(0, 0.02, generator=gen) for s in shapes]
    grads = [[torch.empty(s, device=device, dtype=dtype).uniform_(-1e-3, 1e-3, generator=gen) for s in shapes]
             for _ in range(grad_sets)]
    return init, grads

def time_contenders(contenders, timer: Timer, warmup: int, repeats: int,
                    peaks: dict[str, int] | None = None) -> dict[str, list[float]]:
    """Interleaved rounds: every contender runs one window per round; the first mover rotates so
    none always runs right after the same neighbour. Returns the timed rounds' ms per contender.

    ``peaks`` (CUDA only): filled with each contender's peak memory, the peak
    ``torch.cuda.max_memory_allocated`` of its windows less what was allocated when the window
    began, plus the bytes the contender itself holds (parameters, optimizer state, accumulation
    buffers): the peak it would reach alone, the shared gradient sets not counted. Read outside
    the timed region (the Timer synchronises before each window anyway)."""
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    n = len(contenders)
    track = peaks is not None and timer.cuda
    gc.collect()
    gc.disable()
    try:
        for r in range(warmup + repeats):
            for c in contenders[r % n:] + contenders[:r % n]:
                if track:
                    torch.cuda.synchronize()
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                ms = timer(c.window)
                if track:
                    peak = torch.cuda.max_memory_allocated() - before + c.resident_bytes()
                    peaks[c.name] = max(peaks.get(c.name, 0), peak)
                if r >= warmup:
                    times[c.name].append(ms)
    finally:
        gc.enable()
    timer.sync()
    for c in contenders:
        c.check(warmup + repeats)
    return times

def summarise(contenders, times, *, k: int, clip: bool, esize: int, numel: int, copy: dict, add: dict,
              peaks: dict[str, int] | None = None) -> list[dict]:
    native_times = times["native"]
    results = []
    for c in contenders:
        model = bytes_per_param("native" if c.name == "native" else "accum_fused", k, clip, esize)
        ts = times[c.name]
        med = statistics.median(ts)
        ratios = [t / nt for t, nt in zip(ts, native_times)]
        gbps = model["total"] * numel / (med * 1e-3) / 1e9
        q1, q3 = quantiles(ts)
        results.append({
            "contender": c.name, "implementation": c.label, "bytes_per_param": model,
            "modelled_bytes": model["total"] * numel, "times_ms": ts, "median_ms": med, "min_ms": min(ts),
            "q1_ms": q1, "q3_ms": q3, "ratios_vs_native": ratios, "median_ratio_vs_native": statistics.median(ratios),
            "ratio_of_medians_vs_native": med / statistics.median(native_times),
            "gbps": gbps, "pct_copy_bandwidth": 100 * gbps / copy["gbps"],
            "pct_add_bandwidth": 100 * gbps / add["gbps"],
            # CUDA: see time_contenders; None on CPU (no allocator peak to read)
            "peak_memory_bytes": (peaks or {}).get(c.name),
        })
    return results
