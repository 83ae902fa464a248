"""Run outputs (a contract: tests, benchmarks and notebooks read these; ARCHITECTURE.md "Run outputs").

<workdir>/metrics.jsonl (one object per step; validation's val/* join the row of the step they ran at,
and a validation before training is a row of step 0 with only val/*), TensorBoard event files (every
metric as a scalar), run_summary.json, plots/reward.png, val_generations.jsonl (validation.py).
Also the helpers notebooks draw with: ``metrics_columns``,
``draw_reward`` (into a matplotlib Axes), ``memory_by_phase`` and ``draw_memory``; the loop's ``progress_bar`` and
``NoWriter`` (the metrics sink of processes other than 0).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys

import numpy as np

from rollplex_jax.memory.meter import peak_row


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl and every scalar to TensorBoard."""

    def __init__(self, workdir: str, keep_steps: int = 0):
        """Starts metrics.jsonl afresh, or (a resumed run) keeps its rows of steps <= ``keep_steps``."""
        from tensorboardX import SummaryWriter

        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        kept = [r for r in read_metrics(workdir) if r["step"] <= keep_steps] if keep_steps and \
            os.path.exists(self.path) else []
        self._last: tuple[int, int, dict] | None = None  # (file offset, step, row) of the last row
        with open(self.path + ".tmp", "w") as f:
            for r in kept:
                self._last = (f.tell(), r["step"], r)
                f.write(json.dumps(r) + "\n")
        os.replace(self.path + ".tmp", self.path)
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(logdir=os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._last = (self._file.tell(), step, row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._scalars(step, metrics)

    def amend(self, step: int, metrics: dict[str, float]) -> None:
        """Adds ``metrics`` to the row of ``step`` when it is the last one written, else writes a new row."""
        if self._last is None or self._last[1] != step:
            self.write(step, metrics)
            return
        offset, _, row = self._last
        row = {**row, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.truncate(offset)
        self._file.seek(offset)
        self._last = (offset, step, row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._scalars(step, metrics)

    def _scalars(self, step: int, metrics: dict) -> None:
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()


def _jsonable(v):
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_summary(workdir: str, summary: dict) -> str:
    path = os.path.join(workdir, "run_summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2, default=_jsonable)
    os.replace(path + ".tmp", path)
    return path


def metrics_columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """metrics.jsonl rows -> columns: ``step`` (int64) and every other key (float64, NaN where missing).

    Non-finite values written as strings ("nan", "inf") come back as floats; other non-numbers are NaN.
    """
    keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "step"]
    cols = {"step": np.array([int(r["step"]) for r in rows], np.int64)}
    for k in keys:
        cols[k] = np.array([_as_float(r.get(k)) for r in rows], np.float64)
    return cols


def _as_float(v) -> float:
    if isinstance(v, (bool, int, float, np.integer, np.floating)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan


def _figure(width: float, height: float):
    # A bare Figure renders with Agg and leaves pyplot's global state (and a notebook's backend) alone.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def draw_reward(ax, rows: list[dict], window: int = 20, *, eval_accuracy: float | None = None,
                reward_name: str | None = None, title: str | None = "Training reward") -> None:
    """Draws the reward curve of metrics rows into a matplotlib Axes (what ``plot_reward`` saves).

    Mean reward of each step's B x G answers, a moving average (``window`` steps, shortened for short
    runs), the steps whose update was skipped for lack of signal, the validation reward (``val/reward_score``:
    one answer per held-out prompt) at the steps it ran when there is one, and the greedy accuracy on held-out
    prompts at the last step when ``eval_accuracy`` is given.
    """
    val = [(r["step"], _as_float(r["val/reward_score"])) for r in rows if "val/reward_score" in r]
    rows = [r for r in rows if "reward/mean" in r]  # a validation before training is a row without it
    steps = np.array([r["step"] for r in rows], float)
    reward = np.array([_as_float(r.get("reward/mean")) for r in rows], float)
    few = len(steps) <= 30
    ax.plot(steps, reward, lw=0.8 if not few else 1.2, alpha=0.5 if not few else 0.9, marker="o" if few else None,
            ms=3, label="mean reward of the step's answers")
    w = min(window, len(reward) // 5)
    if w >= 2:
        ma = np.convolve(reward, np.ones(w) / w, mode="valid")
        ax.plot(steps[w - 1:], ma, lw=2, label=f"moving average ({w} steps)")
    skipped = [r["step"] for r in rows if r.get("skipped_steps/no_signal")]
    if skipped:
        ax.plot(skipped, np.full(len(skipped), -0.03), "|", color="grey", label="no-signal step (update skipped)")
    if val:
        ax.plot([v[0] for v in val], [v[1] for v in val], "s-", ms=4, lw=1.2, color="tab:green", zorder=4,
                label="validation reward (one answer per held-out prompt)")
    if eval_accuracy is not None and len(steps):
        ax.plot([steps[-1]], [eval_accuracy], "*", ms=12, color="tab:red", zorder=5,
                label=f"greedy accuracy on held-out prompts ({eval_accuracy:.2f})")
    values = np.concatenate([reward[np.isfinite(reward)], [v[1] for v in val if math.isfinite(v[1])]])
    if eval_accuracy is not None:
        values = np.append(values, eval_accuracy)
    if values.size == 0 or (values.min() >= 0.0 and values.max() <= 1.0):
        ax.set_ylim(-0.06, 1.05)  # a 0/1 reward: its mean is the fraction of answers that were right
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward per answer" + (f" ({reward_name})" if reward_name else ""))
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(steps) or val:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no steps yet", transform=ax.transAxes, ha="center")


def plot_reward(rows: list[dict], path: str, window: int = 20, *, eval_accuracy: float | None = None,
                reward_name: str | None = None) -> str:
    """Reward per step with a moving average and the greedy-eval accuracy if given (``draw_reward``); PNG."""
    fig, ax = _figure(7, 4)
    draw_reward(ax, rows, window, eval_accuracy=eval_accuracy, reward_name=reward_name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# --- memory per phase (metrics memory/<phase>_peak_bytes and memory/<phase>/<class>_bytes) -------------------
_PEAK = re.compile(r"^memory/([^/]+)_peak_bytes$")
_CLASS = re.compile(r"^memory/([^/]+)/(.+)_bytes$")


def memory_by_phase(rows: list[dict]) -> dict[str, dict]:
    """The last row's memory metrics: ``{phase: {"peak_bytes": float | None, "classes": {class: bytes}}}``.

    Phases in step order (rollout, score, train, update, then others as found); {} when no row has any.
    """
    row = next((r for r in reversed(rows) if any(_PEAK.match(k) or _CLASS.match(k) for k in r)), None)
    if row is None:
        return {}
    out: dict[str, dict] = {}
    for k, v in row.items():
        if m := _PEAK.match(k):
            out.setdefault(m.group(1), {"peak_bytes": None, "classes": {}})["peak_bytes"] = _as_float(v)
        elif m := _CLASS.match(k):
            out.setdefault(m.group(1), {"peak_bytes": None, "classes": {}})["classes"][m.group(2)] = _as_float(v)
    from rollplex_jax.memory.classes import PHASES

    order = [p for p in PHASES if p in out] + [p for p in out if p not in PHASES]
    return {p: out[p] for p in order}


def _byte_unit(n: float) -> tuple[str, float]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, scale
    return "bytes", 1.0


def draw_memory(ax, rows: list[dict], *, title: str | None = "Device memory per phase") -> bool:
    """Stacked bars of live bytes per buffer class for each phase, a black tick at each phase's peak.

    Returns False (and writes a note into the Axes) when the rows have no memory metrics.
    """
    mem = memory_by_phase(rows)
    if not mem:
        ax.text(0.5, 0.5, "no memory/* metrics in this run", transform=ax.transAxes, ha="center")
        ax.set_axis_off()
        return False
    peaks = [d["peak_bytes"] or 0.0 for d in mem.values()]
    totals = [sum(d["classes"].values()) for d in mem.values()]
    unit, scale = _byte_unit(max(peaks + totals + [1.0]))
    phases = list(mem)
    x = np.arange(len(phases))
    classes = list(dict.fromkeys(c for d in mem.values() for c in d["classes"]))
    bottom = np.zeros(len(phases))
    for c in classes:
        vals = np.array([mem[p]["classes"].get(c, 0.0) for p in phases]) / scale
        ax.bar(x, vals, bottom=bottom, width=0.6, label=c)
        bottom += vals
    if any(d["peak_bytes"] is not None for d in mem.values()):
        ax.hlines(np.array(peaks) / scale, x - 0.35, x + 0.35, colors="black", lw=2, zorder=5, label="measured peak")
    ax.set_xticks(x, phases)
    ax.set_xlabel("phase of the RL step")
    ax.set_ylabel(f"device memory ({unit})")
    if title:
        ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.legend(fontsize=7, title="buffer class" if classes else None, title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    return True


def plot_memory(history: list[dict], path: str, title: str = "device memory per phase (peak step)") -> None:
    """plots/memory.png: per phase, the live bytes by buffer class at its peak step (stacked bars)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    draw_memory(ax, [peak_row(history)], title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def progress_bar(total: int):
    """The loop's progress bar on stderr (``--progress``)."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()  # in a log file (SLURM, make demo > log) one line per 30 s, not per step
    return tqdm(total=total, desc="GRPO", unit="step", dynamic_ncols=True, file=sys.stderr,
                mininterval=0.1 if tty else 30.0, maxinterval=10.0 if tty else 60.0)


class NoWriter:
    """Metrics sink of processes other than 0 (process 0 writes metrics.jsonl and TensorBoard)."""

    def write(self, step: int, metrics: dict) -> None:
        pass

    def amend(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass
