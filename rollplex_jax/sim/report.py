"""Reporting a simulation: the phase table, a Gantt chart of each schedule, and the sensitivity sweep.

``table`` (phases x schedules, step times, speedups, assumptions) and ``plot`` (one panel per schedule,
one time axis) are what ``launch.plan --simulate`` prints and writes; ``sweep`` re-simulates with one
assumption scaled by each factor (x0.5 / x2 by default) and sorts the assumptions by how far they move
the rollplex / serial speedup (``--simulate_sweep``).

``bench_calibration`` (``launch.bench --bench_simulate=cpu``) predicts a bench run at the lengths it measured
and sets each mode's predicted step time beside the measured one (``calibration``): a reported benchmark of
the simulator, not a test gate (wall times on a shared machine are noisy: on the 2-core CI machine, 2026-12-03,
bench_cpu's fastest serial step ranged 0.28-0.52 s and its speedup 3.07-6.54 within one hour). What gates the
simulator in the tests is deterministic: its FLOPs and bytes per phase against XLA's counts of the same
programs (tests/test_simulator.py).
"""

from __future__ import annotations

import dataclasses

from rollplex_jax.config import Config
from rollplex_jax.memory.planner import Lengths, ProgramModel
from rollplex_jax.sim.hardware import Hardware
from rollplex_jax.sim.schedules import PHASES, SCHEDULES, Simulation, simulate

TABLE_SCHEDULES = SCHEDULES


def table(sim: Simulation) -> str:
    names = TABLE_SCHEDULES
    keys = [*PHASES[:4], "engine_vision", *PHASES[4:], "transfer", "decode_slowdown"]
    w = 16
    lines = [f"{'phase (s)':<{w}}" + "".join(f"{n:>15}" for n in names)]
    for k in keys:
        vals = [sim.schedules[n].phases.get(k, 0.0) for n in names]
        if any(vals):
            mark = ["*" if sim.sources.get(n, {}).get(k) == "compiled" else " " for n in names]
            lines.append(f"{k:<{w}}" + "".join(f"{val:>14.4g}{m}" for val, m in zip(vals, mark, strict=True)))
    lines.append(f"{'STEP (critical)':<{w}}" + "".join(f"{sim.schedules[n].step_s:>14.4g} " for n in names))
    if sim.sources:
        lines.append("* from the compiled programs' FLOPs, bytes, kernels and collectives (sim/compiled.py)")
    lines += ["", f"speedup rollplex / serial:        {sim.speedup('rollplex', 'serial'):.3f}x",
              f"speedup rollplex / disaggregated: {sim.speedup('rollplex', 'disaggregated'):.3f}x",
              f"speedup overlap_only / serial:    {sim.speedup('overlap_only', 'serial'):.3f}x",
              f"speedup sharing_only / serial:    {sim.speedup('sharing_only', 'serial'):.3f}x",
              "", "assumptions:"]
    lines += [f"  {i}. {a}" for i, a in enumerate(sim.assumptions, 1)]
    return "\n".join(lines)


