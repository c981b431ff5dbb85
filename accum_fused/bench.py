"""Time accumulation windows: accum_fused.AdamW against the native torch loop.

``python -m accum_fused bench`` runs a sweep of windows (shape sets and sizes, dtypes, k, with
and without clipping), prints a table and writes a JSON file and a PNG plot;
``benchmarks/bench_window.py`` times one configuration in detail (``window_main``).

A window is k micro-batches followed by one AdamW update (k=8 and max_grad_norm=1.0 by default).
Backward is not timed: every micro-batch's gradients are precomputed once, so only the
optimizer-side work of the window is measured.

Contenders, interleaved round by round in one process (the starting contender rotates each
round so none always runs right after the same neighbour):

  native    the loop a user writes without accum_fused, at its cheapest:
              micro-batch 1     p.grad = <fresh tensor>   (free: autograd keeps the new grad;
                                                            modelled as assigning a tensor)
              micro-batches 2..k  p.grad.add_(g_i)         (autograd's in-place accumulate)
              torch.nn.utils.clip_grad_norm_(params, max_grad_norm)   (unless --no-clip)
              torch.optim.AdamW(params, fused=True).step()  (foreach=True where fused fails)
              opt.zero_grad()
            Its micro-batch-1 tensor is its own scratch copy, so the in-place adds never touch
            the shared precomputed gradients; that scratch grows by (k-1)·|g| per window, which
            is harmless for timing (uniform(-1e-3, 1e-3) gradients stay far from overflow).
  <backend> accum_fused.AdamW(..., accumulation_steps=k, max_grad_norm=..., backend=<backend>)
            driven as the documented training loop: for each micro-batch
            p.grad = g_i (assignment, no copy); opt.step(); opt.zero_grad().

Modelled bytes per parameter (the model of DESIGN.md, "Bytes per parameter"; k >= 2;
P = parameter bytes, G = gradient bytes, A = accumulation-buffer bytes, S = optimizer-state
bytes per element; AdamW state = exp_avg + exp_avg_sq):

  accum_fused (A = S = 4, fp32 buffer and state whatever the parameter dtype)
    micro-batch 1         overwrite the buffer, no zeroing:   read g, write acc    G + A
    micro-batches 2..k-1  acc += g:                   read g, read acc, write acc   G + 2A
    clip on:  micro-batch k   as above, norm partial sums in the same pass          G + 2A
              update          read acc, p, m, v; write p, m, v                      A + 2P + 4S
    clip off: micro-batch k is fused into the update:
                              read g, acc, p, m, v; write p, m, v               G + A + 2P + 4S
    (k = 1: clip on  G + A  then  A + 2P + 4S;  clip off  G + 2P + 4S, the buffer never used)
  native (G = S = P: torch keeps grads and AdamW state in the parameter dtype)
    micro-batch 1         free
    micro-batches 2..k    .grad += g:                 read g, read grad, write grad    3G
    clip_grad_norm_       norm pass (read G) + scale pass (read G, write G)            3G
    fused AdamW           read g, p, m, v; write p, m, v                           G + 2P + 4S

  fp32, clip on : accum_fused 8 + 12(k-2) + 12 + 28 = 12k + 24   (k=8: 120 B/param)
                  native      12(k-1) + 12 + 28     = 12k + 28   (k=8: 124 B/param)
  fp32, clip off: accum_fused 8 + 12(k-2) + 32      = 12k + 16   native 12(k-1) + 28 = 12k + 16
  bf16, clip on : accum_fused 6 + 10(k-2) + 10 + 24 = 10k + 20   (k=8: 100 B/param)
                  native      6(k-1) + 6 + 14       =  6k + 14   (k=8:  62 B/param)
  bf16, clip off: accum_fused 6 + 10(k-2) + 26      = 10k + 12   native 6(k-1) + 14 = 6k + 8

Achieved GB/s = modelled bytes / window time: the bytes a fused implementation must move, not
what a given implementation does move (the pure-PyTorch "torch" backend moves more, through
temporaries, so its GB/s understates its traffic). It is compared with the device's measured
copy bandwidth, (bytes read + bytes written) / time of dst.copy_(src) on a large fp32 tensor,
under the same thread count: "% copy" near 100 means the window runs at the memory floor on a
GPU. On a CPU the copy under-counts its traffic (write-allocate reads every destination line),
so in-place passes beat it and "% copy" exceeds 100; "% add_" (in-place a.add_(b), 12 B per
element, the accumulate pass itself) is the floor to read there.

Usage:
  python -m accum_fused bench                     # the sweep sized for this device
  python -m accum_fused bench --quick             # a few seconds: one small case
  python -m accum_fused bench --device cuda --shapes uniform gpt2 --sizes 1M 16M 256M
  python benchmarks/bench_window.py               # one case in detail (see benchmarks/README.md)
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import itertools
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import backends as af_backends
from .optim import AdamW
from .version import __version__

PACKAGE_DIR = Path(__file__).resolve().parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR, WEIGHT_DECAY = 1e-3, 1e-2
SHAPE_SETS = ("uniform", "cpu33m", "gpt2")
SCHEMA_VERSION = 1
# Keys of every entry of the sweep's JSON "measurements" (tests/test_cli.py checks them).
MEASUREMENT_KEYS = ("contender", "implementation", "shapes", "size", "numel", "tensors", "dtype", "k",
                    "max_grad_norm", "grad_sets", "bytes_per_param", "modelled_bytes", "times_ms",
                    "median_ms", "min_ms", "q1_ms", "q3_ms", "ratios_vs_native", "median_ratio_vs_native",
                    "gbps", "pct_copy_bandwidth", "pct_add_bandwidth")
RECORD_KEYS = ("benchmark", "schema_version", "date", "command", "device", "versions", "config",
               "copy_bandwidth", "add_bandwidth", "skipped_backends", "skipped_cases", "measurements", "plot")


# ------------------------------------------------------------------------------ shapes
def shape_set(name: str, numel: int = 1 << 26, tensors: int = 1) -> list[tuple[int, ...]]:
    if name == "cpu33m":
        # The CPU acceptance case of issue 3: 33,595,392 parameters in 60 tensors.
        return [(1024, 1024)] * 16 + [(4096, 1024)] * 4 + [(1024,)] * 40
    if name == "uniform":
        if tensors < 1 or numel < tensors:
            raise SystemExit(f"--shapes uniform needs 1 <= tensors <= numel, got {tensors} and {numel}")
        base, extra = divmod(numel, tensors)
        return [(base + (1 if i < extra else 0),) for i in range(tensors)]
    if name == "gpt2":
        # GPT-2 124M (HF transformer.* names); the LM head is tied to wte and not duplicated.
        d, vocab, ctx, layers = 768, 50257, 1024, 12
        shapes = [(vocab, d), (ctx, d)]  # wte, wpe
        for _ in range(layers):
            shapes += [(d,), (d,),                  # ln_1 weight, bias
                       (d, 3 * d), (3 * d,),        # attn.c_attn weight, bias
                       (d, d), (d,),                # attn.c_proj weight, bias
                       (d,), (d,),                  # ln_2 weight, bias
                       (d, 4 * d), (4 * d,),        # mlp.c_fc weight, bias
                       (4 * d, d), (d,)]            # mlp.c_proj weight, bias
        return shapes + [(d,), (d,)]  # ln_f weight, bias  -> 124,439,808 in total
    raise SystemExit(f"unknown shape set {name!r}")


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")


def parse_size(text: str) -> int:
    """'100k' -> 100,000; '1M' -> 2^20; '2^24' -> 2^24; a plain integer as is. k is decimal
    (for the tiny test sizes), M and G binary (the sweep's 1M..256M are powers of two)."""
    text = str(text).strip()
    if "^" in text:
        base, exp = text.split("^", 1)
        return int(base) ** int(exp)
    match = _SIZE_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 100k, 1M, 256M, 2^20, 1048576)")
    value, unit = float(match.group(1)), match.group(2).lower()
    n = int(value * {"": 1, "k": 1000, "m": 1 << 20, "g": 1 << 30}[unit])
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1, got {text!r}")
    return n


