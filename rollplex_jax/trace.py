"""A phase timeline for RL steps: record spans, export a Chrome trace, draw a Gantt chart.

The scheduler runs each step's phases on lanes; within a step, lanes may overlap in time (with the
Rollplex schedule the "JAX prefix" programs run while "torch decode" decodes); steps do not overlap
(the update of step k ends before the rollout of step k+1 starts: on-policy). A `Tracer` records
each phase as a `Span` on its lane;
`write_chrome_trace` writes `trace.json` for Perfetto / chrome://tracing and
`plot_timeline` draws `plots/timeline.png` (see ARCHITECTURE.md, "Run outputs").
Times are seconds since the tracer was created; no global state, one tracer per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

# Rows top to bottom in the order data flows through a step; unknown lanes follow.
LANE_ORDER = ("torch decode", "JAX prefix", "overlap", "JAX suffix", "rewards", "update", "weights", "host")


@dataclasses.dataclass(frozen=True)
class Span:
    """One phase on one lane: [start, end] in seconds since the tracer's creation."""
    lane: str
    name: str
    step: int
    start: float
    end: float
    args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Tracer:
    """Collects spans. Use `span` around synchronous work, `add` for work timed elsewhere."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._t0 = clock()
        self._spans: list[Span] = []

    def now(self) -> float:
        """Seconds since creation: the time base for `add`'s start and end."""
        return self._clock() - self._t0

    @contextlib.contextmanager
    def span(self, lane: str, name: str, step: int, **args) -> Iterator[None]:
        """Records the wall-clock time of the `with` body (also when it raises)."""
        start = self.now()
        try:
            yield
        finally:
            self.add(lane, name, step, start, self.now(), **args)

    def add(self, lane: str, name: str, step: int, start: float, end: float, **args) -> Span:
        """Records a span measured elsewhere, e.g. async JAX work whose end was observed later.

        Args:
          start, end: seconds in this tracer's time base (take them from `now()`).
        Returns:
          The recorded span.
        """
        if end < start:
            raise ValueError(f"span {lane}/{name} ends before it starts: {start} > {end}")
        s = Span(lane, name, int(step), float(start), float(end), dict(args))
        self._spans.append(s)
        return s

    @property
    def spans(self) -> list[Span]:
        return list(self._spans)

    def phase_totals(self, step: int | None = None) -> dict[str, float]:
        """Seconds per phase name, summed over lanes (and over all steps when `step` is None)."""
        totals: dict[str, float] = {}
        for s in self._spans:
            if step is None or s.step == step:
                totals[s.name] = totals.get(s.name, 0.0) + s.duration
        return totals


def ordered_lanes(spans: Iterable[Span]) -> list[str]:
    """Lanes present in `spans`: those of LANE_ORDER in that order, then others as first seen."""
    seen = list(dict.fromkeys(s.lane for s in spans))
    return [lane for lane in LANE_ORDER if lane in seen] + [lane for lane in seen if lane not in LANE_ORDER]


def chrome_trace_events(spans: Sequence[Span]) -> list[dict]:
    """Trace Event Format: process/thread metadata ("M") then one complete event ("X") per span."""
    tids = {lane: i + 1 for i, lane in enumerate(ordered_lanes(spans))}
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rollplex"}}]
    for lane, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": lane}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
    for s in spans:
        events.append({"name": s.name, "cat": s.lane, "ph": "X", "ts": s.start * 1e6, "dur": s.duration * 1e6,
                       "pid": 0, "tid": tids[s.lane], "args": {"step": s.step, **s.args}})
    return events


def write_chrome_trace(spans: Sequence[Span], path) -> None:
    """Writes `{"traceEvents": [...]}` (ts/dur in µs); non-JSON args are written as strings."""
    with open(path, "w") as f:
        json.dump({"traceEvents": chrome_trace_events(spans), "displayTimeUnit": "ms"}, f, default=str)


def _phase_colors(names: Iterable[str]) -> dict[str, Any]:
    import matplotlib

    names = sorted(set(names))  # sorted: a phase keeps its colour across runs and plots
    cmap = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"]
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _draw_lanes(ax, spans: Sequence[Span], colors: Mapping[str, Any], offset: float = 0.0) -> None:
    """One row per lane, a bar per span (longest first so nested spans stay visible), step lines."""
    lanes = ordered_lanes(spans)
    row = {lane: i for i, lane in enumerate(lanes)}
    for s in sorted(spans, key=lambda s: -s.duration):
        ax.barh(row[s.lane], s.duration, left=s.start - offset, height=0.6, color=colors[s.name],
                edgecolor="white", linewidth=0.5)
    step_starts: dict[int, float] = {}
    for s in spans:
        step_starts[s.step] = min(step_starts.get(s.step, s.start), s.start)
    for step, t in sorted(step_starts.items()):
        ax.axvline(t - offset, color="0.8", linewidth=0.8, zorder=0)
        ax.text(t - offset, 1.01, f"step {step}", transform=ax.get_xaxis_transform(), fontsize=7, color="0.4")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(max(len(lanes), 1) - 0.5, -0.5)  # first lane on top
    ax.grid(axis="x", color="0.93", linewidth=0.5)
    ax.set_axisbelow(True)


