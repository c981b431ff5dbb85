#!/usr/bin/env python
"""Communication per accumulation window: sync once per window against an all-reduce after
every micro-batch, data parallel over R processes (gloo on CPU, NCCL with --device cuda).

Each rank holds the same parameter set (``--numel`` fp32 elements in ``--tensors`` tensors).
A window is k micro-batches; each micro-batch "backward" writes a fresh gradient into .grad
(a clone of pre-generated random tensors: the same work for every contender, timed as part
of the window; autograd then accumulates it into .grad in the native loops). Contenders, taking turns window by window:

  every_micro_batch  what DDP does without no_sync(): after every micro-batch the gradients
                     are all-reduced (averaged) in buckets, then .grad accumulates; at the end
                     clip_grad_norm_ and torch.optim.AdamW (fused on CUDA, foreach on CPU).
                     k x N x 4 bytes all-reduced per window.
  once_native        the hand-written no_sync() pattern: .grad accumulates locally, one bucketed
                     all-reduce after the last micro-batch, clip, AdamW. N x 4 bytes.
  accum_fused        accum_fused.AdamW(accumulation_steps=k, max_grad_norm=1.0,
                     process_group=...): step(weight=) per micro-batch; one small metadata
                     all-reduce and N x 4 bytes of fp32 sums per window, in place (no bucket
                     copies).

Reported per contender: ms per window (median over windows; each window's time is the slowest
rank's), bytes all-reduced per rank per window, and ms per window inside collectives (measured
around the calls, waits included). Buckets of every contender are accum_fused's
BUCKET_BYTES unless ``--bucket-mb`` says otherwise.

Usage (from the repository root):
  python benchmarks/bench_comm.py                       # 2 gloo ranks on this machine
  python benchmarks/bench_comm.py --device cuda --ranks 2 --numel 67108864
  torchrun --nproc-per-node 2 benchmarks/bench_comm.py  # ranks started by torchrun
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
try:
    import accum_fused
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(HERE.parent))
    import accum_fused
from accum_fused import distributed as af_dist
from accum_fused.bench import cpu_model

CONTENDERS = ("every_micro_batch", "once_native", "accum_fused")


class CommTimer:
    """Wall time and bytes spent in collectives (synchronising the device around them)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.bytes = device, 0.0, 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def all_reduce_buckets(self, buckets: list[torch.Tensor], group) -> None:
        self.sync()
        start = time.perf_counter()
        works = [dist.all_reduce(b, group=group, async_op=True) for b in buckets]
        for w in works:
            w.wait()
        self.sync()
        self.seconds += time.perf_counter() - start
        self.bytes += sum(b.numel() * b.element_size() for b in buckets)


def bucketed_all_reduce_mean(grads: list[torch.Tensor], timer: CommTimer, group, bucket_bytes: int) -> None:
    """DDP's way for .grad tensors: copy into flat buckets, all-reduce, copy back divided by R."""
    world = dist.get_world_size(group)
    for run in af_dist._chunks(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in run])
        timer.all_reduce_buckets([flat], group)
        flat.div_(world)
        for g, piece in zip(run, flat.split([g.numel() for g in run])):
            g.copy_(piece.view_as(g))


def make_params(args, device) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    sizes = [args.numel // args.tensors] * args.tensors
    sizes[0] += args.numel - sum(sizes)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).to(device) * 0.02) for n in sizes]


