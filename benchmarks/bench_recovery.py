#!/usr/bin/env python
"""What out-of-memory recovery (``opt.run``, accum_fused/recovery.py) costs (issue 30).

1. When nothing fails: ``opt.run(batch, loss_fn)`` against the hand-written loop it replaces,
   same model, same data, interleaved window by window, in plain mode
   (``loss.backward(); opt.step(weight=n)``) and in_backward mode B
   (``opt.backward(loss, weight=n)``, whose window's last pass updates each parameter inside its
   hook; under run() that pass only accumulates and the update follows at its end, so that a
   failure in it updates nothing). Reported: median ms per window, the median of the per-round
   ratios run/loop, and the bytes the optimizer holds after a window (buffers and state) for both.
3. ``--exactness``: per mode and failure point, the parameters after two windows against the run
   given the same split from the start and against the unsplit run.
2. One recovery: the same run() windows with one micro-batch per window running out of memory
   (an injected torch.OutOfMemoryError in the middle of its backward, as a real one would come):
   ms per window against the clean run() windows, i.e. what one retry costs (the failed pass's
   forward and part of its backward, done again in two parts).

Model: an MLP of --width x --width layers (--layers), fp32, AdamW, k = --k micro-batches of
--batch samples, --threads CPU threads. Usage (from the repository root):

  python benchmarks/bench_recovery.py                       # 8 layers of 1024: 8.4M params, k=8
  python benchmarks/bench_recovery.py --rounds 11 --json benchmarks/results/recovery_cpu.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import accum_fused  # noqa: E402


class _Gate(torch.autograd.Function):
    """Identity; its backward raises torch.OutOfMemoryError while ``armed[0]`` and the pass holds
    more than ``armed[1]`` samples."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.n, ctx.armed = x.shape[0], armed
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed[0] and ctx.n > ctx.armed[1]:
            ctx.armed[0] = False  # once per arming
            raise torch.OutOfMemoryError("injected by bench_recovery")
        return grad, None


class MLP(nn.Module):
    def __init__(self, width: int, layers: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.armed = [False, 0]

    def forward(self, x):
        half = len(self.layers) // 2
        for i, layer in enumerate(self.layers):
            x = torch.tanh(layer(x))
            if i == half:
                x = _Gate.apply(x, self.armed)
        return x


class _GateAt(torch.autograd.Function):
    """Identity; raises torch.OutOfMemoryError in backward while ``armed[0]`` and the pass holds
    more than ``armed[1]`` samples (re-armed by the caller per micro-batch)."""

    @staticmethod
    def forward(ctx, x, armed):
        ctx.n, ctx.armed = x.shape[0], list(armed)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.armed[0] and ctx.n > ctx.armed[1]:
            raise torch.OutOfMemoryError("injected by bench_recovery --exactness")
        return grad, None


def exactness(args) -> list[dict]:
    """Per mode and failure point, the largest parameter difference after 2 windows between the
    run whose micro-batch 1 fails once (retried split in 2) and (a) the run given that split from
    the start, (b) the unsplit run without any failure. Failure points: forward (nothing ran),
    out (backward, before any gradient), mid (half the layers' gradients in)."""
    width, layers, k = 64, 4, 4
    gen = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, width, generator=gen), torch.randn(16, width, generator=gen)) for _ in range(2 * k)]

    def train(mode, where, fail, preset):
        torch.manual_seed(0)
        model = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        opt = accum_fused.AdamW(model.parameters(), lr=1e-2, accumulation_steps=1 if mode == "A" else k,
                                in_backward=mode != "plain", backend=args.backend, max_grad_norm=1.0)
        for i, (x, y) in enumerate(data):
            armed = [fail and i == 1, 8]

            def loss_fn(b):
                h = b[0]
                if where == "forward" and armed[0] and h.shape[0] > armed[1]:
                    raise torch.OutOfMemoryError("injected in forward")
                for j, layer in enumerate(model):
                    h = torch.tanh(layer(h))
                    if where == "mid" and j == layers // 2 - 1:
                        h = _GateAt.apply(h, armed)
                out = _GateAt.apply(h, armed) if where == "out" else h
                loss = nn.functional.mse_loss(out, b[1])
                # mode A sums passes: the loop's constant 1/k (run() gives a part its share)
                return loss / k if mode == "A" else loss
            opt.recovery.max_part_size = 8 if (preset and i == 1) else None
            opt.run((x, y), loss_fn)
            armed[0] = False
            if mode == "A" and (i + 1) % k == 0:
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    rows = []
    for mode in ("plain", "A", "B"):
        for where in ("forward", "out", "mid"):
            recovered = train(mode, where, True, False)
            split = train(mode, where, False, True)
            unsplit = train(mode, where, False, False)
            d_split = max((a - b).abs().max().item() for a, b in zip(recovered, split))
            d_unsplit = max((a - b).abs().max().item() for a, b in zip(recovered, unsplit))
            rows.append(dict(mode=mode, failure=where, vs_split_from_start=d_split, vs_unsplit=d_unsplit))
            print(f"exactness  mode {mode:<5} failure {where:<7}  max |dparam| vs split from the start "
                  f"{d_split:.1e}   vs unsplit {d_unsplit:.1e}")
    return rows


