#!/usr/bin/env python
"""A real CUDA out-of-memory error, recovered by ``opt.run`` (issue 30; a stage of gpu_check.sh).

GPU memory is filled with one filler tensor until only --free-gib is left; an MLP's micro-batch
of --batch samples then needs more activation memory than that (--width x --layers fp32
activations kept for backward), so its forward or backward raises torch.OutOfMemoryError for
real. ``opt.run`` takes the failed pass out, empties the cache, splits the micro-batch and
carries on. Checked, for plain mode and in_backward mode B: at least one retry happened, the
window closed after k micro-batches, and the parameters equal those of the same run given the
parts it ended at from the start (bit for bit in plain mode; to fp32 rounding in mode B, where a
pass may fail after adding some parameters' gradients whole). Exit 0 when every check holds.

  python benchmarks/gpu_oom_check.py                 # on a CUDA machine
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import accum_fused  # noqa: E402


def make_model(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())]).cuda()


def train(mode: str, args, data, max_part_size=None, fill: bool = False):
    model = make_model(args.width, args.layers)
    opt = accum_fused.AdamW(model.parameters(), lr=1e-4, accumulation_steps=args.k, in_backward=mode == "B")
    opt.recovery.max_part_size = max_part_size
    filler = None
    if fill:  # leave --free-gib: the micro-batch's activations do not fit
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        # (plus what the window keeps: .grad, the fp32 buffer, AdamW's two moments, a margin)
        spare = int(args.free_gib * 2**30) + 5 * sum(p.numel() * 4 for p in model.parameters())
        filler = torch.empty(max(free - spare, 0), dtype=torch.uint8, device="cuda")
    loss_fn = lambda b: nn.functional.mse_loss(model(b[0]), b[1])  # noqa: E731
    for batch in data:
        opt.run(batch, loss_fn)
    del filler
    assert opt.update_count == 1 and opt.micro_step == 0
    return [p.detach().clone() for p in model.parameters()], opt.recovery


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--free-gib", type=float, default=2.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 3
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=gen).cuda(),
             torch.randn(args.batch, args.width, generator=gen).cuda()) for _ in range(args.k)]
    need = args.batch * args.width * 4 * args.layers * 2 / 2**30
    print(f"micro-batch activations ~{need:.1f} GiB, {args.free_gib} GiB left free")
    results, ok = {}, True
    for mode in ("plain", "B"):
        params, recovery = train(mode, args, data, fill=True)
        reference, _ = train(mode, args, data, max_part_size=recovery.max_part_size)
        diff = max((a - b).abs().max().item() for a, b in zip(params, reference))
        exact = all(torch.equal(a, b) for a, b in zip(params, reference))
        good = recovery.retries >= 1 and (exact if mode == "plain" else diff <= 1e-5)
        ok &= good
        results[mode] = dict(retries=recovery.retries, part_size=recovery.max_part_size, max_abs_diff=diff,
                             bit_exact=exact, ok=good)
        print(f"mode {mode}: {recovery.retries} retries, parts of {recovery.max_part_size}, max |dparam| against "
              f"the run split from the start {diff:.3g} ({'bit for bit' if exact else 'not bit for bit'}): "
              f"{'ok' if good else 'FAILED'}")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, results=results)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