def size_label(numel: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20)):
        if numel >= factor and numel % factor == 0:
            return f"{numel // factor}{unit}"
    if numel >= 1000 and numel % 1000 == 0:
        return f"{numel // 1000}k"
    if numel >= 1 << 20:
        return f"{numel / 1e6:.1f}M"
    return str(numel)


# -------------------------------------------------------------------------- byte model
def bytes_per_param(contender: str, k: int, clip: bool, param_bytes: int) -> dict[str, int]:
    """Modelled bytes per parameter for one window, split by phase (see the module docstring)."""
    P = G = param_bytes
    if contender == "native":
        S = P
        phases = {"accumulate": 3 * G * (k - 1), "clip": 3 * G if clip else 0, "update": G + 2 * P + 4 * S}
    else:
        A = S = 4
        if k == 1:
            phases = ({"accumulate": G + A, "update": A + 2 * P + 4 * S} if clip
                      else {"accumulate": 0, "update": G + 2 * P + 4 * S})
        elif clip:
            phases = {"accumulate": (G + A) + (k - 1) * (G + 2 * A), "update": A + 2 * P + 4 * S}
        else:
            phases = {"accumulate": (G + A) + (k - 2) * (G + 2 * A), "update": G + A + 2 * P + 4 * S}
    phases["total"] = sum(phases.values())
    return phases


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
    """Streaming bandwidths on fp32 tensors of ``numel``, as (bytes read + written) / median time:
    "copy" dst.copy_(src) (8 B/element), the reference of "% copy"; "add_" a.add_(b)
    (12 B/element), the in-place read-modify-write that every accumulate pass is. On CPUs a
    copy's stores to fresh lines also read them (write-allocate) and are not counted, so
    in-place passes can beat "copy" there: measured on a 2-core EPYC VM, 2 threads,
    copy_ 33 GB/s and add_ 55 GB/s at 2^26 elements."""
    a = torch.empty(numel, dtype=torch.float32, device=device).uniform_()
    b = torch.empty_like(a).uniform_()
    probes = {"copy": (lambda: b.copy_(a), 8), "add_": (lambda: a.add_(b, alpha=1e-9), 12)}
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


