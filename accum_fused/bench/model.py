"""The model of bytes and the parameter sets of the window benchmarks (no timing here).

Owns: the shape sets (``cpu33m``, ``uniform``, ``gpt2``), size parsing and labels, the modelled
bytes per parameter of one window (``bytes_per_param``; the model is the package docstring's,
``python -m pydoc accum_fused.bench``) and the bytes a case holds (``memory_needed``).
Must not: time, allocate or print anything.
"""
from __future__ import annotations

import argparse
import re

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

SHAPE_SETS = ("uniform", "cpu33m", "gpt2")


# ------------------------------------------------------------------------------ shapes
def shape_set(name: str, numel: int = 1 << 26, tensors: int = 1) -> list[tuple[int, ...]]:
    if name == "cpu33m":
        # The CPU acceptance case of issue 3: 33,595,392 parameters in 60 tensors.
        return [(1024, 1024)] * 16 + [(4096, 1024)] * 4 + [(1024,)] * 40
    if name == "uniform":
        if tensors < 1 or numel < tensors:
            raise SystemExit(f"--shapes uniform needs 1 <= tensors <= numel, got {tensors} and {numel}")
        base, extra = divmod(numel, tensors)
        return [(base + (1 if i < extra else 0),) for i in range(tensors)]
    if name == "gpt2":
        # GPT-2 124M (HF transformer.* names); the LM head is tied to wte and not duplicated.
        d, vocab, ctx, layers = 768, 50257, 1024, 12
        shapes = [(vocab, d), (ctx, d)]  # wte, wpe
        for _ in range(layers):
            shapes += [(d,), (d,),                  # ln_1 weight, bias
                       (d, 3 * d), (3 * d,),        # attn.c_attn weight, bias
                       (d, d), (d,),                # attn.c_proj weight, bias
                       (d,), (d,),                  # ln_2 weight, bias
                       (d, 4 * d), (4 * d,),        # mlp.c_fc weight, bias
                       (4 * d, d), (d,)]            # mlp.c_proj weight, bias
        return shapes + [(d,), (d,)]  # ln_f weight, bias  -> 124,439,808 in total
    raise SystemExit(f"unknown shape set {name!r}")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*$")

def parse_size(text: str) -> int:
    """'100k' -> 100,000; '1M' -> 2^20; '2^24' -> 2^24; a plain integer as is. k is decimal
    (for the tiny test sizes), M and G binary (the sweep's 1M..256M are powers of two)."""
    text = str(text).strip()
    if "^" in text:
        base, exp = text.split("^", 1)
        return int(base) ** int(exp)
    match = _SIZE_RE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 100k, 1M, 256M, 2^20, 1048576)")
    value, unit = float(match.group(1)), match.group(2).lower()
    n = int(value * {"": 1, "k": 1000, "m": 1 << 20, "g": 1 << 30}[unit])
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be >= 1, got {text!r}")
    return n

def size_label(numel: int) -> str:
    for unit, factor in (("G", 1 << 30), ("M", 1 << 20)):
        if numel >= factor and numel % factor == 0:
            return f"{numel // factor}{unit}"
    if numel >= 1000 and numel % 1000 == 0:
        return f"{numel // 1000}k"
    if numel >= 1 << 20:
        return f"{numel / 1e6:.1f}M"
    return str(numel)

# -------------------------------------------------------------------------- byte model
def bytes_per_param(contender: str, k: int, clip: bool, param_bytes: int) -> dict[str, int]:
    """Modelled bytes per parameter for one window, split by phase (see the module docstring)."""
    P = G = param_bytes
    if contender == "native":
        S = P
        phases = {"accumulate": 3 * G * (k - 1), "clip": 3 * G if clip else 0, "update": G + 2 * P + 4 * S}
    else:
        A = S = 4
        if k == 1:
            phases = ({"accumulate": G + A, "update": A + 2 * P + 4 * S} if clip
                      else {"accumulate": 0, "update": G + 2 * P + 4 * S})
        elif clip:
            phases = {"accumulate": (G + A) + (k - 1) * (G + 2 * A), "update": A + 2 * P + 4 * S}
        else:
            phases = {"accumulate": (G + A) + (k - 2) * (G + 2 * A), "update": G + A + 2 * P + 4 * S}
    phases["total"] = sum(phases.values())
    return phases

def memory_needed(numel: int, esize: int, n_af: int, grad_sets: int) -> int:
    """Bytes a case holds: init copy; native p, m, v, scratch; per accum_fused backend p, acc,
    m, v (fp32 buffer and state); the gradient sets; the two fp32 tensors of the bandwidth probes."""
    return numel * (esize + esize * 4 + n_af * (esize + 4 + 8) + grad_sets * esize + 8)
