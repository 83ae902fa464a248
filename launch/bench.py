"""serial vs rollplex (and its two ablations) in one process, same seeds and data.

  python -m launch.bench --flagfile=configs/bench_cpu.flags [--bench_steps=4] [--bench_warmup=2]

Modes (``--bench_modes``, default all): serial; rollplex (prefix sharing + overlap); overlap_only
(--noprefix_sharing); sharing_only (--nooverlap). Each runs warm-up steps (compilation) then timed steps from the
same initial params and prompts; step_s is the median timed step. The updated params of every
mode are compared with serial's in units of the update (``launch.equivalence``: per-element
|a - b| / (lr x updates), in the checkpoint's layout, the decoder's attention key biases excluded: their exact
gradient is zero): equivalent when the 99.9th percentile is <= --bench_tolerance (max and percentile in
``update_diff``);
``max_param_rel_diff`` (max over tensors of ||a - b|| / ||b||) is kept for reference.
Overlap accounting per mode (means over timed steps; per step in each trace.json, lane "overlap"):
``decode_slowdown_s`` is the mode's rollout minus serial's rollout of the same step (same params and
seeds, so the same answers: serial's is the time that rollout takes with nothing beside it),
``hidden_prefix_s`` the prefix programs' time inside the decode's span, ``exposed_prefix_s`` their time
after it, ``critical_path_saving_s`` hidden minus slowdown (``trace.overlap_stats``).
Serial's reference and actor phases also carry XLA's FLOPs and the rate they ran at (``phase_flops``:
``launch/bench_flops.py``). Prints one JSON line last (ARCHITECTURE.md); with --peer_report a second,
shorter one after it (every mode's step time, tokens per second per device, the fraction of the step that is
rollout, the ratios to serial).
With --bench_simulate=PRESET the line also holds ``simulated``: the step-time simulator's prediction of each mode
beside the measured median and fastest step (``rollplex_jax/sim/report.py``, ``bench_calibration``).
Writes bench.json (the full line), trace.json per mode and plots/timeline_compare.png (serial vs rollplex
on one time axis) under --workdir.
"""

import dataclasses
import json
import os
import statistics
import sys

from absl import app, flags, logging

from launch import flags as launch_flags
from launch.bench_flops import serial_phase_rates
from rollplex_jax.run.summary import versions

