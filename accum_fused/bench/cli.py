"""The window benchmarks' command lines: ``benchmarks/bench_window.py`` (one case in detail,
``window_main``) and ``python -m accum_fused bench`` (a sweep, ``run_bench``), their tables,
JSON records and the sweep's plot.

Owns: argument parsing and defaults, the plan of cases, printing, where results go, the record's
layout (``RECORD_KEYS``, ``MEASUREMENT_KEYS``), the plot. Must not: time anything itself
(``measure.py``) or model bytes (``model.py``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import itertools
import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import backends as af_backends
from ..version import __version__
from .measure import (LR, PACKAGE_DIR, WEIGHT_DECAY, AccumFused, BandwidthProbe, Native, Timer, available_memory,
                      bandwidth_probes, loadavg, make_tensors, native_adamw_impl, pick_backends, resolve_device,
                      summarise, time_contenders, versions)
from .model import DTYPES, SHAPE_SETS, memory_needed, parse_size, shape_set, size_label

SCHEMA_VERSION = 1

# Keys of every entry of the sweep's JSON "measurements" (tests/test_cli.py checks them).
MEASUREMENT_KEYS = ("contender", "implementation", "shapes", "size", "numel", "tensors", "dtype", "k",
                    "max_grad_norm", "grad_sets", "bytes_per_param", "modelled_bytes", "times_ms",
                    "median_ms", "min_ms", "q1_ms", "q3_ms", "ratios_vs_native", "median_ratio_vs_native",
                    "gbps", "pct_copy_bandwidth", "pct_add_bandwidth", "copy_gbps_at_size", "add_gbps_at_size")

RECORD_KEYS = ("benchmark", "schema_version", "date", "command", "device", "versions", "config",
               "copy_bandwidth", "add_bandwidth", "skipped_backends", "skipped_cases", "measurements", "plot")


def split_names(items: list[str] | None) -> list[str] | None:
    """['a,b', 'c'] -> ['a', 'b', 'c'] (order kept, duplicates dropped); None stays None."""
    if items is None:
        return None
    return list(dict.fromkeys(x for item in items for x in str(item).split(",") if x))

def format_table(header: list[str], rows: list[list[str]], left: int) -> str:
    """Columns padded to width; the first ``left`` columns left-aligned, the rest right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = []
    for row in [header, ["-" * w for w in widths]] + rows:
        lines.append("  ".join(cell.ljust(w) if i < left else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)

# ------------------------------------------------------------------- bench_window (one case)
def window_parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Time ONE accumulation window: accum_fused.AdamW against the "
                                             "native torch loop (byte model: python -m pydoc accum_fused.bench).")
    ap.add_argument("--shapes", choices=list(SHAPE_SETS), default="cpu33m")
    ap.add_argument("--numel", type=parse_size, default=1 << 26,
                    help="total parameters for --shapes uniform (default 2^26; 64M and 2^26 work too)")
    ap.add_argument("--tensors", type=int, default=1, help="tensors for --shapes uniform (default 1)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="parameter and gradient dtype")
    ap.add_argument("--k", type=int, default=8, help="micro-batches per window (accumulation_steps)")
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--no-clip", action="store_true", help="no clipping (max_grad_norm=None)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="accum_fused backends (space or comma separated); default: the available ones "
                         "that support the device and dtype")
    ap.add_argument("--repeats", type=int, default=None, help="timed windows per contender (default 20 CPU, 50 CUDA)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed windows per contender first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 2 on CPU; untouched on CUDA)")
    ap.add_argument("--grad-sets", type=int, default=None,
                    help="precomputed gradient sets (default k if memory allows, else 2 used alternately)")
    ap.add_argument("--copy-numel", type=parse_size, default=1 << 26,
                    help="fp32 elements for the bandwidth probes (copy_, add_)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None,
                    help="results file (default benchmarks/results/window_<device>_<date>.json)")
    args = ap.parse_args(argv)
    args.backends = split_names(args.backends)
    if args.k < 1:
        ap.error("--k must be >= 1")
    if args.repeats is None:
        args.repeats = 50 if args.device == "cuda" else 20
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    return args