def split_names(items: list[str] | None) -> list[str] | None:
    """['a,b', 'c'] -> ['a', 'b', 'c'] (order kept, duplicates dropped); None stays None."""
    if items is None:
        return None
    return list(dict.fromkeys(x for item in items for x in str(item).split(",") if x))


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


def format_table(header: list[str], rows: list[list[str]], left: int) -> str:
    """Columns padded to width; the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = []
    for row in [header, ["-" * w for w in widths]] + rows:
        lines.append("  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def memory_needed(numel: int, esize: int, n_af: int, grad_sets: int) -> int:
    """Bytes a case holds: init copy; native p, m, v, scratch; per accum_fused backend p, acc,
    m, v (fp32 buffer and state); the gradient sets."""
    return numel * (esize + esize * 4 + n_af * (esize + 4 + 8) + grad_sets * esize)


# ------------------------------------------------------------------- bench_window (one case)
def window_parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Time ONE accumulation window: accum_fused.AdamW against the "
                                             "native torch loop (byte model: python -m pydoc accum_fused.bench).")
    ap.add_argument("--shapes", choices=list(SHAPE_SETS), default="cpu33m")
    ap.add_argument("--numel", type=parse_size, default=1 << 26,
                    help="total parameters for --shapes uniform (default 2^26; 64M and 2^26 work too)")
    ap.add_argument("--tensors", type=int, default=1, help="tensors for --shapes uniform (default 1)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter and gradient dtype")
    ap.add_argument("--k", type=int, default=8, help="micro-batches per window (accumulation_steps)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--no-clip", action="store_true", help="no clipping (max_grad_norm=None)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="accum_fused backends (space or comma separated); default: the available ones "
                         "that support the device and dtype")
    ap.add_argument("--repeats", type=int, default=None, help="timed windows per contender (default 20 CPU, 50 CUDA)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed windows per contender first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2 on CPU; untouched on CUDA)")
    ap.add_argument("--grad-sets", type=int, default=None,
                    help="precomputed gradient sets (default k if memory allows, else 2 used alternately)")
    ap.add_argument("--copy-numel", type=parse_size, default=1 << 26,
                    help="fp32 elements for the bandwidth probes (copy_, add_)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="results file (default benchmarks/results/window_<device>_<date>.json)")
    args = ap.parse_args(argv)
    args.backends = split_names(args.backends)
    if args.k < 1:
        ap.error("--k must be >= 1")
    if args.repeats is None:
        args.repeats = 50 if args.device == "cuda" else 20
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def plan_grad_sets(requested: int | None, k: int, numel: int, esize: int, n_af: int, device: torch.device) -> int:
    """k gradient sets when they fit in 70% of free memory, else 2 used alternately."""
    if requested is not None:
        return max(1, min(requested, k))
    if memory_needed(numel, esize, n_af, k) <= 0.7 * available_memory(device):
        return k
    return min(k, 2)


def window_main(argv=None, results_dir: Path | None = None) -> int:
    """benchmarks/bench_window.py: one configuration, every round's time in the JSON."""
    args = window_parse_args(argv)
    device, device_name = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    max_grad_norm = None if args.no_clip else args.max_grad_norm
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 2)
    threads = torch.get_num_threads()

    shapes = shape_set(args.shapes, args.numel, args.tensors)
    numel = sum(math.prod(s) for s in shapes)
    backend_names, skipped = pick_backends(args.backends, device, dtype)
    grad_sets = plan_grad_sets(args.grad_sets, args.k, numel, dtype.itemsize, len(backend_names), device)
    impl = native_adamw_impl(device, dtype)
    timer = Timer(device)

    print(f"device {device_name} ({device.type}), torch {torch.__version__}, threads {threads}, "
          f"accum_fused {__version__} [{', '.join(backend_names) or 'no backend'}]"
          + (f"; skipped {skipped}" if skipped else ""), flush=True)
    bandwidth = bandwidth_probes(device, args.copy_numel, timer)
    copy, add = bandwidth["copy"], bandwidth["add_"]
    print(f"bandwidth on {args.copy_numel:,} fp32 (median of {len(copy['times_ms'])}): copy_ {copy['gbps']:.1f} GB/s "
          f"(best {copy['best_gbps']:.1f}), in-place add_ {add['gbps']:.1f} GB/s (best {add['best_gbps']:.1f})",
          flush=True)

    init, grads = make_tensors(shapes, device, dtype, grad_sets, args.seed)
    contenders = [Native(init, grads, args.k, max_grad_norm, impl)]
    contenders += [AccumFused(b, init, grads, args.k, max_grad_norm) for b in backend_names]
    del init
    print(f"{args.shapes}: {numel:,} {args.dtype} params in {len(shapes)} tensors, k={args.k}, "
          f"clip={'off' if max_grad_norm is None else max_grad_norm}, {grad_sets} gradient set(s), "
          f"native {contenders[0].label}; {args.warmup} warm-up + {args.repeats} timed rounds", flush=True)

    load_before = loadavg()
    peaks: dict[str, int] = {}
    times = time_contenders(contenders, timer, args.warmup, args.repeats, peaks)
    results = summarise(contenders, times, k=args.k, clip=max_grad_norm is not None, esize=dtype.itemsize,
                        numel=numel, copy=copy, add=add, peaks=peaks)

    header = ["contender", "dtype", "shapes", "numel", "k", "clip", "B/param", "ms/window", "IQR ms",
              "ratio", "GB/s", "% copy", "% add_"]
    rows = [[r["contender"], args.dtype, args.shapes, f"{numel:,}", str(args.k),
             "off" if max_grad_norm is None else f"{max_grad_norm:g}", str(r["bytes_per_param"]["total"]),
             f"{r['median_ms']:.2f}", f"{r['q1_ms']:.3g}-{r['q3_ms']:.3g}",
             f"{r['median_ratio_vs_native']:.3f}", f"{r['gbps']:.1f}", f"{r['pct_copy_bandwidth']:.0f}%",
             f"{r['pct_add_bandwidth']:.0f}%"]
            for r in results]
    print()
    print(format_table(header, rows, left=3))
    print(f"\nratio = median over rounds of (contender / native) window time; native = {contenders[0].label}; "
          f"GB/s = modelled bytes / median time; copy_ = {copy['gbps']:.1f} GB/s, add_ = {add['gbps']:.1f} GB/s")

    now = _dt.datetime.now().astimezone()
    out = args.json or (results_dir or default_output_dir()) / f"window_{device.type}_{now:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "window",
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": {"type": device.type, "name": device_name, "threads": threads, "cpu_count": os.cpu_count(),
                   # 1/5/15-min load averages around the timed rounds: other work on the machine shows here
                   "loadavg_before": load_before, "loadavg_after": loadavg()},
        "versions": versions(),
        "config": {"shapes": args.shapes, "numel": numel, "tensors": len(shapes), "dtype": args.dtype, "k": args.k,
                   "max_grad_norm": max_grad_norm, "repeats": args.repeats, "warmup": args.warmup,
                   "grad_sets": grad_sets, "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": args.seed,
                   "native_adamw": impl, "backends": backend_names, "skipped_backends": skipped},
        "copy_bandwidth": copy,
        "add_bandwidth": add,
        "results": results,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------------- bench (a sweep)