def held_bytes(opt) -> int:
    tensors = {id(t): t for t in opt._window.buffers.values()}
    for state in opt.state.values():
        tensors.update({id(t): t for t in state.values() if isinstance(t, torch.Tensor)})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--backend", default="cpp")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--exactness", action="store_true", help="also the exactness table (seconds)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("accum_fused").setLevel(logging.ERROR)  # (one retry logged per window otherwise)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen))
            for _ in range(args.k)]

    contenders = {}
    for mode in ("plain", "B"):
        for how in ("loop", "run", "run+1oom"):
            model = MLP(args.width, args.layers)
            opt = accum_fused.AdamW(model.parameters(), lr=1e-4, accumulation_steps=args.k,
                                    in_backward=mode == "B", backend=args.backend)
            contenders[f"{mode}-{how}"] = (mode, how, model, opt)

    def window(mode, how, model, opt):
        loss_fn = lambda b: nn.functional.mse_loss(model(b[0]), b[1])  # noqa: E731
        for i, batch in enumerate(data):
            if how == "loop":
                loss = loss_fn(batch)
                if mode == "B":
                    opt.backward(loss, weight=len(batch[0]))
                else:
                    loss.backward()
                    opt.step(weight=len(batch[0]))
            else:
                model.armed[:] = [how == "run+1oom" and i == args.k // 2, args.batch // 2]
                opt.run(batch, loss_fn)
                opt.recovery.max_part_size = None  # every window recovers anew
        assert opt.updated

    for c in contenders.values():  # warm-up
        window(*c)
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            start = time.perf_counter()
            window(*contenders[name])
            times[name].append((time.perf_counter() - start) * 1e3)

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    params = sum(p.numel() for p in contenders["plain-loop"][2].parameters())
    rows = []
    print(f"{params / 1e6:.1f}M fp32 params, k={args.k}, batch {args.batch}, {args.threads} threads, "
          f"{args.rounds} rounds, backend {args.backend}, torch {torch.__version__}")
    print(f"{'contender':<14} {'ms/window':>9} {'IQR':>13} {'vs':>10} {'ratio':>6} {'held MB':>8}")
    for name in names:
        mode, how = contenders[name][:2]
        base = f"{mode}-loop" if how == "run" else (f"{mode}-run" if how == "run+1oom" else name)
        q = statistics.quantiles(times[name], n=4)
        row = dict(contender=name, ms_per_window=statistics.median(times[name]), iqr=[q[0], q[2]], against=base,
                   ratio=ratio(name, base), held_bytes=held_bytes(contenders[name][3]),
                   retries=contenders[name][3].recovery.retries)
        rows.append(row)
        print(f"{name:<14} {row['ms_per_window']:9.1f} {q[0]:6.1f}-{q[2]:<6.1f} {base:>10} {row['ratio']:6.3f} "
              f"{row['held_bytes'] / 1e6:8.1f}")
    exact_rows = exactness(args) if args.exactness else None
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(dict(
            args=vars(args) | {"json": str(args.json)}, params=params, torch=torch.__version__,
            machine=platform.machine(), processor=platform.processor(), loadavg=os.getloadavg(), rows=rows,
            times_ms=times, exactness=exact_rows), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