def plan_grad_sets(requested: int | None, k: int, numel: int, esize: int, n_af: int, device: torch.device) -> int:
    """k gradient sets when they fit in 70% of free memory, else 2 used alternately."""
    if requested is not None:
        return max(1, min(requested, k))
    if memory_needed(numel, esize, n_af, k) <= 0.7 * available_memory(device):
        return k
    return min(k, 2)

def window_main(argv=None, results_dir: Path | None = None) -> int:
    """benchmarks/bench_window.py: one configuration, every round's time in the JSON."""
    args = window_parse_args(argv)
    device, device_name = resolve_device(args.device)
    dtype = DTYPES[args.dtype]
    max_grad_norm = None if args.no_clip else args.max_grad_norm
    if args.threads is not None or device.type == "cpu":
        torch.set_num_threads(args.threads or 2)
    threads = torch.get_num_threads()

    shapes = shape_set(args.shapes, args.numel, args.tensors)
    numel = sum(math.prod(s) for s in shapes)
    backend_names, skipped = pick_backends(args.backends, device, dtype)
    grad_sets = plan_grad_sets(args.grad_sets, args.k, numel, dtype.itemsize, len(backend_names), device)
    impl = native_adamw_impl(device, dtype)
    timer = Timer(device)

    print(f"device {device_name} ({device.type}), torch {torch.__version__}, threads {threads}, "
          f"accum_fused {__version__} [{', '.join(backend_names) or 'no backend'}]"
          + (f"; skipped {skipped}" if skipped else ""), flush=True)
    copy, add = _window_bandwidth(device, args.copy_numel, timer)

    init, grads = make_tensors(shapes, device, dtype, grad_sets, args.seed)
    contenders = [Native(init, grads, args.k, max_grad_norm, impl)]
    contenders += [AccumFused(b, init, grads, args.k, max_grad_norm) for b in backend_names]
    del init
    print(f"{args.shapes}: {numel:,} {args.dtype} params in {len(shapes)} tensors, k={args.k}, "
          f"clip={'off' if max_grad_norm is None else max_grad_norm}, {grad_sets} gradient set(s), "
          f"native {contenders[0].label}; {args.warmup} warm-up + {args.repeats} timed rounds", flush=True)

    load_before = loadavg()
    peaks: dict[str, int] = {}
    times = time_contenders(contenders, timer, args.warmup, args.repeats, peaks)
    results = summarise(contenders, times, k=args.k, clip=max_grad_norm is not None, esize=dtype.itemsize,
                        numel=numel, copy=copy, add=add, peaks=peaks)
    _print_window_table(args, numel, max_grad_norm, results, contenders[0].label, copy, add)

    now = _dt.datetime.now().astimezone()
    out = args.json or (results_dir or default_output_dir()) / f"window_{device.type}_{now:%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"shapes": args.shapes, "numel": numel, "tensors": len(shapes), "dtype": args.dtype, "k": args.k,
              "max_grad_norm": max_grad_norm, "repeats": args.repeats, "warmup": args.warmup,
              "grad_sets": grad_sets, "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": args.seed,
              "native_adamw": impl, "backends": backend_names, "skipped_backends": skipped}
    record = {
        "benchmark": "window",
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": _device_record(device, device_name, threads, load_before),
        "versions": versions(),
        "config": config,
        "copy_bandwidth": copy,
        "add_bandwidth": add,
        "results": results,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


def _window_bandwidth(device: torch.device, numel: int, timer: Timer) -> tuple[dict, dict]:
    """The copy_ and add_ probes on ``numel`` fp32 elements, printed with their best times."""
    bandwidth = bandwidth_probes(device, numel, timer)
    copy, add = bandwidth["copy"], bandwidth["add_"]
    print(f"bandwidth on {numel:,} fp32 (median of {len(copy['times_ms'])}): copy_ {copy['gbps']:.1f} GB/s "
          f"(best {copy['best_gbps']:.1f}), in-place add_ {add['gbps']:.1f} GB/s (best {add['best_gbps']:.1f})",
          flush=True)
    return copy, add


def _print_window_table(args, numel: int, max_grad_norm, results: list[dict], native_label: str, copy: dict,
                        add: dict) -> None:
    header = ["contender", "dtype", "shapes", "numel", "k", "clip", "B/param", "ms/window", "IQR ms",
              "ratio", "GB/s", "% copy", "% add_"]
    rows = [[r["contender"], args.dtype, args.shapes, f"{numel:,}", str(args.k),
             "off" if max_grad_norm is None else f"{max_grad_norm:g}", str(r["bytes_per_param"]["total"]),
             f"{r['median_ms']:.2f}", f"{r['q1_ms']:.3g}-{r['q3_ms']:.3g}",
             f"{r['median_ratio_vs_native']:.3f}", f"{r['gbps']:.1f}", f"{r['pct_copy_bandwidth']:.0f}%",
             f"{r['pct_add_bandwidth']:.0f}%"]
            for r in results]
    print()
    print(format_table(header, rows, left=3))
    print(f"\nratio = median over rounds of (contender / native) window time; native = {native_label}; "
          f"GB/s = modelled bytes / median time; copy_ = {copy['gbps']:.1f} GB/s, add_ = {add['gbps']:.1f} GB/s")


def _device_record(device: torch.device, device_name: str, threads: int, load_before) -> dict:
    return {"type": device.type, "name": device_name, "threads": threads, "cpu_count": os.cpu_count(),
            # 1/5/15-min load averages around the timing: other work on the machine shows here
            "loadavg_before": load_before, "loadavg_after": loadavg()}


# ------------------------------------------------------------------------- bench (a sweep)
# Sweep defaults per device. CPU: small enough for ~2-3 minutes on 2 cores; clipping off only
# at the largest k (where the last micro-batch folds into the update). CUDA: the grid.
DEFAULTS = {
    "cpu": dict(shapes=["uniform", "cpu33m"], sizes=["1M", "4M", "16M"], dtypes=["fp32", "bf16"], k=[1, 4, 8],
                clip="auto", repeats=10, warmup=2, copy_numel="64M"),
    "cuda": dict(shapes=["uniform", "gpt2"], sizes=["1M", "4M", "16M", "64M", "256M"], dtypes=["fp32", "bf16"],
                 k=[1, 4, 8], clip="both", repeats=30, warmup=5, copy_numel="256M"),
    "quick": dict(shapes=["uniform"], sizes=["100k"], dtypes=["fp32"], k=[4], clip="both", repeats=2, warmup=1,
                  copy_numel="1M"),
}

def default_output_dir() -> Path:
    """benchmarks/results of the checkout this package lives in, when run from inside it; else a
    new temporary directory (never the user's current directory: --output-dir names one). The
    caller prints where the files went."""
    repo = PACKAGE_DIR.parent
    cwd = Path.cwd().resolve()
    if (repo / "benchmarks").is_dir() and (repo / "setup.py").is_file() and (cwd == repo or repo in cwd.parents):
        return repo / "benchmarks" / "results"
    return Path(tempfile.mkdtemp(prefix="accum_fused_bench_"))

def add_bench_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    ap.add_argument("--backends", nargs="+", default=None,
                    help="accum_fused backends, space or comma separated (default: the available ones that run "
                         "natively on the device; Triton on CPU only when named, it is the interpreter)")
    ap.add_argument("--dtypes", nargs="+", default=None, help="fp32 and/or bf16 (default both)")
    ap.add_argument("--k", nargs="+", type=int, default=None, help="accumulation steps per window (default 1 4 8)")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="shape sets: uniform (one tensor of each --sizes), cpu33m (33.6M params, 60 tensors), "
                         "gpt2 (GPT-2 124M's 148 tensors) (default: uniform cpu33m on CPU, uniform gpt2 on CUDA)")
    ap.add_argument("--sizes", nargs="+", default=None,
                    help="elements for --shapes uniform, e.g. 1M 4M 100k 2^24 (M = 2^20; default 1M 4M 16M on "
                         "CPU, 1M..256M on CUDA where memory allows)")
    ap.add_argument("--clip", choices=["on", "off", "both", "auto"], default=None,
                    help="max_grad_norm=1.0 (on), none (off), both; auto = on everywhere and off too at the "
                         "largest k (default: auto on CPU, both on CUDA)")
    ap.add_argument("--repeats", type=int, default=None, help="timed windows per contender and case "
                                                              "(default 10 CPU, 30 CUDA)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed windows per contender and case first")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny configuration for tests and a first look: 100k fp32 elements, k=4, clip on "
                         "and off, 2 repeats (seconds); other options still override it")
    ap.add_argument("--output-dir", type=Path, default=None,
                    help="where bench_<device>_<date>.json and .png go (default: benchmarks/results when run "
                         "from the source checkout, else a new temporary directory; the paths are printed)")
    ap.add_argument("--copy-size", default=None,
                    help="fp32 elements of the copy_/add_ bandwidth probes (default 64M on CPU, 256M on CUDA, "
                         "1M with --quick)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")

