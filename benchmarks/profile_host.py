#!/usr/bin/env python
"""Host overhead of one contender alone, in one process: median ms per window over 5 windows and,
with ``prof``, a cProfile of one more window sorted by own time (issue 31: where the Python time
per tensor goes). The backward is bench_backward.py's cheap one: an autograd Function whose
backward returns c_p * dloss for every parameter, so the window is mostly optimizer-side work.

    N=5000 D=4096 K=4 python benchmarks/profile_host.py plain [noclip] [prof]
    N=288 D=3072 K=8 python benchmarks/profile_host.py a noclip prof

Contenders: native (torch.optim.AdamW(fused=True), clip_grad_norm_), plain, plain_python_close
(plain with the step table's closing plan switched off), a (in_backward mode A), b (mode B), fb (forward +
backward only, hooks drop .grad). AdamW lr 1e-3, max_grad_norm 1.0
unless ``noclip``; N tensors of D fp32 elements, K micro-batches per window, 2 threads.
Contenders run in separate processes here: compare them only within one sitting, and prefer
bench_backward.py's interleaved runs for ratios.
"""
import cProfile
import os
import pstats
import sys
import time

import torch

import accum_fused
from _cheap_loss import cheap_loss

torch.set_num_threads(2)
N, D, K = (int(os.environ.get(name, default)) for name, default in (("N", 5000), ("D", 4096), ("K", 4)))
mode = sys.argv[1]
clip = None if "noclip" in sys.argv else 1.0
params = [torch.nn.Parameter(torch.randn(D) * 0.01) for _ in range(N)]
cs = [torch.empty(D).uniform_(-1e-3, 1e-3) for _ in range(N)]


loss_of = cheap_loss(cs)


if mode in ("plain", "plain_python_close"):
    opt = accum_fused.AdamW(params, lr=1e-3, accumulation_steps=K, max_grad_norm=clip)
    if mode == "plain_python_close":  # (issue 31's A/B: windows closed by add_micro_batch, as before the closing plan)
        accum_fused.window.StepTable.closing_plan = lambda *args: None
elif mode == "native":
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
elif mode == "a":
    opt = accum_fused.AdamW(params, lr=1e-3, max_grad_norm=clip, in_backward=True)
elif mode == "b":
    opt = accum_fused.AdamW(params, lr=1e-3, accumulation_steps=K, max_grad_norm=clip, in_backward=True)
elif mode == "fb":
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
else:
    raise SystemExit(f"unknown contender {mode!r}: native, plain, plain_python_close, a, b, fb")


def window():
    for _ in range(K):
        loss = loss_of(*params)
        if mode == "b":
            opt.backward(loss)
        elif mode in ("native", "a"):
            (loss / K).backward()
        elif mode == "fb":
            loss.backward()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
    if mode == "native" and clip:
        torch.nn.utils.clip_grad_norm_(params, clip)
    if mode in ("native", "a"):
        opt.step()
        opt.zero_grad()


for _ in range(2):
    window()
times = []
for _ in range(5):
    t0 = time.perf_counter()
    window()
    times.append(time.perf_counter() - t0)
print(f"{mode} clip={clip} N={N} D={D} K={K}: {sorted(times)[2] * 1e3:.1f} ms/window (median of 5)")
if "prof" in sys.argv:
    profile = cProfile.Profile()
    profile.enable()
    window()
    profile.disable()
    pstats.Stats(profile).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("ROWS", 14)))
