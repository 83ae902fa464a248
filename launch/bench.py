"""serial vs rollplex (and its two ablations) in one process, same seeds and data.

  python -m launch.bench --flagfile=configs/bench_cpu.flags [--bench_steps=4] [--bench_warmup=2]

Modes: serial; rollplex (prefix sharing + overlap); overlap_only (--noprefix_sharing);
sharing_only (--nooverlap). Each runs warm-up steps (compilation) then timed steps from the
same initial params and prompts; step_s is the median timed step. The updated params of every
mode are compared with serial's in units of the update (``rollplex_jax.equivalence``: per-element
|a - b| / (lr x updates), attention key biases excluded, their exact gradient is zero): equivalent
when the 99.9th percentile is <= --bench_tolerance (max and percentile in ``update_diff``);
``max_param_rel_diff`` (max over tensors of ||a - b|| / ||b||) is kept for reference.
Prints one JSON line last (ARCHITECTURE.md); writes trace.json per mode and
plots/timeline_compare.png (serial vs rollplex on one time axis) under --workdir.
"""

import dataclasses
import json
import os
import statistics
import sys

from absl import app, flags, logging

from launch import flags as launch_flags

_STEPS = flags.DEFINE_integer("bench_steps", 5, "Timed steps per mode.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("bench_warmup", 2, "Warm-up (compile) steps per mode.", lower_bound=0)
_TOL = flags.DEFINE_float("bench_tolerance", 0.02, "Equivalent when the 99.9th percentile of the per-element param "
                          "difference to serial is at most this fraction of the update scale (lr x updates): see "
                          "rollplex_jax/equivalence.py.")

MODES = {
    "serial": dict(schedule="serial"),
    "rollplex": dict(schedule="rollplex", prefix_sharing=True, overlap=True),
    "overlap_only": dict(schedule="rollplex", prefix_sharing=False, overlap=True),
    "sharing_only": dict(schedule="rollplex", prefix_sharing=True, overlap=False),
}


def run_mode(cfg, name: str, steps: int, warmup: int):
    import numpy as np

    from rollplex_jax.runner import Runner
    from rollplex_jax.trace import write_chrome_trace

    run = dataclasses.replace(cfg.run, workdir=os.path.join(cfg.run.workdir, name), steps=steps + warmup,
                              progress=False, **MODES[name])
    runner = Runner(dataclasses.replace(cfg, run=run))
    metrics = list(runner.run())
    timed = metrics[warmup:]
    spans = [s for s in runner.tracer.spans if s.step >= warmup]
    write_chrome_trace(spans, os.path.join(run.workdir, "trace.json"))
    params = {k: np.asarray(v) for k, v in runner.state.params.items()}
    runner.close()
    phases = {k[len("time/"):-2]: statistics.median(m.get(k, 0.0) for m in timed)
              for k in timed[0] if k.startswith("time/")}
    return {"step_s": statistics.median(m["time/step_s"] for m in timed), "phases_s": phases,
            "reward_mean": statistics.mean(m["reward/mean"] for m in timed)}, params, spans


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    import numpy as np

    from rollplex_jax.equivalence import ZERO_GRADIENT, update_distance
    from rollplex_jax.trace import plot_timelines_side_by_side

    cfg = launch_flags.config_from_flags(flags.FLAGS)
    results, params, spans = {}, {}, {}
    for name in MODES:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        results[name], params[name], spans[name] = run_mode(cfg, name, _STEPS.value, _WARMUP.value)
        print(f"bench: {name} step_s={results[name]['step_s']:.3f}", file=sys.stderr, flush=True)
    base = params["serial"]
    diffs = {name: max(float(np.linalg.norm(p[k] - base[k]) / (np.linalg.norm(base[k]) + 1e-30))
                       for k in base if not k.endswith(ZERO_GRADIENT))
             for name, p in params.items() if name != "serial"}
    updates = (_STEPS.value + _WARMUP.value) * cfg.rl.mini_batches
    dist = {name: update_distance(p, base, lr=cfg.optim.lr, updates=updates)
            for name, p in params.items() if name != "serial"}
    os.makedirs(os.path.join(cfg.run.workdir, "plots"), exist_ok=True)
    plot_timelines_side_by_side({"serial": spans["serial"], "rollplex": spans["rollplex"]},
                                os.path.join(cfg.run.workdir, "plots", "timeline_compare.png"))
    serial_s = results["serial"]["step_s"]
    out = {
        "modes": results,
        "speedup": {name: serial_s / results[name]["step_s"] for name in MODES if name != "serial"},
        "equivalent": all(d["p999"] <= _TOL.value for d in dist.values()),
        "update_diff": {name: {k: d[k] for k in ("max", "p999", "worst")} for name, d in dist.items()},
        "max_param_rel_diff": max(diffs.values()),  # per-tensor ||a - b|| / ||b||, for reference
        "param_rel_diff": diffs,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    launch_flags.define_flags()
    app.run(main)
