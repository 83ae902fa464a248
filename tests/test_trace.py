"""Phase tracer: span recording, Chrome trace export, timeline plots."""

import json
import time

import numpy as np
import pytest
from PIL import Image

from rollplex_jax.trace import (
    LANE_ORDER,
    Span,
    Tracer,
    chrome_trace_events,
    ordered_lanes,
    overlap_spans,
    overlap_stats,
    plot_timeline,
    plot_timelines_side_by_side,
    write_chrome_trace,
)


def _fake_run(overlap: bool, steps: int = 3) -> list[Span]:
    """Deterministic spans shaped like a serial or an overlapped schedule."""
    t = Tracer(clock=lambda: 0.0)
    now = 0.0
    for k in range(steps):
        t.add("torch decode", "decode", k, now, now + 1.0)
        t.add("rewards", "rewards", k, now + 1.0, now + 1.1)
        t.add("JAX prefix", "prefix", k, now + 1.1, now + 1.4, tokens=128)
        t.add("JAX suffix", "suffix", k, now + 1.4, now + 1.9)
        t.add("update", "update", k, now + 1.9, now + 2.5)
        t.add("host", "publish", k, now + 2.5, now + 2.55)
        now += 1.2 if overlap else 2.55
    return t.spans


def test_span_records_nested_and_sequential():
    t = Tracer()
    with t.span("update", "update", 0, lr=1e-3):
        with t.span("host", "inner", 0):
            time.sleep(0.002)
    with t.span("rewards", "rewards", 1):
        time.sleep(0.001)
    inner, outer, rew = t.spans  # the inner span closes first
    assert (outer.lane, outer.name, outer.step, outer.args) == ("update", "update", 0, {"lr": 1e-3})
    assert all(s.duration > 0 for s in t.spans)
    assert outer.start <= inner.start < inner.end <= outer.end <= rew.start < rew.end
    assert 0.0 <= outer.start and rew.end <= t.now()


def test_span_recorded_when_body_raises():
    t = Tracer()
    with pytest.raises(RuntimeError):
        with t.span("host", "boom", 0):
            raise RuntimeError
    assert [s.name for s in t.spans] == ["boom"]


def test_add_and_phase_totals():
    t = Tracer()
    s = t.add("JAX suffix", "suffix", 2, 1.0, 1.5, tokens=7)
    assert s == Span("JAX suffix", "suffix", 2, 1.0, 1.5, {"tokens": 7})
    t.add("JAX suffix", "suffix", 3, 2.0, 2.25)
    t.add("update", "update", 3, 2.25, 3.0)
    assert t.phase_totals() == pytest.approx({"suffix": 0.75, "update": 0.75})
    assert t.phase_totals(step=3) == pytest.approx({"suffix": 0.25, "update": 0.75})
    assert t.phase_totals(step=9) == {}
    with pytest.raises(ValueError):
        t.add("update", "update", 0, 2.0, 1.0)
    t.spans.clear()  # a copy: the tracer's own list is untouched
    assert len(t.spans) == 3


def test_lane_order():
    spans = [Span(lane, "x", 0, 0.0, 1.0) for lane in ["misc", "update", "torch decode", "JAX suffix"]]
    assert ordered_lanes(spans) == ["torch decode", "JAX suffix", "update", "misc"]
    assert ordered_lanes([Span(lane, "x", 0, 0.0, 1.0) for lane in LANE_ORDER]) == list(LANE_ORDER)


