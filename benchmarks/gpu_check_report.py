#!/usr/bin/env python
"""The Python half of benchmarks/gpu_check.sh (see benchmarks/README.md, "gpu_check.sh").

  env WORK [--dry-run]   versions, the device and the tools, into WORK/env.json (printed too).
  check-build [--cuda]   which accum_fused is imported and whether its extension has the CUDA
                         half; with --cuda, fail loudly unless the cpp backend's CUDA kernels
                         load and agree with the reference on a CUDA tensor.
  report WORK OUTDIR     gather the stages' results from WORK into OUTDIR: summary.md,
                         gpu_check.json (holding the model, FSDP2 and parity stages' json), junit.xml, bench.json,
                         bench.png, train.json, logs.txt
                         (7 files: the device tool brings back at most 8 of at most 16 MiB).

``report`` uses the standard library only, so a summary is written even when torch is broken.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

LOG_CAP = 3 << 20  # bytes of one stage's log kept in logs.txt (head and tail)
STAGE_ORDER = ("env", "build", "tests", "bench", "train", "model", "fsdp", "parity", "oom", "memcheck", "racecheck")


# ------------------------------------------------------------------------------------- env
def _first_line(command: list[str], pattern: str = "") -> str | None:
    try:
        text = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in text.splitlines() if re.search(pattern, line)]
    return lines[-1] if lines else None


def collect_env(work: Path, dry_run: bool) -> int:
    root = Path(__file__).resolve().parents[1]
    env = {"date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"), "dry_run": dry_run,
           "python": platform.python_version(), "cpus": os.cpu_count(),
           "git_commit": _first_line(["git", "-C", str(root), "rev-parse", "--short", "HEAD"]),
           "nvcc": _first_line(["nvcc", "--version"], r"release"),
           "driver": _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])}
    try:
        import torch

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.update(device=props.name, capability="%d.%d" % torch.cuda.get_device_capability(0),
                       gpu_memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        else:
            env["device"] = f"CPU ({platform.machine()}), no CUDA device"
    except Exception as exc:  # a broken torch is itself the finding: record it, keep going
        env["torch_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"not importable ({type(exc).__name__})"
    (work / "env.json").write_text(json.dumps(env, indent=1) + "\n")
    print(json.dumps(env, indent=1))
    return 0 if "torch_error" not in env and (dry_run or env.get("cuda_available")) else 1


# ------------------------------------------------------------------------------ check-build
def check_build(cuda: bool) -> int:
    import torch

    import accum_fused
    from accum_fused import backends

    root = Path(__file__).resolve().parents[1]
    where = Path(accum_fused.__file__).resolve().parent
    print(f"accum_fused {accum_fused.__version__} imported from {where}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), CUDA available: {torch.cuda.is_available()}")
    reasons = backends.unavailable_reasons()
    print(f"available backends: {backends.available_backends()}; unavailable: {reasons or 'none'}")
    if where != root / "accum_fused":
        print(f"FAIL: the tests would not run this checkout ({root}) but {where}")
        return 1
    cpp = backends._load("cpp")
    if cpp is None:
        print(f"FAIL: the compiled backend does not load: {reasons.get('cpp')}")
        return 1
    from accum_fused import _C

    print(f"extension {_C.__file__}: with_cuda={_C.with_cuda}, CPU kernels {_C.cpu_kernel_variant()}")
    if not cuda:
        return 0
    if not _C.with_cuda:
        print("FAIL: the extension was built WITHOUT its CUDA half (torch.version.cuda or CUDA_HOME missing at "
              "build time?): every cpp CUDA test would hand its tensors to the reference")
        return 1
    # One real window on the GPU through each backend that claims CUDA, against the reference.
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(n, generator=gen) for n in (4097, 3, 2**20 + 3)]
    grads = [[torch.randn(t.shape, generator=gen) for t in init] for _ in range(3)]
    results = {}
    for name in ("torch", "cpp", "triton"):
        if name != "torch" and backends.resolve(name, device, torch.float32) is backends.reference:
            print(f"{name}: does not run CUDA tensors here")
            continue
        params = [torch.nn.Parameter(t.to(device)) for t in init]
        opt = accum_fused.AdamW(params, lr=0.01, accumulation_steps=3, max_grad_norm=1.0, backend=name)
        for micro in grads:
            for p, g in zip(params, micro):
                p.grad = g.to(device)
            opt.step()
        torch.cuda.synchronize()
        assert opt.update_count == 1, f"{name}: no update"
        results[name] = torch.cat([p.detach().flatten().cpu() for p in params])
    if "cpp" not in results:
        print("FAIL: backend cpp does not run CUDA tensors although the extension reports with_cuda")
        return 1
    for name, flat in results.items():
        diff = (flat - results["torch"]).abs().max().item()
        print(f"{name}: one CUDA window, max |param - reference| = {diff:.3g}")
        if not diff <= 1e-5:
            print(f"FAIL: backend {name} disagrees with the reference on CUDA")
            return 1
    print("OK: the CUDA half of the extension is built and runs")
    return 0


# ------------------------------------------------------------------------------------ report
def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_stages(work: Path) -> list[dict]:
    stages = []
    try:
        lines = (work / "stages.tsv").read_text().splitlines()
    except OSError:
        return stages
    for line in lines:
        parts = line.split("\t")
        if len(parts) >= 5:
            name, status, rc, seconds, budget = parts[:5]
            stages.append({"stage": name, "status": status, "rc": int(rc), "seconds": int(seconds),
                           "budget_s": int(budget), "note": parts[5] if len(parts) > 5 else ""})
    return stages


def junit_counts(path: Path) -> dict | None:
    """Totals, failed test ids and the number of CUDA cases that ran, from pytest's junit XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, cuda_run = [], 0
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        if "failure" in kinds:
            counts["failed"] += 1
            failed.append(test_id)
        elif "error" in kinds:
            counts["errors"] += 1
            failed.append(test_id + " (error)")
        elif "skipped" in kinds:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
            cuda_run += "cuda" in case.get("name", "")
    return {**counts, "total": sum(counts.values()), "cuda_cases_passed": cuda_run, "failed_ids": failed}