# Sweep defaults per device. CPU: small enough for ~2-3 minutes on 2 cores; clipping off only
# at the largest k (where the last micro-batch folds into the update). CUDA: the grid.
DEFAULTS = {
    "cpu": dict(shapes=["uniform", "cpu33m"], sizes=["1M", "4M", "16M"], dtypes=["fp32", "bf16"], k=[1, 4, 8],
                clip="auto", repeats=10, warmup=2, copy_numel="64M"),
    "cuda": dict(shapes=["uniform", "gpt2"], sizes=["1M", "4M", "16M", "64M", "256M"], dtypes=["fp32", "bf16"],
                 k=[1, 4, 8], clip="both", repeats=30, warmup=5, copy_numel="256M"),
    "quick": dict(shapes=["uniform"], sizes=["100k"], dtypes=["fp32"], k=[4], clip="both", repeats=2, warmup=1,
                  copy_numel="1M"),
}


def default_output_dir() -> Path:
    """benchmarks/results of the checkout this package lives in, when run from inside it; else cwd."""
    repo = PACKAGE_DIR.parent
    cwd = Path.cwd().resolve()
    if (repo / "benchmarks").is_dir() and (repo / "setup.py").is_file() and (cwd == repo or repo in cwd.parents):
        return repo / "benchmarks" / "results"
    return cwd


