#!/usr/bin/env python
"""Communication per accumulation window: sync once per window against an all-reduce after
every micro-batch, data parallel over R processes (gloo on CPU, NCCL with --device cuda).

Each rank trains the same model, an MLP of ``--layers`` Linear(--width, --width) layers with tanh
between them (8.4M fp32 parameters in 16 tensors by default), on its own k micro-batches of
``--batch`` rows per window (random inputs and targets, fixed per rank, mean-squared-error loss).
Every gradient comes from a real forward and backward pass, timed as part of the window, so that
an all-reduce overlapping backward has compute to hide behind. Contenders, taking turns window
by window:

  every_micro_batch  what DDP does without no_sync(): after every micro-batch's backward the
                     gradients are all-reduced (averaged) in buckets; at the end clip_grad_norm_
                     and torch.optim.AdamW (fused on CUDA, foreach on CPU). k x N x 4 bytes
                     all-reduced per window.
  once_native        the hand-written no_sync() pattern: .grad accumulates locally ((loss / k)
                     .backward()), one bucketed all-reduce after the last backward, clip, AdamW.
                     N x 4 bytes.
  ddp_no_sync        torch's DistributedDataParallel (bucket_cap_mb = the bucket size below):
                     micro-batches 1..k-1 under ddp.no_sync(), the k-th backward with DDP's
                     all-reduce overlapping it; then clip_grad_norm_, AdamW. N x 4 bytes.
  accum_fused        accum_fused.AdamW(accumulation_steps=k, max_grad_norm=1.0,
                     process_group=...): loss.backward(); step(weight=1) per micro-batch; one
                     small metadata all-reduce and N x 4 bytes of fp32 sums per window, in place,
                     after the last step().
  accum_fused_in_backward
                     the same optimizer with in_backward=True: opt.backward(loss, weight=1) per
                     micro-batch; the metadata all-reduce when the k-th backward starts and the
                     fixed buckets all-reduced during it as their gradients arrive (overlapped,
                     as DDP), the update at its end.
  ddp_accum_fused    the model wrapped in DistributedDataParallel, forward through DDP, and
                     accum_fused.AdamW(accumulation_steps=k, max_grad_norm=1.0) without a
                     process_group: the optimizer takes DDP's group and turns its per-backward
                     all-reduce off; loss.backward(); step(weight=1). What accum_fused sends is
                     all there is (DDP's reducer sends nothing): counted like accum_fused's.
  ddp_accum_fused_in_backward
                     the same with in_backward=True (opt.backward per micro-batch, overlapped).

Reported per contender: ms per window (median over windows; each window's time is the slowest
rank's), bytes all-reduced per rank per window (counted at torch.distributed.all_reduce for all
but ddp_no_sync, whose C++ reducer is not seen from Python: N x 4, DDP's bucket all-reduce of
every parameter once per synced backward), and ms per window the host spent blocked in
collectives (waits included; for accum_fused_in_backward only the part not hidden behind
backward: the metadata all-reduce and the final wait; not measured for ddp_no_sync). Buckets of
every contender are accum_fused's BUCKET_BYTES unless ``--bucket-mb`` says otherwise. The load
average at start and end is recorded: other processes on the machine slow every contender.

Usage (from the repository root):
  python benchmarks/bench_comm.py                       # 2 gloo ranks on this machine
  python benchmarks/bench_comm.py --bucket-mb 4         # one 1024x1024 layer per bucket
  python benchmarks/bench_comm.py --device cuda --ranks 2 --width 4096 --layers 4
  torchrun --nproc-per-node 2 benchmarks/bench_comm.py  # ranks started by torchrun
"""
from __future__ import annotations

import argparse
import contextlib
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

CONTENDERS = ("every_micro_batch", "once_native", "ddp_no_sync", "accum_fused", "accum_fused_in_backward",
              "ddp_accum_fused", "ddp_accum_fused_in_backward")


