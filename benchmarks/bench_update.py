#!/usr/bin/env python
"""The AdamW update pass alone, per byte: accum_fused's CPU kernel (cpp backend, one
``_C.adam_update`` call: the window's update, or the update with the last micro-batch folded in)
against torch's fused CPU AdamW (``torch.optim.AdamW(fused=True).step()``, one
``torch._fused_adamw_`` call), on the same tensors, interleaved call by call (issue 31, item 3).

Modelled bytes per fp32 parameter (reads + writes):
  torch fused AdamW           read g, p, m, v; write p, m, v                         28 B
  cpp update (window closed)  read acc, p, m, v; write p, m, v                       28 B
  cpp update, last folded in  read g, acc, p, m, v; write p, m, v (acc not written)  32 B
so the first two should take the same time; GB/s = modelled bytes / median time.

Shapes: ``large`` (8 tensors of 2^22 = 33.5M parameters, out of cache), ``small`` (5,000 tensors
of 4,096 = 20.5M parameters: the per-tensor cost shows), ``lora`` (1,152 tensors of 8 x 256 =
2.4M: a LoRA adapter set, cache-resident, per-call overhead dominates).

    python benchmarks/bench_update.py                      # all shapes, 2 threads, 15 rounds
    python benchmarks/bench_update.py --shapes small --rounds 31 --threads 1
Writes benchmarks/results/update_cpu_<date>.json (``--json``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
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
from accum_fused.backends import cpp_backend  # noqa: E402

SHAPES = {"large": [(1 << 22,)] * 8, "small": [(4096,)] * 5000, "lora": [(8, 256)] * 1152}
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, amsgrad=False, maximize=False,
             decoupled_weight_decay=True)


def contenders(shapes):
    gen = torch.Generator().manual_seed(0)
    make = lambda: [torch.randn(s, generator=gen) * 1e-3 for s in shapes]  # noqa: E731
    # torch: parameters with .grad, state created by a first step.
    t_params = [torch.nn.Parameter(x) for x in make()]
    for p, g in zip(t_params, make()):
        p.grad = g
    t_opt = torch.optim.AdamW(t_params, lr=HYPER["lr"], weight_decay=HYPER["weight_decay"], fused=True)
    t_opt.step()
    # cpp: parameters, window buffers, state, a last micro-batch to fold.
    c_params, bufs, grads, m, v = make(), make(), make(), make(), [x.abs() for x in make()]
    step = [1]

    def torch_step():
        t_opt.step()

    def cpp_update(fold: bool):
        step[0] += 1
        cpp_backend.adam_update(params=c_params, buffers=bufs, exp_avgs=m, exp_avg_sqs=v, max_exp_avg_sqs=[],
                                step=step[0], weight_sum=4.0, clip_coef=None,
                                grads=grads if fold else None, weight=1.0, overwrite=False, **HYPER)

    return {"torch_fused": (torch_step, 28), "cpp_update": (lambda: cpp_update(False), 28),
            "cpp_update_folded": (lambda: cpp_update(True), 32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="large,small,lora")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for shape_name in args.shapes.split(","):
        shapes = SHAPES[shape_name]
        numel = sum(torch.Size(s).numel() for s in shapes)
        calls = contenders(shapes)
        times = {name: [] for name in calls}
        for r in range(args.warmup + args.rounds):
            order = list(calls)
            order = order[r % len(order):] + order[:r % len(order)]  # the first mover rotates
            for name in order:
                t0 = time.perf_counter()
                calls[name][0]()
                dt = time.perf_counter() - t0
                if r >= args.warmup:
                    times[name].append(dt)
        base = statistics.median(times["torch_fused"])
        for name, (_, bytes_per_param) in calls.items():
            med = statistics.median(times[name])
            row = dict(shape=shape_name, tensors=len(shapes), params=numel, contender=name, median_ms=med * 1e3,
                       ratio_vs_torch_fused=med / base, modelled_bytes_per_param=bytes_per_param,
                       gb_per_s=numel * bytes_per_param / med / 1e9, us_per_tensor=med / len(shapes) * 1e6,
                       times_ms=[t * 1e3 for t in times[name]])
            results.append(row)
            print(f"{shape_name:6s} {len(shapes):5d} tensors {numel / 1e6:6.1f}M  {name:18s} {med * 1e3:8.2f} ms  "
                  f"{row['ratio_vs_torch_fused']:5.2f}x torch  {row['gb_per_s']:6.1f} GB/s  "
                  f"{row['us_per_tensor']:6.2f} us/tensor")
    out = Path(args.json or HERE / "results" / f"update_cpu_{_dt.datetime.now():%Y%m%d-%H%M%S}.json")
    out.write_text(json.dumps(dict(
        benchmark="bench_update", command=" ".join(sys.argv), date=_dt.datetime.now().isoformat(timespec="seconds"),
        device=dict(cpu=platform.processor() or platform.machine(), threads=args.threads,
                    kernel_variant=cpp_backend._C.cpu_kernel_variant()),
        versions=dict(torch=torch.__version__, accum_fused=accum_fused.__version__, python=platform.python_version()),
        results=results), indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