def _legend(fig, colors: Mapping[str, Any]) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=name) for name, c in colors.items()]
    fig.legend(handles=handles, loc="center right", fontsize=7, frameon=False, title="phase", title_fontsize=8)


def _save(fig, path, legend_width: float = 0.12) -> None:
    fig.tight_layout(rect=(0, 0, 1 - legend_width, 1))
    fig.savefig(path, dpi=150)


def _figure(height: float, ratios: Sequence[float]):
    # A bare Figure renders with Agg and leaves pyplot's global state (and a notebook's backend) alone.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, height))
    axes = fig.subplots(len(ratios), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": ratios})
    return fig, list(axes[:, 0])


def plot_timeline(spans: Sequence[Span], path, *, title: str | None = None,
                  steps: Iterable[int] | None = None) -> None:
    """Gantt chart PNG (10x3.5 in): rows are lanes, bars coloured by phase, steps marked.

    Args:
      spans: spans of one run, times in seconds since its tracer started.
      path: where to write the PNG.
      title: figure title.
      steps: only draw spans of these steps (default: all).
    """
    if steps is not None:
        keep = set(steps)
        spans = [s for s in spans if s.step in keep]
    colors = _phase_colors(s.name for s in spans)
    fig, (ax,) = _figure(3.5, [1.0])
    _draw_lanes(ax, spans, colors)
    if not spans:
        ax.text(0.5, 0.5, "no spans", transform=ax.transAxes, ha="center")
    ax.set_xlabel("time (s)")
    if title:
        ax.set_title(title, fontsize=10, pad=14)
    _legend(fig, colors)
    _save(fig, path)


def plot_timelines_side_by_side(span_sets: Mapping[str, Sequence[Span]], path) -> None:
    """Several runs (e.g. serial vs rollplex) stacked on one time axis, each from its first span.

    Args:
      span_sets: label -> spans of that run.
      path: where to write the PNG.
    """
    colors = _phase_colors(s.name for spans in span_sets.values() for s in spans)
    heights = [0.7 + 0.3 * max(1, len(ordered_lanes(spans))) for spans in span_sets.values()]
    fig, axes = _figure(max(3.5, 0.6 + sum(heights)), heights)
    for ax, (label, spans) in zip(axes, span_sets.items(), strict=True):
        _draw_lanes(ax, spans, colors, offset=min((s.start for s in spans), default=0.0))
        ax.set_title(label, fontsize=9, loc="left", pad=12)
    axes[-1].set_xlabel("time (s)")
    _legend(fig, colors)
    _save(fig, path)


def overlap_stats(spans: Iterable[Span], alone_rollout_s: Mapping[int, float]) -> dict[int, dict[str, float]]:
    """Per step, what overlapping the prefix programs with the decode cost and hid.

    Args:
      spans: one run's spans; a step counts when it has a "rollout" (torch decode) and a "prefix" span.
      alone_rollout_s: step -> seconds the same step's rollout takes with nothing beside it (the bench
        takes serial's rollout of that step: the same answers from the same params, in the same process).
    Returns:
      step -> ``decode_slowdown_s`` (rollout here minus alone; absent without an alone time),
      ``hidden_prefix_s`` (prefix time inside the decode's span), ``exposed_prefix_s`` (prefix time after
      the decode ended, on the critical path), ``critical_path_saving_s`` (hidden minus slowdown: the
      paper's min(T_prefix - slowdown, T_decode), with T_prefix the prefix's span in this run).
    """
    out = {}
    for step, (roll, pre) in sorted(_rollout_and_prefix(spans).items()):
        hidden = max(0.0, min(pre.end, roll.end) - max(pre.start, roll.start))
        row = {"hidden_prefix_s": hidden, "exposed_prefix_s": max(0.0, pre.end - max(roll.end, pre.start))}
        if step in alone_rollout_s:
            row["decode_slowdown_s"] = roll.duration - alone_rollout_s[step]
            row["critical_path_saving_s"] = hidden - row["decode_slowdown_s"]
        out[step] = row
    return out


def overlap_spans(spans: Iterable[Span], stats: Mapping[int, Mapping[str, float]]) -> list[Span]:
    """Spans on an "overlap" lane that draw ``overlap_stats``: each step's hidden prefix time (the prefix's part
    inside the decode) and its decode slowdown (the end of the rollout beyond its alone time), both with the
    step's stats as args."""
    pairs = _rollout_and_prefix(spans)
    out = []
    for step, row in stats.items():
        roll, pre = pairs[step]
        start = max(pre.start, roll.start)
        out.append(Span("overlap", "hidden prefix", step, start, start + row["hidden_prefix_s"], dict(row)))
        slow = row.get("decode_slowdown_s", 0.0)
        if slow > 0:
            out.append(Span("overlap", "decode slowdown", step, roll.end - min(slow, roll.duration), roll.end,
                            dict(row)))
    return out


def _rollout_and_prefix(spans: Iterable[Span]) -> dict[int, tuple[Span, Span]]:
    """step -> (its "rollout" span, its "prefix" span), for the steps that have both."""
    by_step: dict[int, dict[str, Span]] = {}
    for s in spans:
        if s.name in ("rollout", "prefix"):
            by_step.setdefault(s.step, {})[s.name] = s
    return {step: (d["rollout"], d["prefix"]) for step, d in by_step.items() if len(d) == 2}
