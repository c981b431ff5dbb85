#!/usr/bin/env python
"""Time one accumulation window with gradients from a REAL backward pass (so in_backward's
post-accumulate-grad hooks run): the native torch loop against accum_fused plain and
accum_fused in_backward mode A and mode B (issue 12, "Measured": speed).

The "model" is the CPU window benchmark's parameter set (``cpu33m``: 33,595,392 fp32 parameters
in 60 tensors, the shapes of benchmarks/bench_window.py) with a forward whose backward is as
cheap as a backward can be: loss = sum_p <p, c_p> for fixed random c_p (uniform +-1e-3),
written as an autograd Function whose forward does no work (returns a zero) and whose backward
returns c_p * dloss: one fresh gradient per parameter per backward (one read of c_p, one
write). Autograd then does with it what it does in a real model: the native loop steals the
first micro-batch's gradient as .grad and adds the others in place; in_backward hands each one
to its hook. Forward and backward cost the same for every contender; the fb_only row measures
them alone, and "optimizer-side" columns subtract it round by round (contender - fb_only).

Contenders (AdamW lr 1e-3, weight decay 0.01, k micro-batches, clip --clip or none), each on
its own copy of the parameters, interleaved window by window (the first mover rotates):

  native   per micro-batch (loss / k).backward(); at the window end clip_grad_norm_(params, clip)
           (when clipping), torch.optim.AdamW(fused=True).step(), zero_grad()
  plain    accum_fused.AdamW(accumulation_steps=k, max_grad_norm=clip):
           per micro-batch loss.backward(); opt.step(weight=1); opt.zero_grad()
  mode_a   accum_fused.AdamW(in_backward=True, max_grad_norm=clip): the native loop unchanged,
           (loss / k).backward() per micro-batch; opt.step(); opt.zero_grad() at the window end
  mode_b   accum_fused.AdamW(in_backward=True, accumulation_steps=k, max_grad_norm=clip):
           opt.backward(loss, weight=1) per micro-batch; the k-th applies the update (per
           parameter in its hook without clipping; at the end of backward with clipping)
  fb_only  k x (forward + backward) with hooks that drop each .grad, no optimizer: the floor
           that the model itself costs (not a training loop)
  plain_python_close  plain with the step table's closing plan switched off while it runs: its windows
           close through window.plain.add_micro_batch and _apply_window (issue 31's before/after of
           the closing micro-batch, in one run; not in the default set)

Reported per clip setting: median ms/window, interquartile range, median of the per-round
ratios to native (and ratio of medians), optimizer-side time (also per tensor per window), the
median number of minor page faults per window (fresh gradient storage the kernel maps in and
zeroes: the cost of freeing and re-allocating .grad), and, as a sanity check that the timed work is the same
training, max |param - native param| after all windows (~1e-6 expected for fp32).

Usage (from the repository root):
  python benchmarks/bench_backward.py                    # cpu33m, k=8, clip 1.0 and none, 2 threads
  python benchmarks/bench_backward.py --clip on --repeats 30
  python benchmarks/bench_backward.py --numel 4194304 --tensors 16 --k 4    # uniform shapes
  python benchmarks/bench_backward.py --numel 20480000 --tensors 5000 --k 4  # many small tensors
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
try:
    import accum_fused
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(HERE.parent))
    import accum_fused
from accum_fused.bench import cpu_model, loadavg, minor_page_faults, native_adamw_impl  # noqa: E402  (shared)

LR, WEIGHT_DECAY = 1e-3, 1e-2


def cpu33m_shapes() -> list[tuple[int, ...]]:
    """benchmarks/bench_window.py's CPU acceptance case (accum_fused.bench.shape_set("cpu33m"))."""
    try:
        from accum_fused.bench import shape_set
        return shape_set("cpu33m")
    except Exception:  # the shared module may be mid-edit; the shapes are fixed
        return [(1024, 1024)] * 16 + [(4096, 1024)] * 4 + [(1024,)] * 40


def versions() -> dict:
    try:
        from accum_fused.bench import versions as af_versions
        return af_versions()
    except Exception:
        return {"accum_fused": getattr(accum_fused, "__version__", None), "torch": torch.__version__,
                "python": platform.python_version(), "platform": platform.platform()}


class _Probe(torch.autograd.Function):
    """y = 0 * <p, c> as a graph node: the forward does no work (a 0-dim zero), the backward
    returns c * dy, one fresh gradient tensor per call (one read of c, one write): the cheapest
    backward that still hands autograd a new gradient for p."""

    @staticmethod
    def forward(ctx, p, c):
        ctx.c = c
        return p.new_zeros(())

    @staticmethod
    def backward(ctx, dy):
        return ctx.c * dy, None