def plot(sim: Simulation, path: str, schedules=("serial", "rollplex", "disaggregated")) -> None:
    """Gantt chart of each schedule's simulated step, one panel per schedule, same time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in schedules if n in sim.schedules]
    lanes = ["host", "weights", "rollout", "prefix", "reference", "actor", "update"]
    phases = sorted({s[1] for n in names for s in sim.schedules[n].spans})
    cmap = plt.get_cmap("tab20")
    colors = {p: cmap(i % 20) for i, p in enumerate(phases)}
    tmax = max(sim.schedules[n].step_s for n in names)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.9 * len(names) + 0.8), sharex=True)
    for ax, n in zip(axes, names, strict=True):
        sch = sim.schedules[n]
        for lane_name, ph, s, e in sch.spans:
            y = lanes.index(lane_name)
            ax.barh(y, e - s, left=s, color=colors[ph], edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{n}: step {sch.step_s:.3g} s", fontsize=9, loc="left")
        ax.set_xlim(0, tmax * 1.02)
    axes[-1].set_xlabel("simulated time in one RL step (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    fig.legend(handles, phases, loc="center right", fontsize=7)
    fig.suptitle(f"simulated step on {sim.devices} x {sim.hardware.name}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep(cfg: Config, hw: Hardware, lengths: Lengths, devices: int | None = None, *,
          response_mean: float | None = None, programs: ProgramModel | None = None,
          factors=(0.5, 2.0)) -> list[dict]:
    """Rollplex/serial speedup when one assumption is scaled by each factor; sorted by the largest move."""
    base_sim = simulate(cfg, hw, lengths, devices, response_mean=response_mean, programs=programs)
    base = base_sim.speedup("rollplex", "serial")
    rm = base_sim.response_mean
    knobs = {
        "decode efficiency (decode_bw_eff, step floor / f)": lambda f: dict(
            hw=hw.replace(decode_bw_eff=min(1.0, hw.decode_bw_eff * f),
                          decode_step_floor_s=hw.decode_step_floor_s / f)),
        "interference factor": lambda f: dict(hw=hw.replace(interference=hw.interference * f)),
        "decode compute share (decode_util)": lambda f: dict(hw=hw.replace(decode_util=min(0.95, hw.decode_util * f))),
        "training MFU": lambda f: dict(hw=hw.replace(mfu_forward=min(1, hw.mfu_forward * f),
                                                     mfu_backward=min(1, hw.mfu_backward * f))),
        "response length (mean and max)": lambda f: dict(
            lengths=dataclasses.replace(lengths, response_tokens=max(1, round(lengths.response_tokens * f))),
            response_mean=max(1.0, rm * f)),
        "vision tokens": lambda f: dict(lengths=_scale_vision(lengths, f)),
    }
    out = []
    for name, mk in knobs.items():
        row = {"assumption": name, "base": base}
        for f in factors:
            kw = {"hw": hw, "lengths": lengths, "response_mean": response_mean, **mk(f)}
            s = simulate(cfg, kw["hw"], kw["lengths"], devices, response_mean=kw["response_mean"], programs=programs)
            row[f"x{f:g}"] = s.speedup("rollplex", "serial")
        row["range"] = max(row[f"x{f:g}"] for f in factors) - min(row[f"x{f:g}"] for f in factors)
        out.append(row)
    return sorted(out, key=lambda r: -r["range"])


def _scale_vision(lengths: Lengths, f: float) -> Lengths:
    tv = max(0, round(lengths.vision_tokens * f))
    text = lengths.prompt_tokens - lengths.vision_tokens
    return dataclasses.replace(lengths, vision_tokens=tv, prompt_tokens=max(1, text + tv))


def sweep_table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k.startswith("x")]
    lines = [f"{'assumption':<52}{'base':>8}" + "".join(f"{k:>8}" for k in keys) + f"{'range':>8}"]
    for r in rows:
        lines.append(f"{r['assumption']:<52}{r['base']:>8.3f}" + "".join(f"{r[k]:>8.3f}" for k in keys)
                     + f"{r['range']:>8.3f}")
    return "\n".join(lines)


def calibration(sim: Simulation, modes: dict[str, dict]) -> dict:
    """Each bench mode's predicted step time beside the measured ones, and the rollplex / serial speedup.

    Args:
      sim: the simulation of the bench's config and lengths.
      modes: ``launch.bench``'s per-mode results: ``step_s`` (median timed step), ``step_s_min`` (fastest).
    Returns:
      ``{"hardware", "modes": {mode: {"predicted_s", "measured_median_s", "measured_min_s",
      "predicted_over_median", "predicted_over_min"}}, "speedup": {"predicted", "measured_median",
      "measured_min"}}`` (speedup only with both serial and rollplex).
    """
    out = {"hardware": sim.hardware.name, "modes": {}}
    for name, r in modes.items():
        pred = sim.schedules[name].step_s
        out["modes"][name] = {"predicted_s": pred, "measured_median_s": r["step_s"], "measured_min_s": r["step_s_min"],
                              "predicted_over_median": pred / r["step_s"], "predicted_over_min": pred / r["step_s_min"]}
    if {"serial", "rollplex"} <= set(modes):
        s, r = modes["serial"], modes["rollplex"]
        out["speedup"] = {"predicted": sim.speedup("rollplex", "serial"),
                          "measured_median": s["step_s"] / r["step_s"],
                          "measured_min": s["step_s_min"] / r["step_s_min"]}
    return out


def bench_calibration(cfg: Config, hw: Hardware, modes: dict[str, dict]) -> dict:
    """``calibration`` of a ``launch.bench`` run: simulated on ``hw`` at the lengths its serial mode measured
    (``lengths``: the largest prompt, vision tokens per prompt, longest and mean answer of its timed steps)."""
    m = modes["serial"]["lengths"]
    lengths = Lengths(prompt_tokens=round(m["prompt_length/max"]), vision_tokens=round(m["prompt_length/vision_mean"]),
                      response_tokens=max(1, round(m["response_length/max"])), source="measured by the bench")
    sim = simulate(cfg, hw, lengths, response_mean=m["response_length/mean"])
    return calibration(sim, modes)