class CommTimer:
    """Wall time spent blocked in collectives (synchronising the device around them)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, 0.0

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

    def wrap(self, fn):
        """``fn`` timed as time spent in collectives."""
        def timed(*a, **kw):
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.sync()
                self.seconds += time.perf_counter() - start
        return timed


class ByteCounter:
    """Bytes handed to torch.distributed.all_reduce (accum_fused looks it up at each call), per
    contender, while ``current`` names one."""

    def __init__(self):
        self.current, self.bytes = None, {}
        inner = dist.all_reduce

        def all_reduce(tensor, *a, **kw):
            if self.current is not None:
                self.bytes[self.current] = self.bytes.get(self.current, 0) + tensor.numel() * tensor.element_size()
            return inner(tensor, *a, **kw)

        dist.all_reduce = all_reduce


def bucketed_all_reduce_mean(grads: list[torch.Tensor], timer: CommTimer, group, bucket_bytes: int) -> None:
    """DDP's way for .grad tensors: copy into flat buckets, all-reduce, copy back divided by R."""
    world = dist.get_world_size(group)
    for run in af_dist._chunks(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in run])
        timer.all_reduce_buckets([flat], group)
        flat.div_(world)
        for g, piece in zip(run, flat.split([g.numel() for g in run])):
            g.copy_(piece.view_as(g))


