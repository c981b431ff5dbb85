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


def test_the_memory_picture_says_what_its_benchmark_measured():
    """What the memory guide says beside the picture, read from the same JSON it is drawn from."""
    import json
    curves = make_figures.memory_curves(json.loads(make_figures.MEMORY_RESULTS.read_text(encoding="utf-8")))
    fp32, bf16 = curves["fp32"], curves["bf16"]
    assert set(fp32) == set(bf16) == {"native loop", "plain", "mode A", "mode B"}
    for name, (_, ys) in fp32.items():  # between windows: parameters and two moments
        assert abs(ys[0] - 12) < 0.1, (name, ys[0])
    native_peak = max(fp32["native loop"][1])
    for name in ("mode A", "mode B"):
        assert abs(max(fp32[name][1]) - native_peak) < 1e-3 * native_peak
    assert max(fp32["plain"][1]) > 1.05 * native_peak  # (.grad and the buffer together until step())
    for name in ("plain", "mode A", "mode B"):  # bf16: fp32 sums and state, on purpose
        assert abs((bf16[name][1][0] - bf16["native loop"][1][0]) - 8) < 0.1


def test_the_memory_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    assert (ROOT / "docs" / "images" / "memory_window.svg").is_file()
    make_figures.draw_memory(tmp_path / "memory_window.svg")
    assert (tmp_path / "memory_window.svg").stat().st_size > 10_000


def test_the_performance_summary_table_is_its_pictures_data():
    """docs/performance.md's summary table: each cell the median (and range) of the runs the
    summary picture draws, from the same JSON."""
    import re
    import statistics
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    table = page[page.index("| case | plain | mode A | mode B |"):].split("\n\n", 1)[0].splitlines()[2:]
    cells = [re.findall(r"(\d\.\d\d) \((\d\.\d\d)–(\d\.\d\d)\)", row) for row in table]
    ratios = make_figures.performance_ratios()
    assert len(cells) == len(ratios)
    for row, values in zip(cells, ratios.values()):
        expected = [(f"{statistics.median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}") for v in values.values()]
        assert row == expected


def test_the_performance_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    assert (ROOT / "docs" / "images" / "performance_summary.svg").is_file()
    make_figures.draw_performance(tmp_path / "performance_summary.svg")
    assert (tmp_path / "performance_summary.svg").stat().st_size > 10_000


def test_the_window_states_picture_shows_the_close_in_close_pys_order(tmp_path):
    """The close's boxes (CLOSE_STEPS) are close.close's calls, in its order: the ranks' sums and
    the non-finite check (agree), clipping (clip_coefficient), the update (update_spec.apply)."""
    import inspect

    from accum_fused.window import close
    source = inspect.getsource(close.close)
    calls = ["agree(", "clip_coefficient(", "update_spec.apply("]
    assert [source.index(call) for call in calls] == sorted(source.index(call) for call in calls)
    assert [step.split("\n")[0] for step in make_figures.CLOSE_STEPS] == [
        "all-reduce sums", "non-finite", "clip to", "update with"]
    source = inspect.getsource(close.agree)
    assert source.index("reduce_window(") < source.index("found_inf")  # (the sums first, then the check)
    pytest.importorskip("matplotlib")
    assert "<svg" in (ROOT / "docs" / "images" / "window_states.svg").read_text(encoding="utf-8")[:500]
    make_figures.draw_states(tmp_path / "window_states.svg")
    assert (tmp_path / "window_states.svg").stat().st_size > 5_000