def _bench_config(args) -> dict:
    device_type = torch.device(args.device).type
    defaults = DEFAULTS["quick" if args.quick else device_type]
    shapes = split_names(args.shapes) or list(defaults["shapes"])
    for name in shapes:
        if name not in SHAPE_SETS:
            raise SystemExit(f"unknown shape set {name!r}: choose from {', '.join(SHAPE_SETS)}")
    dtypes = split_names(args.dtypes) or list(defaults["dtypes"])
    for name in dtypes:
        if name not in DTYPES:
            raise SystemExit(f"unknown dtype {name!r}: choose from {', '.join(DTYPES)}")
    sizes = [parse_size(s) for s in (split_names(args.sizes) or defaults["sizes"])]
    ks = list(dict.fromkeys(args.k or defaults["k"]))
    if min(ks) < 1:
        raise SystemExit("--k values must be >= 1")
    repeats = args.repeats if args.repeats is not None else defaults["repeats"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    if repeats < 1 or warmup < 0:
        raise SystemExit("--repeats must be >= 1 and --warmup >= 0")
    return dict(shapes=shapes, dtypes=dtypes, sizes=sizes, k=ks, clip=args.clip or defaults["clip"],
                repeats=repeats, warmup=warmup,
                copy_numel=parse_size(getattr(args, "copy_size", None) or defaults["copy_numel"]))

def _clip_settings(clip: str, k: int, ks: list[int]) -> list[float | None]:
    if clip == "on":
        return [1.0]
    if clip == "off":
        return [None]
    if clip == "both" or k == max(ks):
        return [1.0, None]
    return [1.0]

def run_bench(args, argv: list[str] | None = None) -> int:
    """The sweep behind ``python -m accum_fused bench``: table on stdout, JSON + PNG written.
    ``argv``: the command line after ``python -m accum_fused`` (for the record; default sys.argv)."""
    from tqdm.auto import tqdm

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device, device_name = resolve_device(args.device)
    config = _bench_config(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    timer = Timer(device)
    plan = _plan_cases(config)
    backend_names, skipped = _sweep_backends(config, split_names(args.backends), device)
    names_all = sorted({b for bs in backend_names.values() for b in bs}, key=af_backends.BACKEND_NAMES.index)
    print(f"accum_fused bench on {device_name} ({device.type}), torch {torch.__version__}, threads {threads}, "
          f"accum_fused {__version__}; backends: {', '.join(names_all) or 'none'}"
          + (f"; not timed: {', '.join(sorted(skipped))}" if skipped else ""), flush=True)
    bandwidth = bandwidth_probes(device, config["copy_numel"], timer)
    copy, add = bandwidth["copy"], bandwidth["add_"]
    print(f"measured bandwidth on {config['copy_numel']:,} fp32: copy_ {copy['gbps']:.1f} GB/s, "
          f"in-place add_ {add['gbps']:.1f} GB/s; {len(plan)} cases, {config['warmup']} warm-up + "
          f"{config['repeats']} timed windows each, contenders interleaved", flush=True)

    load_before = loadavg()
    started = time.perf_counter()
    bar = tqdm(total=len(plan), desc="bench", unit="case", disable=args.no_progress, mininterval=1.0)
    measurements, skipped_cases, impls = _time_cases(plan, config, backend_names, device, timer, copy, add,
                                                     seed=args.seed, bar=bar)
    elapsed = time.perf_counter() - started
    _print_sweep_table(measurements, skipped_cases, impls, config, copy, add, elapsed)

    now = _dt.datetime.now().astimezone()
    out_dir = args.output_dir or default_output_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"bench_{device.type}_{now:%Y%m%d-%H%M%S}"
    json_path, png_path = stem.with_suffix(".json"), stem.with_suffix(".png")
    argv = sys.argv[1:] if argv is None else argv
    record = {
        "benchmark": "bench",
        "schema_version": SCHEMA_VERSION,
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "accum_fused", *argv]),
        "device": _device_record(device, device_name, threads, load_before),
        "versions": versions(),
        "config": {**{key: config[key] for key in ("shapes", "sizes", "dtypes", "k", "clip", "repeats", "warmup")},
                   "max_grad_norm_when_clipping": 1.0, "lr": LR, "weight_decay": WEIGHT_DECAY, "seed": args.seed,
                   "quick": bool(args.quick), "backends": backend_names, "native_adamw": impls,
                   "timing_seconds": elapsed},
        "copy_bandwidth": copy,
        "add_bandwidth": add,
        "skipped_backends": skipped,
        "skipped_cases": skipped_cases,
        "measurements": measurements,
        "plot": png_path.name,
    }
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    plot_bench(record, png_path)
    print(f"wrote {json_path}\nwrote {png_path}")
    return 0


