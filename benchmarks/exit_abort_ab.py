"""A/B of torch 2.13's gloo exit-time abort (issue 29, row 5): does accum_fused raise its rate?

A 2-rank DDP job on gloo (127.0.0.1) sometimes dies after ``dist.destroy_process_group()``, in
interpreter teardown, with SIGABRT "terminate called without an active exception": all work is
done, but torchrun reports the job failed. This script launches the same tiny job many times,
interleaving the arms launch by launch (the order inside each round shuffled, so machine load
hits every arm alike), and counts per arm the launches whose exit status was not 0 and those
whose stderr carries that abort.

    python benchmarks/exit_abort_ab.py --n 100                     # arms A, B, C; 100 launches each
    python benchmarks/exit_abort_ab.py --n 30 --arms A,B,B_close   # a quick bisection
    python benchmarks/exit_abort_ab.py --list                      # what each arm does
    # before/after a fix in one interleaved run: two worktrees (copy accum_fused/_C*.so into each)
    python benchmarks/exit_abort_ab.py --n 100 --arms A,B,Bfix --arm-path B=/tmp/af_before \
        --arm-path Bfix=/tmp/af_fix --minutes 45

Every launch is ``torchrun --standalone --nproc-per-node 2 benchmarks/exit_abort_ab.py --worker
ARM``: a Linear(32, 64) -> Linear(64, 8) model in DDP, 3 windows of k=4 micro-batches,
``destroy_process_group()``, exit. Arms (``--list`` prints them all):
  A  torch.optim.AdamW, hand-written accumulation under ``ddp.no_sync()``
  B  accum_fused.AdamW(accumulation_steps=4), plain mode (step() after every backward)
  C  accum_fused.AdamW(accumulation_steps=4, in_backward=True), mode B
plus bisection variants of B (see ARMS).

Measured (torch 2.13.0+cpu, Python 3.11, the shared 2-core VM at load 3-8, results/
exit_abort_ab_torch2.13_cpu.json): A 0/64, B 0/64, Bfix 0/64 aborts (Bfix: WindowSync keeping every
tensor it sent to all_reduce alive until the next window, a candidate not adopted); pilot
(exit_abort_ab_pilot_ABC.json) A, B, C 0/11 each. Probe (exit_abort_ab_mechanism_probe.json):
exiting with gloo work still in flight aborts 4/6 (Q) and 4/6 with the tensors held (Q_hold).

Prints one line per launch (round, arm, exit status, abort seen, seconds) and at the end a table
per arm: launches, non-zero exits, aborts, other failures, with the load average before and
after; writes all of it to benchmarks/results/exit_abort_ab_<timestamp>.json (``--out`` to
choose the name).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

ABORT = "terminate called without an active exception"
K, WINDOWS = 4, 3

ARMS = {
    "A": "torch.optim.AdamW + DDP, no_sync for the first k-1 micro-batches of each window",
    "A_import": "as A, with accum_fused imported (extension loaded) but not used",
    "B": "accum_fused.AdamW(accumulation_steps=k), plain mode, DDP taken over",
    "Bfix": "as B, against the checkout given with --arm-path Bfix=DIR (B's with a fix applied)",
    "B_close": "as B, opt.close() before destroy_process_group()",
    "B_del": "as B, del opt, ddp, model and gc.collect() before destroy_process_group()",
    "B_pg": "accum_fused.AdamW(accumulation_steps=k, process_group=WORLD), no DDP module",
    "B_nodist": "as B but the optimizer built with backend='torch' (no extension kernels)",
    "C": "accum_fused.AdamW(accumulation_steps=k, in_backward=True) (mode B), DDP taken over",
    # Mechanism probes, torch alone: as A, then 8 async all_reduces of fresh tensors right before
    # destroy_process_group(): Python drops each tensor at launch (S) or keeps them all until
    # after destroy_process_group() (S_hold).
    "S": "as A + 8 async all_reduce(torch.ones(65536)) whose Python tensors are dropped at launch",
    "S_hold": "as S, the tensors kept alive in Python until after destroy_process_group()",
    # The same, made likely: 32 async all_reduce(torch.ones(1 << 20)) queued, only the first waited
    # for, so gloo's threads are still finishing them while the interpreter exits.
    "Q": "as A + 32 async all_reduce of fresh 4 MiB tensors dropped at launch, only the first waited",
    "Q_hold": "as Q, the tensors kept in a module-level list (freed by the main thread at teardown)",
}
_KEEP = []


def worker(arm: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model) if arm != "B_pg" else model
    if arm.startswith(("A", "S", "Q")):
        if arm == "A_import":
            import accum_fused  # noqa: F401
            import accum_fused._C  # noqa: F401
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    else:
        import accum_fused

        kwargs = {"accumulation_steps": K}
        if arm == "C":
            kwargs["in_backward"] = True
        if arm == "B_pg":
            kwargs["process_group"] = dist.group.WORLD
        if arm == "B_nodist":
            kwargs["backend"] = "torch"
        opt = accum_fused.AdamW(ddp.parameters(), lr=1e-3, **kwargs)
    g = torch.Generator().manual_seed(rank)
    for _ in range(WINDOWS):
        for i in range(K):
            x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
            if arm.startswith(("A", "S", "Q")):
                if i < K - 1:
                    with ddp.no_sync():
                        (torch.nn.functional.mse_loss(ddp(x), y) / K).backward()
                else:
                    (torch.nn.functional.mse_loss(ddp(x), y) / K).backward()
                    opt.step()
                    opt.zero_grad()
            elif arm == "C":  # mode B: one backward is one micro-batch, the k-th updates inside it
                opt.backward(torch.nn.functional.mse_loss(ddp(x), y))
            else:
                torch.nn.functional.mse_loss(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
    if arm == "B_close":
        opt.close()
    if arm == "B_del":
        import gc

        del opt, ddp, model
        gc.collect()
    held = []
    if arm in ("Q", "Q_hold"):
        works = []
        for _ in range(32):
            t = torch.ones(1 << 20)
            works.append(dist.all_reduce(t, async_op=True))
            if arm == "Q_hold":
                _KEEP.append(t)
            del t
        works[0].wait()
        del works
    if arm in ("S", "S_hold"):
        works = []
        for _ in range(8):
            t = torch.ones(1 << 16)
            works.append(dist.all_reduce(t, async_op=True))
            if arm == "S_hold":
                held.append(t)
            del t
        for w in works:
            w.wait()
        del works
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()
    del held


def launch(arm: str, timeout: float, accum_fused_path: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", os.path.abspath(__file__), "--worker", arm]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    if accum_fused_path:
        env["PYTHONPATH"] = os.pathsep.join([accum_fused_path] + [p for p in [env.get("PYTHONPATH")] if p])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", str(e.stdout or ""), str(e.stderr or "")
    seconds = time.perf_counter() - t0
    done = out.count(": done")
    abort = ABORT in err
    return {"arm": arm, "rc": rc, "abort": abort, "done_ranks": done, "seconds": round(seconds, 2),
            # a failure that is not the exit abort (a rank's exception, a timeout): kept for reading
            "other_failure": rc != 0 and not (abort and done == 2),
            "stderr_tail": err[-1500:] if rc != 0 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=100, help="launches per arm")
    parser.add_argument("--arms", default="A,B,C", help="comma-separated arms (see --list)")
    parser.add_argument("--seed", type=int, default=0, help="shuffles the order inside each round")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    parser.add_argument("--out", default=None, help="result json (default benchmarks/results/exit_abort_ab_<time>.json)")
    parser.add_argument("--minutes", type=float, default=None, help="stop starting rounds after this long")
    parser.add_argument("--accum-fused-path", default=None,
                        help="put this checkout first on the workers' PYTHONPATH (e.g. a worktree of the commit before a fix)")
    parser.add_argument("--arm-path", action="append", default=[], metavar="ARM=DIR",
                        help="as --accum-fused-path for one arm only (repeatable): before/after a fix in one run")
    parser.add_argument("--list", action="store_true", help="print the arms and exit")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if args.list:
        for arm, what in ARMS.items():
            print(f"{arm:10s} {what}")
        return
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; --list shows them")
    import torch

    arm_paths = dict(item.split("=", 1) for item in args.arm_path)
    rng = random.Random(args.seed)
    started = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"exit_abort_ab_{started}.json")
    load_before = os.getloadavg()
    runs = []
    t0 = time.perf_counter()

    def record(rounds: int) -> dict:
        summary = {}
        for arm in arms:
            mine = [x for x in runs if x["arm"] == arm]
            summary[arm] = {"launches": len(mine), "nonzero_exit": sum(x["rc"] != 0 for x in mine),
                            "aborts": sum(x["abort"] for x in mine),
                            "other_failures": sum(x["other_failure"] for x in mine),
                            "mean_seconds": round(sum(x["seconds"] for x in mine) / max(1, len(mine)), 2)}
        rec = {"what": "exit-time SIGABRT after destroy_process_group, 2 gloo ranks under torchrun (issue 29 row 5)",
               "arms": {a: ARMS[a] for a in arms}, "k": K, "windows": WINDOWS, "seed": args.seed,
               "rounds_done": rounds, "rounds_asked": args.n, "accum_fused_path": args.accum_fused_path, "arm_paths": arm_paths,
               "torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
               "started": started, "wall_seconds": round(time.perf_counter() - t0, 1),
               "load_before": load_before, "load_after": os.getloadavg(),
               "load1_mean": round(sum(x["load1"] for x in runs) / max(1, len(runs)), 2),
               "summary": summary, "runs": runs}
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as f:  # after every round: a run stopped early keeps what it measured
            json.dump(rec, f, indent=1)
        return rec

    rounds = 0
    for r in range(args.n):
        if args.minutes and time.perf_counter() - t0 > 60 * args.minutes:
            print(f"stopping after {r} rounds: --minutes {args.minutes} reached", flush=True)
            break
        order = arms[:]
        rng.shuffle(order)
        for arm in order:
            res = launch(arm, args.timeout, arm_paths.get(arm, args.accum_fused_path))
            res["round"] = r
            res["load1"] = round(os.getloadavg()[0], 2)
            runs.append(res)
            print(f"round {r:3d} {arm:9s} rc={res['rc']!s:4s} abort={int(res['abort'])} "
                  f"{res['seconds']:5.1f}s load={res['load1']}", flush=True)
        rounds = r + 1
        rec = record(rounds)
    rec = record(rounds)
    summary = rec["summary"]
    print(f"\n{'arm':9s} {'launches':>8s} {'rc!=0':>6s} {'aborts':>6s} {'other':>6s} {'s/launch':>8s}")
    for arm, s in summary.items():
        print(f"{arm:9s} {s['launches']:8d} {s['nonzero_exit']:6d} {s['aborts']:6d} {s['other_failures']:6d} "
              f"{s['mean_seconds']:8.1f}")
    print(f"load average before {load_before}, after {os.getloadavg()}; written to {out}")


if __name__ == "__main__":
    main()
