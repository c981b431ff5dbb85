#!/usr/bin/env python
"""End-to-end training benchmark: a small GPT-style model trained with gradient accumulation,
accum_fused.AdamW against the loop a user writes without it.

Every contender trains its own copy of the same model (token + position embeddings, pre-LN
transformer blocks with causal self-attention through F.scaled_dot_product_attention and a GELU
MLP, final LayerNorm, LM head tied to the token embedding) on the same random-token windows:
k micro-batches of uneven sizes (``--micro-batches``; k is their count), then one update.
Contenders take turns window by window, the first mover rotating each round, after warm-up
windows; each window is timed whole (forward, backward, optimizer):

  native     for each micro-batch: (loss * tokens_i / tokens_window).backward()  (.grad
             accumulates in autograd); then clip_grad_norm_(params, 1.0);
             torch.optim.AdamW(fused=True).step() (foreach=True where fused is unsupported);
             zero_grad()
  <backend>  accum_fused.AdamW(accumulation_steps=k, max_grad_norm=1.0, backend=<backend>):
             for each micro-batch: loss.backward(); opt.step(weight=tokens_i); opt.zero_grad()

Both compute the same update (the window's token-weighted mean gradient, clipped to norm 1), so
after the run every backend's parameters are compared with native's ("max |dparam|"): a sanity
check that the timed work is the same training.

Memory: on CUDA, each contender's peak is torch.cuda.max_memory_allocated() over its own
windows, less what was allocated when the window began, plus the bytes the contender itself
holds then (parameters, optimizer state, accumulation buffers): the peak it would reach alone,
although all contenders share the device. On CPU there is no allocator peak to read: the table
reports the optimizer-side bytes (gradients + optimizer state + accumulation buffers), and says
so. accum_fused keeps an fp32 accumulation buffer per parameter that the native loop does not
(the .grad it frees between micro-batches is allocated again by every backward), so its
optimizer-side bytes are 4 B/param higher for fp32 parameters.

Usage (from the repository root):
  python benchmarks/bench_train.py                     # CPU preset: 3.5M params, ~1 minute on 2 cores
  python benchmarks/bench_train.py --device cuda       # GPU preset: GPT-2-small sized, bf16 autocast
  python benchmarks/bench_train.py --layers 2 --windows 3 --micro-batches 3,1,2 --json /tmp/t.json
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import gc
import json
import math
import os
import shlex
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HERE = Path(__file__).resolve().parent
try:
    import accum_fused
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(HERE.parent))
    import accum_fused
from accum_fused import bench as af_bench

PRESETS = {
    # 3.5M parameters, 128-token sequences: about a second per window, a minute in all, on 2 CPU cores.
    "cpu": dict(vocab=4096, ctx=128, d_model=192, layers=6, heads=6, micro_batches="6,2,8,3,5,7,1,4",
                windows=16, warmup=2, autocast=None),
    # GPT-2 small's width and depth (124M parameters with vocab 50304), 512-token sequences.
    "cuda": dict(vocab=50304, ctx=512, d_model=768, layers=12, heads=12, micro_batches="12,4,16,6,10,16,2,8",
                 windows=10, warmup=3, autocast="bf16"),
}
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 3e-4, 0.1, 1.0


# ------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int):
        super().__init__()
        if d % heads:
            raise SystemExit(f"--d-model {d} must be a multiple of --heads {heads}")
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # mean over the micro-batch's tokens


# -------------------------------------------------------------------------- contenders
def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class Contender:
    name: str
    label: str

    def __init__(self, model: nn.Module, autocast):
        self.model = model
        self.params = list(model.parameters())  # the tied weight once
        self.autocast = autocast
        self.updates = 0

    def loss(self, x, y):
        with self.autocast() if self.autocast else nullcontext():
            return self.model(x, y)

    def resident_bytes(self) -> int:
        """Parameters, optimizer state and accumulation buffers held between windows."""
        # Found by walking the optimizer, not by naming its private attributes (which move).
        return af_bench.held_tensor_bytes(self.params, self.opt)

    def optimizer_side_bytes(self) -> int:
        """Gradients (one per parameter, in its dtype: backward makes them every micro-batch),
        optimizer state and accumulation buffers: the CPU stand-in for peak memory."""
        grads = sum(p.numel() * p.element_size() for p in self.params)
        return grads + self.resident_bytes() - _tensor_bytes(self.params)


class Native(Contender):
    name = "native"

    def __init__(self, model, autocast, impl):
        super().__init__(model, autocast)
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, **{impl: True})
        self.label = f"loss*tokens_i/tokens_window, .grad accumulation, clip_grad_norm_, torch.optim.AdamW({impl}=True)"

    def window(self, micro_batches) -> None:
        total = sum(x.numel() for x, _ in micro_batches)
        for x, y in micro_batches:
            (self.loss(x, y) * (x.numel() / total)).backward()
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.opt.step()
        self.opt.zero_grad()
        self.updates += 1


class AccumFused(Contender):
    def __init__(self, model, autocast, backend, k):
        super().__init__(model, autocast)
        self.name = backend
        self.opt = accum_fused.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=k,
                                     max_grad_norm=MAX_GRAD_NORM, backend=backend)
        self.label = f"accum_fused.AdamW(accumulation_steps={k}, max_grad_norm={MAX_GRAD_NORM:g}, backend={backend!r})"

    def window(self, micro_batches) -> None:
        for x, y in micro_batches:
            self.loss(x, y).backward()
            self.opt.step(weight=x.numel())
            self.opt.zero_grad()
        assert self.opt.updated, f"{self.name}: the window did not end in an update"
        self.updates += 1


# -------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="model and run size (default: the device's); the options below override it")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--ctx", type=int, help="tokens per sequence")
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--micro-batches", help="sequences per micro-batch, comma separated; k = their count "
                                            "(CPU preset 6,2,8,3,5,7,1,4)")
    ap.add_argument("--windows", type=int, help="timed windows per contender")
    ap.add_argument("--warmup", type=int, help="untimed windows per contender first")
    ap.add_argument("--autocast", choices=["bf16", "none"], default=None,
                    help="torch.autocast dtype for forward (default: bf16 on CUDA, none on CPU)")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="accum_fused backends (space or comma separated; default: the available ones that run "
                         "natively on the device)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="results file (default benchmarks/results/train_<device>_<date>.json)")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[args.preset or torch.device(args.device).type]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.autocast = None if args.autocast == "none" else args.autocast
    try:
        args.micro_batches = [int(s) for s in str(args.micro_batches).split(",") if s]
    except ValueError:
        ap.error(f"--micro-batches takes comma separated integers, got {args.micro_batches!r}")
    if not args.micro_batches or min(args.micro_batches) < 1:
        ap.error("--micro-batches needs at least one size, all >= 1")
    if args.windows < 1 or args.warmup < 0:
        ap.error("--windows must be >= 1 and --warmup >= 0")
    args.backends = af_bench.split_names(args.backends)
    return args


def make_data(args, device, n_windows: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``n_windows`` distinct windows of random tokens, reused in turn (no generation while timed)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    data = []
    for _ in range(n_windows):
        window = []
        for b in args.micro_batches:
            t = torch.randint(0, args.vocab, (b, args.ctx + 1), generator=gen)
            window.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
        data.append(window)
    return data


def main(argv=None) -> int:
    args = parse_args(argv)
    device, device_name = af_bench.resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    cuda = device.type == "cuda"
    autocast = None
    if args.autocast:
        autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    backend_names, skipped = af_bench.pick_backends(args.backends, device, torch.float32)
    impl = af_bench.native_adamw_impl(device, torch.float32)
    k = len(args.micro_batches)

    torch.manual_seed(args.seed)
    base = GPT(args.vocab, args.ctx, args.d_model, args.layers, args.heads).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    contenders = [Native(copy.deepcopy(base), autocast, impl)]
    contenders += [AccumFused(copy.deepcopy(base), autocast, b, k) for b in backend_names]
    del base
    data = make_data(args, device, n_windows=4)
    tokens_per_window = sum(args.micro_batches) * args.ctx
    print(f"bench_train on {device_name} ({device.type}), torch {torch.__version__}, threads {threads}, "
          f"accum_fused {accum_fused.__version__}" + (f"; not timed: {', '.join(skipped)}" if skipped else ""))
    print(f"model: {n_params / 1e6:.2f}M params (d={args.d_model}, {args.layers} layers, {args.heads} heads, "
          f"vocab {args.vocab}, ctx {args.ctx}, tied head), autocast {args.autocast or 'off'}; window: k={k} "
          f"micro-batches of {args.micro_batches} sequences = {tokens_per_window:,} tokens; "
          f"{args.warmup} warm-up + {args.windows} timed windows per contender, interleaved", flush=True)

    timer = af_bench.Timer(device)
    times = {c.name: [] for c in contenders}
    peaks = {c.name: 0 for c in contenders}
    n = len(contenders)
    load_before = af_bench.loadavg()
    gc.collect()
    for r in range(args.warmup + args.windows):
        window = data[r % len(data)]
        this_round = {}
        for c in contenders[r % n:] + contenders[:r % n]:
            if cuda:
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                resident = c.resident_bytes()
                torch.cuda.reset_peak_memory_stats(device)
            ms = timer(lambda: c.window(window))
            if cuda:
                peaks[c.name] = max(peaks[c.name], torch.cuda.max_memory_allocated(device) - before + resident)
            this_round[c.name] = ms
            if r >= args.warmup:
                times[c.name].append(ms)
        print(f"  round {r + 1}/{args.warmup + args.windows}" + (" (warm-up)" if r < args.warmup else "") + ": "
              + ", ".join(f"{c.name} {this_round[c.name]:.0f} ms" for c in contenders), flush=True)
    timer.sync()
    if not cuda:
        peaks = {c.name: c.optimizer_side_bytes() for c in contenders}
    memory_kind = ("peak CUDA memory (max_memory_allocated) of the contender's window, its own resident bytes "
                   "included" if cuda else "optimizer-side bytes: gradients + optimizer state + accumulation "
                                           "buffers (no allocator peak on CPU)")

    reference = torch.cat([p.detach().float().flatten() for p in contenders[0].params])
    native_times = times["native"]
    results = []
    for c in contenders:
        assert c.updates == args.warmup + args.windows, f"{c.name}: {c.updates} updates"
        flat = torch.cat([p.detach().float().flatten() for p in c.params])
        ts = times[c.name]
        med = statistics.median(ts)
        q1, q3 = af_bench.quantiles(ts)
        ratios = [t / nt for t, nt in zip(ts, native_times)]
        results.append({
            "contender": c.name, "implementation": c.label, "times_ms": ts, "median_ms": med, "q1_ms": q1,
            "q3_ms": q3, "min_ms": min(ts), "ratios_vs_native": ratios,
            "median_ratio_vs_native": statistics.median(ratios),
            "tokens_per_s": tokens_per_window / (med * 1e-3),
            "memory_bytes": peaks[c.name], "memory_bytes_per_param": peaks[c.name] / n_params,
            "max_abs_param_diff_vs_native": (flat - reference).abs().max().item(),
        })

    memory_header = "peak MB" if cuda else "opt-side MB"
    header = ["contender", "ms/window", "IQR ms", "tokens/s", "vs native", memory_header, "B/param", "max |dparam|"]
    rows = [[r["contender"], f"{r['median_ms']:.1f}", f"{r['q1_ms']:.0f}-{r['q3_ms']:.0f}",
             f"{r['tokens_per_s']:,.0f}", f"{r['median_ratio_vs_native']:.3f}", f"{r['memory_bytes'] / 2**20:.2f}",
             f"{r['memory_bytes_per_param']:.1f}", f"{r['max_abs_param_diff_vs_native']:.1e}"]
            for r in results]
    print()
    print(af_bench.format_table(header, rows, left=1))
    print(f"\nms/window: median over {args.windows} windows of k={k} micro-batches (forward + backward + "
          f"optimizer); vs native: median of per-round ratios (< 1 is faster); native = {contenders[0].label}.\n"
          f"memory: {memory_kind}.\nmax |dparam|: largest parameter difference from native after "
          f"{args.warmup + args.windows} identical windows (same training, summed in another order).")

    now = _dt.datetime.now().astimezone()
    out = args.json or HERE / "results" / f"train_{device.type}_{now:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "train",
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv]),
        "device": {"type": device.type, "name": device_name, "threads": threads, "cpu_count": os.cpu_count(),
                   "loadavg_before": load_before, "loadavg_after": af_bench.loadavg()},
        "versions": af_bench.versions(),
        "config": {"params": n_params, "vocab": args.vocab, "ctx": args.ctx, "d_model": args.d_model,
                   "layers": args.layers, "heads": args.heads, "micro_batches": args.micro_batches, "k": k,
                   "tokens_per_window": tokens_per_window, "windows": args.windows, "warmup": args.warmup,
                   "autocast": args.autocast, "lr": LR, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM,
                   "seed": args.seed, "native_adamw": impl, "backends": backend_names, "skipped_backends": skipped},
        "memory_kind": memory_kind,
        "results": results,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