def _plan_cases(config: dict) -> list:
    """[((label, shape set, shapes), dtype name, k, max_grad_norm)]: every shape group (one per
    --sizes for "uniform"), smallest first, at every dtype, k and clip setting."""
    groups = []
    for name in config["shapes"]:
        if name == "uniform":
            groups += [(size_label(n), "uniform", shape_set("uniform", n, 1)) for n in config["sizes"]]
        else:
            groups.append((name, name, shape_set(name)))
    groups.sort(key=lambda g: sum(math.prod(s) for s in g[2]))
    plan = []
    for group, dtype_name in itertools.product(groups, config["dtypes"]):
        for k in config["k"]:
            plan += [(group, dtype_name, k, clip) for clip in _clip_settings(config["clip"], k, config["k"])]
    return plan


def _sweep_backends(config: dict, requested: list[str] | None, device: torch.device) -> tuple[dict, dict]:
    """({dtype name: backends timed at it}, {backend: why it is not timed})."""
    backend_names, skipped = {}, {}
    for dtype_name in config["dtypes"]:
        backend_names[dtype_name], why = pick_backends(requested, device, DTYPES[dtype_name])
        for name, reason in why.items():
            skipped.setdefault(name, reason)
    return backend_names, skipped


def _time_cases(plan, config: dict, backend_names: dict, device: torch.device, timer: Timer, copy: dict, add: dict,
                *, seed: int, bar) -> tuple[list[dict], list[dict], dict]:
    """Time every case of ``plan``: (measurements, cases that did not fit in memory, native
    AdamW implementation per dtype). Tensors are made once per (shape group, dtype); ``bar``
    (tqdm) advances once per case."""
    measurements, skipped_cases, impls = [], [], {}
    cache_key, init, grads = None, None, None
    for (label, shapes_name, shapes), dtype_name, k, max_grad_norm in plan:
        dtype = DTYPES[dtype_name]
        numel = sum(math.prod(s) for s in shapes)
        names = backend_names[dtype_name]
        if (label, dtype_name) != cache_key:
            init = grads = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            max_k = max(config["k"])
            free = 0.7 * available_memory(device)
            sets = max_k if memory_needed(numel, dtype.itemsize, len(names), max_k) <= free else min(max_k, 2)
            if memory_needed(numel, dtype.itemsize, len(names), sets) > free:
                cache_key = None
                skipped_cases.append({"shapes": shapes_name, "size": label, "numel": numel, "dtype": dtype_name,
                                      "k": k, "max_grad_norm": max_grad_norm, "reason": "does not fit in memory"})
                bar.update()
                continue
            init, grads = make_tensors(shapes, device, dtype, sets, seed)
            cache_key = (label, dtype_name)
        impl = impls.setdefault(dtype_name, native_adamw_impl(device, dtype))
        contenders = [Native(init, grads, k, max_grad_norm, impl)]
        contenders += [AccumFused(b, init, grads, k, max_grad_norm) for b in names]
        # The references of "% copy" / "% add_": at the case's own size (a 1M-parameter window
        # runs largely in cache: add_ 105 GB/s there, 35-39 at 33.6M-64M on the 2-core VM) and
        # in the same rounds as the contenders (see BandwidthProbe).
        probes = [BandwidthProbe(kind, numel, device) for kind in ("copy", "add_")]
        peaks: dict[str, int] = {}
        times = time_contenders(contenders + probes, timer, config["warmup"], config["repeats"], peaks)
        copy, add = (probe.gbps(times.pop(probe.name)) for probe in probes)
        del probes
        case = {"shapes": shapes_name, "size": label, "numel": numel, "tensors": len(shapes), "dtype": dtype_name,
                "k": k, "max_grad_norm": max_grad_norm, "grad_sets": min(len(grads), k)}
        for r in summarise(contenders, times, k=k, clip=max_grad_norm is not None, esize=dtype.itemsize,
                           numel=numel, copy=copy, add=add, peaks=peaks):
            measurements.append({**case, **r, "copy_gbps_at_size": copy["gbps"], "add_gbps_at_size": add["gbps"]})
        del contenders
        bar.update()
    bar.close()
    return measurements, skipped_cases, impls


