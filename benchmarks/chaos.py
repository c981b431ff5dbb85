#!/usr/bin/env python
"""Chaos soak (issue 45): a seeded training run in which every failure a long job meets is
injected, mixed, in any order, and whose end is compared with the same seed's run without them.

A *round* trains one configuration for W windows of k=4 uneven micro-batches (AdamW, clipping
at 1.0, a LambdaLR scheduler stepped on updates, every micro-batch through ``opt.run``) on 1
process or 2 gloo ranks, saving a checkpoint (``accum_fused.save_checkpoint``: model, optimizer,
scheduler, GradScaler and the loop's own position) every few micro-batches, mid-window
included, and keeping the last five. Configurations:

  mlp_scaler   the tests' MLP, plain mode, fp16-style GradScaler, sample weights
  mlp_bn       the MLP with BatchNorm1d under window_batchnorm, plain mode (no out-of-memory
               faults: a split micro-batch normalises by its parts' statistics, another forward)
  gpt_plain    a small GPT, plain mode, uneven padded micro-batches weighted by their tokens
  gpt_mode_b   the same GPT in mode B (in_backward=True, accumulation_steps=k)

Faults, from the round's seed. *Recoverable* ones happen inside a micro-batch, at the same
micro-batch whenever the run passes there (a replay after a restart meets them again):
  oom/forward     torch.OutOfMemoryError raised in forward (once or twice: two splits)
  oom/backward    raised in backward by an autograd Function between the layers
  oom/allocator   a real allocation failure: RLIMIT_AS lowered, then a tensor larger than the room
                  (1-process rounds: the cap is the whole process's, gloo's threads' too)
  nonfinite       an infinite loss under GradScaler (plain): the window is skipped, and the loop
                  runs its micro-batches again (what a user's loop does not lose)
*Fatal* ones fire once each (recorded before they fire): SIGKILL of the process (one rank of two)
in forward, in backward, in a window's closing pass, in a retry after an out-of-memory error,
right after an update, or in the middle of writing a checkpoint; and the newest checkpoint file
truncated or one byte of it inverted, then SIGKILL. The job is restarted the way users restart:
1 process by a relaunch loop, 2 ranks by ``torchrun --max-restarts``; each start loads the newest
checkpoint that loads on every rank (a damaged file is refused loudly: CheckpointCorruptError)
and replays the micro-batches after it.

Oracles, each a separate run of the same seed: ``recoverable`` has the recoverable faults only
(no kill, no damaged file): the fatal faults must change nothing, bit for bit (parameters,
BatchNorm buffers, optimizer state, GradScaler, update_count, the scheduler's step). ``clean``
has no fault at all: equal bit for bit where no micro-batch was split; where one was, the split
sums the gradient in another order, documented as fp32 rounding, and the difference is reported
(max |dp| and ||p - p_clean|| / ||p_clean - p_0||) beside the rounding floor: the same distance
for a fault-free run whose every micro-batch ran in two parts.

  python benchmarks/chaos.py soak --faults 1000 --json benchmarks/results/chaos_soak_<date>.json
  python benchmarks/chaos.py soak --small                       # the CI slice (tests/test_chaos.py)
  python benchmarks/chaos.py round --config gpt_mode_b --ranks 2 --seed 3 --windows 8
"""
from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
try:
    import accum_fused
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(ROOT))
    import accum_fused
from accum_fused import checkpoint_files  # noqa: E402
from accum_fused.nn import window_batchnorm  # noqa: E402

K = 4                 # micro-batches per window
SAVE_EVERY = 3        # micro-batches between checkpoints (not a divisor of K: most are mid-window)
KEEP = 5              # checkpoints kept per rank (ranks drift apart by up to a window between two
                      # closes, and the newest may be damaged: a set that loads on every rank must remain)
CONFIGS = {
    "mlp_scaler": dict(model="mlp", mode="plain", scaler=True, oom=True),
    "mlp_bn": dict(model="mlp_bn", mode="plain", scaler=False, oom=False),
    "gpt_plain": dict(model="gpt", mode="plain", scaler=False, oom=True),
    "gpt_mode_b": dict(model="gpt", mode="B", scaler=False, oom=True),
}
# A split sums a micro-batch's gradient in another order (fp32 rounding, ~1e-7 of a gradient);
# AdamW's m / sqrt(v) carries such differences into the parameters at about that size relative to
# how far training moved them, more for coordinates whose gradients are near zero.
RELATIVE_TOLERANCE = 1e-3
FAULT_KINDS = ("oom", "nonfinite", "kill", "corrupt")  # (the other events: what the job did about them)
KILL_PHASES = ("forward", "backward", "closing", "retry", "after_update", "save", "corrupt")