_STEPS = flags.DEFINE_integer("bench_steps", 5, "Timed steps per mode.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("bench_warmup", 2, "Warm-up (compile) steps per mode.", lower_bound=0)
_TOL = flags.DEFINE_float("bench_tolerance", 0.02, "Equivalent when the 99.9th percentile of the per-element param "
                          "difference to serial is at most this fraction of the update scale (lr x updates): see "
                          "launch/equivalence.py.")

_MODES = flags.DEFINE_list("bench_modes", "serial,rollplex,overlap_only,sharing_only",
                           "Modes to run (serial always runs, first: the others are compared with it).")
_SIMULATE = flags.DEFINE_string("bench_simulate", "", "Also predict the bench with the step-time simulator on this "
                                "hardware preset (cpu: this machine, probed before the bench and cached in --workdir; "
                                "H100/H800/H200) and print predicted / measured step times and speedup under "
                                "\"simulated\" (rollplex_jax/sim/report.py: a reported benchmark, not a test).")
_PEER = flags.DEFINE_bool("peer_report", False, "Also print the peer-report JSON line last: per mode step_s, "
                          "tokens_per_s_per_device, rollout_frac, and speedup over serial.")

MODES = {
    "serial": dict(schedule="serial"),
    "rollplex": dict(schedule="rollplex", prefix_sharing=True, overlap=True),
    "overlap_only": dict(schedule="rollplex", prefix_sharing=False, overlap=True),
    "sharing_only": dict(schedule="rollplex", prefix_sharing=True, overlap=False),
}


def run_mode(cfg, name: str, steps: int, warmup: int, alone_rollout_s: dict[int, float] | None = None):
    """Runs one mode; returns its result, final params, timed spans, and the alone rollout times it was measured
    against. ``alone_rollout_s``: step -> serial's rollout seconds (None: this is serial, its own)."""
    import numpy as np

    from rollplex_jax.run.runner import Runner
    from rollplex_jax.trace import overlap_spans, overlap_stats, write_chrome_trace

    run = dataclasses.replace(cfg.run, workdir=os.path.join(cfg.run.workdir, name), steps=steps + warmup,
                              progress=False, **MODES[name])
    runner = Runner(dataclasses.replace(cfg, run=run))
    metrics = list(runner.run())
    import torch

    torch_threads = torch.get_num_threads()  # what the run's decode used (rollplex_jax/parallel/threads.py)
    timed = metrics[warmup:]
    spans = [s for s in runner.tracer.spans if s.step >= warmup]
    if alone_rollout_s is None:
        alone_rollout_s = {s.step: s.duration for s in spans if s.name == "rollout"}
    per_step = overlap_stats(spans, alone_rollout_s)
    write_chrome_trace(spans + overlap_spans(spans, per_step), os.path.join(run.workdir, "trace.json"))
    params = {k: np.asarray(v) for k, v in runner.state.params.items()}
    phases = {k[len("time/"):-2]: statistics.median(m.get(k, 0.0) for m in timed)
              for k in timed[0] if k.startswith("time/")}
    rates = serial_phase_rates(runner, phases) if name == "serial" else {}
    runner.close()
    overlap = {k: statistics.mean(row[k] for row in per_step.values())  # means: saving = hidden - slowdown
               for k in ("decode_slowdown_s", "hidden_prefix_s", "exposed_prefix_s", "critical_path_saving_s")
               if per_step and all(k in row for row in per_step.values())}
    result = {"step_s": statistics.median(m["time/step_s"] for m in timed), "phases_s": phases,
              "step_s_min": min(m["time/step_s"] for m in timed),  # the least disturbed step (shared machines)
              "lengths": {k: max(m[k] for m in timed) for k in ("prompt_length/max", "prompt_length/vision_mean",
                                                                "response_length/max", "response_length/mean")},
              "tokens_per_s_per_device": statistics.median(m["perf/throughput"] for m in timed),
              "rollout_frac": statistics.median(m.get("time/rollout_s", 0.0) / m["time/step_s"] for m in timed),
              "padding_frac": statistics.median(m["perf/padding_frac"] for m in timed),
              "padding_frac_unpacked": statistics.median(m["perf/padding_frac_unpacked"] for m in timed),
              "overlap": overlap, "torch_threads": torch_threads, **({"phase_flops": rates} if rates else {}),
              "reward_mean": statistics.mean(m["reward/mean"] for m in timed)}
    return result, params, spans, alone_rollout_s


def peer_report(results: dict[str, dict]) -> dict:
    """The short comparison line of ``--peer_report``: per mode step time, tokens per second per device, the
    fraction of the step that is rollout, and each mode's speedup over serial (median step times)."""
    keys = ("step_s", "tokens_per_s_per_device", "rollout_frac")
    serial_s = results["serial"]["step_s"]
    return {"peer_report": {name: {k: r[k] for k in keys} for name, r in results.items()},
            "speedup": {name: serial_s / r["step_s"] for name, r in results.items() if name != "serial"}}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    import numpy as np

    from launch.equivalence import ZERO_GRADIENT, checkpoint_layout, update_distance
    from rollplex_jax.trace import plot_timelines_side_by_side

    cfg = launch_flags.config_from_flags(flags.FLAGS)
    unknown = set(_MODES.value) - set(MODES)
    if unknown:
        raise app.UsageError(f"--bench_modes: unknown {sorted(unknown)}; choose from {', '.join(MODES)}")
    modes = [m for m in MODES if m == "serial" or m in _MODES.value]
    if _SIMULATE.value:  # before the bench: the cpu preset probes this machine while it is quiet
        from rollplex_jax.sim import hardware, report
        try:
            hw = hardware.preset(_SIMULATE.value, workdir=cfg.run.workdir, torch_threads=cfg.rollout.torch_threads)
        except ValueError as e:
            raise app.UsageError(f"--bench_simulate: {e}") from None
    results, params, spans, alone = {}, {}, {}, None
    for name in modes:  # serial first: its rollouts are the alone times of the others'
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        results[name], params[name], spans[name], alone = run_mode(cfg, name, _STEPS.value, _WARMUP.value, alone)
        print(f"bench: {name} step_s={results[name]['step_s']:.3f}", file=sys.stderr, flush=True)
    params = {name: checkpoint_layout(p, cfg.model) for name, p in params.items()}  # q/k/v apart: ZERO_GRADIENT
    base = params["serial"]
    diffs = {name: max(float(np.linalg.norm(p[k] - base[k]) / (np.linalg.norm(base[k]) + 1e-30))
                       for k in base if not k.endswith(ZERO_GRADIENT))
             for name, p in params.items() if name != "serial"}
    updates = (_STEPS.value + _WARMUP.value) * cfg.rl.mini_batches
    dist = {name: update_distance(p, base, lr=cfg.optim.lr, updates=updates)
            for name, p in params.items() if name != "serial"}
    os.makedirs(os.path.join(cfg.run.workdir, "plots"), exist_ok=True)
    if "rollplex" in spans:
        plot_timelines_side_by_side({"serial": spans["serial"], "rollplex": spans["rollplex"]},
                                    os.path.join(cfg.run.workdir, "plots", "timeline_compare.png"))
    serial_s = results["serial"]["step_s"]
    out = {
        "modes": results,
        "speedup": {name: serial_s / results[name]["step_s"] for name in modes if name != "serial"},
        "equivalent": all(d["p999"] <= _TOL.value for d in dist.values()),
        "update_diff": {name: {k: d[k] for k in ("max", "p999", "worst")} for name, d in dist.items()},
        "max_param_rel_diff": max(diffs.values(), default=0.0),  # per-tensor ||a - b|| / ||b||, for reference
        "param_rel_diff": diffs,
        "versions": versions(),  # the stack this ran on (constraints.txt pins it for make setup)
    }
    if _SIMULATE.value:
        out["simulated"] = report.bench_calibration(cfg, hw, results)
    with open(os.path.join(cfg.run.workdir, "bench.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))
    if _PEER.value:
        print(json.dumps(peer_report(results)))


if __name__ == "__main__":
    launch_flags.define_flags()
    app.run(main)
