"""Time accumulation windows: accum_fused.AdamW against the native torch loop.

``python -m accum_fused bench`` runs a sweep of windows (shape sets and sizes, dtypes, k, with
and without clipping), prints a table and writes a JSON file and a PNG plot;
``benchmarks/bench_window.py`` times one configuration in detail (``window_main``).

The package: ``model.py`` (shape sets, sizes, the byte model below; no timing), ``measure.py``
(timer, bandwidth probes, the contenders, interleaved rounds, environment records), ``cli.py``
(both command lines, tables, JSON records, the plot). Every name is re-exported here.

A window is k micro-batches followed by one AdamW update (k=8 and max_grad_norm=1.0 by default).
Backward is not timed: every micro-batch's gradients are precomputed once, so only the
optimizer-side work of the window is measured.

Contenders, interleaved round by round in one process (the starting contender rotates each
round so none always runs right after the same neighbour):

  native    the loop a user writes without accum_fused, at its cheapest:
              micro-batch 1     p.grad = <fresh tensor>   (free: autograd keeps the new grad;
                                                            modelled as assigning a tensor)
              micro-batches 2..k  p.grad.add_(g_i)         (autograd's in-place accumulate)
              torch.nn.utils.clip_grad_norm_(params, max_grad_norm)   (unless --no-clip)
              torch.optim.AdamW(params, fused=True).step()  (foreach=True where fused fails)
              opt.zero_grad()
            Its micro-batch-1 tensor is its own scratch copy, so the in-place adds never touch
            the shared precomputed gradients; that scratch grows by (k-1)·|g| per window, which
            is harmless for timing (uniform(-1e-3, 1e-3) gradients stay far from overflow).
  <backend> accum_fused.AdamW(..., accumulation_steps=k, max_grad_norm=..., backend=<backend>)
            driven as the documented training loop: for each micro-batch
            p.grad = g_i (assignment, no copy); opt.step(); opt.zero_grad().

Modelled bytes per parameter (the model of DESIGN.md, "Bytes per parameter"; k >= 2;
P = parameter bytes, G = gradient bytes, A = accumulation-buffer bytes, S = optimizer-state
bytes per element; AdamW state = exp_avg + exp_avg_sq):

  accum_fused (A = S = 4, fp32 buffer and state whatever the parameter dtype)
    micro-batch 1         overwrite the buffer, no zeroing:   read g, write acc    G + A
    micro-batches 2..k-1  acc += g:                   read g, read acc, write acc   G + 2A
    clip on:  micro-batch k   as above, norm partial sums in the same pass          G + 2A
              update          read acc, p, m, v; write p, m, v                      A + 2P + 4S
    clip off: micro-batch k is fused into the update:
                              read g, acc, p, m, v; write p, m, v               G + A + 2P + 4S
    (k = 1: clip on  G + A  then  A + 2P + 4S;  clip off  G + 2P + 4S, the buffer never used)
  native (G = S = P: torch keeps grads and AdamW state in the parameter dtype)
    micro-batch 1         free
    micro-batches 2..k    .grad += g:                 read g, read grad, write grad    3G
    clip_grad_norm_       norm pass (read G) + scale pass (read G, write G)            3G
    fused AdamW           read g, p, m, v; write p, m, v                           G + 2P + 4S

  fp32, clip on : accum_fused 8 + 12(k-2) + 12 + 28 = 12k + 24   (k=8: 120 B/param)
                  native      12(k-1) + 12 + 28     = 12k + 28   (k=8: 124 B/param)
  fp32, clip off: accum_fused 8 + 12(k-2) + 32      = 12k + 16   native 12(k-1) + 28 = 12k + 16
  bf16, clip on : accum_fused 6 + 10(k-2) + 10 + 24 = 10k + 20   (k=8: 100 B/param)
                  native      6(k-1) + 6 + 14       =  6k + 14   (k=8:  62 B/param)
  bf16, clip off: accum_fused 6 + 10(k-2) + 26      = 10k + 12   native 6(k-1) + 14 = 6k + 8

Achieved GB/s = modelled bytes / window time: the bytes a fused implementation must move, not
what a given implementation does move (the pure-PyTorch "torch" backend moves more, through
temporaries, so its GB/s understates its traffic). It is compared with the device's measured
copy bandwidth, (bytes read + bytes written) / time of dst.copy_(src) on a large fp32 tensor,
under the same thread count: "% copy" near 100 means the window runs at the memory floor on a
GPU. On a CPU the copy under-counts its traffic (write-allocate reads every destination line),
so in-place passes beat it and "% copy" exceeds 100; "% add_" (in-place a.add_(b), 12 B per
element, the accumulate pass itself) is the floor to read there.

Usage:
  python -m accum_fused bench                     # the sweep sized for this device
  python -m accum_fused bench --quick             # a few seconds: one small case
  python -m accum_fused bench --device cuda --shapes uniform gpt2 --sizes 1M 16M 256M
  python benchmarks/bench_window.py               # one case in detail (see benchmarks/README.md)
"""
from .cli import (DEFAULTS, MEASUREMENT_KEYS, RECORD_KEYS, SCHEMA_VERSION, add_bench_arguments,
                  bench_main, default_output_dir, format_table, plan_grad_sets, plot_bench, run_bench,
                  split_names, window_main, window_parse_args)
from .measure import (LR, PACKAGE_DIR, WEIGHT_DECAY, AccumFused, Native, Timer, available_memory,
                      bandwidth_probes, cpu_model, git_commit, held_tensor_bytes, loadavg, make_tensors,
                      minor_page_faults, native_adamw_impl, pick_backends, quantiles, resolve_device, summarise,
                      time_contenders, versions)
from .model import DTYPES, SHAPE_SETS, bytes_per_param, memory_needed, parse_size, shape_set, size_label

# What benchmarks/*.py, tests/test_cli.py and __main__.py use as accum_fused.bench.<name>.
__all__ = [
    "DEFAULTS", "MEASUREMENT_KEYS", "RECORD_KEYS", "SCHEMA_VERSION", "add_bench_arguments",
    "bench_main", "default_output_dir", "format_table", "plan_grad_sets", "plot_bench", "run_bench",
    "split_names", "window_main", "window_parse_args", "LR", "PACKAGE_DIR", "WEIGHT_DECAY",
    "AccumFused", "Native", "Timer", "available_memory", "bandwidth_probes", "cpu_model",
    "git_commit", "held_tensor_bytes", "loadavg", "make_tensors", "minor_page_faults",
    "native_adamw_impl", "pick_backends", "quantiles", "resolve_device", "summarise", "time_contenders", "versions",
    "DTYPES", "SHAPE_SETS", "bytes_per_param", "memory_needed", "parse_size", "shape_set",
    "size_label",
]
