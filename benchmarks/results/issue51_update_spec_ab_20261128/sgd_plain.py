"""SGD without momentum, many small tensors: a window's time in plain mode, mode A and mode B
against the native loop (torch.optim.SGD, .grad accumulated, step every k), in one process,
contenders interleaved window by window. Run it on each side's tree (PYTHONPATH) to compare.

    PYTHONPATH=TREE python sgd_plain.py [--tensors 2000] [--numel 1024] [--windows 15] --json OUT
"""
import argparse, json, statistics, time

import torch

import accum_fused

ap = argparse.ArgumentParser()
ap.add_argument("--tensors", type=int, default=2000)
ap.add_argument("--numel", type=int, default=1024)
ap.add_argument("--windows", type=int, default=15)
ap.add_argument("--json")
args = ap.parse_args()
torch.set_num_threads(1)
K = 4


def contender(name):
    params = [torch.nn.Parameter(torch.randn(args.numel)) for _ in range(args.tensors)]
    coef = [torch.empty(args.numel).uniform_(-1e-3, 1e-3) for _ in range(args.tensors)]

    def loss():
        return sum((p * c).sum() for p, c in zip(params, coef))
    if name == "native":
        opt = torch.optim.SGD(params, lr=1e-3)
    else:
        opt = accum_fused.SGD(params, lr=1e-3, accumulation_steps=1 if name == "mode_a" else K,
                              in_backward=name != "plain")

    def window():
        for _ in range(K):
            if name == "mode_b":
                opt.backward(loss())
            else:
                loss().backward()
                if name == "plain":
                    opt.step()
                    opt.zero_grad()
        if name in ("native", "mode_a"):
            opt.step()
            opt.zero_grad()
    return window


names = ["native", "plain", "mode_a", "mode_b"]
windows = {name: contender(name) for name in names}
for name in names:
    windows[name]()  # (the first window allocates)
times = {name: [] for name in names}
for r in range(args.windows):
    for name in names[r % 4:] + names[:r % 4]:
        t = time.perf_counter()
        windows[name]()
        times[name].append((time.perf_counter() - t) * 1e3)
med = {name: statistics.median(ts) for name, ts in times.items()}
for name in names:
    print(f"{name:8s} {med[name]:8.2f} ms  {med[name] / med['native']:.3f} of native")
if args.json:
    json.dump({"args": vars(args), "torch": torch.__version__, "median_ms": med, "times_ms": times,
               "ratio_vs_native": {n: med[n] / med["native"] for n in names}}, open(args.json, "w"), indent=1)
