"""The docs' pictures, drawn from what the library does (not by hand):

- ``docs/images/window_timeline.svg``: three windows of a loop in plain mode, mode A and mode B,
  k=4 over 10 micro-batches of uneven sizes. The script runs each loop with the real optimizer
  and records, after every call, where the micro-batch's gradient went and where an update was
  applied (``opt.updated``, ``opt.update_count``); the picture is drawn from those records.
- ``docs/images/window_states.svg``: a window's life: empty, open while micro-batches add into
  it, and its close (the ranks' sums, the non-finite check, clipping, the update), in the order
  ``accum_fused/window/close.py`` runs them (``CLOSE_STEPS``; the test checks that order there).
- ``docs/images/memory_window.svg``: memory over one window, the native loop against plain, mode A
  and mode B, fp32 and bf16 parameters, from the memory benchmark's measured phases
  (``MEMORY_RESULTS``: ``benchmarks/bench_memory.py``'s JSON, live tensor bytes at the start,
  peak and end of every forward, backward and step of the window).
- ``docs/images/performance_summary.svg``: a window's time against the native loop's, per mode,
  on the GPT model end to end and on three host-cost cases, from the benchmarks' JSON
  (``PERFORMANCE_RESULTS``): each run a dot, the median a bar.

    python docs/make_figures.py    # needs torch, accum_fused and matplotlib (the test extra)

``tests/test_docs_figures.py`` runs the recording part and checks what the picture shows
against it, so that a change in where a mode takes gradients or updates fails there.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import accum_fused

K = 4
SIZES = (5, 3, 8, 2, 7, 4, 6, 1, 3, 5)  # micro-batch sizes: 2 full windows and a partial one
OUT = Path(__file__).resolve().parent / "images"
_RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
MEMORY_RESULTS = _RESULTS / "memory_cpu_20261127.json"
# (case, JSON files: one run each, or one file whose per-round ratios are the runs)
PERFORMANCE_RESULTS = [
    ("GPT model, 21M parameters, k=8, clip 1.0\n(forward + backward + update)",
     [_RESULTS / "transformer_cpu_20261127c.json"]),
    ("its 53 tensors, clip 1.0\n(host work: backward almost free)",
     sorted(_RESULTS.glob("issue51_update_spec_ab_20261128/sitting*/gpt_clip/after_*.json"))),
    ("288 LoRA adapters, k=8\n(host work)",
     sorted(_RESULTS.glob("issue51_update_spec_ab_20261128/sitting*/lora/after_*.json"))),
    ("5,000 tensors of 4,096, k=4\n(host work)",
     sorted(_RESULTS.glob("issue51_update_spec_ab_20261128/sitting*/t5000/after_*.json"))),
    ("33.6M parameters in 60 tensors, k=8, clip 1.0\n(a real backward that costs little)",
     sorted(_RESULTS.glob("backward_cpu_20261128_run*.json"))),
]


def record(mode: str) -> list[dict]:
    """Run the loop of ``mode`` ("plain", "mode A", "mode B") and return one event per call:
    ``{"micro_batch": i or None, "call": ..., "update": bool, "where": ...}``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    loader = [(torch.randn(n, 8), torch.randn(n, 1)) for n in SIZES]
    loss_fn = nn.functional.mse_loss
    if mode == "plain":
        opt = accum_fused.AdamW(model.parameters(), lr=1e-3, accumulation_steps=K)
    elif mode == "mode A":
        opt = accum_fused.AdamW(model.parameters(), lr=1e-3, in_backward=True)
    else:
        opt = accum_fused.AdamW(model.parameters(), lr=1e-3, in_backward=True, accumulation_steps=K)
    events = []

    def note(i, call, before):
        events.append({"micro_batch": i, "call": call, "update": opt.update_count > before,
                       "grad_held": any(p.grad is not None for p in model.parameters())})

    for i, (x, y) in enumerate(loader):
        loss = loss_fn(model(x), y)
        before = opt.update_count
        if mode == "mode B":
            opt.backward(loss, weight=len(x))
            note(i, "opt.backward(loss, weight)", before)
            continue
        loss.backward()  # (mode A sums the passes, as .grad would: a loop weights them in its loss)
        note(i, "loss.backward()", before)
        if mode == "plain":
            before = opt.update_count
            opt.step(weight=len(x))
            opt.zero_grad()
            note(i, "opt.step(weight)", before)
        elif (i + 1) % K == 0:  # mode A: the loop owns the window, as a tutorial loop's step every k
            before = opt.update_count
            opt.step()
            opt.zero_grad()
            note(None, "opt.step()", before)
    before = opt.update_count
    if mode == "mode A":
        opt.step()  # (the loop's own last, partial window)
        opt.zero_grad()
        note(None, "opt.step()", before)
    else:
        opt.flush()
        note(None, "opt.flush()", before)
    return events


