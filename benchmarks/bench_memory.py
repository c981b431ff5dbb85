#!/usr/bin/env python
"""Peak memory of one accumulation window (k micro-batches + one AdamW update, clip 1.0) of a
GPT-style model: the native torch loop against accum_fused plain and accum_fused in_backward
(mode A and mode B), with fp32 and with bf16 parameters (issue 12, "Measured").

Contenders (AdamW lr 1e-3, weight decay 0.01, max_grad_norm 1.0, k = --k micro-batches):

  native   for each micro-batch: (loss / k).backward()  (.grad accumulated by autograd);
           at the window end clip_grad_norm_(params, 1.0); torch.optim.AdamW(fused=True).step()
           (foreach where fused fails); zero_grad()
  plain    accum_fused.AdamW(accumulation_steps=k, max_grad_norm=1.0):
           for each micro-batch: loss.backward(); opt.step(weight=1); opt.zero_grad()
  mode_a   accum_fused.AdamW(in_backward=True, max_grad_norm=1.0)  (accumulation_steps=1):
           the native loop unchanged: (loss / k).backward() per micro-batch, step(); zero_grad()
           at the window end (the hooks sum each gradient into the fp32 buffers, .grad freed)
  mode_b   accum_fused.AdamW(in_backward=True, accumulation_steps=k, max_grad_norm=1.0):
           opt.backward(loss, weight=1) per micro-batch; the k-th applies the update
  fb_only  no optimizer: forward + backward with a post-accumulate-grad hook that drops each
           .grad at once. Not a training loop: it measures what forward + backward need beyond
           the parameters (activations, autograd temporaries), used to subtract activations.
  <loop>+<bf16_update>  an accum_fused loop above with AdamW(bf16_update=<mode>), for bf16 only
           (skipped for fp32, whose parameters the option does not touch): plain+stochastic,
           plain+kahan, mode_b+stochastic, mode_b+kahan by default (the loops without a suffix
           are bf16_update="nearest", the default). Expected: stochastic keeps one int64 seed per
           parameter tensor in the state (+0 per element), kahan a bf16 compensation (+2 B/param).

Each contender runs in its own process (forked from the parent, which has imported torch but
run nothing; --isolation subprocess for a fresh interpreter each) (same seed, same model, same token batches): one
warm-up window (optimizer state allocated), then the measured window. Reported:

  peak       CPU: peak bytes of live tensor storages over the measured window, from a
             TorchDispatchMode that sees every op's outputs, counts each untyped storage once
             (keyed by data_ptr) and subtracts it when the storage is freed (weakref finalizer).
             Sampled at op boundaries: scratch memory inside one kernel is not seen, nor are
             tensors created before the tracker started (it starts before the model is built).
             CUDA: torch.cuda.max_memory_allocated() over the measured window (reset first).
  resident   live bytes between the warm-up and the measured window (after gc.collect()).
  state@bdry the model-state part at the window boundary, by walking the objects: parameters +
             .grad + accum_fused window buffers + optimizer state (distinct storages).
  peak-act   peak - (fb_only's peak - fb_only's resident): the peak with the forward/backward
             working memory of the same model and batches taken out; approximately the
             model-state part at the peak (params + grads + buffers + state + update temporaries).
  RSS (CPU)  peak RSS (VmHWM, reset through /proc/self/clear_refs before the measured window)
             of the child process, with mallopt(M_MMAP_THRESHOLD, 65536) (MALLOC_MMAP_THRESHOLD_ for
             --isolation subprocess) so freed blocks go back to the OS; includes the
             interpreter and libtorch (see the fb_only row for the floor).

Sanity: after the two windows every contender's parameters are compared with native's and with
plain's (max |diff|). fp32: the same training, so ~1e-6 or less. bf16: the native loop
accumulates .grad in bf16 and keeps bf16 AdamW state, accum_fused in fp32, so they differ by
bf16 rounding; accum_fused's three loops should agree with each other closely (the +stochastic
and +kahan loops differ from plain by the rounding of the parameter writes: up to a bf16 ulp).

Usage (from the repository root):
  python benchmarks/bench_memory.py                         # CPU preset (10.2M params), fp32 + bf16, k=8
  python benchmarks/bench_memory.py --device cuda --preset gpt2
  python benchmarks/bench_memory.py --dtypes fp32 --contenders native,mode_a --layers 2 --d-model 128
  python benchmarks/bench_memory.py --dtypes bf16 --contenders fb_only,native,plain,plain+stochastic,plain+kahan
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import weakref
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
from accum_fused.bench import native_adamw_impl  # noqa: E402  (shared with bench_window)

PRESETS = {
    # 10.2M parameters; 1 x 32 tokens per micro-batch: activations small next to model state,
    # and the 10 contender runs take ~1 minute on an idle 2-core machine.
    "cpu": dict(vocab=8192, ctx=64, d_model=384, layers=4, heads=6, batch=1, seq=32),
    # GPT-2 small shapes (124M parameters, tied head), 4 x 512 tokens per micro-batch.
    "gpt2": dict(vocab=50257, ctx=1024, d_model=768, layers=12, heads=12, batch=4, seq=512),
}
CONTENDERS = ("fb_only", "native", "plain", "mode_a", "mode_b",
              "plain+stochastic", "plain+kahan", "mode_b+stochastic", "mode_b+kahan")
BF16_UPDATES = ("nearest", "stochastic", "kahan")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 1e-2, 1.0


# ------------------------------------------------------------------------------- model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LayerNorm, LM head tied to wte."""

    def __init__(self, vocab: int, ctx: int, d: int, layers: int, heads: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------- tracker
class LiveTensorTracker:
    """Bytes of live tensor storages, updated after every dispatched op (see module docstring)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self
        self.live: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        tracker._add(t)
                if tracker.current > tracker.peak:
                    tracker.peak = tracker.current
                return out

        self.mode = _Mode()

    def _add(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if ptr == 0 or n == 0:
            return
        entry = self.live.get(ptr)
        if entry is not None:
            if entry[0] != n:  # resized in place (out= ops)
                self.current += n - entry[0]
                entry[0] = n
            return
        entry = [n]
        self.live[ptr] = entry
        self.current += n
        weakref.finalize(st, self._free, ptr, entry)

    def _free(self, ptr: int, entry: list[int]) -> None:
        if self.live.get(ptr) is entry:
            del self.live[ptr]
            self.current -= entry[0]

    def reset_peak(self) -> None:
        self.peak = self.current


def _proc_status() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(("VmHWM:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _distinct_bytes(tensors, seen: set) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            key = (t.device, st.data_ptr())
            if key not in seen:
                seen.add(key)
                total += st.nbytes()
    return total


def model_state_bytes(params, opt) -> dict[str, int]:
    """Parameters, .grad, accum_fused window buffers, optimizer state: distinct storages, in that order."""
    seen: set = set()
    out = {"params": _distinct_bytes(params, seen), "grads": _distinct_bytes([p.grad for p in params], seen)}
    window = getattr(opt, "_window", None) if opt is not None else None
    out["buffers"] = _distinct_bytes(list(window.buffers.values()) if window is not None else [], seen)
    state = []
    if opt is not None:
        for s in opt.state.values():
            state += [v for v in s.values() if isinstance(v, torch.Tensor)]
    out["state"] = _distinct_bytes(state, seen)
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------------- child
def run_child(args) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    impl = native_adamw_impl(device, dtype)  # before the tracker: its probe tensors are not counted
    tracker = None if cuda else LiveTensorTracker()
    if tracker is not None:
        tracker.mode.__enter__()
    phases: list[dict] = []

    def now() -> int:
        return torch.cuda.memory_allocated() if cuda else tracker.current

    def start_phase():
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            tracker.reset_peak()
        return now()

    def end_phase(name: str, start: int) -> None:
        if not record["on"]:
            return
        if cuda:
            torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() if cuda else tracker.peak
        phases.append({"phase": name, "start": start, "end": now(), "peak": peak})
        window_peak[0] = max(window_peak[0], peak)

    record = {"on": False}
    window_peak = [0]

    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.ctx, args.d_model, args.layers, args.heads).to(device=device, dtype=dtype)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    k, (c, bf16_update) = args.k, split_contender(args.contender)
    opt = None
    grad_not_none = []
    if c == "native":
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **{impl: True})
    elif c == "plain":
        opt = accum_fused.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=k,
                                max_grad_norm=MAX_GRAD_NORM, backend=args.backend, bf16_update=bf16_update)
    elif c == "mode_a":
        opt = accum_fused.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM,
                                backend=args.backend, in_backward=True, bf16_update=bf16_update)
    elif c == "mode_b":
        opt = accum_fused.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, accumulation_steps=k,
                                max_grad_norm=MAX_GRAD_NORM, backend=args.backend, in_backward=True,
                                bf16_update=bf16_update)
    elif c == "fb_only":
        def drop(p):
            p.grad = None
        for p in params:
            p.register_post_accumulate_grad_hook(drop)
    else:
        raise SystemExit(f"unknown contender {c!r}")

    def batch(window: int, i: int):
        gen = torch.Generator().manual_seed(args.seed * 1000003 + window * 1009 + i)
        toks = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
        return toks[:, :-1], toks[:, 1:]

    def window(w: int) -> None:
        for i in range(k):
            x, y = batch(w, i)
            s = start_phase()
            loss = model(x, y)
            end_phase(f"mb{i}.forward", s)
            s = start_phase()
            if c == "native":
                (loss / k).backward()
            elif c == "plain":
                loss.backward()
            elif c == "mode_a":
                (loss / k).backward()
            elif c == "mode_b":
                opt.backward(loss, weight=1.0)
            else:
                loss.backward()
            del loss
            end_phase(f"mb{i}.backward", s)
            if c in ("mode_a", "mode_b") and any(p.grad is not None for p in params):
                grad_not_none.append((w, i))
            s = start_phase()
            if c == "plain":
                opt.step(weight=1.0)
                opt.zero_grad()
            elif i == k - 1 and c == "native":
                torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
                opt.step()
                opt.zero_grad()
            elif i == k - 1 and c == "mode_a":
                opt.step()
                opt.zero_grad()
            end_phase(f"mb{i}.step" if c == "plain" else "update", s)

    window(0)  # warm-up: optimizer state allocated
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    resident = now()
    state_boundary = model_state_bytes(params, opt)
    gc.collect()
    rss_reset = False if cuda else _reset_peak_rss()
    rss_before = _proc_status().get("VmRSS")
    record["on"] = True
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        tracker.reset_peak()
    window(1)
    peak = max(torch.cuda.max_memory_allocated() if cuda else tracker.peak, window_peak[0])
    record["on"] = False
    status = _proc_status()
    gc.collect()
    resident_after = now()
    if tracker is not None:
        tracker.mode.__exit__(None, None, None)
    peak_phase = max(phases, key=lambda p: p["peak"])["phase"] if phases else None
    fwd_act = max((p["end"] - p["start"] for p in phases if p["phase"].endswith("forward")), default=0)
    checks = {}
    if isinstance(opt, accum_fused.AdamW):
        checks = {"update_count": opt.update_count, "micro_step": opt.micro_step}
    elif opt is not None:
        checks = {"steps": sorted({int(opt.state[p]["step"]) for p in params})}
    if args.params_out:
        torch.save([p.detach().float().cpu() for p in params], args.params_out)
    return {
        "contender": args.contender, "dtype": args.dtype, "n_params": n_params,
        "bf16_update": bf16_update if isinstance(opt, accum_fused.AdamW) else None,
        "native_impl": impl if c == "native" else None,
        "method": "cuda.max_memory_allocated" if cuda else "TorchDispatchMode live-storage tracker",
        "peak_bytes": peak, "resident_bytes": resident, "resident_after_bytes": resident_after,
        "state_at_boundary": state_boundary, "peak_phase": peak_phase,
        "forward_activation_bytes": fwd_act, "phases": phases,
        "rss_peak_bytes": status.get("VmHWM") if rss_reset else None, "rss_before_window_bytes": rss_before,
        "grad_not_none_after_backward": grad_not_none, "checks": checks,
    }


def split_contender(name: str) -> tuple[str, str]:
    """'plain+kahan' -> ('plain', 'kahan'); 'plain' -> ('plain', 'nearest')."""
    loop, _, bf16_update = name.partition("+")
    return loop, bf16_update or "nearest"


# ------------------------------------------------------------------------------ parent
def versions() -> dict:
    try:
        from accum_fused.bench import versions as af_versions
        return af_versions()
    except Exception:  # the shared helper may change under us; fall back to the essentials
        return {"accum_fused": getattr(accum_fused, "__version__", None), "torch": torch.__version__,
                "cuda": torch.version.cuda, "python": platform.python_version(), "platform": platform.platform()}


def device_info(device: torch.device, threads: int) -> dict:
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device)}
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"type": "cpu", "name": name, "threads": threads, "cores": os.cpu_count(),
            "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None}


def fmt_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _run_forked(args, contender: str, dtype: str, params_out: str, result_out: str) -> dict:
    """One contender in a forked child (a fresh address space without re-importing torch; the
    parent has run no torch compute, so no thread pool is inherited)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:  # what MALLOC_MMAP_THRESHOLD_=65536 does for a subprocess (fixed, not dynamic)
                import ctypes
                ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD
            except (OSError, AttributeError):
                pass
            child = argparse.Namespace(**{**vars(args), "contender": contender, "dtype": dtype,
                                          "params_out": params_out})
            result = run_child(child)
            Path(result_out).write_text(json.dumps(result))
            code = 0
        except BaseException:
            import traceback
            Path(result_out).write_text(json.dumps({"contender": contender, "dtype": dtype,
                                                    "error": traceback.format_exc()}))
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    try:
        return json.loads(Path(result_out).read_text())
    except (OSError, ValueError):
        return {"contender": contender, "dtype": dtype, "error": f"child exited with status {status}"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: cpu on CPU, gpt2 on CUDA")
    for name in ("vocab", "ctx", "d-model", "layers", "heads", "batch", "seq"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (memory does not depend on it; "
                    "1 keeps a shared machine from slowing the run down)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--isolation", choices=("fork", "subprocess"), default="fork" if hasattr(os, "fork") else "subprocess",
                    help="one contender per forked child (default; fast) or per fresh interpreter")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/memory_<device>_<date>.json)")
    # internal: one contender in this process
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--params-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    preset = PRESETS[args.preset or ("gpt2" if dev.type == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.seq > args.ctx:
        raise SystemExit(f"--seq {args.seq} exceeds --ctx {args.ctx}")
    for name in (c for c in args.contenders.split(",") if c):
        loop, mode = split_contender(name)
        if loop not in ("fb_only", "native", "plain", "mode_a", "mode_b") or mode not in BF16_UPDATES or (
                mode != "nearest" and loop in ("fb_only", "native")):
            raise SystemExit(f"unknown contender {name!r}: one of fb_only, native, plain, mode_a, mode_b, "
                             f"or an accum_fused loop + one of {', '.join(BF16_UPDATES[1:])} (e.g. plain+kahan)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args)))
        return 0
    device = torch.device(args.device)
    dtypes = [d for d in args.dtypes.split(",") if d]
    contenders = [c for c in args.contenders.split(",") if c]
    if "native" not in contenders:
        contenders.insert(0, "native")  # the reference for the parameter check
    child_argv = [a for a in (argv if argv is not None else sys.argv[1:])]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    results = []
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        finals = {}
        for dt in dtypes:
            for c in contenders:
                if "+" in c and dt != "bf16":
                    continue  # bf16_update only changes how bf16 parameters are written
                out = os.path.join(tmp, f"{dt}_{c}.pt")
                if args.isolation == "fork":
                    r = _run_forked(args, c, dt, out, os.path.join(tmp, f"{dt}_{c}.json"))
                else:
                    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv, "--child",
                           "--contender", c, "--dtype", dt, "--params-out", out]
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    r = (json.loads(line[len("RESULT "):]) if proc.returncode == 0 and line is not None
                         else {"contender": c, "dtype": dt, "error": proc.stderr[-3000:] or f"rc {proc.returncode}"})
                if "error" in r:
                    print(f"[{dt} {c}] FAILED:\n{r['error'][-1500:]}", file=sys.stderr)
                    results.append(r)
                    continue
                finals[(dt, c)] = out  # loaded at the end: a forked child would count them in its RSS
                results.append(r)
                print(f"[{dt} {c}] peak {r['peak_bytes'] / 2**20:.1f} MiB ({time.time() - t0:.0f}s)", file=sys.stderr)
        finals = {key: torch.load(path) for key, path in finals.items()}
        for r in results:
            if "error" in r or r["contender"] == "fb_only":
                continue
            mine = finals[(r["dtype"], r["contender"])]
            for ref in ("native", "plain"):
                other = finals.get((r["dtype"], ref))
                if other is not None and ref != r["contender"]:
                    r[f"max_abs_diff_vs_{ref}"] = max((a - b).abs().max().item() for a, b in zip(mine, other))

    ok = [r for r in results if "error" not in r]
    fb = {r["dtype"]: r for r in ok if r["contender"] == "fb_only"}
    for r in ok:
        base = fb.get(r["dtype"])
        if base is not None and r["contender"] != "fb_only":
            r["peak_minus_fb_working_bytes"] = r["peak_bytes"] - (base["peak_bytes"] - base["resident_bytes"])
    n = ok[0]["n_params"] if ok else 0
    bpp = lambda b: "-" if b is None else f"{b / n:.2f}"  # noqa: E731
    diff = lambda r, ref: "-" if f"max_abs_diff_vs_{ref}" not in r else f"{r[f'max_abs_diff_vs_{ref}']:.1e}"  # noqa: E731
    header = ["dtype", "contender", "peak MiB", "peak B/param", "peak-act B/param", "resident B/param",
              "state@bdry B/param (P+G+A+S)", "peak at", "RSS peak MiB", "max|Δ| vs native", "max|Δ| vs plain"]
    rows = []
    for r in ok:
        sb = r["state_at_boundary"]
        parts = "+".join(f"{sb[key] / n:.0f}" for key in ("params", "grads", "buffers", "state"))
        rows.append([r["dtype"], r["contender"], f"{r['peak_bytes'] / 2**20:.1f}", bpp(r["peak_bytes"]),
                     bpp(r.get("peak_minus_fb_working_bytes")), bpp(r["resident_bytes"]),
                     f"{sb['total'] / n:.2f} ({parts})", str(r["peak_phase"]),
                     "-" if r["rss_peak_bytes"] is None else f"{r['rss_peak_bytes'] / 2**20:.0f}",
                     diff(r, "native"), diff(r, "plain")])
    method = ("CUDA: torch.cuda.max_memory_allocated per contender (fresh process each)" if device.type == "cuda"
              else "CPU: peak bytes of live tensor storages (TorchDispatchMode tracker, storages counted once by "
                   "data_ptr, freed via weakref finalizers), own process per contender; RSS = VmHWM of that "
                   "process over the measured window (mmap threshold 64 KiB), interpreter + libtorch included")
    print(f"\nOne window, k={args.k}, AdamW, clip {MAX_GRAD_NORM}; GPT d={args.d_model} L={args.layers} "
          f"vocab={args.vocab}, {args.batch}x{args.seq} tokens/micro-batch; {n:,} params\n{method}\n")
    print(fmt_table(header, rows))
    problems = [f"{r['dtype']} {r['contender']}: .grad not None after backward at (window, micro-batch) "
                f"{r['grad_not_none_after_backward'][:3]}" for r in ok if r["grad_not_none_after_backward"]]
    problems += [f"{r['dtype']} {r['contender']}: {r['error'].strip().splitlines()[-1]}" for r in results if "error" in r]
    for p in problems:
        print("PROBLEM:", p)
    record = {
        "benchmark": "bench_memory", "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]), "device": device_info(device, args.threads),
        "versions": versions(), "method": method,
        "config": {k: getattr(args, k.replace("-", "_")) for k in ("vocab", "ctx", "d_model", "layers", "heads",
                                                                  "batch", "seq", "k", "backend", "threads", "seed")}
        | {"lr": LR, "weight_decay": WEIGHT_DECAY, "max_grad_norm": MAX_GRAD_NORM, "dtypes": dtypes,
           "contenders": contenders, "n_params": n},
        "results": results, "problems": problems, "elapsed_s": time.time() - t0,
    }
    path = Path(args.json) if args.json else (
        HERE / "results" / f"memory_{device.type}_{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {path}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
