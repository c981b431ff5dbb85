"""Every ```python block of README.md and docs/**/*.md runs, on CPU, with small sizes.

The convention (for whoever writes a page):

- A block runs in a fresh namespace holding a small world (``small_world()`` below): ``torch``,
  ``nn``, ``F``, ``math``, ``accum_fused``, ``model`` (an 8 -> 16 -> 1 MLP), ``loader`` (10
  micro-batches ``(x, y)`` of uneven sizes), ``loss_fn`` (``F.mse_loss``), and, for loops written
  the torch.optim way, ``opt`` (``torch.optim.AdamW`` on the model) and ``scheduler`` (a stand-in that counts its
  ``step()`` calls; a block that shows how to build one builds a real one). Anything else a block uses it defines, or a block before it does:
- ``<!-- example: continue -->`` on the line before the fence: the block builds on the block
  before it in the same file (that one runs first, in the same namespace, and so on up the chain;
  each test is self-contained, so ``-k`` can pick any one).
- ``<!-- example: skip (why) -->`` on the line before the fence: not run; the test is reported
  as skipped with that reason. For blocks that need several processes, a GPU, a framework's
  launcher, or that are fragments (say which test runs the real thing).

``bash`` and other blocks are not executed. Blocks inside lists or admonitions (indented fences)
count too. Each block runs in a temporary working directory (checkpoints it writes go there).
"""
from __future__ import annotations

import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+.-]*)")
MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<what>continue|skip)\s*(?:\((?P<why>.*)\))?\s*-->\s*$")
PYTHON = {"python", "py", "python3"}


@dataclass
class Block:
    path: str  # relative to the repository root
    line: int  # the opening fence's line, 1-based
    code: str
    skip: str | None = None
    continues: bool = False
    chain: list["Block"] = field(default_factory=list)  # the blocks it builds on, first first

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group("indent"), m.group("fence"), m.group("lang").lower()
        start = i
        body: list[str] = []
        i += 1
        # The fence closes on a line of at least as many of the same characters and nothing else.
        closing = re.compile(r"^[ \t]*" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$")
        while i < len(lines) and not closing.match(lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        if lang not in PYTHON:
            continue
        code = textwrap.dedent("\n".join(l[len(indent):] if l.startswith(indent) else l for l in body))
        block = Block(rel, start + 1, code + "\n")
        marker = MARKER.match(lines[start - 1]) if start > 0 else None
        if marker:
            if marker.group("what") == "skip":
                block.skip = (marker.group("why") or "").strip() or "marked skip (no reason given)"
            else:
                block.continues = True
        if block.continues:
            if not found:
                raise ValueError(f"{block.id}: 'example: continue' on the first python block of the file")
            prev = found[-1]
            block.chain = prev.chain + [prev]
        found.append(block)
    return found


def documents() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md")) if (ROOT / "docs").is_dir() else []
    return [ROOT / "README.md", *docs]


ALL_BLOCKS = [b for doc in documents() for b in blocks_of(doc)]


def small_world() -> dict:
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import accum_fused

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    loader = [(torch.randn(n, 8), torch.randn(n, 1)) for n in (5, 3, 8, 2, 7, 4, 6, 1, 5, 3)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = _Scheduler()
    return dict(__name__="__docs_example__", math=math, torch=torch, nn=nn, F=F, accum_fused=accum_fused,
                model=model, loader=loader, loss_fn=F.mse_loss, opt=opt, scheduler=scheduler)


class _Scheduler:
    """The stand-in ``scheduler`` of blocks that step one without building it: counts its steps.
    (A real one built on the small world's ``opt`` would warn when a block steps it after
    stepping another optimizer.)"""

    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> None:
        self.steps += 1


def _run(block: Block, namespace: dict) -> None:
    exec(compile(block.code, block.id, "exec"), namespace)


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_example(block: Block, tmp_path, monkeypatch):
    for earlier in [*block.chain, block]:
        if earlier.skip:
            why = earlier.skip if earlier is block else f"builds on {earlier.id}, skipped: {earlier.skip}"
            pytest.skip(f"{block.id}: {why}")
    monkeypatch.chdir(tmp_path)
    namespace = small_world()
    for earlier in block.chain:
        try:
            _run(earlier, namespace)
        except Exception as exc:  # the chain's failure is this block's, reported as such
            pytest.fail(f"{earlier.id}, which {block.id} builds on, raised {type(exc).__name__}: {exc}")
    _run(block, namespace)


def test_markers_parse():
    """A misspelt marker would silently run (or not skip) a block: every `<!-- example...` comment
    in front of a fence is one of the two forms."""
    bad = []
    for doc in documents():
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            if re.match(r"^\s*<!--\s*example", line) and not MARKER.match(line):
                bad.append(f"{doc.relative_to(ROOT).as_posix()}:{n}: {line.strip()}")
    assert not bad, "unrecognised example markers:\n" + "\n".join(bad)
