#!/usr/bin/env python
"""Host cost per gradient of one backward pass in the middle of a window (issue 31): what the
in-backward hooks add to each gradient against what autograd's own accumulation costs.

One process, contenders interleaved pass by pass, each on its own copy of N fp32 tensors of D
elements; the backward is bench_backward.py's cheap one (an autograd Function whose backward
returns c_p * dloss), so a pass is autograd's per-gradient work plus what happens to the gradient:

  native   torch's loop in the middle of a window: .grad exists, autograd adds into it in place
  py_drop  a Python post-accumulate-grad hook that sets .grad = None (the cost of any Python hook)
  mode_a   accum_fused.AdamW(in_backward=True): its hook adds the gradient into the fp32 buffer
  mode_b   the same with accumulation_steps=K, a pass that neither opens nor closes the window

Reports min and median ms per pass over --repeats passes and, per contender, (median - native's
median) / N in us: the extra host time per gradient. Run it with PYTHONPATH=<other checkout> for
a before/after; compare only within one sitting.

    python benchmarks/bench_hook_cost.py --tensors 5000 --numel-per-tensor 64 --repeats 41

With ``--window K`` it times whole windows of K passes instead, pass by pass (each contender's
pass i of a window next to the others'): native (the last pass then step + zero_grad), plain
(accumulation_steps=K, step() after each pass's backward: the last pass's updates), mode_a
(step + zero_grad after the K passes) and mode_b (accumulation_steps=K: the last pass updates),
median ms per pass over --repeats windows, and the window's sum: where in a window a mode gains
or loses against the native loop (the first pass adopts gradients, the last folds the update).
py_drop's K passes are the floor: a window's optimizer side is its sum less py_drop's.

    python benchmarks/bench_hook_cost.py --tensors 5000 --numel-per-tensor 4096 --window 4 --repeats 15

``--clip 1.0`` clips every window (native: ``clip_grad_norm_`` inside its step, as a step
pre-hook; accum_fused: ``max_grad_norm``): where a clipped window's extra cost sits.

``--shapes-of gpt`` (or ``lora``) takes the tensors' shapes from bench_transformer.py's default
GPT (53 tensors, 21M parameters) or its LoRA GPT (288 rank-8 adapters) instead of N x D: that
model's optimizer side, pass by pass, without the forward and backward whose noise hides it in
the whole model (a pass of the 21M GPT varies by tens of ms; its optimizer side is tens of ms).

    python benchmarks/bench_hook_cost.py --shapes-of gpt --window 8 --clip 1.0 --repeats 15

``--linear-tokens T`` (with ``--shapes-of``) builds that model itself and gives each of its
nn.Linear layers a real forward and backward on a fixed T-token input (the loss is
``sum(linear(x) * c)``; the other tensors keep the cheap backward): each Linear weight's gradient
is then written by a GEMM, as in the whole model, and ``mode_b_fused`` (mode_b with
``accum_fused.nn.fuse_linear_gradients``: the GEMM adds into the window buffer, beta=1) joins
the contenders. A small T keeps the GEMMs' cost, and so their noise, small next to the bytes
the optimizer side moves; the bytes per Linear weight element each contender's pass moves
beyond the floor's are printed with the times.

    python benchmarks/bench_hook_cost.py --shapes-of gpt --linear-tokens 8 --window 8 --clip 1.0 --repeats 21

The contenders share one process, and so glibc's allocator: a contender that holds many fresh
gradients at once (plain mode, until its step) can find their memory handed back to the system
by another's frees and fault it in again (ru_minflt: ~12k faults per plain pass with four
contenders alternating pass by pass, ~4k, as native's, alternating window by window). ``--interleave window`` lessens that; ``MALLOC_TRIM_THRESHOLD_=4294967296
MALLOC_MMAP_THRESHOLD_=4294967296`` in the environment takes it away (no memory goes back, no
page faults after the first window: the times then are what each loop moves, not what the
allocator does to it). The JSON records the MALLOC_ variables.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

import accum_fused
from _cheap_loss import cheap_loss

# bench_transformer.py's arguments for the models whose shapes --shapes-of takes.
MODELS = {"gpt": [], "lora": ["--lora", "8", "--layers", "24", "--qkv", "separate", "--d-model", "256", "--heads", "4"]}
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--tensors", type=int, default=5000)
parser.add_argument("--numel-per-tensor", type=int, default=64)
parser.add_argument("--repeats", type=int, default=41)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--window", type=int, default=0, help="time whole windows of this many passes")
parser.add_argument("--clip", type=float, default=None,
                    help="max_grad_norm (native: clip_grad_norm_ in a step pre-hook, so inside its step)")
parser.add_argument("--shapes-of", choices=tuple(MODELS), default=None,
                    help="the trainable tensors of this bench_transformer.py model instead of N x D")
parser.add_argument("--linear-tokens", type=int, default=0, metavar="T",
                    help="with --shapes-of: the model's Linear layers run a real forward and backward on T tokens "
                         "(their weight gradients come from a GEMM), and mode_b_fused joins")
parser.add_argument("--interleave", choices=("pass", "window"), default="pass",
                    help="with --window: contenders alternate pass by pass, or window by window (each then "
                         "allocates and frees in a run of its own passes, as in a loop of its own)")
parser.add_argument("--frozen", type=int, default=0, metavar="N",
                    help="N more parameters (of the first tensor's shape) in every optimizer that never get a "
                         "gradient: requires_grad=False, as a frozen embedding or a LoRA base passed in with the rest")
parser.add_argument("--json", default=None)
args = parser.parse_args()
if args.linear_tokens < 0:
    parser.error(f"--linear-tokens must be a positive number of tokens, got {args.linear_tokens}")
if args.linear_tokens and not args.shapes_of:
    parser.error("--linear-tokens needs --shapes-of (the model whose Linear layers run)")
torch.set_num_threads(args.threads)
if args.shapes_of:
    import bench_transformer

    def build_model():
        return bench_transformer.build_model(bench_transformer.parse_args(MODELS[args.shapes_of]))
    SHAPES = [p.shape for p in build_model().parameters() if p.requires_grad]
else:
    SHAPES = [(args.numel_per_tensor,)] * args.tensors
N, D = len(SHAPES), args.numel_per_tensor
K = args.window or 1000  # (without --window, mode B's window never closes here)
FUSED = []
if args.linear_tokens:
    # (fuse_linear_gradients refuses a model with no nn.Linear whose weight trains: LoRA's frozen
    # base layers; its adapters are plain parameters)
    if any(type(m) is nn.Linear and m.weight.requires_grad for m in build_model().modules()):
        FUSED = ["mode_b_fused"]
    else:
        print(f"mode_b_fused left out: no nn.Linear of the {args.shapes_of} model has a trainable weight to fuse")


def linear_loss(model):
    """The model's trainable tensors and ``loss(*params)``: each trainable nn.Linear runs on its
    own fixed T-token input (its weight gradient: a GEMM), every other tensor takes the cheap
    backward."""
    torch.manual_seed(1)
    params = [p for p in model.parameters() if p.requires_grad]
    linears = [m for m in model.modules() if type(m) is nn.Linear and m.weight.requires_grad]
    inputs = [torch.randn(args.linear_tokens, m.in_features) for m in linears]
    coefs = [torch.empty(args.linear_tokens, m.out_features).uniform_(-1e-3, 1e-3) for m in linears]
    in_linears = {id(p) for m in linears for p in m.parameters()}
    others = [p for p in params if id(p) not in in_linears]
    cheap = cheap_loss([torch.empty(p.shape).uniform_(-1e-3, 1e-3) for p in others])

    def loss_of(*_):
        return sum(((m(x) * c).sum() for m, x, c in zip(linears, inputs, coefs)), cheap(*others))
    return params, loss_of


def contender(name):
    if args.linear_tokens:
        model = build_model()
        params, loss_of = linear_loss(model)
    else:
        params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
        loss_of = cheap_loss([torch.empty(shape).uniform_(-1e-3, 1e-3) for shape in SHAPES])

    # (in every optimizer, torch's too: its step skips a parameter whose .grad is None)
    frozen = [torch.nn.Parameter(torch.randn(SHAPES[0]), requires_grad=False) for _ in range(args.frozen)]
    opt = None
    if name == "py_drop":
        for p in params:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    elif name == "mode_a":
        opt = accum_fused.AdamW(params + frozen, lr=1e-3, in_backward=True, max_grad_norm=args.clip)
    elif name in ("mode_b", "mode_b_fused"):
        opt = accum_fused.AdamW(params + frozen, lr=1e-3, in_backward=True, accumulation_steps=K,
                                max_grad_norm=args.clip)
        if name == "mode_b_fused":
            from accum_fused.nn import fuse_linear_gradients
            fuse_linear_gradients(model, opt)
    elif name == "plain":
        opt = accum_fused.AdamW(params + frozen, lr=1e-3, accumulation_steps=K, max_grad_norm=args.clip)

    def one_pass():
        loss = loss_of(*params)
        if name in ("mode_b", "mode_b_fused"):
            opt.backward(loss)
        else:
            loss.backward()
        if name == "plain":
            opt.step()  # (the window's k-th updates)
    if name == "native":
        opt = torch.optim.AdamW(params + frozen, lr=1e-3, fused=True)
        if args.clip is not None:
            def clip(*_):
                torch.nn.utils.clip_grad_norm_(params, args.clip)
            opt.register_step_pre_hook(clip)
    for _ in range(3):  # the window's first passes (adopt, arm) and a steady one
        one_pass()
    return one_pass, opt


def middle_passes():
    names = ["native", "py_drop", "mode_a", "mode_b"] + FUSED
    passes = {name: contender(name)[0] for name in names}
    times = {name: [] for name in names}
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:  # (the first mover rotates)
            t = time.perf_counter()
            passes[name]()
            times[name].append((time.perf_counter() - t) * 1e3)
    native = statistics.median(times["native"])
    rows = []
    for name in names:
        med = statistics.median(times[name])
        rows.append(dict(contender=name, min_ms=min(times[name]), median_ms=med,
                         extra_us_per_gradient_vs_native=(med - native) * 1e3 / N, times_ms=times[name]))
        print(f"{name:8s} min {min(times[name]):7.2f} ms  median {med:7.2f} ms  "
              f"{(med - native) * 1e3 / N:+6.2f} us per gradient vs native")
    return rows


def windows():
    names = ["native", "plain", "mode_a", "mode_b"] + FUSED + ["py_drop"]
    no_step = ("plain", "mode_b", "mode_b_fused", "py_drop")  # (no step column: the last pass updates, or no update at all)
    contenders = {name: contender(name) for name in names}
    for name in ("native", "mode_a"):  # (let them end the window contender() began)
        contenders[name][1].step()
        contenders[name][1].zero_grad()
    untimed = 3 + (K - 3 % K) % K  # (theirs too: contender() ran 3 passes)
    for name in (n for n in names if n in no_step):
        for _ in range(untimed - 3):
            contenders[name][0]()
    times = {name: [[] for _ in range(K + 1)] for name in names}  # per pass; then step + zero_grad
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        # (pass by pass: contender x's pass i beside the others' pass i; window by window: x's
        # whole window, then the next contender's)
        steps = ([(i, name) for i in range(K + 1) for name in order] if args.interleave == "pass"
                 else [(i, name) for name in order for i in range(K + 1)])
        for i, name in steps:
            one_pass, opt = contenders[name]
            if i == K and name in no_step:
                continue
            t = time.perf_counter()
            if i < K:
                one_pass()
            else:  # (the window's step, native and mode A)
                opt.step()
                opt.zero_grad()
            times[name][i].append((time.perf_counter() - t) * 1e3)
    for name in ("plain", "mode_b", *FUSED):
        assert contenders[name][1].update_count == untimed // K + args.repeats, \
            f"{name}'s windows did not close where timed"
    # The window's optimizer side: its sum of per-pass medians less the floor's (py_drop: the
    # same backward with every gradient dropped, no update).
    window_ms = {name: sum(statistics.median(ts) if ts else 0.0 for ts in times[name]) for name in names}
    side = {name: window_ms[name] - window_ms["py_drop"] for name in names}
    rows = []
    print(" " * 12 + "".join(f"{'pass ' + str(i + 1):>9s}" for i in range(K)) +
          "     step   window  / native  optimizer side  / native's")
    for name in names:
        medians = [statistics.median(ts) if ts else 0.0 for ts in times[name]]
        rows.append(dict(contender=name, median_ms_per_pass=medians[:K], median_ms_step=medians[K],
                         window_ms=window_ms[name], ratio_vs_native=window_ms[name] / window_ms["native"],
                         optimizer_side_ms=side[name], optimizer_side_ratio_vs_native=side[name] / side["native"],
                         times_ms=times[name]))
        print(f"{name:12s}" + "".join(f"{m:9.1f}" for m in medians[:K]) +
              (f"{medians[K]:9.1f}" if name not in no_step else "        -") +
              f"{window_ms[name]:9.1f}{window_ms[name] / window_ms['native']:9.3f}" +
              ("" if name == "py_drop" else f"{side[name]:15.1f}{side[name] / side['native']:11.3f}"))
    if FUSED:
        print("bytes per Linear weight element a middle pass moves beyond the floor's (whose GEMM writes a fresh\n"
              "gradient, 4 B, then drops it): native 12 (.grad += g: two reads, a write), plain/mode_a/mode_b 12\n"
              "(buffer += g), mode_b_fused 4 (the GEMM reads the buffer it adds into, beta=1; no fresh gradient)")
    return rows


rows = windows() if args.window else middle_passes()
if args.json:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(accum_fused.__file__).parent).stdout.strip()
    Path(args.json).write_text(json.dumps(dict(
        benchmark="bench_hook_cost", date=time.strftime("%Y-%m-%dT%H:%M:%S"),
        config=dict(tensors=N, numel_per_tensor=None if args.shapes_of else D, shapes_of=args.shapes_of,
                    numel=sum(torch.Size(shape).numel() for shape in SHAPES), repeats=args.repeats, threads=args.threads,
                    window=args.window or None, clip=args.clip, linear_tokens=args.linear_tokens or None,
                    interleave=args.interleave if args.window else None,
                    malloc_env={k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}),
        versions=dict(accum_fused_path=str(Path(accum_fused.__file__).parent), git_commit=commit,
                      torch=torch.__version__, python=platform.python_version()),
        results=rows), indent=1))
