"""The demo: why accumulation belongs in the optimizer, in one table and one plot.

Trains one small model on a deterministic task generated here (no download) three ways. All
three see the same big batches, each split into micro-batches of uneven sizes (as a
length-bucketed loader gives), and the last window of every epoch is partial:

1. ``torch.optim.AdamW`` on each whole big batch: the target;
2. the tutorial loop: ``(loss / k).backward()``, ``step()`` every k-th micro-batch, and the
   last partial window divided by the full k as well;
3. ``accum_fused.AdamW(accumulation_steps=k)`` with ``step(weight=len(x))`` and ``flush()``.
"""
from __future__ import annotations

import copy
import importlib
import time
from dataclasses import dataclass, field

import torch

from .optim import AdamW

# One epoch: 23 micro-batches of uneven sizes; with k=4, five full windows and a partial one.
MICRO_BATCH_SIZES = (37, 5, 64, 12, 3, 50, 21, 9, 64, 2, 30, 17, 44, 8, 64, 1, 25, 40, 6, 58, 13, 33, 20)
ACCUMULATION_STEPS = 4
FEATURES = 32
HIDDEN = 128


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)  # full-data loss after each epoch
    seconds: float = 0.0
    peak_bytes: int = 0
    max_param_diff: float = float("nan")


def make_task(device: torch.device, seed: int = 0):
    """A deterministic regression task and model: y = a smooth function of x plus noise."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(MICRO_BATCH_SIZES)
    x = torch.randn(n, FEATURES, generator=generator)
    w = torch.randn(FEATURES, 4, generator=generator) / FEATURES**0.5
    y = torch.tanh(x @ w * 2).sum(dim=1, keepdim=True) + 0.05 * torch.randn(n, 1, generator=generator)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.GELU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, 1),
    )
    return model.to(device), x.to(device), y.to(device)


def windows(x: torch.Tensor, y: torch.Tensor) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The epoch as windows of ACCUMULATION_STEPS micro-batches (the last one partial)."""
    micro, start = [], 0
    for size in MICRO_BATCH_SIZES:
        micro.append((x[start:start + size], y[start:start + size]))
        start += size
    return [micro[i:i + ACCUMULATION_STEPS] for i in range(0, len(micro), ACCUMULATION_STEPS)]


def _loss(model, x, y) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def _epoch_full_batch(model, opt, data) -> None:
    for window in data:
        xb, yb = torch.cat([m[0] for m in window]), torch.cat([m[1] for m in window])
        opt.zero_grad()
        _loss(model, xb, yb).backward()
        opt.step()


def _epoch_tutorial_loop(model, opt, data) -> None:
    for window in data:
        for xb, yb in window:
            (_loss(model, xb, yb) / ACCUMULATION_STEPS).backward()
        opt.step()  # every k-th micro-batch, and after the short last window too, still / k
        opt.zero_grad()


def _epoch_accum_fused(model, opt, data) -> None:
    for window in data:
        for xb, yb in window:
            _loss(model, xb, yb).backward()
            opt.step(weight=len(xb))
            opt.zero_grad()
    opt.flush()  # the partial last window, averaged over what it holds


def _state_bytes(opt) -> int:
    """Bytes of gradients (counted whether or not .grad is set right now: backward makes
    them), optimizer state and accumulation buffers. The CPU stand-in for peak memory."""
    tensors = [p for g in opt.param_groups for p in g["params"]]
    tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    window = getattr(opt, "_window", None)  # accum_fused's accumulation buffers
    tensors += list(window.buffers.values()) if window is not None else []
    return sum(t.numel() * t.element_size() for t in tensors)


# The demo's optional dependencies (the ``[demo]`` extra): what each gives.
EXTRAS = {"tqdm": "progress bar", "matplotlib": "loss plot"}


def missing_extra(name: str) -> str | None:
    """None if the optional module ``name`` imports, else why not (one line, with the fix)."""
    try:
        importlib.import_module(name)
    except ImportError as exc:  # not installed, or installed but broken
        cause = "is not installed" if isinstance(exc, ModuleNotFoundError) else f"does not import ({exc})"
        return (f"{name} {cause}: no {EXTRAS.get(name, name)}. Install it with `pip install {name}` "
                f"(the demo's extras, `[demo]`: `pip install {' '.join(EXTRAS)}`)")
    return None


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def run_demo(*, device: str = "cpu", backend: str = "auto", epochs: int = 60, lr: float = 2e-3,
             progress: bool = True) -> list[RunResult]:
    """Train the three ways; return their results (loss curves, time, memory, distance).

    ``progress`` shows a tqdm bar; without tqdm installed there is none (the training is the same)."""
    tqdm = None
    if progress:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            tqdm = None
    device = torch.device(device)
    target, x, y = make_task(device)
    data = windows(x, y)
    runs = {
        "torch.optim.AdamW, full batch": (lambda m: torch.optim.AdamW(m.parameters(), lr=lr), _epoch_full_batch),
        "tutorial loop (loss / k)": (lambda m: torch.optim.AdamW(m.parameters(), lr=lr), _epoch_tutorial_loop),
        "accum_fused.AdamW": (
            lambda m: AdamW(m.parameters(), lr=lr, accumulation_steps=ACCUMULATION_STEPS, backend=backend),
            _epoch_accum_fused,
        ),
    }
    results, reference = [], None
    for name, (make_optimizer, epoch) in runs.items():
        # One bar per run: it counts the epochs that run does (the demo's --epochs each).
        bar = (tqdm(total=epochs, desc=name, unit="epoch", mininterval=1.0) if tqdm is not None else _NoBar())
        model = copy.deepcopy(target)
        opt = make_optimizer(model)
        result = RunResult(name)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        for _ in range(epochs):
            start = time.perf_counter()
            epoch(model, opt, data)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result.seconds += time.perf_counter() - start
            if device.type != "cuda":
                result.peak_bytes = max(result.peak_bytes, _state_bytes(opt))
            with torch.no_grad():
                result.losses.append(_loss(model, x, y).item())
            bar.update()
        bar.close()
        if device.type == "cuda":
            result.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        reference = flat if reference is None else reference
        result.max_param_diff = (flat - reference).abs().max().item()
        results.append(result)
    return results


def format_table(results: list[RunResult], device: str, epochs: int) -> str:
    memory = "peak MB" if device.startswith("cuda") else "grad+state MB"
    lines = [f"{'run':31} {'final loss':>11} {'max |Δparam| vs full batch':>27} {memory:>14} {'ms/epoch':>9}"]
    for r in results:
        lines.append(f"{r.name:31} {r.losses[-1]:11.4e} {r.max_param_diff:27.2e} "
                     f"{r.peak_bytes / 2**20:14.3f} {1000 * r.seconds / epochs:9.2f}")
    return "\n".join(lines)


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    # The target is drawn wide and pale so that accum_fused, which lies on it, stays visible.
    styles = [dict(linewidth=5, alpha=0.35), dict(linestyle="--", linewidth=2),
              dict(linestyle=":", linewidth=2, marker="o", markersize=3, markevery=3)]
    for style, r in zip(styles, results):
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.name, **style)
    ax.set_yscale("log")
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (full data, MSE)")
    ax.set_title(f"Uneven micro-batches, k={ACCUMULATION_STEPS}, partial last window")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