def run_rank(rank: int, world: int, args, port: int | None) -> None:
    if port is not None:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    else:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(args.threads)
        device = torch.device("cpu")
    group = dist.group.WORLD
    bucket_bytes = int(args.bucket_mb * 2**20) if args.bucket_mb else af_dist.BUCKET_BYTES
    af_dist.BUCKET_BYTES = bucket_bytes
    k = args.k

    # every rank: its own gradients for each micro-batch of a window (reused every window)
    gen = torch.Generator().manual_seed(1 + rank)
    grads = [[torch.randn(p.shape, generator=gen).to(device) * 1e-3 for p in make_params(args, "cpu")]
             for _ in range(k)]
    # the native loops divide the loss by k (the tutorial's loss / k), accum_fused does not
    native_grads = [[g / k for g in micro] for micro in grads]

    setups = {}
    for name in CONTENDERS:
        params = make_params(args, device)
        if name == "accum_fused":
            opt = accum_fused.AdamW(params, lr=1e-4, accumulation_steps=k, max_grad_norm=1.0,
                                    process_group=group)
        else:
            fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
            opt = torch.optim.AdamW(params, lr=1e-4, **fused)
        setups[name] = (params, opt, CommTimer(device))

    def window(name: str) -> None:
        params, opt, timer = setups[name]
        for i in range(k):
            for p, g in zip(params, grads[i] if name == "accum_fused" else native_grads[i]):
                new = g.clone()  # the gradient backward produces
                if name == "accum_fused" or i == 0:
                    p.grad = new  # handed over as .grad
                else:
                    p.grad.add_(new)  # autograd's .grad += g
            if name == "every_micro_batch":
                # DDP reduces the .grad it is about to accumulate into; reduce the sum so far
                # (the same bytes and calls: N x 4 per micro-batch)
                bucketed_all_reduce_mean([p.grad for p in params], timer, group, bucket_bytes)
            if name == "accum_fused":
                opt.step(weight=1.0)
                opt.zero_grad()
        if name == "once_native":
            bucketed_all_reduce_mean([p.grad for p in params], timer, group, bucket_bytes)
        if name != "accum_fused":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()

    # time accum_fused's collectives: wrap its reduce
    params, opt, af_timer = setups["accum_fused"]
    inner_reduce = opt._sync.reduce_window

    def timed_reduce(*a, **kw):
        af_timer.sync()
        start = time.perf_counter()
        out = inner_reduce(*a, **kw)
        af_timer.sync()
        af_timer.seconds += time.perf_counter() - start
        af_timer.bytes += 8 * (2 + len(params)) + (4 * args.numel if not out[1] else 0)
        return out

    opt._sync.reduce_window = timed_reduce

    times = {name: [] for name in CONTENDERS}
    for round_ in range(args.warmup + args.windows):
        order = CONTENDERS[round_ % 3:] + CONTENDERS[:round_ % 3]
        for name in order:
            timer = setups[name][2]
            if round_ == args.warmup:
                timer.seconds, timer.bytes = 0.0, 0
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            window(name)
            if device.type == "cuda":
                torch.cuda.synchronize()
            slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if round_ >= args.warmup:
                times[name].append(slowest.item())

    # sanity: accum_fused and once_native compute the same update on every rank
    a, b = setups["accum_fused"][0], setups["once_native"][0]
    max_diff = max((x - y).abs().max().item() for x, y in zip(a, b))

    if rank == 0:
        base = statistics.median(times["every_micro_batch"])
        rows = []
        for name in CONTENDERS:
            timer = setups[name][2]
            ms = statistics.median(times[name]) * 1e3
            rows.append({
                "contender": name, "ms_per_window": ms, "ratio_to_every_micro_batch": ms / (base * 1e3),
                "allreduce_MB_per_window_per_rank": timer.bytes / args.windows / 1e6,
                "comm_ms_per_window": timer.seconds / args.windows * 1e3,
                "all_ms": [t * 1e3 for t in times[name]],
            })
        print(f"{world} ranks, {dist.get_backend()} on {device}, {args.numel:,} fp32 params in {args.tensors} tensors, "
              f"k={k}, buckets {bucket_bytes / 2**20:g} MiB, {args.windows} windows")
        print(f"{'contender':<18} {'ms/window':>10} {'ratio':>7} {'MB all-reduced':>15} {'comm ms':>9}")
        for r in rows:
            print(f"{r['contender']:<18} {r['ms_per_window']:>10.1f} {r['ratio_to_every_micro_batch']:>7.3f} "
                  f"{r['allreduce_MB_per_window_per_rank']:>15.1f} {r['comm_ms_per_window']:>9.1f}")
        print(f"max |param(accum_fused) - param(once_native)| after the run: {max_diff:.2e}")
        if args.json:
            record = {
                "benchmark": "bench_comm", "date": _dt.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv), "args": vars(args), "ranks": world,
                "dist_backend": dist.get_backend(), "bucket_bytes": bucket_bytes,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_model(),
                "cpu_count": os.cpu_count(), "torch": torch.__version__, "accum_fused": accum_fused.__version__,
                "python": platform.python_version(), "max_param_diff_vs_once_native": max_diff, "rows": rows,
            }
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1))
            print(f"results: {args.json}")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--numel", type=int, default=8 * 2**20)
    parser.add_argument("--tensors", type=int, default=40)
    parser.add_argument("-k", type=int, default=8, help="micro-batches per window")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank on CPU")
    parser.add_argument("--bucket-mb", type=float, default=None)
    parser.add_argument("--json", default=None, help="write results here (default: benchmarks/results/comm_<device>_<time>.json)")
    args = parser.parse_args()
    if args.json is None:
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        args.json = str(HERE / "results" / f"comm_{args.device}_{stamp}.json")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        run_rank(0, 0, args, None)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run_rank, args=(args.ranks, args, port), nprocs=args.ranks, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
