#!/usr/bin/env python
"""Training quality of bf16 parameters: accum_fused.AdamW's bf16_update="nearest" | "stochastic" |
"kahan" against fp32 master weights, on a small GPT-style causal language model trained on real
text (bytes of the installed torch package's Python sources), with gradient accumulation.

Contenders, all from the same initial weights (built in fp32 under --seed) and the same data order
(--data-seed), the same hyperparameters, LR schedule and k = --k micro-batches per update:

  fp32_master  fp32 parameters; the forward (and so the backward's matmuls) under
               torch.autocast("cpu", dtype=torch.bfloat16); per micro-batch (loss / k).backward()
               (fp32 .grad accumulated by autograd), at the window end clip_grad_norm_ (unless
               --max-grad-norm 0), torch.optim.AdamW(foreach).step(), zero_grad()
  nearest      the model cast to pure bf16 (model.to(torch.bfloat16): parameters, activations and
  stochastic   gradients bf16), accum_fused.AdamW(accumulation_steps=k, max_grad_norm=...,
  kahan        bf16_update=<mode>), driven in the plain mode: per micro-batch loss.backward();
               opt.step(weight=1.0); opt.zero_grad() (the k-th step applies the update). The
               window sum and AdamW's moments are fp32 inside accum_fused; only the write of the
               updated weight into the bf16 parameter differs between the three.
  fp32_master@dsN  (--spread-seeds) fp32_master again with data seed N: the run-to-run spread that
               "within noise" is judged against. Same init, another data order.

So between fp32_master and the bf16 contenders the weight precision differs, and also the
forward: autocast runs the Linear layers and the attention in bf16 but keeps the embeddings,
LayerNorm and the residual stream in fp32, while the pure bf16 model keeps all of its activations
in bf16 (the loss is taken in fp32 from bf16 logits in every contender). The final validation loss is therefore reported
twice: with each contender's own training forward, and with one common evaluator (the weights
copied into an fp32 model, forward under the same bf16 autocast as fp32_master), which compares
the weights alone. For fp32_master the final weights rounded to bf16 are evaluated too (the
cost of rounding once at the end).

Model (defined here): byte-level vocabulary (256), token + learned position embeddings, --layers
pre-LayerNorm blocks (causal scaled_dot_product_attention, qkv as one Linear(d, 3d), output
projection, GELU MLP d -> 4d -> d), final LayerNorm, untied LM head. GPT-2 initialisation
(normal(0, 0.02), residual projections 0.02 / sqrt(2 * layers), zero biases, LayerNorm 1 / 0).
Weight decay on the matrices and embeddings only (biases and LayerNorm parameters in a group
without decay), as nanoGPT.

Data: every *.py file of the installed torch package in sorted path order, concatenated (bytes;
the corpus size and SHA-256 are recorded); cut into 64 KiB blocks, every 10th block held out as
the validation split. A training micro-batch is --micro-batch windows of --seq + 1 bytes at
offsets drawn from torch.Generator(--data-seed); the validation set is fixed (offsets from a
generator of its own): --final-eval-seqs sequences for the final losses, the first --eval-seqs of
them for the curve (every --eval-every updates and at the end).

LR schedule: linear warm-up over --warmup updates to --lr, then cosine decay to --lr *
--min-lr-ratio at the last update (--schedule constant: --lr after the warm-up).

Defaults: 3 layers, d 256, 4 heads (2,533,632 parameters); k = 2 micro-batches of 2 x 128 bytes
per update; 2000 updates; AdamW lr 1.5e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, clip
1.0; warm-up 100 updates, cosine to 1.5e-5; fp32_master also with data seeds 2 and 3. Sized for
the 25-minute budget of a 2-core VM (6 runs, 2 at a time: about 10 minutes there with the
machine otherwise idle). An AdamW step moves a weight by at most about lr, usually less: at
lr 1.5e-4 that is below half a bf16 ulp (about |w| * 2^-9) of every weight above ~0.08 in
magnitude (every LayerNorm gain, at 1.0), at the end of the cosine (1.5e-5) of every weight above
~0.008 (the initialisation's std is 0.02): "nearest" loses those updates, fp32 still learns.

Each contender runs in its own forked process with --threads intra-op threads (default 1), --jobs
of them at a time (default 2): on a 2-core machine shared with other work two one-thread
processes train faster than one two-thread process (the seconds per contender are therefore
measured beside another contender's run).

Reported: train loss (mean over each --log-every updates; an update's loss is the mean of its k
micro-batch losses), the validation curve, the final validation loss (own forward and common
evaluator), the update at which fp32_master's validation curve reached each contender's final
value (how much of the training a contender's rounding cost), seconds, how far each contender's
weights moved from the initial ones and how far they ended from fp32_master's (relative L2 over
all parameters; AdamW moves every weight by about lr per update), and memory per parameter
measured from the tensors each contender holds (distinct storages; sum of nbytes): parameters,
gradients, optimizer state by key (exp_avg, exp_avg_sq, step, bf16_rounding_seed,
bf16_compensation) and accum_fused's window buffers (opt._window.buffers), both mid-window
(after a backward, before the optimizer call: gradients live) and between updates. A JSON record
and a PNG (loss curves per contender; the difference to fp32_master) go to
benchmarks/results/bf16_update_<date>.json / .png.

Usage (from the repository root):
  python benchmarks/bench_bf16.py                  # default config (see --help): 6 runs, ~10 min on 2 idle cores
  python benchmarks/bench_bf16.py --quick          # smoke run, < 1 minute
  python benchmarks/bench_bf16.py --updates 4000 --lr 3e-4 --spread-seeds 2,3 --jobs 1 --threads 2
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import shlex
import sys
import tempfile
import time
import traceback
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
from accum_fused.bench import cpu_model, loadavg, versions  # noqa: E402

MODES = ("nearest", "stochastic", "kahan")
CONTENDERS = ("fp32_master",) + MODES
BLOCK = 64 * 1024  # corpus block size of the train / validation split
VAL_EVERY = 10     # every 10th block is validation
VOCAB = 256
QUICK = dict(layers=2, d_model=64, heads=2, seq=32, micro_batch=4, k=2, updates=60, warmup=6, log_every=5,
             eval_every=20, eval_seqs=16, final_eval_seqs=32, max_files=200)


# --------------------------------------------------------------------------------- the model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, seq: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)
        for name, p in self.named_parameters():  # GPT-2 initialisation
            if name.endswith("proj.weight"):  # attention output and MLP output projections
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model(args) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(args.seq, args.d_model, args.layers, args.heads)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lm_loss(model: nn.Module, tokens: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Next-token cross entropy in fp32 (mean over tokens); tokens is (batch, seq + 1) int64."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------- the data
def torch_sources(max_files: int | None = None) -> list[Path]:
    root = Path(torch.__file__).resolve().parent
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    return files[:max_files] if max_files else files


def load_corpus(max_files: int | None = None) -> tuple[bytes, bytes, dict]:
    """(train bytes, validation bytes, description): the torch sources concatenated, every
    VAL_EVERY-th BLOCK-byte block held out."""
    files = torch_sources(max_files)
    data = b"".join(f.read_bytes() for f in files)
    blocks = [data[i:i + BLOCK] for i in range(0, len(data), BLOCK)]
    train = b"".join(b for i, b in enumerate(blocks) if i % VAL_EVERY != VAL_EVERY - 1)
    val = b"".join(b for i, b in enumerate(blocks) if i % VAL_EVERY == VAL_EVERY - 1)
    info = {"source": f"*.py under {Path(torch.__file__).resolve().parent} (torch {torch.__version__}), "
                      "sorted by relative path, concatenated as bytes",
            "files": len(files), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "split": f"{BLOCK}-byte blocks, every {VAL_EVERY}th held out for validation",
            "train_bytes": len(train), "val_bytes": len(val), "vocab": "bytes (256)"}
    return train, val, info


def as_tokens(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def windows_at(tokens: torch.Tensor, offsets: torch.Tensor, seq: int) -> torch.Tensor:
    return torch.stack([tokens[o:o + seq + 1] for o in offsets.tolist()]).long()


def val_offsets(n_val: int, seq: int, count: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(12345)  # the same validation set for every contender and seed
    return torch.randint(n_val - seq - 1, (count,), generator=gen)


# ----------------------------------------------------------------------------- one contender
def lr_at(args, update: int) -> float:
    """LR of update number ``update`` (0-based)."""
    if update < args.warmup:
        return args.lr * (update + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    span = max(1, args.updates - 1 - args.warmup)
    progress = min(1.0, (update - args.warmup) / span)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def memory_breakdown(params: list[torch.Tensor], opt) -> dict:
    """Bytes per category of the distinct storages behind the parameters, their .grad, the
    optimizer state (by key) and accum_fused's window buffers."""
    seen: set = set()
    out: dict[str, int] = {}

    def add(category: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                out[category] = out.get(category, 0) + t.untyped_storage().nbytes()

    for p in params:
        add("params", p)
    for p in params:
        add("grads", p.grad)
    for state in opt.state.values():
        for name, value in state.items():
            add(f"state.{name}", value)
    window = getattr(opt, "_window", None)
    if window is not None:
        for buf in window.buffers.values():
            add("window_buffers", buf)
    out["total"] = sum(out.values())
    return out


class Run:
    """One contender's training loop."""

    def __init__(self, args, name: str, mode: str | None, data_seed: int):
        self.args, self.name, self.mode, self.data_seed = args, name, mode, data_seed
        self.model = build_model(args)
        self.init = [p.detach().clone() for p in self.model.parameters()]  # fp32
        self.autocast = mode is None
        if mode is not None:
            self.model.to(torch.bfloat16)
        self.params = list(self.model.parameters())
        groups = param_groups(self.model, args.weight_decay)
        hyper = dict(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps)
        clip = args.max_grad_norm or None
        if mode is None:
            self.opt = torch.optim.AdamW(groups, **hyper, foreach=True)
            self.label = ("fp32 params, torch.optim.AdamW(foreach=True), (loss / k).backward(), "
                          + (f"clip_grad_norm_({clip}), " if clip else "") + "forward under bf16 autocast")
        else:
            self.opt = accum_fused.AdamW(groups, **hyper, accumulation_steps=args.k, max_grad_norm=clip,
                                         backend=args.backend, bf16_update=mode)
            self.label = (f"bf16 params (model.to(bfloat16)), accum_fused.AdamW(accumulation_steps={args.k}, "
                          f"max_grad_norm={clip}, backend={args.backend!r}, bf16_update={mode!r}), "
                          "loss.backward(); opt.step(weight=1.0); opt.zero_grad()")
        self.memory: dict[str, dict] = {}

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr

    def micro_batch(self, tokens: torch.Tensor, last: bool, measure: bool) -> float:
        k = self.args.k
        loss = lm_loss(self.model, tokens, self.autocast)
        if self.mode is None:
            (loss / k).backward()
            if measure:
                self.memory["mid_window"] = memory_breakdown(self.params, self.opt)
            if last:
                if self.args.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(self.params, self.args.max_grad_norm)
                self.opt.step()
                self.opt.zero_grad()
        else:
            loss.backward()
            if measure:
                self.memory["mid_window"] = memory_breakdown(self.params, self.opt)
            self.opt.step(weight=1.0)
            self.opt.zero_grad()
        return loss.item()

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, batch: int, model: nn.Module | None = None,
                 autocast: bool | None = None) -> float:
        model = self.model if model is None else model
        autocast = self.autocast if autocast is None else autocast
        was_training = model.training
        model.eval()
        total, count = 0.0, 0
        for i in range(0, tokens.shape[0], batch):
            chunk = tokens[i:i + batch]
            total += lm_loss(model, chunk, autocast).item() * chunk.shape[0]
            count += chunk.shape[0]
        model.train(was_training)
        return total / count

    def common_eval_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """A fresh model holding this contender's weights in ``dtype``."""
        other = build_model(self.args).to(dtype)
        with torch.no_grad():
            for dst, src in zip(other.parameters(), self.params):
                dst.copy_(src)
        return other

    def train(self, train_tokens: torch.Tensor, val_eval: torch.Tensor, val_final: torch.Tensor) -> dict:
        args = self.args
        gen = torch.Generator().manual_seed(self.data_seed)
        offsets = torch.randint(train_tokens.numel() - args.seq - 1, (args.updates, args.k, args.micro_batch),
                                generator=gen)
        curve_train, curve_val, pending = [], [], []
        eval_seconds = 0.0
        t0 = time.perf_counter()
        for u in range(args.updates):
            self.set_lr(lr_at(args, u))
            losses = [self.micro_batch(windows_at(train_tokens, offsets[u, j], args.seq), j == args.k - 1,
                                       measure=(u == 1 and j == 0))
                      for j in range(args.k)]
            if u == 1:
                self.memory["between_updates"] = memory_breakdown(self.params, self.opt)
            pending.append(sum(losses) / len(losses))
            if not all(math.isfinite(x) for x in losses):
                raise FloatingPointError(f"{self.name}: non-finite loss at update {u}: {losses}")
            if (u + 1) % args.log_every == 0 or u + 1 == args.updates:
                curve_train.append({"update": u + 1, "loss": sum(pending) / len(pending), "lr": lr_at(args, u)})
                pending = []
            if (u + 1) % args.eval_every == 0 and u + 1 != args.updates:
                e0 = time.perf_counter()
                curve_val.append({"update": u + 1, "loss": self.evaluate(val_eval, args.micro_batch * 2)})
                eval_seconds += time.perf_counter() - e0
            if args.progress and curve_train and (u + 1) % max(1, args.updates // 10) == 0:
                print(f"  [{self.name}] update {u + 1}/{args.updates} train {curve_train[-1]['loss']:.4f} "
                      f"({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
        train_seconds = time.perf_counter() - t0 - eval_seconds
        e0 = time.perf_counter()
        curve_val.append({"update": args.updates, "loss": self.evaluate(val_eval, args.micro_batch * 2)})
        final_own = self.evaluate(val_final, args.micro_batch * 2)
        fp32_copy = self.common_eval_model(torch.float32)
        final_common = self.evaluate(val_final, args.micro_batch * 2, fp32_copy, autocast=True)
        final_bf16_weights = None
        if self.mode is None:  # fp32 master weights rounded once to bf16, pure bf16 forward
            final_bf16_weights = self.evaluate(val_final, args.micro_batch * 2, self.common_eval_model(torch.bfloat16),
                                               autocast=False)
        eval_seconds += time.perf_counter() - e0
        moved = math.sqrt(sum(((p.float() - p0) ** 2).sum().item() for p, p0 in zip(self.params, self.init)))
        norm0 = math.sqrt(sum((p0 ** 2).sum().item() for p0 in self.init))
        checks = None
        if self.mode is not None and (self.opt.update_count != args.updates or self.opt.micro_step != 0):
            checks = (f"update_count={self.opt.update_count} micro_step={self.opt.micro_step}, "
                      f"expected {args.updates}, 0")
        n = sum(p.numel() for p in self.params)
        return {
            "contender": self.name, "bf16_update": self.mode, "data_seed": self.data_seed, "implementation": self.label,
            "param_dtype": str(self.params[0].dtype).replace("torch.", ""), "n_params": n,
            "train_curve": curve_train, "val_curve": curve_val,
            "final_train_loss": curve_train[-1]["loss"], "final_val_loss": final_own,
            "final_val_loss_common_eval": final_common, "final_val_loss_bf16_rounded_weights": final_bf16_weights,
            "relative_distance_from_init": moved / norm0,
            "train_seconds": train_seconds, "eval_seconds": eval_seconds,
            "memory_bytes": self.memory,
            "memory_bytes_per_param": {when: {k: v / n for k, v in m.items()} for when, m in self.memory.items()},
            "check": checks, "threads": torch.get_num_threads(),
        }

    def close(self) -> None:
        if hasattr(self.opt, "close"):
            self.opt.close()


def run_contender(args, spec: dict, corpus: tuple[bytes, bytes], params_out: str) -> dict:
    torch.set_num_threads(args.threads)
    train, val = corpus
    train_tokens, val_tokens = as_tokens(train), as_tokens(val)
    val_final = windows_at(val_tokens, val_offsets(val_tokens.numel(), args.seq, max(args.final_eval_seqs,
                                                                                      args.eval_seqs)), args.seq)
    val_eval = val_final[:args.eval_seqs]  # the curve's set: the first sequences of the final one
    run = Run(args, spec["name"], spec["mode"], spec["data_seed"])
    try:
        result = run.train(train_tokens, val_eval, val_final)
    finally:
        run.close()
    torch.save([p.detach().float() for p in run.params], params_out)
    return result


def _fork(args, spec: dict, corpus: tuple[bytes, bytes], tmp: str) -> tuple[int, str, str]:
    """Start one contender in a forked child (the parent has run no torch compute, so no thread
    pool is inherited); returns (pid, result path, params path)."""
    result_out = os.path.join(tmp, f"{spec['name']}.json")
    params_out = os.path.join(tmp, f"{spec['name']}.pt")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = run_contender(args, spec, corpus, params_out)
            Path(result_out).write_text(json.dumps(result))
            code = 0
        except BaseException:
            Path(result_out).write_text(json.dumps({"contender": spec["name"], "error": traceback.format_exc()}))
        finally:
            os._exit(code)
    return pid, result_out, params_out


def run_all(args, specs: list[dict], corpus: tuple[bytes, bytes]) -> tuple[list[dict], dict]:
    """Every contender in its own process, --jobs at a time; results in the order of ``specs``."""
    results: dict[str, dict] = {}
    finals: dict[str, str] = {}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        queue, running = list(specs), {}
        while queue or running:
            while queue and len(running) < args.jobs:
                spec = queue.pop(0)
                pid, result_out, params_out = _fork(args, spec, corpus, tmp)
                running[pid] = (spec, result_out, params_out)
                print(f"[{spec['name']}] started ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
            pid, status = os.wait()
            if pid not in running:
                continue
            spec, result_out, params_out = running.pop(pid)
            try:
                r = json.loads(Path(result_out).read_text())
            except (OSError, ValueError):
                r = {"contender": spec["name"], "error": f"child exited with status {status}"}
            if "error" in r:
                print(f"[{spec['name']}] FAILED:\n{r['error'][-2000:]}", file=sys.stderr, flush=True)
            else:
                finals[spec["name"]] = params_out
                print(f"[{spec['name']}] done: train {r['final_train_loss']:.4f} val {r['final_val_loss']:.4f} "
                      f"({r['train_seconds']:.0f}s training; {time.time() - t0:.0f}s elapsed)",
                      file=sys.stderr, flush=True)
            results[spec["name"]] = r
        weights = {name: torch.load(path) for name, path in finals.items()}
    ordered = [results[s["name"]] for s in specs]
    ref = weights.get("fp32_master")
    if ref is not None:
        ref_norm = math.sqrt(sum((w ** 2).sum().item() for w in ref))
        for r in ordered:
            mine = weights.get(r["contender"])
            if mine is not None and r["contender"] != "fp32_master":
                diff = math.sqrt(sum(((a - b) ** 2).sum().item() for a, b in zip(mine, ref)))
                r["relative_distance_to_fp32_master"] = diff / ref_norm
    ref = next((r for r in ordered if r["contender"] == "fp32_master" and "error" not in r), None)
    if ref is not None:
        for r in ordered:
            if "error" not in r and r is not ref:
                r["fp32_master_update_at_same_val_loss"] = fp32_equivalent_update(r["val_curve"][-1]["loss"],
                                                                                  ref["val_curve"])
    return ordered, {"elapsed_s": time.time() - t0}


# ------------------------------------------------------------------------------------ output
def fp32_equivalent_update(val_loss: float, ref_curve: list[dict]) -> float | None:
    """The update at which fp32_master's validation curve (the --eval-seqs set) first reaches
    ``val_loss`` (linear between its evaluations); None when it never does."""
    prev = None
    for point in ref_curve:
        if point["loss"] <= val_loss:
            if prev is None or prev["loss"] == point["loss"]:
                return float(point["update"])
            frac = (prev["loss"] - val_loss) / (prev["loss"] - point["loss"])
            return prev["update"] + frac * (point["update"] - prev["update"])
        prev = point
    return None


def spread(results: list[dict], key: str) -> float | None:
    values = [r[key] for r in results if "error" not in r and r["bf16_update"] is None]
    return max(values) - min(values) if len(values) > 1 else None


def print_tables(results: list[dict], args) -> None:
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    ref = next((r for r in ok if r["contender"] == "fp32_master"), None)
    print()
    header = ["contender", "data seed", "final train", "final val (own fwd)", "Δ val vs fp32_master",
              "final val (common eval)", "Δ common vs fp32_master", "fp32_master reached that val at update",
              "moved from init", "dist. to fp32_master", "train s", "check"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for r in ok:
        d_own = "-" if ref is None or r is ref else f"{r['final_val_loss'] - ref['final_val_loss']:+.4f}"
        d_common = ("-" if ref is None or r is ref
                    else f"{r['final_val_loss_common_eval'] - ref['final_val_loss_common_eval']:+.4f}")
        dist = r.get("relative_distance_to_fp32_master")
        same = "-"
        if ref is not None and r is not ref:
            at = r.get("fp32_master_update_at_same_val_loss")
            same = f"≥ {ref['val_curve'][-1]['update']} (at or below)" if at is None else f"{at:.0f}"
        print("| " + " | ".join([
            r["contender"], str(r["data_seed"]), f"{r['final_train_loss']:.4f}", f"{r['final_val_loss']:.4f}", d_own,
            f"{r['final_val_loss_common_eval']:.4f}", d_common, same, f"{r['relative_distance_from_init']:.4f}",
            "-" if dist is None else f"{dist:.4f}", f"{r['train_seconds']:.0f}", r["check"] or "ok"]) + " |")
    if ref is not None and ref.get("final_val_loss_bf16_rounded_weights") is not None:
        print(f"\nfp32_master's final weights rounded once to bf16 (pure bf16 forward): val "
              f"{ref['final_val_loss_bf16_rounded_weights']:.4f} (own forward {ref['final_val_loss']:.4f})")
    seeds = sorted({r["data_seed"] for r in ok if r["bf16_update"] is None})
    for key, label in (("final_train_loss", "train"), ("final_val_loss", "val (own fwd)"),
                       ("final_val_loss_common_eval", "val (common eval)")):
        s = spread(ok, key)
        if s is not None:
            print(f"fp32_master spread over data seeds {seeds} ({label}): {s:.4f} (max - min)")
    s = spread(ok, "final_val_loss_common_eval")
    if ref is not None and s is not None:
        for r in ok:
            if r["bf16_update"] is not None:
                d = r["final_val_loss_common_eval"] - ref["final_val_loss_common_eval"]
                print(f"  {r['contender']}: val (common eval) {d:+.4f} vs fp32_master: "
                      + ("within" if abs(d) <= s else f"{abs(d) / s:.1f}x outside") + " the fp32_master spread")
    print("\nMemory, bytes per parameter (distinct tensor storages; mid-window = after a backward, "
          "before the optimizer call):")
    keys = sorted({k for r in ok for m in r["memory_bytes_per_param"].values() for k in m} - {"total"})
    header = ["contender", "when"] + keys + ["total"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|")
    seen = set()
    for r in ok:
        sig = (r["bf16_update"], r["param_dtype"])
        if sig in seen:
            continue
        seen.add(sig)
        for when in ("mid_window", "between_updates"):
            m = r["memory_bytes_per_param"].get(when, {})
            print("| " + " | ".join([r["contender"], when] + [f"{m[k]:.4f}" if k in m else "-" for k in keys]
                                    + [f"{m.get('total', 0):.4f}"]) + " |")


def plot(results: list[dict], log_every: int, title: str, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot written")
        return False
    ok = [r for r in results if "error" not in r]
    ref = next((r for r in ok if r["contender"] == "fp32_master"), None)
    colors = {"fp32_master": "black", "nearest": "tab:red", "stochastic": "tab:blue", "kahan": "tab:orange"}
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for r in ok:
        other_order = ref is not None and r["data_seed"] != ref["data_seed"]
        color = "gray" if other_order else colors.get(r["contender"], "tab:purple")
        vx, vy = [p["update"] for p in r["val_curve"]], [p["loss"] for p in r["val_curve"]]
        if not other_order:  # (another data order's train loss differs by its batches, not its training)
            axes[0].plot([p["update"] for p in r["train_curve"]], [p["loss"] for p in r["train_curve"]],
                         color=color, linewidth=1.0, alpha=0.8, label=f"{r['contender']} train")
        axes[0].plot(vx, vy, color=color, marker="o", markersize=3.5, linewidth=1.4,
                     linestyle=":" if other_order else "--", label=f"{r['contender']} val")
        if ref is None or r is ref:
            continue
        ref_val = {p["update"]: p["loss"] for p in ref["val_curve"]}
        dx = [u for u in vx if u in ref_val]
        axes[1].plot(dx, [p["loss"] - ref_val[p["update"]] for p in r["val_curve"] if p["update"] in ref_val],
                     color=color, marker="o", markersize=3.5, linewidth=1.4, linestyle=":" if other_order else "--",
                     label=f"{r['contender']} val")
        if not other_order:
            axes[1].plot([p["update"] for p in r["train_curve"]],
                         [a["loss"] - b["loss"] for a, b in zip(r["train_curve"], ref["train_curve"])],
                         color=color, linewidth=1.0, alpha=0.8, label=f"{r['contender']} train")
    seeds = [r for r in ok if ref is not None and r["data_seed"] != ref["data_seed"] and r["bf16_update"] is None]
    if seeds:
        ref_val = {p["update"]: p["loss"] for p in ref["val_curve"]}
        xs = [p["update"] for p in ref["val_curve"]]
        diffs = [[0.0] + [next((q["loss"] for q in r["val_curve"] if q["update"] == u), ref_val[u]) - ref_val[u]
                          for r in seeds] for u in xs]
        axes[1].fill_between(xs, [min(d) for d in diffs], [max(d) for d in diffs], color="gray", alpha=0.2,
                             label="fp32_master val, spread over data orders")
    axes[0].set_xlabel("update")
    axes[0].set_ylabel("loss (nats per byte)")
    axes[0].set_title(f"train loss (solid, mean per {log_every} updates) and validation loss (dots)",
                      fontsize="small")
    axes[0].legend(fontsize="x-small", ncol=2)
    low = min(p["loss"] for r in ok for p in r["train_curve"] + r["val_curve"])
    high = max(r["val_curve"][0]["loss"] for r in ok)
    axes[0].set_ylim(low - 0.05, high + 0.1)
    axes[1].axhline(0.0, color="black", linewidth=0.8)
    axes[1].set_xlabel("update")
    axes[1].set_ylabel("loss - fp32_master's loss (same update)")
    axes[1].set_title("difference to fp32_master (train: same batches; gray: fp32_master with another data order)",
                      fontsize="small")
    if axes[1].get_legend_handles_labels()[1]:
        axes[1].legend(fontsize="x-small", ncol=2)
    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    for flag, default, kind in (("--layers", 3, int), ("--d-model", 256, int), ("--heads", 4, int),
                                ("--seq", 128, int), ("--micro-batch", 2, int), ("--k", 2, int),
                                ("--updates", 2000, int), ("--lr", 1.5e-4, float), ("--warmup", -1, int),
                                ("--min-lr-ratio", 0.1, float), ("--weight-decay", 0.1, float),
                                ("--beta1", 0.9, float), ("--beta2", 0.95, float), ("--eps", 1e-8, float),
                                ("--max-grad-norm", 1.0, float), ("--log-every", 25, int),
                                ("--eval-every", 100, int), ("--eval-seqs", 64, int),
                                ("--final-eval-seqs", 512, int), ("--seed", 0, int), ("--data-seed", 1, int),
                                ("--threads", 1, int), ("--jobs", 2, int), ("--max-files", 0, int)):
        ap.add_argument(flag, type=kind, default=None,
                        help={"--warmup": "default 5%% of --updates",
                              "--max-files": "default 0: every file"}.get(flag, f"default {default}"))
        ap.set_defaults(**{flag[2:].replace("-", "_") + "_default": default})
    ap.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    ap.add_argument("--spread-seeds", default="2,3",
                    help="extra data seeds for fp32_master (comma list, '' for none): the run-to-run spread")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny model and 60 updates (< 1 minute)")
    ap.add_argument("--progress", action="store_true", help="print each contender's progress")
    ap.add_argument("--json", default=None, help="default benchmarks/results/bf16_update_<date>.json")
    ap.add_argument("--plot", default=None, help="default: the JSON path with .png")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    for name in list(vars(args)):
        if name.endswith("_default"):
            key = name[:-len("_default")]
            if getattr(args, key) is None:
                value = QUICK.get(key, getattr(args, name)) if args.quick else getattr(args, name)
                setattr(args, key, value)
            delattr(args, name)
    args.max_files = args.max_files or None
    args.contenders = [c for c in args.contenders.split(",") if c]
    for c in args.contenders:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
    args.spread_seeds = [int(s) for s in args.spread_seeds.split(",") if s.strip()]
    if args.d_model % args.heads:
        ap.error(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    if min(args.k, args.updates, args.micro_batch, args.jobs, args.threads, args.log_every, args.eval_every) < 1:
        ap.error("--k, --updates, --micro-batch, --jobs, --threads, --log-every, --eval-every must be >= 1")
    if args.warmup < 0:
        args.warmup = max(1, args.updates // 20)
    if not 0 <= args.warmup < args.updates:
        ap.error("--warmup must be in [0, --updates)")
    args.warmup = max(args.warmup, 1)
    return args


def specs_of(args) -> list[dict]:
    specs = [{"name": c, "mode": None if c == "fp32_master" else c, "data_seed": args.data_seed}
             for c in args.contenders]
    specs += [{"name": f"fp32_master@ds{s}", "mode": None, "data_seed": s}
              for s in args.spread_seeds if s != args.data_seed]
    return specs


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    # The parent runs no torch compute before forking (bytes here; the model on the meta device).
    train, val, corpus = load_corpus(args.max_files)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in GPT(args.seq, args.d_model, args.layers, args.heads).parameters())
    specs = specs_of(args)
    load_before = loadavg()
    print(f"GPT {args.layers} layers, d {args.d_model}, {args.heads} heads, seq {args.seq}, byte vocab: "
          f"{n_params:,} params; k={args.k} x {args.micro_batch} sequences per update, {args.updates} updates, "
          f"AdamW lr {args.lr:g} ({args.schedule}, warm-up {args.warmup}), wd {args.weight_decay}, betas "
          f"({args.beta1}, {args.beta2}), clip {args.max_grad_norm or None}; corpus {corpus['files']} files, "
          f"{corpus['bytes']:,} bytes; {len(specs)} runs, {args.jobs} at a time x {args.threads} threads; "
          f"load average {load_before}", flush=True)
    results, timing = run_all(args, specs, (train, val))
    load_after = loadavg()
    print_tables(results, args)
    print(f"\nelapsed {time.time() - t0:.0f}s; load average before {load_before}, after {load_after} "
          f"({os.cpu_count()} CPUs)")
    stamp = _dt.datetime.now()
    path = Path(args.json) if args.json else HERE / "results" / f"bf16_update_{stamp:%Y%m%d-%H%M%S}.json"
    plot_path = None if args.no_plot else Path(args.plot) if args.plot else path.with_suffix(".png")
    title = (f"{n_params:,} params, k={args.k} x {args.micro_batch} x {args.seq} bytes, "
             f"{args.updates} updates, AdamW lr {args.lr:g} {args.schedule}, wd {args.weight_decay}; "
             f"torch sources, byte-level; {cpu_model()}")
    if plot_path is not None and not plot(results, args.log_every, title, plot_path):
        plot_path = None
    config = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "no_plot", "progress")}
    config |= {"n_params": n_params, "tokens_per_update": args.k * args.micro_batch * args.seq,
               "betas": [args.beta1, args.beta2], "corpus": corpus,
               "weight_decay_groups": "dim >= 2 (matrices, embeddings) decayed; biases and LayerNorm not",
               "init": "GPT-2: normal(0, 0.02), residual projections 0.02/sqrt(2*layers), zero biases",
               "lr_schedule": (f"linear warm-up over {args.warmup} updates, then "
                               + (f"cosine to {args.min_lr_ratio} x lr" if args.schedule == "cosine" else "constant")),
               "fp32_master_forward": "torch.autocast('cpu', dtype=torch.bfloat16)",
               "bf16_forward": "pure bf16 model (model.to(torch.bfloat16)), no autocast",
               "common_eval": "weights copied into an fp32 model, forward under bf16 autocast (as fp32_master's)",
               "loss": "next-byte cross entropy in fp32 from the logits, mean over tokens (nats per byte)"}
    ok = [r for r in results if "error" not in r]
    record = {
        "benchmark": "bench_bf16", "date": stamp.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": {"type": "cpu", "name": cpu_model(), "cores": os.cpu_count(), "threads_per_run": args.threads,
                   "concurrent_runs": args.jobs, "loadavg_before": load_before, "loadavg_after": load_after},
        "versions": versions(), "config": config, "results": results,
        "fp32_master_spread": {key: spread(ok, key) for key in ("final_train_loss", "final_val_loss",
                                                                  "final_val_loss_common_eval")},
        "plot": None if plot_path is None else str(plot_path), "elapsed_s": timing["elapsed_s"],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}" + (f" and {plot_path}" if plot_path else ""))
    failed = [r for r in results if "error" in r or r.get("check")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
