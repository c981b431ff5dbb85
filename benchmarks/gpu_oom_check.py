#!/usr/bin/env python
"""A real CUDA out-of-memory error, recovered by ``opt.run`` (issue 30; a stage of gpu_check.sh).

First the window is run twice without a filler, to measure the memory it needs beyond the
parameters and data (CUDA's peak allocation): once with whole micro-batches of --batch samples,
once with halves. GPU memory is then filled with one filler tensor until only the midpoint of
the two is left, so a whole micro-batch's forward or backward raises torch.OutOfMemoryError for
real, and halves fit. (On the H100, 2026-11-27, a margin modelled from the layer sizes still left
room for whole micro-batches: no error was raised and nothing was checked.) ``opt.run`` takes the
failed pass out, empties the cache, splits the micro-batch and carries on. Checked, for plain mode
and in_backward mode B: at least one retry happened, the window closed after k micro-batches, and
the parameters equal those of the same run given the parts it ended at from the start, under the
same filler (bit for bit in plain mode; to fp32 rounding in mode B, where a pass may fail after
adding some parameters' gradients whole). Exit 0 when every check holds.

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


def train(mode: str, args, data, max_part_size=None, leave_free: int | None = None):
    """One window; returns the parameters, the recovery record and the bytes the window needed
    beyond what was allocated when it began (peak allocation). ``leave_free``: fill the GPU but
    that many bytes first."""
    model = make_model(args.width, args.layers)
    opt = accum_fused.AdamW(model.parameters(), lr=1e-4, accumulation_steps=args.k, in_backward=mode == "B")
    opt.recovery.max_part_size = max_part_size
    filler = None
    if leave_free is not None:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(max(free - leave_free, 0), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss_fn = lambda b: nn.functional.mse_loss(model(b[0]), b[1])  # noqa: E731
    for batch in data:
        opt.run(batch, loss_fn)
    torch.cuda.synchronize()
    needed = torch.cuda.max_memory_allocated() - start
    del filler
    assert opt.update_count == 1 and opt.micro_step == 0
    params, recovery = [p.detach().clone() for p in model.parameters()], opt.recovery
    del model, opt, loss_fn  # (the next run measures from an empty cache)
    torch.cuda.empty_cache()
    return params, recovery, needed


def _distance(a: list, b: list) -> tuple[float, bool]:
    return max((x - y).abs().max().item() for x, y in zip(a, b)), all(torch.equal(x, y) for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 3
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.width, generator=gen).cuda(),
             torch.randn(args.batch, args.width, generator=gen).cuda()) for _ in range(args.k)]
    results, ok = {}, True
    for mode in ("plain", "B"):
        _, _, whole = train(mode, args, data)
        _, _, halves = train(mode, args, data, max_part_size=args.batch // 2)
        leave_free = (whole + halves) // 2
        print(f"mode {mode}: the window needs {whole / 2**30:.2f} GiB with whole micro-batches, "
              f"{halves / 2**30:.2f} GiB with halves; {leave_free / 2**30:.2f} GiB left free")
        params, recovery, _ = train(mode, args, data, leave_free=leave_free)
        # The reference: the same run split from the start, under the same filler (halves fit).
        # And that run without the filler: does memory pressure change the GPU's arithmetic?
        # (H100, 2026-11-27: plain mode's recovered run was 4.7e-9 from the split run without a
        # filler, mode B's bit for bit; the run under the filler was not yet there to tell why.)
        reference, ref_recovery, _ = train(mode, args, data, max_part_size=recovery.max_part_size,
                                           leave_free=leave_free)
        unfilled, _, _ = train(mode, args, data, max_part_size=recovery.max_part_size)
        # And that reference run again, as it was: the GPU's own run-to-run floor. Were it not
        # 0, a recovered run's difference would be the GPU's, not the recovery's.
        again, _, _ = train(mode, args, data, max_part_size=recovery.max_part_size, leave_free=leave_free)
        diff, exact = _distance(params, reference)
        pressure, pressure_exact = _distance(unfilled, reference)
        floor, floor_exact = _distance(again, reference)
        # (A reference that ran out of memory itself ran other parts: no comparison.)
        good = recovery.retries >= 1 and ref_recovery.retries == 0 and (exact if mode == "plain" else diff <= 1e-5)
        ok &= good
        results[mode] = dict(whole_bytes=whole, halves_bytes=halves, left_free=leave_free,
                             retries=recovery.retries, part_size=recovery.max_part_size, max_abs_diff=diff,
                             bit_exact=exact, reference_retries=ref_recovery.retries,
                             unfilled_max_abs_diff=pressure, unfilled_bit_exact=pressure_exact,
                             rerun_max_abs_diff=floor, rerun_bit_exact=floor_exact, ok=good)
        print(f"mode {mode}: {recovery.retries} retries, parts of {recovery.max_part_size}, max |dparam| against "
              f"the run split from the start {diff:.3g} ({'bit for bit' if exact else 'not bit for bit'}; "
              f"that run without the filler: {pressure:.3g} from it, and again as it was: {floor:.3g}): "
              f"{'ok' if good else 'FAILED'}")
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, results=results)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
