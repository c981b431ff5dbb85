"""docs/make_figures.py's window timeline shows what the library does: the records it draws
from (one loop of 10 micro-batches, k=4, per mode) say where each micro-batch's gradients went
and where the updates happened, and the committed picture is there."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_figures", ROOT / "docs" / "make_figures.py")
make_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_figures)


def _updates(events):
    return [(e["micro_batch"], e["call"]) for e in events if e["update"]]


def test_plain_mode_takes_grad_in_step_and_updates_on_every_kth_step_and_flush():
    events = make_figures.record("plain")
    assert all(e["grad_held"] for e in events if e["call"] == "loss.backward()")
    assert not any(e["grad_held"] for e in events if e["call"] == "opt.step(weight)")
    assert _updates(events) == [(3, "opt.step(weight)"), (7, "opt.step(weight)"), (None, "opt.flush()")]


def test_mode_a_takes_grads_in_backward_and_updates_in_the_loops_step():
    events = make_figures.record("mode A")
    assert not any(e["grad_held"] for e in events)
    assert _updates(events) == [(None, "opt.step()")] * 3


def test_mode_b_updates_inside_the_windows_last_backward():
    events = make_figures.record("mode B")
    assert not any(e["grad_held"] for e in events)
    assert _updates(events) == [(3, "opt.backward(loss, weight)"), (7, "opt.backward(loss, weight)"),
                                (None, "opt.flush()")]


def test_the_picture_is_committed_and_drawn_from_the_records(tmp_path):
    pytest.importorskip("matplotlib")
    committed = ROOT / "docs" / "images" / "window_timeline.svg"
    assert committed.is_file() and "<svg" in committed.read_text(encoding="utf-8")[:500]
    make_figures.draw(tmp_path / "window_timeline.svg")
    assert (tmp_path / "window_timeline.svg").stat().st_size > 10_000