def make_model(args, device) -> torch.nn.Module:
    """The same initial values on every rank and for every contender."""
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


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
    load_start = os.getloadavg()
    group = dist.group.WORLD
    bucket_bytes = int(args.bucket_mb * 2**20) if args.bucket_mb else af_dist.BUCKET_BYTES
    af_dist.BUCKET_BYTES = bucket_bytes
    k = args.k

    # every rank: its own k micro-batches (reused every window)
    gen = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randn(args.batch, args.width, generator=gen).to(device),
                torch.randn(args.batch, args.width, generator=gen).to(device)) for _ in range(k)]
    loss_fn = torch.nn.functional.mse_loss

    setups = {}
    for name in CONTENDERS:
        model = make_model(args, device)
        params = list(model.parameters())
        ddp = None
        if name.startswith("accum_fused"):
            opt = accum_fused.AdamW(params, lr=1e-4, accumulation_steps=k, max_grad_norm=1.0, process_group=group,
                                    in_backward=name == "accum_fused_in_backward")
        elif name.startswith("ddp_accum_fused"):
            ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                            bucket_cap_mb=bucket_bytes / 2**20)
            opt = accum_fused.AdamW(params, lr=1e-4, accumulation_steps=k, max_grad_norm=1.0,
                                    in_backward=name.endswith("in_backward"))
        else:
            fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
            opt = torch.optim.AdamW(params, lr=1e-4, **fused)
            if name == "ddp_no_sync":
                ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                                bucket_cap_mb=bucket_bytes / 2**20)
        setups[name] = (model, params, opt, CommTimer(device), ddp)
    numel = sum(p.numel() for p in setups["once_native"][1])

    def window(name: str) -> None:
        model, params, opt, timer, ddp = setups[name]
        for i, (x, y) in enumerate(batches):
            forward = model if ddp is None else ddp
            if name.endswith("accum_fused_in_backward"):
                opt.backward(loss_fn(forward(x), y), weight=1.0)  # the k-th applies the update
            elif name.endswith("accum_fused"):
                loss_fn(forward(x), y).backward()
                opt.step(weight=1.0)
                opt.zero_grad()
            elif name == "ddp_no_sync":
                with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                    (loss_fn(ddp(x), y) / k).backward()
            else:
                (loss_fn(model(x), y) / k).backward()
                if name == "every_micro_batch":
                    # DDP reduces each micro-batch's gradients before they join .grad; reducing
                    # the sum so far is the same mean (ranks agree on the part already reduced)
                    # with the same bytes and calls: N x 4 per micro-batch
                    bucketed_all_reduce_mean([p.grad for p in params], timer, group, bucket_bytes)
        if name == "once_native":
            bucketed_all_reduce_mean([p.grad for p in params], timer, group, bucket_bytes)
        if "accum_fused" not in name:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()

    # accum_fused's time blocked in collectives: the reduce at the window's end (for in_backward
    # mode B also the metadata all-reduce at the start of the last backward)
    for name in [name for name in CONTENDERS if "accum_fused" in name]:
        _, _, opt, timer, _ = setups[name]
        opt._window.sync.reduce_window = timer.wrap(opt._window.sync.reduce_window)
        opt._window.sync.begin_overlapped_window = timer.wrap(opt._window.sync.begin_overlapped_window)
    counter = ByteCounter()

    times = {name: [] for name in CONTENDERS}
    for round_ in range(args.warmup + args.windows):
        shift = round_ % len(CONTENDERS)
        order = CONTENDERS[shift:] + CONTENDERS[:shift]
        for name in order:
            timer = setups[name][3]
            if round_ == args.warmup:
                timer.seconds, counter.bytes[name] = 0.0, 0
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            counter.current = name
            window(name)
            counter.current = None
            if device.type == "cuda":
                torch.cuda.synchronize()
            slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if round_ >= args.warmup:
                times[name].append(slowest.item())
    load_end = os.getloadavg()

    # sanity: every contender computes the same update on every rank
    ref = setups["once_native"][1]
    max_diff = {name: max((x - y).abs().max().item() for x, y in zip(setups[name][1], ref)) for name in CONTENDERS}

    if rank == 0:
        base = statistics.median(times["every_micro_batch"])
        rows = []
        for name in CONTENDERS:
            timer = setups[name][3]
            ms = statistics.median(times[name]) * 1e3
            measured = name != "ddp_no_sync"
            rows.append({
                "contender": name, "ms_per_window": ms, "ratio_to_every_micro_batch": ms / (base * 1e3),
                "allreduce_MB_per_window_per_rank": (counter.bytes[name] / args.windows if measured else 4 * numel) / 1e6,
                "allreduce_bytes_counted": measured,
                "comm_ms_per_window": timer.seconds / args.windows * 1e3 if measured else None,
                "max_param_diff_vs_once_native": max_diff[name],
                "all_ms": [t * 1e3 for t in times[name]],
            })
        print(f"{world} ranks, {dist.get_backend()} on {device}, MLP {args.layers} x Linear({args.width}, {args.width}): "
              f"{numel:,} fp32 params, {args.batch} rows per micro-batch, k={k}, buckets {bucket_bytes / 2**20:g} MiB, "
              f"{args.windows} windows, {args.threads} thread(s) per rank, load average {load_start[0]:.2f} -> "
              f"{load_end[0]:.2f}")
        print(f"{'contender':<28} {'ms/window':>10} {'ratio':>7} {'MB all-reduced':>15} {'comm ms':>9} {'max diff':>9}")
        for r in rows:
            comm = "-" if r["comm_ms_per_window"] is None else f"{r['comm_ms_per_window']:.1f}"
            mb = f"{r['allreduce_MB_per_window_per_rank']:.1f}" + ("" if r["allreduce_bytes_counted"] else "*")
            print(f"{r['contender']:<28} {r['ms_per_window']:>10.1f} {r['ratio_to_every_micro_batch']:>7.3f} "
                  f"{mb:>15} {comm:>9} {r['max_param_diff_vs_once_native']:>9.1e}")
        print("* not counted (DDP's C++ reducer): N x 4 bytes per window; max diff: |param - once_native's| after the run")
        if args.json:
            record = {
                "benchmark": "bench_comm", "date": _dt.datetime.now().isoformat(timespec="seconds"),
                "command": " ".join(sys.argv), "args": vars(args), "ranks": world, "numel": numel,
                "dist_backend": dist.get_backend(), "bucket_bytes": bucket_bytes,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_model(),
                "cpu_count": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": load_end,
                "torch": torch.__version__, "accum_fused": accum_fused.__version__,
                "python": platform.python_version(), "rows": rows,
            }
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(record, indent=1))
            print(f"results: {args.json}")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2, help="processes to start (ignored under torchrun)")
    parser.add_argument("--width", type=int, default=1024, help="features of each Linear layer")
    parser.add_argument("--layers", type=int, default=8, help="Linear layers (weight and bias: 2 tensors each)")
    parser.add_argument("--batch", type=int, default=16, help="rows per micro-batch")
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