def test_chrome_trace_is_valid(tmp_path):
    spans = _fake_run(overlap=True)
    path = tmp_path / "trace.json"
    write_chrome_trace(spans, path)
    events = json.loads(path.read_text())["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    assert len(xs) == len(spans)
    for e, s in zip(xs, spans, strict=True):
        assert {"name", "ph", "ts", "dur", "pid", "tid", "args"} <= e.keys()
        assert e["pid"] == 0 and isinstance(e["tid"], int)
        assert e["name"] == s.name and e["args"]["step"] == s.step
        assert e["ts"] == pytest.approx(s.start * 1e6) and e["dur"] == pytest.approx(s.duration * 1e6)
    assert {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rollplex"}} in meta
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted({s.lane for s in spans})
    assert all(names[e["tid"]] == s.lane for e, s in zip(xs, spans, strict=True))
    assert xs[2]["args"] == {"step": 0, "tokens": 128}


def test_chrome_trace_stringifies_odd_args(tmp_path):
    t = Tracer()
    t.add("host", "h", 0, 0.0, 1.0, shape=(2, 3), dtype=np.dtype("float32"))
    write_chrome_trace(t.spans, tmp_path / "t.json")
    (x,) = [e for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert x["args"] == {"step": 0, "shape": [2, 3], "dtype": "float32"}
    assert chrome_trace_events([])[0]["name"] == "process_name"


def _check_png(path, size):
    assert path.stat().st_size > 5_000
    img = np.asarray(Image.open(path).convert("RGB"))
    assert (img.shape[1], img.shape[0]) == size
    assert img.std() > 10  # not blank
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20  # several bar colours, text, lines


def test_plot_timeline(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(_fake_run(overlap=True), path, title="rollplex")
    _check_png(path, (1500, 525))
    plot_timeline(_fake_run(overlap=False), tmp_path / "two.png", steps=[1, 2])
    _check_png(tmp_path / "two.png", (1500, 525))
    plot_timeline([], tmp_path / "empty.png")  # nothing recorded yet: still a figure, no crash
    assert (tmp_path / "empty.png").exists()


def test_plot_side_by_side(tmp_path):
    path = tmp_path / "compare.png"
    plot_timelines_side_by_side({"serial": _fake_run(overlap=False), "rollplex": _fake_run(overlap=True)}, path)
    assert path.stat().st_size > 5_000
    img = Image.open(path)
    assert img.size[0] == 1500 and img.size[1] > 525
    assert np.asarray(img.convert("L")).std() > 10


def test_overlap_stats_hidden_exposed_and_slowdown():
    t = Tracer(clock=lambda: 0.0)
    t.add("JAX prefix", "prefix", 0, 0.9, 1.7)  # dispatched just before the decode [1, 2]: all hidden
    t.add("torch decode", "rollout", 0, 1.0, 2.0)
    t.add("JAX prefix", "prefix", 1, 4.9, 6.5)  # runs 0.5 s past the decode [5, 6]
    t.add("torch decode", "rollout", 1, 5.0, 6.0)
    t.add("torch decode", "rollout", 2, 8.0, 8.5)  # no prefix (serial): no row
    stats = overlap_stats(t.spans, {0: 0.75, 1: 0.5})
    assert sorted(stats) == [0, 1]
    assert stats[0] == pytest.approx({"hidden_prefix_s": 0.7, "exposed_prefix_s": 0.0, "decode_slowdown_s": 0.25,
                                      "critical_path_saving_s": 0.45})
    assert stats[1] == pytest.approx({"hidden_prefix_s": 1.0, "exposed_prefix_s": 0.5, "decode_slowdown_s": 0.5,
                                      "critical_path_saving_s": 0.5})
    assert "decode_slowdown_s" not in overlap_stats(t.spans, {})[0]  # no alone time: no slowdown claimed


def test_overlap_stats_prefix_after_the_decode_hides_nothing():
    t = Tracer(clock=lambda: 0.0)
    t.add("torch decode", "rollout", 0, 0.0, 1.0)
    t.add("JAX prefix", "prefix", 0, 1.0, 1.3)  # --nooverlap: dispatched after the decode
    assert overlap_stats(t.spans, {0: 1.0})[0] == pytest.approx(
        {"hidden_prefix_s": 0.0, "exposed_prefix_s": 0.3, "decode_slowdown_s": 0.0, "critical_path_saving_s": 0.0})


def test_overlap_spans_draw_the_stats_per_step():
    t = Tracer(clock=lambda: 0.0)
    t.add("JAX prefix", "prefix", 0, 0.9, 1.7)
    t.add("torch decode", "rollout", 0, 1.0, 2.0)
    spans = overlap_spans(t.spans, overlap_stats(t.spans, {0: 0.75}))
    by_name = {s.name: s for s in spans}
    assert {s.lane for s in spans} == {"overlap"} and set(by_name) == {"hidden prefix", "decode slowdown"}
    assert (by_name["hidden prefix"].start, by_name["hidden prefix"].end) == pytest.approx((1.0, 1.7))
    assert (by_name["decode slowdown"].start, by_name["decode slowdown"].end) == pytest.approx((1.75, 2.0))
    assert by_name["decode slowdown"].args["critical_path_saving_s"] == pytest.approx(0.45)