def _print_sweep_table(measurements, skipped_cases, impls: dict, config: dict, copy: dict, add: dict,
                       elapsed: float) -> None:
    header = ["backend", "dtype", "size", "params", "k", "clip", "ms/window", "GB/s", "% copy", "% add_",
              "vs native"]
    rows = [[m["contender"], m["dtype"], m["size"], f"{m['numel'] / 1e6:.2f}M", str(m["k"]),
             "off" if m["max_grad_norm"] is None else f"{m['max_grad_norm']:g}", f"{m['median_ms']:.3f}",
             f"{m['gbps']:.1f}", f"{m['pct_copy_bandwidth']:.0f}%", f"{m['pct_add_bandwidth']:.0f}%",
             f"{m['median_ratio_vs_native']:.3f}"]
            for m in measurements]
    print()
    print(format_table(header, rows, left=3))
    impl_text = ", ".join(f"{d}: torch.optim.AdamW({i}=True)" for d, i in impls.items())
    print(f"\nms/window: median of {config['repeats']} windows (k micro-batches + one AdamW update; no backward). "
          f"native = p.grad += g, clip_grad_norm_ (when clipping), {impl_text or 'torch.optim.AdamW'}. "
          f"GB/s = modelled bytes / median time (bytes per parameter: python -m pydoc accum_fused.bench). "
          f"% copy / % add_ = of copy_ / in-place add_ on the case's own number of fp32 elements, timed in the "
          f"case's rounds (before the sweep on {config['copy_numel']:,}: {copy['gbps']:.1f} / {add['gbps']:.1f} GB/s). "
          f"vs native = median over rounds of window time / the native loop's (< 1 is faster). "
          f"{elapsed:.0f} s of timing.")
    for case in skipped_cases:
        print(f"skipped {case['shapes']} {case['size']} {case['dtype']} k={case['k']}: {case['reason']}")


