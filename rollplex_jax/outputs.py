"""Run outputs (a contract: tests, benchmarks and notebooks read these; ARCHITECTURE.md "Run outputs").

<workdir>/metrics.jsonl (one object per step), TensorBoard event files (every metric as a
scalar), run_summary.json, plots/reward.png.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np


class MetricsWriter:
    """Appends one JSON object per step to metrics.jsonl and every scalar to TensorBoard."""

    def __init__(self, workdir: str, keep_steps: int = 0):
        """Starts metrics.jsonl afresh, or (a resumed run) keeps its rows of steps <= ``keep_steps``."""
        from tensorboardX import SummaryWriter

        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        kept = [r for r in read_metrics(workdir) if r["step"] <= keep_steps] if keep_steps and \
            os.path.exists(self.path) else []
        with open(self.path + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(self.path + ".tmp", self.path)
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(logdir=os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
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


def plot_reward(rows: list[dict], path: str, window: int = 20) -> str:
    """Reward per step with a moving average and the greedy-eval accuracy if known; PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = np.array([r["step"] for r in rows])
    reward = np.array([r.get("reward/mean", np.nan) for r in rows], float)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, lw=0.8, alpha=0.5, label="mean reward per step")
    if len(reward) >= window:
        ma = np.convolve(reward, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], ma, lw=2, label=f"moving average ({window} steps)")
    skipped = [r["step"] for r in rows if r.get("skipped_steps/no_signal")]
    if skipped:
        ax.plot(skipped, np.full(len(skipped), -0.03), "|", color="grey", label="no-signal step (update skipped)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward (fraction of answers correct)")
    ax.set_ylim(-0.06, 1.05)
    ax.set_title("Training reward")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
