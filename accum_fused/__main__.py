"""python -m accum_fused {demo,bench,info}: see what accum_fused does, how fast, and what this machine runs."""
from __future__ import annotations

import argparse
import platform
import sys

import torch

from . import backends
from .version import __version__

# What "info" asks every backend about (complex parameters run as their real views).
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


DEMO_PNG = "accum_fused_demo.png"


def cmd_demo(args) -> int:
    import os

    from .demo import format_table, missing_extra, plot, run_demo

    def fail(message: str) -> int:
        print(f"python -m accum_fused demo: error: {message}", file=sys.stderr)
        return 2

    # Everything that could stop the demo is checked here, before minutes of training.
    no_plot = None if args.no_plot else missing_extra("matplotlib")
    output = args.output if args.output is not None else DEMO_PNG
    if no_plot is not None:
        if args.output is not None:
            return fail(f"--output {args.output} needs a plot, and {no_plot}; or use --no-plot")
        print(f"note: {no_plot}. The demo runs and prints its table without it.", file=sys.stderr)
    elif not args.no_plot:
        folder = os.path.dirname(os.path.abspath(output))
        if not os.path.isdir(folder):
            return fail(f"--output {output}: no directory {folder}")
        if not os.access(folder, os.W_OK):
            return fail(f"--output {output}: directory {folder} is not writable")
    progress = not args.no_progress
    if progress:
        no_bar = missing_extra("tqdm")
        if no_bar is not None:
            print(f"note: {no_bar}. The demo runs without it.", file=sys.stderr)
            progress = False

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    results = run_demo(device=device, backend=args.backend, epochs=args.epochs, lr=args.lr, progress=progress)
    print(f"accum_fused demo on {device}: {args.epochs} epochs, micro-batches of uneven sizes, "
          f"k=4, a partial last window every epoch")
    print(format_table(results, device, args.epochs))
    if no_plot is not None:
        print(f"loss curves: not plotted ({no_plot.split(':')[0]}: `pip install matplotlib`)")
    elif not args.no_plot:
        plot(results, output)
        print(f"loss curves: {os.path.abspath(output)}")
    return 0


def cmd_bench(args) -> int:
    from .bench import run_bench

    return run_bench(args, args.argv)


# The extension's fast paths that reach into torch internals, and what each does when it is in
# (csrc/torch_compat.h decides which are, by the torch the extension was compiled against).
FAST_PATHS = {
    "adopt_preserved_gradients": (
        "a window's first fp32 gradients adopted as its buffers even after Python read them (p.grad)",
        "needs torch >= 2.10 headers; such gradients are copied (4 B/param more between micro-batches)"),
}


def _fast_path_lines(cpp) -> list[str]:
    lines = [f"extension compiled against torch {cpp.torch_headers}; C++ in-backward hooks and plain mode's step "
             "table: in"]
    for name, (what, without) in FAST_PATHS.items():
        state = "in" if cpp.fast_paths.get(name) else f"out ({without})"
        lines.append(f"fast path {name}: {state}: {what}")
    return lines


# Written by setup.py beside the extension when a CUDA torch's build went without the CUDA kernels:
# why (an nvcc of another major CUDA version, nvcc failing, ACCUM_FUSED_NO_CUDA=1, ...) and the fix.
CUDA_SKIPPED_RECORD = "_C_without_cuda.txt"


def cuda_skipped_reason(folder: str | None = None) -> str | None:
    """Why the installed extension has no CUDA kernels, as its build recorded it; None if it did not."""
    import os

    path = os.path.join(folder or os.path.dirname(os.path.abspath(__file__)), CUDA_SKIPPED_RECORD)
    try:
        with open(path) as f:
            return " ".join(f.read().split()) or None
    except OSError:
        return None


def info_lines() -> list[str]:
    lines = [f"accum_fused {__version__}", f"python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        import triton

        lines.append(f"triton {triton.__version__}")
    except ImportError as exc:
        lines.append(f"triton: not installed ({exc})")
    lines.append(f"torch CUDA: {torch.version.cuda or 'none (CPU build)'}")
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda", torch.cuda.current_device()))
        lines.append(f"GPU: {torch.cuda.get_device_name()}")
    else:
        lines.append("GPU: none visible to torch")
    available = backends.available_backends()
    reasons = backends.unavailable_reasons()
    for name in backends.BACKEND_NAMES:
        if name not in available:
            lines.append(f"backend {name}: unavailable: {reasons.get(name, 'unknown reason')}")
            continue
        module = backends._load(name)
        runs = []
        for device in devices:
            dtypes = [str(dtype).removeprefix("torch.") for dtype in _PARAM_DTYPES if module.supports(device, dtype)]
            if dtypes:
                runs.append(f"{'/'.join(dtypes)} parameters on {device.type}")
        extra = ""
        if name == "cpp":
            extra = f"; extension built with CUDA: {module.with_cuda}"
            skipped = None if module.with_cuda else cuda_skipped_reason()
            if skipped:
                extra += f" ({skipped})"
        lines.append(f"backend {name}: available; runs {', '.join(runs) or 'nothing on the devices here'}{extra}")
        if name == "cpp":
            lines.extend(_fast_path_lines(module))
    for device in devices:
        picked = backends.resolve(backends.AUTO, device, torch.float32)
        line = f"auto on {device.type}: {picked.name}"
        if device.type != "cpu" and "cpp" in available:
            # (in_backward.by_torch_ops: the one place a GPU's per-gradient work is decided)
            line += ("; in_backward gradients: the extension's C++ hooks, one torch add each (as AccumulateGrad), "
                     f"the update at the window's close on {picked.name}")
        lines.append(line)
    return lines


def cmd_info(args) -> int:
    print("\n".join(info_lines()))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m accum_fused", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small model three ways and compare with the full batch",
                          description="Train one small model on a generated task three ways (full batch, the "
                                      "tutorial loop, accum_fused) and print a table and a loss plot.")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    demo.add_argument("--backend", default="auto", help="accum_fused backend: auto, torch, cpp, triton (default auto)")
    demo.add_argument("--epochs", type=int, default=60, help="passes over the data (default 60)")
    demo.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default 2e-3)")
    demo.add_argument("--output", default=None,
                      help=f"PNG of the loss curves (default {DEMO_PNG} in the current directory; needs matplotlib)")
    demo.add_argument("--no-plot", action="store_true", help="write no plot (matplotlib is then not needed)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar (tqdm is then not needed)")
    demo.set_defaults(func=cmd_demo)
    bench = sub.add_parser("bench", help="time accumulation windows against the native torch loop; table, JSON, PNG",
                           description="Time one accumulation window (k micro-batches + one AdamW update, no "
                                       "backward) for each accum_fused backend against the native torch loop "
                                       "(.grad += g, clip_grad_norm_, torch.optim.AdamW fused/foreach), over "
                                       "sizes, dtypes, k and clipping. Prints a table (ms per window, GB/s of "
                                       "modelled bytes, % of measured copy bandwidth, ratio to native) and "
                                       "writes bench_<device>_<date>.json and .png. Defaults are sized for the "
                                       "device: a few minutes on a 2-core CPU; --quick takes seconds.")
    from .bench import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    info = sub.add_parser("info", help="versions, devices, and which backends run here and why not")
    info.set_defaults(func=cmd_info)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
