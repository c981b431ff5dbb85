#!/usr/bin/env python
"""Distances to the big batch on two processes: every multi-process recipe, with its control.

For each scenario: the largest difference between the two ranks' parameters, the largest
distance of a parameter to the single-process big batch over both ranks' micro-batches, and the
same distance for the control (torch.optim under the same launch and loop). The scenarios and
their ground truths are the tests' (tests/_dist_worker.py, tests/_launch_worker.py,
tests/test_multiprocess.py); the tests assert bounds, this prints the numbers.

  own loop + DDP    two gloo ranks, the _dist_worker data (rank 0: 3 micro-batches per window,
                    rank 1: 2, random sizes, a flushed partial window), AdamW with clipping 0.5;
                    plain step(weight=n), mode A (loss scaled as the Trainer does), mode B
                    (opt.backward(loss, weight=n)). Control: DDP with torch.optim.AdamW, no_sync()
                    on all but each rank's last micro-batch, the loss scaled to the global
                    sample mean times the world size, clip_grad_norm_ (find_unused_parameters=True:
                    an auxiliary head is used by some micro-batches only; the same rows are
                    repeated with it unused everywhere).
  HF Trainer        torchrun, the recipe of docs/guides/hf-trainer.md; control: the Trainer with torch.optim.AdamW.
  accelerate        accelerate launch, the Accelerator recipe and mode A; control: torch.optim
                    under accelerate's accumulation.
  Lightning         strategy="ddp", the recipe and mode A (no torch.optim control run).

Usage: python benchmarks/multiprocess_distances.py [--json out.json]   (about 2 minutes, CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

OWN_LOOP = r'''
import json, sys
import torch, torch.distributed as dist
from torch import nn
import _dist_worker as w
rank, port, out, aux = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "aux"
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
data = w.make_data() if aux else w._with_aux(w.make_data(), lambda *a: False)
make, make_torch, clip = w.OPTIMIZERS["AdamW-clip"]
truth = w.reference_params(make_torch, data, clip)
results = {}
for mode in ("plain", "A", "B", "control"):
    model = w.Net(seed=100 + rank)
    # the aux head gets no gradient in some backward passes: DDP's own sync must be told
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=mode == "control")
    if mode == "control":
        opt = make_torch(model.parameters())
        for window in range(w.FULL_WINDOWS + 1):
            batches = data[rank][window]
            total = sum(len(b[0]) for r in data for b in r[window])
            for i, b in enumerate(batches):
                ctx = ddp.no_sync() if i < len(batches) - 1 else torch.enable_grad()
                with ctx:
                    (w.micro_loss(ddp, b) * len(b[0]) * 2 / total).backward()
            if not batches:  # a rank without micro-batches still joins DDP's reduce, adding zero
                (w.micro_loss(ddp, data[0][0][0]) * 0).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    else:
        kw = dict(accumulation_steps=1 if mode == "A" else w.STEPS_PER_RANK[rank])
        if mode != "plain":
            kw["in_backward"] = True
        opt = make(model.parameters(), **kw)
        for window in range(w.FULL_WINDOWS + 1):
            w._train_ddp(mode, ddp, opt, data, rank, window)
        if mode != "A":
            opt.flush()
    params = [p.detach().clone() for p in model.parameters()]
    theirs = [p.clone() for p in params]
    for t in theirs:
        dist.broadcast(t, src=0)
    results[mode] = {"rank_diff": max((a - b).abs().max().item() for a, b in zip(params, theirs)),
                     "to_big_batch": max((a - b).abs().max().item() for a, b in zip(params, truth))}
if rank == 0:
    json.dump(results, open(out, "w"))
dist.barrier()
'''


def own_loop(tmp: Path, aux: bool) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp / "own_loop.py"
    script.write_text(OWN_LOOP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), str(tmp / "own.json"),
                               "aux" if aux else "no-aux"], env=env) for r in (0, 1)]
    assert all(p.wait(timeout=600) == 0 for p in procs)
    res = json.loads((tmp / "own.json").read_text())
    control = res.pop("control")
    data = "" if aux else ", no aux head"
    return {f"own loop + DDP, {mode}{data}": {**v, "control_to_big_batch": control["to_big_batch"],
                                              "control_rank_diff": control["rank_diff"]}
            for mode, v in res.items()}


def frameworks(tmp: Path) -> dict:
    import _launch_worker as w
    import test_multiprocess as t

    rows = {}

    def measure(run, truth):
        ranks = [torch.load(tmp / f"{run}-rank{r}.pt") for r in (0, 1)]
        return {"rank_diff": max((a - b).abs().max().item() for a, b in zip(ranks[0]["params"], ranks[1]["params"])),
                "to_big_batch": max((a - b).abs().max().item() for a, b in zip(ranks[0]["params"], truth[0]))}

    t._torchrun("hf_trainer", tmp)
    truth = t._truth()
    rows["HF Trainer (torchrun)"] = {**measure("hf-accum_fused", truth),
                                     "control_to_big_batch": measure("hf-torch", truth)["to_big_batch"]}
    t._accelerate_launch("accelerate", tmp)
    truth = t._truth(schedule_total=w.schedule_total(), schedule_stride=2)
    control = measure("accelerate-torch", truth)["to_big_batch"]
    rows["accelerate recipe (accelerate launch)"] = {**measure("accelerate-recipe", truth), "control_to_big_batch": control}
    rows["accelerate mode A (accelerate launch)"] = {**measure("accelerate-mode_a", truth), "control_to_big_batch": control}
    t._launch([sys.executable, str(t.WORKER), "lightning", str(tmp)], tmp)
    truth = t._truth(w.lightning_order())
    for mode in ("recipe", "mode_a"):
        rows[f"Lightning ddp, {mode}"] = {**measure(f"lightning-ddp-{mode}", truth), "control_to_big_batch": None}
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {**own_loop(Path(tmp), aux=True), **own_loop(Path(tmp), aux=False), **frameworks(Path(tmp))}
    print(f"{'scenario':<40} {'rank diff':>10} {'to big batch':>13} {'control':>9} {'its ranks':>10}")
    for name, r in rows.items():
        control = "-" if r["control_to_big_batch"] is None else f"{r['control_to_big_batch']:.2e}"
        control_ranks = f"{r['control_rank_diff']:.2e}" if "control_rank_diff" in r else "-"
        print(f"{name:<40} {r['rank_diff']:>10.2e} {r['to_big_batch']:>13.2e} {control:>9} {control_ranks:>10}")
    print("control: torch.optim under the same launch (own loop: DDP + no_sync()); its ranks: their difference")
    if args.json:
        Path(args.json).write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