def plot_bench(record: dict, path: Path) -> None:
    """GB/s (top) and time relative to the native loop (bottom) against parameter count, one
    column per dtype; colour = contender, line style = k; clip on where measured, else off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = record["measurements"]
    dtypes = list(dict.fromkeys(m["dtype"] for m in ms)) or ["fp32"]
    clipped = any(m["max_grad_norm"] is not None for m in ms)
    ms = [m for m in ms if (m["max_grad_norm"] is not None) == clipped]
    contenders = list(dict.fromkeys(m["contender"] for m in ms))
    ks = sorted({m["k"] for m in ms})
    colours = dict(zip(contenders, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    styles = dict(zip(ks, ["-", "--", ":", "-."] * 4))
    markers = {"uniform": "o", "cpu33m": "s", "gpt2": "^"}
    fig, axes = plt.subplots(2, len(dtypes), figsize=(5.5 * len(dtypes), 7), dpi=110, squeeze=False, sharex=True)
    for col, dtype in enumerate(dtypes):
        ax_bw, ax_ratio = axes[0][col], axes[1][col]
        for contender, k in itertools.product(contenders, ks):
            points = sorted((m for m in ms if m["dtype"] == dtype and m["contender"] == contender and m["k"] == k),
                            key=lambda m: m["numel"])
            if not points:
                continue
            uniform = [m for m in points if m["shapes"] == "uniform"]
            kw = dict(color=colours[contender], linestyle=styles[k])
            for ax, key in ((ax_bw, "gbps"), (ax_ratio, "median_ratio_vs_native")):
                if ax is ax_ratio and contender == "native":
                    continue  # 1 by definition: the grey line
                ax.plot([m["numel"] for m in uniform], [m[key] for m in uniform], marker="o", markersize=4,
                        label=f"{contender}, k={k}", **kw)
                for m in points:
                    if m["shapes"] != "uniform":
                        ax.plot([m["numel"]], [m[key]], marker=markers.get(m["shapes"], "D"), color=kw["color"])
        ax_bw.axhline(record["copy_bandwidth"]["gbps"], color="grey", linewidth=1, linestyle="-.",
                      label="copy_ bandwidth")
        ax_ratio.axhline(1.0, color="grey", linewidth=1)
        ax_bw.set_title(f"{dtype}, clip {'on' if clipped else 'off'}")
        ax_bw.set_ylabel("GB/s (modelled bytes / time)")
        ax_ratio.set_ylabel("window time / native loop (< 1 faster)")
        ax_ratio.set_xlabel("parameters")
        ax_ratio.set_yscale("log")
        for ax in (ax_bw, ax_ratio):
            ax.set_xscale("log")
            ax.grid(alpha=0.3)
    # (below the plots, not over the data: the contenders and k, then what each marker's shapes are)
    handles, labels = axes[0][0].get_legend_handles_labels()
    shapes = {"uniform": "equal tensors", "cpu33m": "33.6M in 60 tensors", "gpt2": "GPT-2 small's shapes"}
    present = list(dict.fromkeys(m["shapes"] for m in ms))
    handles += [plt.Line2D([], [], marker=markers.get(name, "D"), color="black", linestyle="none") for name in present]
    labels += [shapes.get(name, name) for name in present]
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    device = record["device"]
    fig.suptitle(f"accum_fused window benchmark: {device['name']} ({device['type']}, {device['threads']} threads)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(labels) - 1) // 6), 1, 1))
    fig.savefig(path)
    plt.close(fig)

def bench_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m accum_fused bench")
    add_bench_arguments(ap)
    argv = sys.argv[1:] if argv is None else list(argv)
    return run_bench(ap.parse_args(argv), ["bench", *argv])
