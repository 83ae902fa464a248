"""The README's pictures from a finished run: python -m launch.readme_figures --workdir=runs/demo --out=docs/images

Entry point only (`make readme-figures` runs `make demo` first when runs/demo has no run_summary.json).
Renders from the run's raw outputs, so the pictures follow the current plotting code:
- <out>/reward.png: the reward curve of metrics.jsonl with the greedy accuracy of run_summary.json;
- <out>/timeline.png: the phase timeline of the last --timeline_steps steps of trace.json.
"""

import dataclasses
import json
import os

from absl import app, flags

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Defined when run as a program only: importing this module (tests do) leaves flags.FLAGS alone."""
    flags.DEFINE_string("workdir", "runs/demo", "A finished run (metrics.jsonl, trace.json, run_summary.json).")
    flags.DEFINE_string("out", "docs/images", "Directory the PNGs are written to.")
    flags.DEFINE_integer("timeline_steps", 3, "Steps shown in timeline.png (the last ones).", lower_bound=1)


def spans_from_chrome_trace(path: str) -> list:
    """trace.json (``trace.write_chrome_trace``) back to ``trace.Span``s."""
    from rollplex_jax.trace import Span

    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = []
    for e in events:
        if e.get("ph") != "X":
            continue
        args = dict(e.get("args", {}))
        step = int(args.pop("step", 0))
        start = e["ts"] / 1e6
        spans.append(Span(e["cat"], e["name"], step, start, start + e["dur"] / 1e6, args))
    return spans


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from rollplex_jax.run import outputs
    from rollplex_jax.trace import plot_timeline

    wd, out = FLAGS.workdir, FLAGS.out
    needed = ("metrics.jsonl", "trace.json", "run_summary.json")
    missing = [n for n in needed if not os.path.exists(os.path.join(wd, n))]
    if missing:
        raise app.UsageError(f"--workdir={wd} is not a finished run (missing {', '.join(missing)}); run `make demo`")
    with open(os.path.join(wd, "run_summary.json")) as f:
        summary = json.load(f)
    cfg = summary.get("config", {})
    rows = outputs.read_metrics(wd)
    os.makedirs(out, exist_ok=True)
    written = [outputs.plot_reward(rows, os.path.join(out, "reward.png"),
                                   eval_accuracy=summary.get("eval/greedy_accuracy"),
                                   reward_name=cfg.get("rl", {}).get("reward"))]

    spans = spans_from_chrome_trace(os.path.join(wd, "trace.json"))
    # The tracer numbers steps from 0, metrics.jsonl from 1: label the steps as the reward curve does.
    offset = int(summary.get("steps_done", 0)) - max((s.step for s in spans), default=0)
    spans = [dataclasses.replace(s, step=s.step + offset) for s in spans]
    shown = sorted({s.step for s in spans})[-FLAGS.timeline_steps:]
    schedule = cfg.get("run", {}).get("schedule", "serial")
    path = os.path.join(out, "timeline.png")
    plot_timeline(spans, path, steps=shown, title=f"{schedule} schedule: phases of the last {len(shown)} steps "
                                                  f"(time since the run started)")
    written.append(path)

    for p in written:
        print(p)


if __name__ == "__main__":
    define_flags()
    app.run(main)
