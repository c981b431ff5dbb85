"""``python -m accum_fused demo``: why accumulation belongs in the optimizer, in one table.

Trains the same small model on the same deterministic data three ways, each seeing the same
big batches split into micro-batches of uneven sizes:

1. torch.optim.AdamW on each whole big batch (the target),
2. the tutorial loop: loss / k per micro-batch, step every k-th, last partial window / k too,
3. accum_fused.AdamW with weight=len(micro_batch) and flush().
"""
from __future__ import annotations

import argparse
import copy
import time

import torch

import accum_fused

MICRO_BATCH_SIZES = (7, 2, 5, 1, 9, 3, 4)  # one window: uneven, as a length-bucketed loader gives
ACCUMULATION_STEPS = 4  # 7 micro-batches per epoch-slice: one full window and a partial one


def make_task(seed: int = 0, features: int = 16):
    generator = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(features, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    n = sum(MICRO_BATCH_SIZES)
    x = torch.randn(n, features, generator=generator)
    y = torch.sin(x[:, :1] * 2) + 0.1 * torch.randn(n, 1, generator=generator)
    return model, x, y


def windows(x, y):
    """The data as windows of micro-batches: [[(x, y), ...], ...]."""
    micro, start = [], 0
    for size in MICRO_BATCH_SIZES:
        micro.append((x[start:start + size], y[start:start + size]))
        start += size
    return [micro[i:i + ACCUMULATION_STEPS] for i in range(0, len(micro), ACCUMULATION_STEPS)]


def train_full_batch(model, data, steps, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        for window in data:
            xb, yb = torch.cat([m[0] for m in window]), torch.cat([m[1] for m in window])
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()


def train_tutorial_loop(model, data, steps, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        for window in data:
            for xb, yb in window:
                (torch.nn.functional.mse_loss(model(xb), yb) / ACCUMULATION_STEPS).backward()
            opt.step()
            opt.zero_grad()


def train_accum_fused(model, data, steps, lr, backend):
    opt = accum_fused.AdamW(model.parameters(), lr=lr, accumulation_steps=ACCUMULATION_STEPS, backend=backend)
    for _ in range(steps):
        for window in data:
            for xb, yb in window:
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                opt.step(weight=len(xb))
                opt.zero_grad()
            opt.flush()  # the partial last window, averaged over what it holds


def demo(args) -> int:
    torch.manual_seed(0)
    target_model, x, y = make_task()
    data = windows(x, y)
    runs = {
        "torch.optim.AdamW, full batch": lambda m: train_full_batch(m, data, args.steps, args.lr),
        "tutorial loop (loss / k)": lambda m: train_tutorial_loop(m, data, args.steps, args.lr),
        "accum_fused.AdamW": lambda m: train_accum_fused(m, data, args.steps, args.lr, args.backend),
    }
    results, reference = {}, None
    for name, train in runs.items():
        model = copy.deepcopy(target_model)
        start = time.perf_counter()
        train(model)
        seconds = time.perf_counter() - start
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(model(x), y).item()
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        reference = flat if reference is None else reference
        results[name] = (loss, (flat - reference).abs().max().item(), seconds)
    print(f"{'run':34} {'final loss':>11} {'max |Δparam| vs full batch':>27} {'seconds':>8}")
    for name, (loss, diff, seconds) in results.items():
        print(f"{name:34} {loss:11.3e} {diff:27.2e} {seconds:8.2f}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accum_fused", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train a small model three ways and compare with the full batch")
    p.add_argument("--steps", type=int, default=50, help="passes over the data (default 50)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 1e-2)")
    p.add_argument("--backend", default="auto", help="accum_fused backend (default auto)")
    args = parser.parse_args(argv)
    return demo(args)


if __name__ == "__main__":
    raise SystemExit(main())