class Contender:
    def __init__(self, name, init, coefs, k, clip, backend, impl):
        self.name, self.k, self.clip, self.coefs = name, k, clip, coefs
        self.params = [torch.nn.Parameter(t.clone()) for t in init]
        self.opt = None
        self.grad_left = 0  # backward passes after which some .grad was not None (in_backward)
        self._handles = []
        common = dict(lr=LR, weight_decay=WEIGHT_DECAY)
        if name == "native":
            self.opt = torch.optim.AdamW(self.params, **common, **{impl: True})
            self.label = f"torch.optim.AdamW({impl}=True)" + (f" + clip_grad_norm_({clip})" if clip else "")
        elif name in ("plain", "plain_python_close"):
            self.opt = accum_fused.AdamW(self.params, **common, accumulation_steps=k, max_grad_norm=clip,
                                         backend=backend)
        elif name == "mode_a":
            self.opt = accum_fused.AdamW(self.params, **common, max_grad_norm=clip, backend=backend,
                                         in_backward=True)
        elif name == "mode_b":
            self.opt = accum_fused.AdamW(self.params, **common, accumulation_steps=k, max_grad_norm=clip,
                                         backend=backend, in_backward=True)
        elif name == "fb_only":
            def drop(p):
                p.grad = None
            self._handles = [p.register_post_accumulate_grad_hook(drop) for p in self.params]
            self.label = "forward + backward only (hooks drop .grad)"
        else:
            raise SystemExit(f"unknown contender {name!r}")
        if isinstance(self.opt, accum_fused.AdamW):
            self.label = (f"accum_fused.AdamW(backend={backend!r}, accumulation_steps="
                          f"{self.opt.accumulation_steps}, max_grad_norm={clip}, in_backward={self.opt.in_backward})")

    def loss(self) -> torch.Tensor:
        return torch.stack([_Probe.apply(p, c) for p, c in zip(self.params, self.coefs)]).sum()

    def window(self) -> None:
        if self.name != "plain_python_close":
            return self._window()
        # (issue 31's A/B: the window closed by window.plain.add_micro_batch and _apply_window, as
        # before the step table's closing plan, in the same run)
        closing_plan = accum_fused.window.StepTable.closing_plan
        accum_fused.window.StepTable.closing_plan = lambda *args: None
        try:
            self._window()
        finally:
            accum_fused.window.StepTable.closing_plan = closing_plan

    def _window(self) -> None:
        k, opt, name = self.k, self.opt, self.name
        for i in range(k):
            loss = self.loss()
            if name == "native":
                (loss / k).backward()
            elif name in ("plain", "plain_python_close"):
                loss.backward()
                opt.step()
                opt.zero_grad()
            elif name == "mode_a":
                (loss / k).backward()
            elif name == "mode_b":
                opt.backward(loss, weight=1.0)
            else:
                loss.backward()
            if name in ("mode_a", "mode_b") and self.params[0].grad is not None:
                self.grad_left += 1
        if name == "native":
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.params, self.clip)
            opt.step()
            opt.zero_grad()
        elif name == "mode_a":
            opt.step()
            opt.zero_grad()

    def check(self, windows: int) -> str | None:
        if self.name == "native":
            steps = {int(self.opt.state[p]["step"]) for p in self.params}
            return None if steps == {windows} else f"state steps {steps}, expected {windows}"
        if self.opt is not None:
            if self.opt.update_count != windows or self.opt.micro_step != 0:
                return f"update_count={self.opt.update_count} micro_step={self.opt.micro_step}, expected {windows}, 0"
            if any(p.grad is not None for p in self.params):
                return ".grad left after the last window"
            if self.grad_left:
                return f".grad not None after {self.grad_left} backward passes"
        return None