def sanitizer_summary(log: Path) -> str | None:
    """The sanitizer's own closing line(s), e.g. 'ERROR SUMMARY: 0 errors'."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    found = re.findall(r"^=+ ((?:ERROR|RACECHECK) SUMMARY:.*)$", text, re.M)
    return "; ".join(found) if found else None


def pytest_tail(log: Path) -> str | None:
    """pytest's closing line ('3 passed, 1 skipped in 2.0s') from a stage log."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|error|no tests ran)\b", line) and " in " in line:
            return line.strip("= ").strip()
    return None


def fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def bench_section(bench: dict) -> tuple[list[str], dict]:
    out, goals = [], {}
    copy, add = bench["copy_bandwidth"], bench["add_bandwidth"]
    out.append(f"Device copy_ {copy['gbps']:.1f} GB/s, in-place add_ {add['gbps']:.1f} GB/s "
               f"({copy['numel']:,} fp32, median of {len(copy['times_ms'])}), measured in the same run. "
               f"Native AdamW: {bench['config'].get('native_adamw')}. "
               f"{bench['config']['warmup']} warm-up + {bench['config']['repeats']} timed windows per case.")
    out.append("")
    ms = bench["measurements"]
    contenders = list(dict.fromkeys(m["contender"] for m in ms))
    out.append("One row per case; each cell: ms/window · % of copy bandwidth · time vs native · peak MB "
               "(CUDA: max_memory_allocated of its windows, its own resident bytes included).")
    out.append("")
    out.append("| dtype | shapes | params | k | clip | " + " | ".join(contenders) + " |")
    out.append("|---|---|---|---|---|" + "---|" * len(contenders))
    cases = {}
    for m in ms:
        key = (m["dtype"], m["size"], m["numel"], m["k"], m["max_grad_norm"])
        cases.setdefault(key, {})[m["contender"]] = m
    for (dtype, size, numel, k, clip), row in cases.items():
        cells = []
        for name in contenders:
            m = row.get(name)
            cells.append("-" if m is None else f"{m['median_ms']:.2f} · {m['pct_copy_bandwidth']:.0f}% · "
                         f"{m['median_ratio_vs_native']:.2f}x · {fmt_bytes(m.get('peak_memory_bytes'))}")
        out.append(f"| {dtype} | {size} | {numel / 1e6:.1f}M | {k} | {'off' if clip is None else 'on'} | "
                   + " | ".join(cells) + " |")
    for case in bench.get("skipped_cases", []):
        out.append(f"\nskipped {case['shapes']} {case['size']} {case['dtype']} k={case['k']}: {case['reason']}")
    if bench.get("skipped_backends"):
        out.append(f"\nbackends not timed: {bench['skipped_backends']}")
    # Goal figures of issue 11 (reported, not asserted).
    lines = []
    for name in ("cpp", "triton"):
        mine = [m for m in ms if m["contender"] == name]
        if not mine:
            continue
        big = [m["pct_copy_bandwidth"] for m in mine if m["shapes"] == "uniform" and m["numel"] >= 64 << 20]
        gpt2 = [m["pct_copy_bandwidth"] for m in mine if m["shapes"] == "gpt2"]
        ratios = [m["median_ratio_vs_native"] for m in mine if m["k"] > 1]
        goal = {"min_pct_copy_ge_64M": min(big) if big else None, "min_pct_copy_gpt2": min(gpt2) if gpt2 else None,
                "max_ratio_vs_native_k_gt_1": max(ratios) if ratios else None}
        goals[name] = goal
        parts = []
        if big:
            parts.append(f"≥64M: min {min(big):.0f}% of copy (goal ≥ 90%: {'met' if min(big) >= 90 else 'NOT met'})")
        if gpt2:
            parts.append(f"GPT-2 shapes: min {min(gpt2):.0f}% (goal ≥ 80%: {'met' if min(gpt2) >= 80 else 'NOT met'})")
        if ratios:
            parts.append(f"window vs native: worst {max(ratios):.3f} (goal ≤ 0.9: "
                         f"{'met' if max(ratios) <= 0.9 else 'NOT met'})")
        lines.append(f"- {name}: " + "; ".join(parts))
    cases = {}
    for m in ms:
        if m["contender"] in ("cpp", "triton"):
            key = (m["shapes"], m["size"], m["dtype"], m["k"], m["max_grad_norm"])
            cases.setdefault(key, {})[m["contender"]] = m["median_ms"]
    both = [c for c in cases.values() if len(c) == 2]
    if both:
        cpp_wins = sum(c["cpp"] <= c["triton"] for c in both)
        goals["cpp_faster_cases"] = f"{cpp_wins}/{len(both)}"
        lines.append(f"- cpp faster than triton in {cpp_wins} of {len(both)} cases "
                     f"(input for `_auto_candidates` on CUDA)")
    if lines:
        out += ["", "Goals (issue 11; % copy is modelled window bytes over the measured copy bandwidth):"] + lines
    return out, goals