# ------------------------------------------------------------------------------ models, data
class MLP(nn.Module):
    def __init__(self, batchnorm: bool):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.bn = nn.BatchNorm1d(32) if batchnorm else nn.Identity()

    def layers(self):
        return [lambda x: torch.tanh(self.bn(self.l1(x))), lambda x: torch.tanh(self.l2(x)), self.l3]


class GPT(nn.Module):
    """A small decoder: embeddings, one pre-LN block (causal attention, GELU MLP), tied head."""
    VOCAB, SEQ, D = 64, 16, 32

    def __init__(self):
        super().__init__()
        d = self.D
        self.tok, self.pos = nn.Embedding(self.VOCAB, d), nn.Embedding(self.SEQ, d)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def attention(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, 2, d // 2).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(d, dim=-1))
        return x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))

    def layers(self):
        embed = lambda ids: self.tok(ids) + self.pos(torch.arange(ids.shape[1]))  # noqa: E731
        return [embed, self.attention, lambda x: x + self.out(F.gelu(self.fc(self.ln2(x)))),
                lambda x: self.lnf(x) @ self.tok.weight.t()]


def build_model(config: str) -> nn.Module:
    torch.manual_seed(0)  # every rank and every start begin from the same initial values
    kind = CONFIGS[config]["model"]
    return GPT() if kind == "gpt" else MLP(batchnorm=kind == "mlp_bn")


