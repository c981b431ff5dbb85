#!/usr/bin/env python
"""Time ONE accumulation window: accum_fused.AdamW against the native torch loop.

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

Modelled bytes per parameter (the model of ../shared/DESIGN.md, "Bytes per parameter"; k >= 2;
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

Usage (from the repository root; see benchmarks/README.md):
  python benchmarks/bench_window.py                                   # CPU acceptance case
  python benchmarks/bench_window.py --device cuda --shapes uniform --numel 67108864
  python benchmarks/bench_window.py --device cuda --shapes gpt2 --dtype bf16
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

try:
    import accum_fused
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import accum_fused
from accum_fused import backends as af_backends

HERE = Path(__file__).resolve().parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR, WEIGHT_DECAY = 1e-3, 1e-2


# ------------------------------------------------------------------------------ shapes
def shape_set(name: str, numel: int, tensors: int) -> list[tuple[int, ...]]:
    if name == "cpu33m":
        # The CPU acceptance case of issue 3: 33,595,392 parameters in 60 tensors.
        return [(1024, 1024)] * 16 + [(4096, 1024)] * 4 + [(1024,)] * 40
    if name == "uniform":
        if tensors < 1 or numel < tensors:
            raise SystemExit(f"--shapes uniform needs 1 <= --tensors <= --numel, got {tensors} and {numel}")
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

    def check(self, windows: int) -> None:
        steps = {int(self.opt.state[p]["step"]) for p in self.params}
        assert steps == {windows}, f"native: expected {windows} updates, state says {steps}"


class AccumFused:
    def __init__(self, backend, init, grads, k, max_grad_norm):
        self.name = backend
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        self.grads, self.k = grads, k
        self.opt = accum_fused.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=k,
                                     max_grad_norm=max_grad_norm, backend=backend)
        self.label = f"accum_fused.AdamW(backend={backend!r})"

    def window(self) -> None:
        for i in range(self.k):
            for p, g in zip(self.params, self.grads[i % len(self.grads)]):
                p.grad = g
            self.opt.step()
            self.opt.zero_grad()

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
        chosen.append(name)
    if requested is None:
        skipped.update(af_backends.unavailable_reasons())
    return chosen, skipped


# ----------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", choices=["cpu33m", "uniform", "gpt2"], default="cpu33m")
    ap.add_argument("--numel", type=int, default=1 << 26, help="total parameters for --shapes uniform (default 2^26)")
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
    ap.add_argument("--copy-numel", type=int, default=1 << 26, help="fp32 elements for the bandwidth probes (copy_, add_)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="results file (default benchmarks/results/window_<device>_<date>.json)")
    args = ap.parse_args(argv)
    if args.backends is not None:
        args.backends = list(dict.fromkeys(b for item in args.backends for b in item.split(",") if b))
    if args.k < 1:
        ap.error("--k must be >= 1")
    if args.repeats is None:
        args.repeats = 50 if args.device == "cuda" else 20
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def plan_grad_sets(args, numel: int, n_af: int, device: torch.device) -> int:
    """k gradient sets when they fit in 70% of free memory, else 2 used alternately."""
    if args.grad_sets is not None:
        return max(1, min(args.grad_sets, args.k))
    esize = DTYPES[args.dtype].itemsize
    fixed = numel * (esize * 4 + n_af * (esize + 4 + 8))  # native p,m,v,scratch; accum_fused p,acc,m,v
    if fixed + args.k * numel * esize <= 0.7 * available_memory(device):
        return args.k
    return min(args.k, 2)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(HERE), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(HERE), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def quantiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    max_grad_norm = None if args.no_clip else args.max_grad_norm
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device visible to this torch build")
        torch.cuda.set_device(device.index or 0)
        device = torch.device("cuda", torch.cuda.current_device())
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = cpu_model()
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 2)
    threads = torch.get_num_threads()

    shapes = shape_set(args.shapes, args.numel, args.tensors)
    numel = sum(math.prod(s) for s in shapes)
    backend_names, skipped = pick_backends(args.backends, device, dtype)
    grad_sets = plan_grad_sets(args, numel, len(backend_names), device)
    impl = native_adamw_impl(device, dtype)
    timer = Timer(device)

    print(f"device {device_name} ({device.type}), torch {torch.__version__}, threads {threads}, "
          f"accum_fused {accum_fused.__version__} [{', '.join(backend_names) or 'no backend'}]"
          + (f"; skipped {skipped}" if skipped else ""), flush=True)
    bandwidth = bandwidth_probes(device, args.copy_numel, timer)
    copy, add = bandwidth["copy"], bandwidth["add_"]
    print(f"bandwidth on {args.copy_numel:,} fp32 (median of {len(copy['times_ms'])}): copy_ {copy['gbps']:.1f} GB/s "
          f"(best {copy['best_gbps']:.1f}), in-place add_ {add['gbps']:.1f} GB/s (best {add['best_gbps']:.1f})",
          flush=True)

    gen = torch.Generator(device=device).manual_seed(args.seed)
    init = [torch.empty(s, device=device, dtype=dtype).normal_(0, 0.02, generator=gen) for s in shapes]
    grads = [[torch.empty(s, device=device, dtype=dtype).uniform_(-1e-3, 1e-3, generator=gen) for s in shapes]
             for _ in range(grad_sets)]
    contenders = [Native(init, grads, args.k, max_grad_norm, impl)]
    contenders += [AccumFused(b, init, grads, args.k, max_grad_norm) for b in backend_names]
    del init
    print(f"{args.shapes}: {numel:,} {args.dtype} params in {len(shapes)} tensors, k={args.k}, "
          f"clip={'off' if max_grad_norm is None else max_grad_norm}, {grad_sets} gradient set(s), "
          f"native {contenders[0].label}; {args.warmup} warm-up + {args.repeats} timed rounds", flush=True)

    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    n = len(contenders)
    gc.collect()
    gc.disable()
    try:
        for r in range(args.warmup + args.repeats):
            for c in contenders[r % n:] + contenders[:r % n]:  # rotate who goes first
                ms = timer(c.window)
                if r >= args.warmup:
                    times[c.name].append(ms)
    finally:
        gc.enable()
    timer.sync()
    for c in contenders:
        c.check(args.warmup + args.repeats)

    esize = dtype.itemsize
    native_times = times["native"]
    results = []
    for c in contenders:
        model = bytes_per_param("native" if c.name == "native" else "accum_fused", args.k, max_grad_norm is not None, esize)
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
        })

    header = ["contender", "dtype", "shapes", "numel", "k", "clip", "B/param", "ms/window", "IQR ms",
              "ratio", "GB/s", "% copy", "% add_"]
    rows = [[r["contender"], args.dtype, args.shapes, f"{numel:,}", str(args.k),
             "off" if max_grad_norm is None else f"{max_grad_norm:g}", str(r["bytes_per_param"]["total"]),
             f"{r['median_ms']:.2f}", f"{r['q1_ms']:.3g}-{r['q3_ms']:.3g}",
             f"{r['median_ratio_vs_native']:.3f}", f"{r['gbps']:.1f}", f"{r['pct_copy_bandwidth']:.0f}%",
             f"{r['pct_add_bandwidth']:.0f}%"]
            for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print()
    for row in [header, ["-" * w for w in widths]] + rows:
        print("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    print(f"\nratio = median over rounds of (contender / native) window time; native = {contenders[0].label}; "
          f"GB/s = modelled bytes / median time; copy_ = {copy['gbps']:.1f} GB/s, add_ = {add['gbps']:.1f} GB/s")

    now = _dt.datetime.now().astimezone()
    out = args.json or HERE / "results" / f"window_{device.type}_{now:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "window",
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": {"type": device.type, "name": device_name, "threads": threads, "cpu_count": os.cpu_count(),
                   # 1/5/15-min load averages around the timed rounds: other work on the machine shows here
                   "loadavg_before": load_before,
                   "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                     "accum_fused": accum_fused.__version__, "accum_fused_path": str(Path(accum_fused.__file__).parent),
                     "git_commit": git_commit(), "platform": platform.platform()},
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


if __name__ == "__main__":
    sys.exit(main())