def train_section(train: dict) -> list[str]:
    cfg = train["config"]
    out = [f"{cfg['params'] / 1e6:.1f}M params, k={cfg['k']} micro-batches {cfg['micro_batches']}, "
           f"{cfg['tokens_per_window']:,} tokens/window, autocast {cfg['autocast'] or 'off'}, "
           f"{cfg['windows']} timed windows. Memory: {train.get('memory_kind')}.", "",
           "| contender | ms/window | tokens/s | vs native | memory MB | B/param | max abs dparam |",
           "|---|---|---|---|---|---|---|"]
    for r in train["results"]:
        out.append(f"| {r['contender']} | {r['median_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['median_ratio_vs_native']:.3f} | {fmt_bytes(r['memory_bytes'])} | "
                   f"{r['memory_bytes_per_param']:.1f} | {r['max_abs_param_diff_vs_native']:.1e} |")
    return out


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def model_section(model: dict) -> list[str]:
    """benchmarks/bench_transformer.py's record of the GPT-2 step (issue 43 item 4): one row per
    contender, the skipped ones with why."""
    cfg, dev = model["config"], model["device"]
    clips = cfg["clips"]
    out = [f"{cfg['params']:,} params ({cfg['layers']} layers, d {cfg['d_model']}, {cfg['heads']} heads, "
           f"vocab {cfg['vocab']}, context {cfg['seq']}, {'tied' if cfg['tie'] else 'untied'} head) "
           f"on {dev['name']}; k={cfg['k']} micro-batches of {cfg['micro_batch']} x {cfg['seq']} tokens, autocast "
           f"{cfg.get('autocast') or 'off'}, clip {', '.join(str(c) for c in clips)}, native "
           f"torch.optim.AdamW({cfg['native_adamw']}=True); {cfg['warmup']} warm-up + {cfg['repeats']} timed "
           "rounds, contenders interleaved. vs native: median of per-round ratios; optimizer side: median of per-round "
           f"(contender - fb_only); peak: {model.get('memory_kind', '?')}; rel. distance: "
           "||p - p_native|| / ||p_native - p_0||.", ""]
    clip_col = len(clips) > 1
    header = (["clip"] if clip_col else []) + ["contender", "backend", "ms/window", "vs native", "optimizer-side ms",
                                               "peak MB", "max abs dparam", "rel. distance", "check"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in model["results"]:
        backend = r.get("resolved_backend") or "-"
        cells = ([str(r["max_grad_norm"])] if clip_col else []) + [
            r["contender"], backend, f"{r['median_ms']:.1f}", _num(r.get("median_ratio_vs_native"), ".3f"),
            _num(r.get("optimizer_side_ms"), ".1f"), fmt_bytes(r.get("peak_memory_bytes")),
            _num(r.get("max_abs_diff_vs_native"), ".1e"), _num(r.get("rel_distance_vs_native"), ".1e"),
            r.get("check") or "ok"]
        out.append("| " + " | ".join(cells) + " |")
    reasons: dict[str, list[str]] = {}  # (one line per reason: the triton contenders share theirs)
    for skip in model.get("skipped", []):
        reasons.setdefault(skip["reason"], []).append(skip["contender"])
    if reasons:
        out.append("")
    out += [f"- skipped {', '.join(names)}: {reason}" for reason, names in reasons.items()]
    return out


def fsdp_section(fsdp: dict) -> list[str]:
    """benchmarks/bench_fsdp.py's record: one row per pattern (per rank per window)."""
    a = fsdp["args"]
    out = [f"{fsdp['ranks']} rank(s), {fsdp['dist_backend']} on {fsdp['device']}; {fsdp['params'] / 1e6:.2f}M params, "
           f"k={a['k']}, {'bf16 params / fp32 reduce' if a.get('bf16') else 'fp32'}. Bytes per rank per window, "
           "measured (model), full message sizes; peak: " + fsdp["memory_counted_as"] + ".", "",
           "| pattern | ms/window | peak MB | B/param | all-gather MB | reduce-scatter MB | all-reduce bytes |",
           "|---|---|---|---|---|---|---|"]
    for r in fsdp["rows"]:
        b, m = r["bytes_rank0"], r["expected_bytes"]
        ar = m["all_reduce"]
        out.append(f"| {r['pattern']} | {r['ms_per_window']:.1f} | {fmt_bytes(r['peak_bytes_max_rank'])} | "
                   f"{r['peak_B_per_param']:.1f} | {b.get('all_gather', 0) / 1e6:.2f} ({m['all_gather'] / 1e6:.2f}) | "
                   f"{b.get('reduce_scatter', 0) / 1e6:.2f} ({m['reduce_scatter'] / 1e6:.2f}) | "
                   f"{b.get('all_reduce', 0)} ({'?' if ar != ar else f'{ar:.0f}'}) |")
    return out


def capped(text: str, cap: int = LOG_CAP) -> str:
    if len(text) <= cap:
        return text
    head, tail = text[: cap // 8], text[-(cap - cap // 8):]
    return f"{head}\n\n[... {len(text) - cap:,} characters cut by gpu_check_report.py ...]\n\n{tail}"


def report(work: Path, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    env = read_json(work / "env.json") or {}
    stages = read_stages(work)
    junit = junit_counts(work / "junit.xml")
    bench_files = sorted((work / "bench").glob("bench_*.json")) if (work / "bench").is_dir() else []
    bench = read_json(bench_files[-1]) if bench_files else None
    train = read_json(work / "train.json")
    model = read_json(work / "model.json")
    fsdp = read_json(work / "fsdp.json")
    parity = read_json(work / "parity.json")
    oom = read_json(work / "oom.json")
    sanitizers = {name: {"summary": sanitizer_summary(work / f"{name}.log"), "pytest": pytest_tail(work / f"{name}.log")}
                  for name in ("memcheck", "racecheck")}

    # The files that come back (flat; the device tool returns at most 8 of at most 16 MiB).
    if junit is not None:
        shutil.copyfile(work / "junit.xml", out / "junit.xml")
    if bench_files:
        shutil.copyfile(bench_files[-1], out / "bench.json")
        png = bench_files[-1].with_suffix(".png")
        if png.is_file():
            shutil.copyfile(png, out / "bench.png")
    if train is not None:
        shutil.copyfile(work / "train.json", out / "train.json")
    with open(out / "logs.txt", "w") as f:
        names = [s["stage"] for s in stages] + sorted(p.stem for p in work.glob("*.log"))
        for name in dict.fromkeys(names):
            log = work / f"{name}.log"
            if log.is_file():
                f.write(f"\n{'=' * 30} {name} {'=' * 30}\n")
                f.write(capped(log.read_text(errors="replace")))

    failed = [s for s in stages if s["status"] in ("failed", "timeout")]
    goals = {}
    md = [f"# accum_fused GPU check{' (dry run, CPU, tiny sizes)' if env.get('dry_run') else ''}", ""]
    md.append(f"{env.get('date', '?')} · {env.get('device', '?')} · commit {env.get('git_commit', '?')} · "
              f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda')}) · Triton {env.get('triton')} · "
              f"Python {env.get('python', '?')} · nvcc {env.get('nvcc') or '-'} · {env.get('cpus', '?')} CPUs")
    md.append("")
    verdict = "all stages passed" if not failed else "FAILED: " + ", ".join(f"{s['stage']} ({s['status']})" for s in failed)
    md += [f"**Result: {verdict}**", "", "| stage | status | s | budget s | note |", "|---|---|---|---|---|"]
    for s in stages:
        md.append(f"| {s['stage']} | {s['status']} | {s['seconds']} | {s['budget_s']} | {s['note']} |")
    md += ["", "## Tests"]
    if junit:
        md.append(f"{junit['passed']} passed, {junit['failed']} failed, {junit['errors']} errors, "
                  f"{junit['skipped']} skipped ({junit['total']} in junit.xml); CUDA cases passed: "
                  f"{junit['cuda_cases_passed']}")
        for test_id in junit["failed_ids"][:25]:
            md.append(f"- FAILED {test_id}")
        if len(junit["failed_ids"]) > 25:
            md.append(f"- ... {len(junit['failed_ids']) - 25} more in junit.xml")
    else:
        md.append("no junit.xml (the test stage did not run or crashed: see logs.txt)")
    md += ["", "## compute-sanitizer"]
    for name, found in sanitizers.items():
        md.append(f"- {name}: {found['summary'] or 'no sanitizer summary (see logs.txt)'}; "
                  f"tests: {found['pytest'] or '-'}")
    md += ["", "## Window benchmark (python -m accum_fused bench)"]
    if bench:
        lines, goals = bench_section(bench)
        md += lines
    else:
        md.append("no result (see logs.txt)")
    md += ["", "## Training benchmark (benchmarks/bench_train.py)"]
    md += train_section(train) if train else ["no result (see logs.txt)"]
    md += ["", "## Model step: GPT-2 small, native vs every mode x backend (benchmarks/bench_transformer.py)"]
    md += model_section(model) if model else ["no result (see logs.txt)"]
    md += ["", "## FSDP2 benchmark (benchmarks/bench_fsdp.py)"]
    md += fsdp_section(fsdp) if fsdp else ["no result (see logs.txt)"]
    files = ["summary.md", "gpu_check.json"] + [p for p in ("junit.xml", "bench.json", "bench.png", "train.json")
                                               if (out / p).is_file()] + ["logs.txt"]
    md += ["", f"Files: {', '.join(files)}. Stage logs, in order, are in logs.txt."]
    (out / "summary.md").write_text("\n".join(md) + "\n")

    record = {"env": env, "stages": stages, "failed_stages": [s["stage"] for s in failed],
              "tests": junit, "sanitizers": sanitizers, "goals": goals,
              "bench": {k: bench[k] for k in ("copy_bandwidth", "add_bandwidth", "config")} if bench else None,
              "model": model,  # bench_transformer.py's record of the GPT-2 step (likewise: no file of its own)
              "fsdp": fsdp,  # bench_fsdp.py's whole record (no file of its own: the device tool returns 8 at most)
              "parity": parity,  # gpu_parity.py's record (likewise)
              "oom": oom,  # gpu_oom_check.py's record (likewise)
              "files": files}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"] and len(argv) >= 2:
        return collect_env(Path(argv[1]), "--dry-run" in argv[2:])
    if argv[:1] == ["check-build"]:
        return check_build("--cuda" in argv[1:])
    if argv[:1] == ["report"] and len(argv) == 3:
        return report(Path(argv[1]), Path(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