def time_case(args, init, coefs, clip, impl) -> dict:
    contenders = [Contender(name, init, coefs, args.k, clip, args.backend, impl) for name in args.contenders]
    n = len(contenders)
    times = {c.name: [] for c in contenders}
    faults = {c.name: [] for c in contenders}  # minor page faults per window: fresh gradient storage
    gc.collect()
    gc.disable()
    try:
        for r in range(args.warmup + args.repeats):
            for c in contenders[r % n:] + contenders[:r % n]:
                f0 = minor_page_faults()
                t0 = time.perf_counter()
                c.window()
                ms = (time.perf_counter() - t0) * 1e3
                if r >= args.warmup:
                    times[c.name].append(ms)
                    faults[c.name].append(minor_page_faults() - f0)
    finally:
        gc.enable()
    windows = args.warmup + args.repeats
    native = next((c for c in contenders if c.name == "native"), None)
    fb = times.get("fb_only")
    out = []
    for c in contenders:
        ts = times[c.name]
        q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else [ts[0]] * 3
        entry = {"contender": c.name, "implementation": c.label, "max_grad_norm": clip, "times_ms": ts,
                 "median_ms": statistics.median(ts), "min_ms": min(ts), "q1_ms": q[0], "q3_ms": q[2],
                 "page_faults_per_window": statistics.median(faults[c.name]), "check": c.check(windows)}
        if native is not None:
            nts = times["native"]
            ratios = [t / nt for t, nt in zip(ts, nts)]
            entry["ratios_vs_native"] = ratios
            entry["median_ratio_vs_native"] = statistics.median(ratios)
            entry["ratio_of_medians_vs_native"] = entry["median_ms"] / statistics.median(nts)
            if fb is not None and c.name != "fb_only":
                excess = [t - f for t, f in zip(ts, fb)]
                native_excess = [t - f for t, f in zip(times["native"], fb)]
                entry["optimizer_side_ms"] = statistics.median(excess)
                entry["optimizer_side_us_per_tensor"] = entry["optimizer_side_ms"] * 1e3 / len(c.params)
                entry["optimizer_side_ratio_vs_native"] = statistics.median(excess) / statistics.median(native_excess)
            if c.name not in ("fb_only", "native"):
                entry["max_abs_diff_vs_native"] = max((a - b).abs().max().item()
                                                      for a, b in zip(c.params, native.params))
        out.append(entry)
    del contenders, native
    gc.collect()
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--clip", choices=("both", "on", "off"), default="both", help="max_grad_norm 1.0, none, or both")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--numel", type=int, default=None, help="uniform shapes of this total instead of cpu33m")
    ap.add_argument("--tensors", type=int, default=60, help="with --numel")
    ap.add_argument("--contenders", default="native,plain,mode_a,mode_b,fb_only")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="default benchmarks/results/backward_cpu_<date>.json")
    args = ap.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.numel is None:
        shapes, shape_name = cpu33m_shapes(), "cpu33m"
    else:
        base, extra = divmod(args.numel, args.tensors)
        shapes, shape_name = [(base + (1 if i < extra else 0),) for i in range(args.tensors)], "uniform"
    numel = sum(torch.Size(s).numel() for s in shapes)
    gen = torch.Generator().manual_seed(args.seed)
    init = [torch.empty(s).normal_(0, 0.02, generator=gen) for s in shapes]
    coefs = [torch.empty(s).uniform_(-1e-3, 1e-3, generator=gen) for s in shapes]
    impl = native_adamw_impl(torch.device("cpu"), torch.float32)
    resolved = accum_fused.backends.resolve(args.backend, torch.device("cpu"), torch.float32)
    clips = {"both": [args.max_grad_norm, None], "on": [args.max_grad_norm], "off": [None]}[args.clip]
    load_before = loadavg()
    print(f"{shape_name}: {numel:,} fp32 params in {len(shapes)} tensors, k={args.k}, threads "
          f"{torch.get_num_threads()}, backend {args.backend} -> {getattr(resolved, '__name__', resolved)}, "
          f"{args.warmup} warm-up + {args.repeats} timed windows, load average {load_before}", flush=True)
    t0 = time.time()
    results = []
    for clip in clips:
        results += time_case(args, init, coefs, clip, impl)
        print(f"  clip {clip}: done ({time.time() - t0:.0f}s)", flush=True)
    load_after = loadavg()

    header = ["clip", "contender", "ms/window (median)", "IQR ms", "ratio vs native (median of rounds)",
              "ratio of medians", "optimizer-side ms (- fb_only)", "optimizer-side ratio",
              "optimizer-side µs per tensor", "page faults per window", "max |Δparam| vs native", "check"]
    rows = []
    for r in results:
        rows.append([str(r["max_grad_norm"]), r["contender"], f"{r['median_ms']:.1f}",
                     f"{r['q1_ms']:.1f}-{r['q3_ms']:.1f}",
                     f"{r['median_ratio_vs_native']:.3f}" if "median_ratio_vs_native" in r else "-",
                     f"{r['ratio_of_medians_vs_native']:.3f}" if "ratio_of_medians_vs_native" in r else "-",
                     f"{r['optimizer_side_ms']:.1f}" if "optimizer_side_ms" in r else "-",
                     f"{r['optimizer_side_ratio_vs_native']:.3f}" if "optimizer_side_ratio_vs_native" in r else "-",
                     f"{r['optimizer_side_us_per_tensor']:.1f}" if "optimizer_side_us_per_tensor" in r else "-",
                     f"{r['page_faults_per_window']:.0f}",
                     f"{r['max_abs_diff_vs_native']:.1e}" if "max_abs_diff_vs_native" in r else "-",
                     r["check"] or "ok"])
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nload average before {load_before}, after {load_after} ({os.cpu_count()} CPUs)")
    record = {
        "benchmark": "bench_backward", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": {"type": "cpu", "name": cpu_model(), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                   "loadavg_before": load_before, "loadavg_after": load_after},
        "versions": versions(),
        "config": {"shapes": shape_name, "numel": numel, "tensors": len(shapes), "k": args.k,
                   "clips": clips, "backend": args.backend,
                   "resolved_backend": getattr(resolved, "__name__", str(resolved)), "native_adamw": impl,
                   "warmup": args.warmup, "repeats": args.repeats, "lr": LR, "weight_decay": WEIGHT_DECAY,
                   "seed": args.seed, "model": "loss = sum_p <p, c_p> via an autograd Function (forward: zero; backward: c_p * dloss), c_p ~ U(-1e-3, 1e-3) fixed"},
        "results": results, "elapsed_s": time.time() - t0,
    }
    path = Path(args.json) if args.json else (
        HERE / "results" / f"backward_cpu_{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")
    return 1 if any(r["check"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