def draw(path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "accum_fused"  # (the same file from the same records)
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    modes = ["plain", "mode A", "mode B"]
    records = {mode: record(mode) for mode in modes}
    fig, ax = plt.subplots(figsize=(11, 4.6))
    n = len(SIZES)
    slot = 1.0
    windows = [(0, K), (K, 2 * K), (2 * K, n)]
    colours = {"pass": "#c9d6e3", "hook": "#f4a261", "step": "#8ecae6", "update": "#e63946"}
    for row, mode in enumerate(modes):
        y = len(modes) - 1 - row
        ax.text(-0.35, y + 0.35, mode, ha="right", va="center", fontsize=11, fontweight="bold")
        for w, (a, b) in enumerate(windows):  # the windows, shaded
            ax.add_patch(FancyBboxPatch((a * slot + 0.04, y + 0.02), (b - a) * slot - 0.08, 0.66,
                                        boxstyle="round,pad=0.0,rounding_size=0.05",
                                        facecolor="#f5f5f5" if w % 2 else "#ececec", edgecolor="none", zorder=0))
        x_end = n * slot
        for at, e in enumerate(records[mode]):
            i = e["micro_batch"]
            if i is not None and e["call"] != "opt.step(weight)":
                x = i * slot
                # forward + backward; in modes A and B the gradient goes into the window in it
                ax.add_patch(FancyBboxPatch((x + 0.1, y + 0.12), 0.55, 0.44, boxstyle="round,pad=0.0,rounding_size=0.04",
                                            facecolor=colours["pass"], edgecolor="#4a5a6a", lw=0.8, zorder=2))
                ax.text(x + 0.375, y + 0.34, f"{SIZES[i]}", ha="center", va="center", fontsize=8, zorder=3)
                if mode != "plain":
                    ax.add_patch(plt.Rectangle((x + 0.52, y + 0.12), 0.13, 0.44, facecolor=colours["hook"],
                                               edgecolor="none", zorder=3))
            if e["call"] == "opt.step(weight)":
                x = i * slot
                ax.add_patch(plt.Rectangle((x + 0.68, y + 0.2), 0.22, 0.28, facecolor=colours["step"],
                                           edgecolor="#4a5a6a", lw=0.6, zorder=2))
                if e["update"]:
                    ax.plot(x + 0.79, y + 0.62, marker="v", color=colours["update"], ms=9, zorder=4)
            elif e["update"] and i is not None:  # mode B: the update inside the window's last backward
                ax.plot(i * slot + 0.585, y + 0.62, marker="v", color=colours["update"], ms=9, zorder=4)
            elif e["micro_batch"] is None:  # opt.step() in mode A's loop, or flush()
                last = max(ev["micro_batch"] for ev in records[mode][:at] if ev["micro_batch"] is not None)
                x = last * slot + 0.72 if e["call"] == "opt.step()" else x_end + 0.1
                label = "flush()" if e["call"] == "opt.flush()" else "step()"
                ax.add_patch(plt.Rectangle((x, y + 0.2), 0.22 if label == "step()" else 0.5, 0.28,
                                           facecolor=colours["step"], edgecolor="#4a5a6a", lw=0.6, zorder=2))
                if label == "flush()":
                    ax.text(x + 0.25, y + 0.34, "flush()", ha="center", va="center", fontsize=7, zorder=3)
                if e["update"]:
                    ax.plot(x + (0.11 if label == "step()" else 0.25), y + 0.62, marker="v",
                            color=colours["update"], ms=9, zorder=4)
    for w, (a, b) in enumerate(windows):
        ax.text((a + b) / 2 * slot, len(modes) + 0.05, f"window {w + 1}" + (" (partial)" if b - a < K else ""),
                ha="center", va="bottom", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=colours["pass"], edgecolor="#4a5a6a"),
               plt.Rectangle((0, 0), 1, 1, facecolor=colours["hook"]),
               plt.Rectangle((0, 0), 1, 1, facecolor=colours["step"], edgecolor="#4a5a6a"),
               plt.Line2D([], [], marker="v", color=colours["update"], ls="none", ms=9)]
    labels = ["a micro-batch's forward + backward (its size inside)",
              "in backward: its gradients added into the fp32 window",
              "step() / flush(): plain mode adds .grad into the window here",
              "the update (one per window)"]
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=9)
    ax.set_xlim(-1.4, n * slot + 0.8)
    ax.set_ylim(-0.1, len(modes) + 0.4)
    ax.axis("off")
    fig.subplots_adjust(left=0.02, right=0.99, top=0.95, bottom=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


# The close's steps, in close.py's order (tests/test_docs_figures.py reads them there).
CLOSE_STEPS = ["all-reduce sums\nand weights\n(ranks only)", "non-finite\nanywhere?",
               "clip to\nmax_grad_norm\n(if set)", "update with\nΣ w·g / Σ w"]


def draw_states(path: Path) -> None:
    """A window's states (top) and its close (down the right column); the lanes on the left go
    back to empty."""
    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "accum_fused"
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    width, height = 2.6, 1.0
    places = [(0.0, 0.0), (4.4, 0.0)] + [(4.4, -1.9 - 1.75 * i) for i in range(len(CLOSE_STEPS))]
    fig, ax = plt.subplots(figsize=(6.2, 7.4))
    for i, ((x, y), text) in enumerate(zip(places, ["empty", "open"] + CLOSE_STEPS)):
        state = i < 2
        h = height if state or text.count("\n") < 2 else height * 1.25
        ax.add_patch(FancyBboxPatch((x - width / 2, y - h / 2), width, h,
                                    boxstyle=f"round,pad=0.02,rounding_size={0.2 if state else 0.05}",
                                    facecolor="#c9d6e3" if state else "#f1f1f1", edgecolor="#4a5a6a", lw=1.0))
        ax.text(x, y, text, ha="center", va="center", fontsize=12 if state else 10,
                fontweight="bold" if state else "normal")

    def line(points, colour="#333333"):
        xs, ys = zip(*points)
        ax.plot(xs, ys, color=colour, lw=1.3)
        ax.annotate("", xy=points[-1], xytext=points[-2],
                    arrowprops=dict(arrowstyle="-|>", color=colour, lw=1.3, shrinkA=0, shrinkB=0))

    def label(x, y, text, colour="#222222", ha="center"):
        ax.text(x, y, text, ha=ha, va="center", fontsize=9.5, color=colour,
                bbox=dict(facecolor="white", edgecolor="none", pad=1.5))

    (ex, ey), (ox, oy) = places[0], places[1]
    half = width / 2
    line([(ex + half, ey), (ox - half, oy)])
    label((ex + ox) / 2, ey + 0.45, "first micro-batch\nbuf = w·g")
    top = oy + height / 2
    line([(ox + 0.6, top), (ox + 0.6, top + 0.45), (ox - 0.6, top + 0.45), (ox - 0.6, top)])
    label(ox, top + 0.75, "each later micro-batch: buf += w·g")
    steps = places[1:]
    for (x, y0), (_, y1) in zip(steps, steps[1:]):
        line([(x, y0 - 0.5 - (0.13 if y0 < -1 else 0)), (x, y1 + 0.5 + 0.13)])
    label(ox + 0.2, (steps[0][1] + steps[1][1]) / 2, "k-th micro-batch or flush()", ha="left")
    label(ox + 0.2, (steps[2][1] + steps[3][1]) / 2, "no", ha="left")
    # Back to empty, each along a lane of its own: discarded, skipped, updated.
    bottom = ey - height / 2
    line([(ox - 0.8, bottom), (ox - 0.8, bottom - 0.45), (ex + 0.8, bottom - 0.45), (ex + 0.8, bottom)], "#8a6d1f")
    label((ex + ox) / 2, bottom - 0.45, "discarded (see below)", "#8a6d1f")
    for (x, y), into, colour, text in [(places[3], ex, "#b23a48", "yes: skipped,\nnothing changes"),
                                       (places[-1], ex - 0.8, "#2a7a3a", "updated: the buffers\nare empty again")]:
        line([(x - half, y), (into, y), (into, bottom)], colour)
        label((into + x - half) / 2 + 0.3, y + 0.45, text, colour)
    ax.set_xlim(ex - half - 0.1, ox + half + 0.1)
    ax.set_ylim(places[-1][1] - 0.8, top + 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    fig.subplots_adjust(left=0.01, right=0.99, top=0.99, bottom=0.01)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def memory_curves(results: dict) -> dict[str, dict[str, tuple[list[float], list[float]]]]:
    """Per dtype and contender (native, plain, mode A, mode B): the window's live bytes per
    parameter, three points per phase (its start, peak, end), x in phases."""
    names = {"native": "native loop", "plain": "plain", "mode_a": "mode A", "mode_b": "mode B"}
    curves: dict[str, dict] = {}
    for r in results["results"]:
        if r["contender"] not in names or r.get("bf16_update") not in (None, "nearest"):
            continue
        xs, ys = [], []
        for i, phase in enumerate(r["phases"]):
            for dx, key in ((0.0, "start"), (0.5, "peak"), (1.0, "end")):
                xs.append(i + dx)
                ys.append(phase[key] / r["n_params"])
        curves.setdefault(r["dtype"], {})[names[r["contender"]]] = (xs, ys)
    return curves


def draw_memory(path: Path, results_path: Path = MEMORY_RESULTS) -> None:
    import json

    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "accum_fused"
    import matplotlib.pyplot as plt

    results = json.loads(results_path.read_text(encoding="utf-8"))
    curves = memory_curves(results)
    config = results["config"]
    styles = {"native loop": ("#222222", "-", 2.2), "plain": ("#1f77b4", "-", 1.4),
              "mode A": ("#2a9d8f", "--", 1.4), "mode B": ("#e76f51", ":", 1.8)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, dtype in zip(axes, ("fp32", "bf16")):
        for name, (xs, ys) in curves[dtype].items():
            colour, ls, lw = styles[name]
            ax.plot(xs, ys, color=colour, ls=ls, lw=lw, label=name)
        phases = next(r for r in results["results"] if r["contender"] == "native" and r["dtype"] == dtype)["phases"]
        for i, phase in enumerate(phases):
            if phase["phase"].endswith("forward"):
                ax.axvspan(i, i + 1, color="#f0f0f0", lw=0, zorder=0)
        ax.set_title(f"{dtype} parameters", fontsize=11)
        ax.set_xlabel(f"one window: {config['k']} micro-batches (forward shaded, backward, step)")
        ax.set_xticks([3 * m + 1.5 for m in range(config["k"])])
        ax.set_xticklabels([str(m + 1) for m in range(config["k"])])
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", color="#dddddd", lw=0.6)
    axes[0].set_ylabel("live tensor bytes per parameter")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False, fontsize=10)
    fig.suptitle(f"Memory over one window: a {config['layers']}-layer GPT ({results['config']['n_params'] / 1e6:.1f}M "
                 f"parameters), AdamW, clip {config['max_grad_norm']}, CPU", fontsize=11)
    fig.subplots_adjust(left=0.07, right=0.99, top=0.86, bottom=0.27, wspace=0.18)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


def performance_ratios(cases=PERFORMANCE_RESULTS) -> dict[str, dict[str, list[float]]]:
    """Per case and mode (plain, mode A, mode B): the window's time / the native loop's, one
    value per run (bench_hook_cost.py's files) or per round (bench_transformer.py's)."""
    import json
    names = {"plain": "plain", "mode_a": "mode A", "mode_b": "mode B"}
    out: dict[str, dict[str, list[float]]] = {}
    for case, files in cases:
        ratios = out.setdefault(case, {name: [] for name in names.values()})
        for f in files:
            for r in json.loads(Path(f).read_text(encoding="utf-8"))["results"]:
                # (a file that also timed other clip settings: the clipped rows, as everywhere here)
                if r["contender"] in names and r.get("max_grad_norm", 1.0) == 1.0:
                    values = r.get("ratios_vs_native") or [r["ratio_vs_native"]]
                    ratios[names[r["contender"]]] += values
    return out


def draw_performance(path: Path) -> None:
    import statistics

    import matplotlib
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "accum_fused"
    import matplotlib.pyplot as plt

    ratios = performance_ratios()
    modes = {"plain": "#1f77b4", "mode A": "#2a9d8f", "mode B": "#e76f51"}
    fig, ax = plt.subplots(figsize=(10, 5.6))
    cases = list(ratios)
    for c, case in enumerate(cases):
        y0 = len(cases) - 1 - c
        for m, (mode, colour) in enumerate(modes.items()):
            values = ratios[case][mode]
            y = y0 + 0.22 * (1 - m)
            ax.scatter(values, [y] * len(values), s=16, color=colour, alpha=0.55, lw=0, zorder=3)
            median = statistics.median(values)
            ax.plot([median, median], [y - 0.09, y + 0.09], color=colour, lw=3, zorder=4,
                    label=mode if c == 0 else None)
    ax.axvline(1.0, color="#222222", lw=1.2, zorder=2)
    ax.text(1.0, len(cases) - 0.45, " the native loop", fontsize=9, va="bottom")
    ax.set_yticks(range(len(cases)))
    ax.set_yticklabels(list(reversed(cases)), fontsize=9)
    ax.set_ylim(-0.5, len(cases) - 0.3)
    ax.set_xlabel("window time / the native loop's (left of the line: faster)")
    ax.grid(axis="x", color="#dddddd", lw=0.6)
    handles = [plt.Line2D([], [], color=colour, lw=3) for colour in modes.values()]
    fig.legend(handles, [f"{mode} (bar: median; dots: runs)" for mode in modes], loc="lower center", ncol=3,
               frameon=False, fontsize=9)
    fig.subplots_adjust(left=0.33, right=0.98, top=0.95, bottom=0.2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    draw(OUT / "window_timeline.svg")
    draw_states(OUT / "window_states.svg")
    draw_memory(OUT / "memory_window.svg")
    draw_performance(OUT / "performance_summary.svg")
    print(f"wrote the pictures into {OUT}")
