#!/usr/bin/env python
"""Time ONE accumulation window in detail: accum_fused.AdamW against the native torch loop.

A thin wrapper: the benchmark lives in the ``accum_fused.bench`` package (``window_main``), shared with
``python -m accum_fused bench`` (the sweep). The contenders, the byte model and the bandwidth
probes are described in that module's docstring (``python -m pydoc accum_fused.bench``) and in
benchmarks/README.md.

Usage (from the repository root; see benchmarks/README.md):
  python benchmarks/bench_window.py                                   # CPU acceptance case
  python benchmarks/bench_window.py --device cuda --shapes uniform --numel 67108864
  python benchmarks/bench_window.py --device cuda --shapes gpt2 --dtype bf16
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

try:
    from accum_fused.bench import window_main
except ImportError:  # not installed: run against the checkout this script lives in
    sys.path.insert(0, str(HERE.parent))
    from accum_fused.bench import window_main

if __name__ == "__main__":
    sys.exit(window_main(results_dir=HERE / "results"))