def add_bench_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="accum_fused backends, space or comma separated (default: the available ones that run "
                         "natively on the device; Triton on CPU only when named, it is the interpreter)")
    ap.add_argument("--dtypes", nargs="+", default=None, help="fp32 and/or bf16 (default both)")
    ap.add_argument("--k", nargs="+", type=int, default=None, help="accumulation steps per window (default 1 4 8)")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="shape sets: uniform (one tensor of each --sizes), cpu33m (33.6M params, 60 tensors), "
                         "gpt2 (GPT-2 124M's 148 tensors) (default: uniform cpu33m on CPU, uniform gpt2 on CUDA)")
    ap.add_argument("--sizes", nargs="+", default=None,
                    help="elements for --shapes uniform, e.g. 1M 4M 100k 2^24 (M = 2^20; default 1M 4M 16M on "
                         "CPU, 1M..256M on CUDA where memory allows)")
    ap.add_argument("--clip", choices=["on", "off", "both", "auto"], default=None,
                    help="max_grad_norm=1.0 (on), none (off), both; auto = on everywhere and off too at the "
                         "largest k (default: auto on CPU, both on CUDA)")
    ap.add_argument("--repeats", type=int, default=None, help="timed windows per contender and case "
                                                              "(default 10 CPU, 30 CUDA)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed windows per contender and case first")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny configuration for tests and a first look: 100k fp32 elements, k=4, clip on "
                         "and off, 2 repeats (seconds); other options still override it")
    ap.add_argument("--output-dir", type=Path, default=None,
                    help="where bench_<device>_<date>.json and .png go (default: benchmarks/results when run "
                         "from the source checkout, else the current directory)")
    ap.add_argument("--copy-size", default=None,
                    help="fp32 elements of the copy_/add_ bandwidth probes (default 64M on CPU, 256M on CUDA, "
                         "1M with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _bench_config(args) -> dict:
    device_type = torch.device(args.device).type
    defaults = DEFAULTS["quick" if args.quick else device_type]
    shapes = split_names(args.shapes) or list(defaults["shapes"])
    for name in shapes:
        if name not in SHAPE_SETS:
            raise SystemExit(f"unknown shape set {name!r}: choose from {', '.join(SHAPE_SETS)}")
    dtypes = split_names(args.dtypes) or list(defaults["dtypes"])
    for name in dtypes:
        if name not in DTYPES:
            raise SystemExit(f"unknown dtype {name!r}: choose from {', '.join(DTYPES)}")
    sizes = [parse_size(s) for s in (split_names(args.sizes) or defaults["sizes"])]
    ks = list(dict.fromkeys(args.k or defaults["k"]))
    if min(ks) < 1:
        raise SystemExit("--k values must be >= 1")
    repeats = args.repeats if args.repeats is not None else defaults["repeats"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    if repeats < 1 or warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    return dict(shapes=shapes, dtypes=dtypes, sizes=sizes, k=ks, clip=args.clip or defaults["clip"],
                repeats=repeats, warmup=warmup,
                copy_numel=parse_size(getattr(args, "copy_size", None) or defaults["copy_numel"]))


def _clip_settings(clip: str, k: int, ks: list[int]) -> list[float | None]:
    if clip == "on":
        return [1.0]
    if clip == "off":
        return [None]
    if clip == "both" or k == max(ks):
        return [1.0, None]
    return [1.0]


def run_bench(args, argv: list[str] | None = None) -> int:
    """The sweep behind ``python -m accum_fused bench``: table on stdout, JSON + PNG written.
    ``argv``: the command line after ``python -m accum_fused`` (for the record; default sys.argv)."""
    from tqdm.auto import tqdm

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device, device_name = resolve_device(args.device)
    config = _bench_config(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    requested = split_names(args.backends)
    timer = Timer(device)

    # The shape groups: (label, shape set, shapes), each timed at every dtype, k and clip.
    groups = []
    for name in config["shapes"]:
        if name == "uniform":
            groups += [(size_label(n), "uniform", shape_set("uniform", n, 1)) for n in config["sizes"]]
        else:
            groups.append((name, name, shape_set(name)))
    groups.sort(key=lambda g: sum(math.prod(s) for s in g[2]))
    plan = []  # (group, dtype name, k, max_grad_norm)
    for group, dtype_name in itertools.product(groups, config["dtypes"]):
        for k in config["k"]:
            plan += [(group, dtype_name, k, clip) for clip in _clip_settings(config["clip"], k, config["k"])]

    backend_names, skipped = {}, {}
    for dtype_name in config["dtypes"]:
        backend_names[dtype_name], why = pick_backends(requested, device, DTYPES[dtype_name])
        for name, reason in why.items():
            skipped.setdefault(name, reason)
    names_all = sorted({b for bs in backend_names.values() for b in bs}, key=af_backends.BACKEND_NAMES.index)
    print(f"accum_fused bench on {device_name} ({device.type}), torch {torch.__version__}, threads {threads}, "
          f"accum_fused {__version__}; backends: {', '.join(names_all) or 'none'}"
          + (f"; not timed: {', '.join(sorted(skipped))}" if skipped else ""), flush=True)
    bandwidth = bandwidth_probes(device, config["copy_numel"], timer)
    copy, add = bandwidth["copy"], bandwidth["add_"]
    print(f"measured bandwidth on {config['copy_numel']:,} fp32: copy_ {copy['gbps']:.1f} GB/s, "
          f"in-place add_ {add['gbps']:.1f} GB/s; {len(plan)} cases, {config['warmup']} warm-up + "
          f"{config['repeats']} timed windows each, contenders interleaved", flush=True)

    load_before = loadavg()
    started = time.perf_counter()
    measurements, skipped_cases, impls = [], [], {}
    bar = tqdm(total=len(plan), desc="bench", unit="case", disable=args.no_progress, mininterval=1.0)
    cache_key, init, grads = None, None, None
    for (label, shapes_name, shapes), dtype_name, k, max_grad_norm in plan:
        dtype = DTYPES[dtype_name]
        numel = sum(math.prod(s) for s in shapes)
        names = backend_names[dtype_name]
        if (label, dtype_name) != cache_key:
            init = grads = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            max_k = max(config["k"])
            free = 0.7 * available_memory(device)
            sets = max_k if memory_needed(numel, dtype.itemsize, len(names), max_k) <= free else min(max_k, 2)
            if memory_needed(numel, dtype.itemsize, len(names), sets) > free:
                cache_key = None
                skipped_cases.append({"shapes": shapes_name, "size": label, "numel": numel, "dtype": dtype_name,
                                      "k": k, "max_grad_norm": max_grad_norm, "reason": "does not fit in memory"})
                bar.update()
                continue
            init, grads = make_tensors(shapes, device, dtype, sets, args.seed)
            cache_key = (label, dtype_name)
        impl = impls.setdefault(dtype_name, native_adamw_impl(device, dtype))
        contenders = [Native(init, grads, k, max_grad_norm, impl)]
        contenders += [AccumFused(b, init, grads, k, max_grad_norm) for b in names]
        peaks: dict[str, int] = {}
        times = time_contenders(contenders, timer, config["warmup"], config["repeats"], peaks)
        case = {"shapes": shapes_name, "size": label, "numel": numel, "tensors": len(shapes), "dtype": dtype_name,
                "k": k, "max_grad_norm": max_grad_norm, "grad_sets": min(len(grads), k)}
        for r in summarise(contenders, times, k=k, clip=max_grad_norm is not None, esize=dtype.itemsize,
                           numel=numel, copy=copy, add=add, peaks=peaks):
            measurements.append({**case, **r})
        del contenders
        bar.update()
    bar.close()
    init = grads = None
    elapsed = time.perf_counter() - started

    header = ["backend", "dtype", "size", "params", "k", "clip", "ms/window", "GB/s", "% copy", "% add_",
              "vs native"]
    rows = [[m["contender"], m["dtype"], m["size"], f"{m['numel'] / 1e6:.2f}M", str(m["k"]),
             "off" if m["max_grad_norm"] is None else f"{m['max_grad_norm']:g}", f"{m['median_ms']:.3f}",
             f"{m['gbps']:.1f}", f"{m['pct_copy_bandwidth']:.0f}%", f"{m['pct_add_bandwidth']:.0f}%",
             f"{m['median_ratio_vs_native']:.3f}"]
            for m in measurements]
    print()
    print(format_table(header, rows, left=3))
    impl_text = ", ".join(f"{d}: torch.optim.AdamW({i}=True)" for d, i in impls.items())
    print(f"\nms/window: median of {config['repeats']} windows (k micro-batches + one AdamW update; no backward). "
          f"native = p.grad += g, clip_grad_norm_ (when clipping), {impl_text or 'torch.optim.AdamW'}. "
          f"GB/s = modelled bytes / median time (bytes per parameter: python -m pydoc accum_fused.bench). "
          f"% copy / % add_ = of the measured copy_ {copy['gbps']:.1f} GB/s / in-place add_ {add['gbps']:.1f} GB/s. "
          f"vs native = median over rounds of window time / the native loop's (< 1 is faster). "
          f"{elapsed:.0f} s of timing.")
    for case in skipped_cases:
        print(f"skipped {case['shapes']} {case['size']} {case['dtype']} k={case['k']}: {case['reason']}")

    now = _dt.datetime.now().astimezone()
    out_dir = args.output_dir or default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"bench_{device.type}_{now:%Y%m%d-%H%M%S}"
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    argv = sys.argv[1:] if argv is None else argv
    record = {
        "benchmark": "bench",
        "schema_version": SCHEMA_VERSION,
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "accum_fused", *argv]),
        "device": {"type": device.type, "name": device_name, "threads": threads, "cpu_count": os.cpu_count(),
                   # 1/5/15-min load averages around the timing: other work on the machine shows here
                   "loadavg_before": load_before, "loadavg_after": loadavg()},
        "versions": versions(),
        "config": {**{key: config[key] for key in ("shapes", "sizes", "dtypes", "k", "clip", "repeats", "warmup")},
                   "max_grad_norm_when_clipping": 1.0, "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": args.seed,
                   "quick": bool(args.quick), "backends": backend_names, "native_adamw": impls,
                   "timing_seconds": elapsed},
        "copy_bandwidth": copy,
        "add_bandwidth": add,
        "skipped_backends": skipped,
        "skipped_cases": skipped_cases,
        "measurements": measurements,
        "plot": png_path.name,
    }
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    plot_bench(record, png_path)
    print(f"wrote {json_path}\nwrote {png_path}")
    return 0


def plot_bench(record: dict, path: Path) -> None:
    """GB/s (top) and time relative to the native loop (bottom) against parameter count, one
    column per dtype; colour = contender, line style = k; clip on where measured, else off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = record["measurements"]
    dtypes = list(dict.fromkeys(m["dtype"] for m in ms)) or ["fp32"]
    clipped = any(m["max_grad_norm"] is not None for m in ms)
    ms = [m for m in ms if (m["max_grad_norm"] is not None) == clipped]
    contenders = list(dict.fromkeys(m["contender"] for m in ms))
    ks = sorted({m["k"] for m in ms})
    colours = dict(zip(contenders, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    styles = dict(zip(ks, ["-", "--", ":", "-."] * 4))
    markers = {"uniform": "o", "cpu33m": "s", "gpt2": "^"}
    fig, axes = plt.subplots(2, len(dtypes), figsize=(5.5 * len(dtypes), 7), dpi=110, squeeze=False, sharex=True)
    for col, dtype in enumerate(dtypes):
        ax_bw, ax_ratio = axes[0][col], axes[1][col]
        for contender, k in itertools.product(contenders, ks):
            points = sorted((m for m in ms if m["dtype"] == dtype and m["contender"] == contender and m["k"] == k),
                            key=lambda m: m["numel"])
            if not points:
                continue
            uniform = [m for m in points if m["shapes"] == "uniform"]
            kw = dict(color=colours[contender], linestyle=styles[k])
            for ax, key in ((ax_bw, "gbps"), (ax_ratio, "median_ratio_vs_native")):
                if ax is ax_ratio and contender == "native":
                    continue  # 1 by definition: the grey line
                ax.plot([m["numel"] for m in uniform], [m[key] for m in uniform], marker="o", markersize=4,
                        label=f"{contender}, k={k}", **kw)
                for m in points:
                    if m["shapes"] != "uniform":
                        ax.plot([m["numel"]], [m[key]], marker=markers.get(m["shapes"], "D"), color=kw["color"])
        ax_bw.axhline(record["copy_bandwidth"]["gbps"], color="grey", linewidth=1, linestyle="-.",
                      label="copy_ bandwidth")
        ax_ratio.axhline(1.0, color="grey", linewidth=1)
        ax_bw.set_title(f"{dtype}, clip {'on' if clipped else 'off'}")
        ax_bw.set_ylabel("GB/s (modelled bytes / time)")
        ax_ratio.set_ylabel("window time / native loop (< 1 faster)")
        ax_ratio.set_xlabel("parameters (o uniform, s cpu33m, ^ gpt2)")
        ax_ratio.set_yscale("log")
        for ax in (ax_bw, ax_ratio):
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    device = record["device"]
    fig.suptitle(f"accum_fused window benchmark: {device['name']} ({device['type']}, {device['threads']} threads)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def bench_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m accum_fused bench")
    add_bench_arguments(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_bench(ap.parse_args(argv), ["bench", *argv])