def micro_batch(config: str, seed: int, rank: int, index: int):
    """Micro-batch ``index`` of ``rank``: a function of them alone, so a replay sees the same."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + index)
    if CONFIGS[config]["model"] == "gpt":
        n = int(torch.randint(2, 9, (), generator=gen))
        ids = torch.randint(0, GPT.VOCAB, (n, GPT.SEQ + 1), generator=gen)
        lengths = torch.randint(4, GPT.SEQ + 1, (n,), generator=gen)
        mask = torch.arange(GPT.SEQ)[None, :] < lengths[:, None]  # padding after each sequence
        return ids[:, :-1], ids[:, 1:], mask
    n = int(torch.randint(4, 17, (), generator=gen))
    x = torch.randn(n, 8, generator=gen)
    return x, torch.randn(n, 4, generator=gen)


# ------------------------------------------------------------------------------ fault points
class FaultPoint(torch.autograd.Function):
    """Identity between two layers; its backward is where backward faults fire."""

    @staticmethod
    def forward(ctx, x, job, layer):
        ctx.job, ctx.layer, ctx.samples = job, layer, x.shape[0]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.job.in_backward(ctx.layer, ctx.samples)
        return grad, None, None


class Job:
    """One start of a round's training run, on one rank."""

    def __init__(self, args):
        self.args, self.config = args, CONFIGS[args.config]
        self.dir = Path(args.dir)
        self.plan = json.loads(Path(args.plan).read_text())
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.life = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("CHAOS_LIFE", "0")))
        if self.world > 1:
            import torch.distributed as dist
            dist.init_process_group("gloo")
            self.dist = dist
        self.rank = int(os.environ.get("RANK", "0"))
        self.events = open(self.dir / f"events_rank{self.rank}.jsonl", "a")
        self.fired = {line.strip() for path in self.dir.glob("fired_rank*.txt") for line in open(path)}
        self.recoverable = {int(i): f for i, f in self.plan["recoverable"].get(str(self.rank), {}).items()}
        self.fatal = [f for f in self.plan["fatal"] if f["rank"] == self.rank and f["id"] not in self.fired]

    # -- bookkeeping
    def log(self, **event):
        event.update(life=self.life, rank=self.rank, tick=self.pos["ticks"])
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()  # (in the kernel's hands: a SIGKILL after this keeps it)

    def fatal_due(self, phase):
        """The first unfired fatal fault of ``phase`` whose tick has come, or None."""
        for fault in self.fatal:
            if fault["phase"] == phase and fault["tick"] <= self.pos["ticks"]:
                return fault
        return None

    def die(self, fault, **extra):
        self.log(kind="kill", phase=fault["phase"], **extra)
        with open(self.dir / f"fired_rank{self.rank}.txt", "a") as f:  # before the kill: fires once
            f.write(fault["id"] + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    # -- the model's forward with its fault points
    def in_forward(self, samples):
        fault = ((self.opt.recovery.retries > self.retries_before and self.fatal_due("retry"))
                 or self.fatal_due("forward"))
        if fault:
            self.die(fault)
        planned = self.recoverable.get(self.pos["micro"])
        # (only where a split can help: a part of one sample that runs out of memory is the job's end)
        if (planned and planned["kind"] in ("oom_forward", "oom_allocator") and self.attempt < planned["times"]
                and samples > 1):
            self.attempt += 1
            self.log(kind="oom", phase=planned["kind"][4:])
            if planned["kind"] == "oom_allocator":
                allocate_beyond_the_limit()
            raise torch.OutOfMemoryError("chaos: injected out of memory in forward")
        self.attempt += 1  # (a part that gets this far without a fault)

    def in_backward(self, layer, samples):
        fault = (self.closing and self.fatal_due("closing")) or self.fatal_due("backward")
        if fault:
            self.die(fault)
        planned = self.recoverable.get(self.pos["micro"])
        if (planned and planned["kind"] == "oom_backward" and layer == planned["layer"]
                and self.backward_faults < planned["times"] and samples > 1):
            self.backward_faults += 1
            self.log(kind="oom", phase="backward")
            raise torch.OutOfMemoryError("chaos: injected out of memory in backward")

    def loss_fn(self, batch):
        self.in_forward(len(batch[0]))
        h, layers = batch[0], self.model.layers()
        for i, layer in enumerate(layers):
            h = layer(h)
            if i < len(layers) - 1:  # (a fault point between every two layers)
                h = FaultPoint.apply(h, self, i)
        if self.args.config.startswith("gpt"):  # the mean over the real tokens, weighted by their count
            _, targets, mask = batch
            losses = F.cross_entropy(h.flatten(0, 1), targets.flatten(), reduction="none")
            weight = int(mask.sum())
            loss = (losses * mask.flatten()).sum() / weight
        else:
            loss, weight = F.mse_loss(h, batch[1]), len(h)
        planned = self.recoverable.get(self.pos["micro"])
        if planned and planned["kind"] == "nonfinite" and self.pos["window_attempt"] == 0:
            if not self.poisoned:  # (one fault per micro-batch, however many parts it runs in)
                self.log(kind="nonfinite", phase="forward")
                self.poisoned = True
            loss = loss * float("inf")
        return loss, weight

    # -- checkpoints
    def checkpoint_path(self, ticks, rank=None):
        return self.dir / f"ckpt_{ticks:06d}_rank{self.rank if rank is None else rank}.pt"

    def save(self):
        fault = self.fatal_due("save")
        if fault:
            def torn_write(f, header, payload):  # half the file, then the kill
                f.write(header)
                f.write(payload[: len(payload) // 2])
                f.flush()
                self.die(fault)
            checkpoint_files._write = torn_write
        accum_fused.save_checkpoint({
            "model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
            "scaler": None if self.scaler is None else self.scaler.state_dict(), "pos": dict(self.pos),
        }, self.checkpoint_path(self.pos["ticks"]))
        for old in sorted(self.dir.glob(f"ckpt_*_rank{self.rank}.pt"))[:-KEEP]:
            old.unlink()
        fault = self.fatal_due("corrupt")
        if fault:
            newest = self.checkpoint_path(self.pos["ticks"])
            data = bytearray(newest.read_bytes())
            rng = random.Random(fault["id"])
            if fault["damage"] == "truncate":
                data = data[: rng.randrange(len(data))]
                how = f"truncated to {len(data)} bytes"
            else:
                at = rng.randrange(len(data))
                how, data[at] = f"inverted byte {at}", data[at] ^ 0xFF
            newest.write_bytes(bytes(data))
            self.log(kind="corrupt", phase=how)
            self.die(fault)

    def resume(self):
        """Load the newest checkpoint that verifies on every rank; refuse damaged ones loudly."""
        for stale in self.dir.glob(f".ckpt_*_rank{self.rank}.pt.*.tmp"):  # a kill while saving
            stale.unlink()
        valid, loaded = set(), {}
        for path in sorted(self.dir.glob(f"ckpt_*_rank{self.rank}.pt"), reverse=True):
            ticks = int(path.name.split("_")[1])
            try:
                loaded[ticks] = accum_fused.load_checkpoint(path, weights_only=True)
                valid.add(ticks)
            except accum_fused.CheckpointCorruptError as exc:
                print(f"chaos: checkpoint refused: {exc}", file=sys.stderr, flush=True)
                self.log(kind="refused", phase=str(exc).split(": ", 1)[1][:40])
        if self.world > 1:
            every = [None] * self.world
            self.dist.all_gather_object(every, valid)
            valid = set.intersection(*every)
        if not valid:
            return False
        saved = loaded[max(valid)]
        self.model.load_state_dict(saved["model"])
        self.opt.load_state_dict(saved["opt"])
        self.sched.load_state_dict(saved["sched"])
        if self.scaler is not None:
            self.scaler.load_state_dict(saved["scaler"])
        self.pos.update(saved["pos"])
        self.log(kind="resumed", phase=f"ticks {self.pos['ticks']}")
        return True

    # -- the loop
    def run(self):
        torch.set_num_threads(1)  # (the same summation order in every start)
        self.pos = {"micro": 0, "ticks": 0, "window_start": 0, "window_attempt": 0}
        self.model = build_model(self.args.config)
        mode_b = self.config["mode"] == "B"
        self.opt = accum_fused.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.1, max_grad_norm=1.0,
                                     backend=self.args.backend, in_backward=mode_b, accumulation_steps=K,
                                     **({"process_group": self.dist.group.WORLD} if self.world > 1 else {}))
        self.opt.recovery.grow_back_after = 1  # (parts grow back: later faults have something to split)
        if self.plan.get("split_in_two"):  # the rounding floor's run: every micro-batch in two parts, no fault
            self.opt.recovery.max_part_size, self.opt.recovery.grow_back_after = None, None
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda update: 1 / (1 + 0.05 * update))
        if CONFIGS[self.args.config]["model"] == "mlp_bn":
            window_batchnorm(self.model, self.opt)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if self.config["scaler"] else None
        self.resume()
        while self.opt.update_count < self.args.windows:
            before = self.opt.update_count
            self.attempt = self.backward_faults = 0
            self.poisoned = False
            self.retries_before = self.opt.recovery.retries
            self.closing = self.opt.micro_step == K - 1
            batch = micro_batch(self.args.config, self.plan["seed"], self.rank, self.pos["micro"])
            if self.plan.get("split_in_two"):
                self.opt.recovery.max_part_size = (len(batch[0]) + 1) // 2
            self.opt.run(batch, self.loss_fn, scaler=self.scaler)
            self.pos["micro"] += 1
            self.pos["ticks"] += 1
            if self.opt.micro_step == 0:  # the window closed
                if self.opt.update_count > before:
                    self.sched.step()
                    self.pos["window_start"], self.pos["window_attempt"] = self.pos["micro"], 0
                    fault = self.fatal_due("after_update")
                    if fault:
                        self.die(fault)
                else:  # skipped (non-finite gradients): run the window's micro-batches again
                    self.log(kind="skipped", phase="window")
                    self.pos["micro"] = self.pos["window_start"]
                    self.pos["window_attempt"] += 1
            if self.pos["ticks"] % SAVE_EVERY == 0:
                self.save()
        final = {"model": self.model.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                 "scaler": None if self.scaler is None else self.scaler.state_dict(),
                 "update_count": self.opt.update_count, "micro_step": self.opt.micro_step,
                 "retries": self.opt.recovery.retries}
        abort = os.environ.get("CHAOS_TEST_ABORT_RANK") == str(self.rank)  # (tests: torch's exit abort, below)
        if abort and os.environ.get("CHAOS_TEST_ABORT_WHEN") == "before_done":
            os.abort()
        torch.save(final, self.dir / f"final_rank{self.rank}.pt")
        self.log(kind="done", phase="")
        if self.world > 1:
            self.dist.destroy_process_group()
        if abort:  # as gloo's teardown dies (launch's EXIT_ABORT)
            sys.stderr.write(EXIT_ABORT + "\n")
            sys.stderr.flush()
            os.abort()


def allocate_beyond_the_limit():
    """A real allocator failure: the address space capped just above what is mapped now, then a
    tensor of 1 GiB (the CPU allocator's own error, which opt.run recognises), then the cap
    lifted. torch's error is re-raised as is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (64 << 20), hard))
    try:
        torch.empty(1 << 28, dtype=torch.float32)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    raise AssertionError("chaos: 1 GiB was allocated under a cap of 64 MiB above the mapped size")


# ------------------------------------------------------------------------------ the plan
def make_plan(config: str, seed: int, ranks: int, windows: int, fatal, recoverable_rate: float) -> dict:
    """The round's faults, from its seed. Recoverable faults by micro-batch index on each rank
    (a window's micro-batches are K consecutive indices; a replayed window has the same ones);
    fatal faults by tick (micro-batches run, replays included), each fired once: ``fatal`` of
    them at random, or, given a list of phases, those, spread over the run in that order."""
    rng = random.Random(f"{config}/{seed}/{ranks}")
    cfg = CONFIGS[config]
    # Real allocator failures on 1 rank only: RLIMIT_AS caps the whole process, and with gloo's
    # threads in it the cap can fail an allocation that is not the micro-batch's (glibc reserves
    # 64 MiB of address space per thread's arena), which says nothing about recovery. (A CI run's
    # 2-rank abort, "terminate called without an active exception", first blamed on this, was
    # torch's gloo exit-time abort: a later one came in a fault-free launch. See launch.)
    ooms = ["oom_forward", "oom_backward"] + (["oom_allocator"] if ranks == 1 else [])
    kinds = (ooms if cfg["oom"] else []) + (["nonfinite"] if cfg["scaler"] else [])
    recoverable = {}
    for rank in range(ranks):
        mine = recoverable[str(rank)] = {}
        for index in range(windows * K):
            if kinds and rng.random() < recoverable_rate:
                kind = rng.choice(kinds)
                if kind == "nonfinite" and any(f["kind"] == "nonfinite" and int(i) // K == index // K
                                               for i, f in mine.items()):
                    continue  # (one per window: a second would only repeat the first's skip)
                mine[str(index)] = {"kind": kind, "times": rng.choice((1, 1, 2)), "layer": rng.randrange(2)}
    ticks = windows * K
    phases = [p for p in KILL_PHASES if cfg["oom"] or p != "retry"]
    if isinstance(fatal, int):
        chosen = [(rng.choice(phases), rng.randrange(1, ticks)) for _ in range(fatal)]
    else:
        chosen = [(phase, (i + 1) * ticks // (len(fatal) + 1)) for i, phase in enumerate(fatal)]
    fatal_faults = [{"id": f"{seed}-{i}", "rank": rng.randrange(ranks), "phase": phase, "tick": tick,
                     "damage": rng.choice(("truncate", "invert"))} for i, (phase, tick) in enumerate(chosen)]
    return {"seed": seed, "recoverable": recoverable, "fatal": fatal_faults}


# ------------------------------------------------------------------------------ running a round
EXIT_ABORT = "terminate called without an active exception"


def launch(config, backend, ranks, windows, plan, directory: Path, max_restarts: int) -> dict:
    """Run the job until it finishes, restarting it after each death the way users do."""
    directory.mkdir(parents=True)
    plan_path = directory / "plan.json"
    plan_path.write_text(json.dumps(plan))
    job = [str(Path(__file__).resolve()), "job", "--config", config, "--backend", backend, "--windows", str(windows),
           "--dir", str(directory), "--plan", str(plan_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    log = open(directory / "log.txt", "w")
    started = time.perf_counter()
    if ranks == 1:
        for life in range(max_restarts + 1):
            code = subprocess.run([sys.executable, *job], env=dict(env, CHAOS_LIFE=str(life)), stdout=log,
                                  stderr=subprocess.STDOUT).returncode
            if code != -signal.SIGKILL:
                break
    else:
        # torchrun's rendezvous store is shared with the workers' process group by default, and
        # after a restart a worker can read the previous attempt's gloo addresses from it ("Gloo
        # connectFullMesh failed ... Connection refused": pytorch/pytorch#135712, seen here on
        # torch 2.13): give the workers a store of their own.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        code = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                               f"--max-restarts={max_restarts}", "--monitor-interval=0.2", *job],
                              env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    log.close()
    events = [json.loads(line) for path in sorted(directory.glob("events_rank*.jsonl")) for line in open(path)]
    # torch's gloo exit-time abort (issue 29 row 5, benchmarks/exit_abort_ab.py: ~1-2 % of 2-rank
    # launches on torch 2.13, torch's own loop too): a worker dies with SIGABRT in interpreter
    # teardown, after destroy_process_group, its work done. torchrun then restarts the job (which
    # resumes from its newest checkpoint and finishes again) or, with no restart left, fails it.
    # Neither is a fault of the run's: counted, not failed, when every rank's last event is its
    # finished run ("done", written after its final state) and the log carries that abort.
    done = [e for e in events if e["kind"] == "done"]
    last = {e["rank"]: e["kind"] for e in events}  # (each rank's last event)
    finished = ranks > 1 and all(last.get(r) == "done" and (directory / f"final_rank{r}.pt").exists()
                                 for r in range(ranks))
    exit_aborts = len(done) // max(ranks, 1) - 1 if done else 0  # (finished lives torchrun restarted)
    if code != 0:
        text = (directory / "log.txt").read_text()
        if not (finished and EXIT_ABORT in text):
            raise RuntimeError(f"chaos: the job in {directory} ended with exit status {code}:\n{text[-3000:]}")
        exit_aborts += 1
    finals = [torch.load(directory / f"final_rank{r}.pt", weights_only=False) for r in range(ranks)]
    return {"events": events, "finals": finals, "seconds": time.perf_counter() - started, "exit_aborts": exit_aborts}


def flatten(value, prefix=""):
    """Every leaf of a nested state (dicts, lists, tensors, numbers) by its path."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}/{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}/{i}")
    else:
        yield prefix, value


def compare(final, oracle, ignore=()) -> dict:
    """Leaves that differ, and the largest difference of any floating-point tensor."""
    mine, theirs = dict(flatten(final)), dict(flatten(oracle))
    differ, max_diff = [], 0.0
    for key in sorted(set(mine) | set(theirs)):
        if any(part in key for part in ignore):
            continue
        a, b = mine.get(key, "<missing>"), theirs.get(key, "<missing>")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                differ.append(key)
            elif not torch.equal(a, b):
                differ.append(key)
                if a.is_floating_point():
                    max_diff = max(max_diff, (a.double() - b.double()).abs().max().item())
        elif not (a == b or (a != a and b != b)):  # (a NaN equals a NaN here)
            differ.append(key)
    return {"differ": differ, "max_abs_diff": max_diff}


def relative_distance(final, clean, initial) -> float:
    """||p - p_clean|| / ||p_clean - p_0|| over the parameters: a difference as a share of how far
    training moved them (issue 43's measure)."""
    names = [name for name, _ in initial]
    dist = sum(float((final["model"][n].double() - clean["model"][n].double()).pow(2).sum()) for n in names)
    moved = sum(float((clean["model"][n].double() - p.double()).pow(2).sum()) for n, p in initial)
    return (dist / moved) ** 0.5 if moved else 0.0


def run_round(config, backend, ranks, seed, windows, fatal, recoverable_rate, workdir: Path) -> dict:
    plan = make_plan(config, seed, ranks, windows, fatal, recoverable_rate)
    recoverable_only = dict(plan, fatal=[])
    clean = dict(plan, recoverable={}, fatal=[])
    split_in_two = dict(clean, split_in_two=True)
    name = f"{config}-{backend}-{ranks}r-s{seed}"
    restarts = fatal if isinstance(fatal, int) else len(fatal)
    chaos = launch(config, backend, ranks, windows, plan, workdir / name / "chaos", max_restarts=restarts + 2)
    oracle = launch(config, backend, ranks, windows, recoverable_only, workdir / name / "recoverable", 0)
    reference = launch(config, backend, ranks, windows, clean, workdir / name / "clean", 0)
    # The rounding floor: how far a fault-free run whose micro-batches all ran in two parts ends
    # from the clean run (a split is exact up to the order of a sum; this is what that order costs).
    floor = launch(config, backend, ranks, windows, split_in_two, workdir / name / "split_in_two", 0)
    # A damaged checkpoint is one fault (the file, then the kill that makes the job load it).
    counts = collections.Counter(
        f"{e['kind']}/{e['phase'].split()[0] if e['kind'] == 'corrupt' else e['phase']}"
        if e["kind"] in ("oom", "kill", "corrupt") else e["kind"]
        for e in chaos["events"] if e["kind"] != "done" and not (e["kind"] == "kill" and e["phase"] == "corrupt"))
    injected = sum(n for key, n in counts.items() if key.split("/")[0] in FAULT_KINDS)
    splits = sum(1 for e in oracle["events"] if e["kind"] == "oom")
    # The recoverable oracle: everything, bit for bit. The clean run: the GradScaler's scale and the
    # recovery's counters differ by design (skips halve the scale; retries are counted).
    against_oracle = [compare(f, o) for f, o in zip(chaos["finals"], oracle["finals"])]
    against_clean = [compare(f, c, ignore=("/scaler", "/recovery", "/retries")) for f, c in zip(chaos["finals"], reference["finals"])]
    initial = [(n, p.detach().clone()) for n, p in build_model(config).named_parameters()]
    relative = max(relative_distance(f, c, initial) for f, c in zip(chaos["finals"], reference["finals"]))
    rounding_floor = max(relative_distance(f, c, initial) for f, c in zip(floor["finals"], reference["finals"]))
    ranks_identical = all(not compare(chaos["finals"][0]["model"], f["model"])["differ"] for f in chaos["finals"][1:])
    result = {
        "round": name, "config": config, "backend": backend, "ranks": ranks, "seed": seed, "windows": windows,
        "faults_injected": injected, "faults_by_kind": dict(sorted(counts.items())),
        "starts": len({(e["life"]) for e in chaos["events"] if e["kind"] == "resumed"}) + 1,
        "restarts": max(e["life"] for e in chaos["events"]),  # (torchrun's after an exit abort too: exit_aborts)
        "update_count": chaos["finals"][0]["update_count"],
        "equal_to_recoverable_oracle": all(not c["differ"] for c in against_oracle),
        "differ_from_recoverable_oracle": sorted({k for c in against_oracle for k in c["differ"]})[:10],
        "max_abs_diff_recoverable_oracle": max(c["max_abs_diff"] for c in against_oracle),
        "equal_to_clean_run": all(not c["differ"] for c in against_clean),
        "max_abs_diff_clean_run": max(c["max_abs_diff"] for c in against_clean),
        "relative_distance_clean_run": relative,
        "relative_distance_split_in_two": rounding_floor,
        "clean_run_split": splits > 0,
        "ranks_identical": ranks_identical,
        "seconds": round(chaos["seconds"] + oracle["seconds"] + reference["seconds"] + floor["seconds"], 1),
        # torch's gloo exit-time aborts met by the round's four launches (not faults: see launch)
        "exit_aborts": sum(run["exit_aborts"] for run in (chaos, oracle, reference, floor)),
    }
    # Survived: the run finished every window, equals its oracle bit for bit, and equals the clean
    # run bit for bit where nothing was split (else within fp32 rounding of it).
    result["survived"] = (result["update_count"] == windows and result["equal_to_recoverable_oracle"] and ranks_identical
                          and (result["equal_to_clean_run"] or (splits > 0 and relative < RELATIVE_TOLERANCE)))
    return result


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def soak(args) -> dict:
    rounds, rng = [], random.Random(args.seed)
    if args.small:  # the CI slice: every configuration's kind of fault, 1 and 2 ranks, in ~1 minute
        # (the fatal faults named: each kind is met, whatever the seed)
        schedule = [("gpt_mode_b", "auto", 1, 6, ["backward", "corrupt", "closing"]),
                    ("mlp_scaler", "auto", 2, 5, ["forward", "save", "after_update"]),
                    ("mlp_bn", "torch", 1, 4, ["forward", "corrupt"])]
    else:
        combos = [(c, b, r) for c in CONFIGS for b in ("auto", "torch") for r in (1, 2)]
        rng.shuffle(combos)
        schedule = [(c, b, r, args.windows, args.fatal) for c, b, r in combos]
    workdir = Path(tempfile.mkdtemp(prefix="chaos_"))
    started = time.perf_counter()
    try:
        i = 0
        while True:
            config, backend, ranks, windows, fatal = schedule[i % len(schedule)]
            result = run_round(config, backend, ranks, args.seed * 100 + i, windows, fatal, args.rate, workdir)
            rounds.append(result)
            clean = "=" if result["equal_to_clean_run"] else f"{result['max_abs_diff_clean_run']:.2e}"
            print(f"{result['round']:<28} faults {result['faults_injected']:>4}  restarts {result['restarts']:>2}  "
                  f"oracle {'=' if result['equal_to_recoverable_oracle'] else 'DIFFERS'}  clean {clean} "
                  f"(rel {result['relative_distance_clean_run']:.1e}, split-in-two {result['relative_distance_split_in_two']:.1e})  "
                  f"{'survived' if result['survived'] else 'FAILED'}  {result['seconds']:.0f} s", flush=True)
            i += 1
            total = sum(r["faults_injected"] for r in rounds)
            if (args.small and i == len(schedule)) or (not args.small and total >= args.faults and i >= len(schedule)):
                break
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work files kept in {workdir}")
    by_kind = collections.Counter()
    for r in rounds:
        by_kind.update(r["faults_by_kind"])
    return {
        "date": _dt.date.today().isoformat(), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "torch": torch.__version__, "accum_fused": accum_fused.__version__, "commit": _commit(),
        "rounds": len(rounds), "windows": sum(r["windows"] for r in rounds),
        "faults_injected": sum(r["faults_injected"] for r in rounds),
        "faults_by_kind": dict(sorted(by_kind.items())),
        "restarts": sum(r["restarts"] for r in rounds),
        "survived": sum(r["survived"] for r in rounds),
        "all_survived": all(r["survived"] for r in rounds),
        "max_abs_diff_recoverable_oracle": max(r["max_abs_diff_recoverable_oracle"] for r in rounds),
        "max_abs_diff_clean_run": max(r["max_abs_diff_clean_run"] for r in rounds),
        "max_relative_distance_clean_run": max(r["relative_distance_clean_run"] for r in rounds),
        "max_relative_distance_split_in_two": max(r["relative_distance_split_in_two"] for r in rounds),
        "max_abs_diff_clean_run_unsplit": max((r["max_abs_diff_clean_run"] for r in rounds if not r["clean_run_split"]),
                                              default=0.0),
        "seconds": round(time.perf_counter() - started, 1),
        "per_round": rounds,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    job = sub.add_parser("job", help="(internal) one start of a round's run")
    for flag in ("--config", "--backend", "--dir", "--plan"):
        job.add_argument(flag, required=True)
    job.add_argument("--windows", type=int, required=True)
    one = sub.add_parser("round", help="one round, its result printed")
    one.add_argument("--config", choices=sorted(CONFIGS), required=True)
    one.add_argument("--backend", default="auto")
    one.add_argument("--ranks", type=int, default=1)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--windows", type=int, default=8)
    one.add_argument("--fatal", type=int, default=3, help="kills and damaged checkpoints")
    one.add_argument("--rate", type=float, default=0.3, help="share of micro-batches with a recoverable fault")
    many = sub.add_parser("soak", help="rounds over every configuration until --faults were injected")
    many.add_argument("--faults", type=int, default=1000)
    many.add_argument("--windows", type=int, default=12)
    many.add_argument("--fatal", type=int, default=6)
    many.add_argument("--rate", type=float, default=0.4)
    many.add_argument("--seed", type=int, default=0)
    many.add_argument("--small", action="store_true", help="the CI slice")
    many.add_argument("--keep", action="store_true", help="keep the work files")
    many.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.command == "job":
        Job(args).run()
        return 0
    if args.command == "round":
        workdir = Path(tempfile.mkdtemp(prefix="chaos_"))
        result = run_round(args.config, args.backend, args.ranks, args.seed, args.windows, args.fatal, args.rate, workdir)
        print(json.dumps(result, indent=1))
        print(f"work files in {workdir}")
        return 0 if result["survived"] else 1
    result = soak(args)
    summary = {k: v for k, v in result.items() if k != "per_round"}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["all_survived"] else 1


if __name__ == "__main__":
    sys.exit(main())
