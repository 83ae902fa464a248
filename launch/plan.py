"""Per-device memory plan of a config before launch: naive colocation vs rollplex, per phase and class.

  python -m launch.plan --flagfile=configs/qwen2_5_vl_32b_h800x32.flags [--format=table|json]
      [--plan_prompt_tokens=T] [--plan_vision_tokens=T] [--plan_response_tokens=T]
      [--plan_video_frames=F] [--plan_attention=flash|dense] [--plan_remat=layer|none]

Prints a table (phases as columns, buffer classes as rows, GiB per device, for both layouts, with the
peaks, whether each fits --hbm_budget, the smallest budget that fits and every assumption), then one
JSON object as the last stdout line (``--format=json``: only that line). The formulas and what they
assume are in the ``rollplex_jax/memory/planner/`` modules (``layouts``: the layouts; ``activations``: the per-layer
formulas; ``types``: mesh, lengths, program model). The buffers are counted as XLA's GPU compiler assigns them
(``--target``, default h100; ``--target=cpu``: as the CPU's), and the last table line (JSON ``memory_fractions``)
splits the card between XLA and the rollout engine: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` and vLLM's
``gpu_memory_utilization`` from the plan (``planner/fractions.py``). JSON ``versions``: the stack it ran on.
It plans the training mesh that runs, dp x fsdp x tp (``--train_dp``, ``--train_fsdp``, ``--train_tp``):
``--plan_devices``, if given, must be that mesh's device count (a larger count was once planned as
hypothetical data-parallel groups; ``--train_dp`` runs them now, and the planner refuses any other count).

  python -m launch.plan --flagfile=... --compile [--target=h100|h200|h800|a100|cpu] [--format=json]

adds XLA's own bytes: every program of one step AOT-compiled for the plan's shapes (``rollplex_jax/memory/aot.py``;
nothing is allocated, a mesh runs on fake CPU devices, or with a GPU ``--target`` on fake GPUs of that card compiled
by XLA's GPU compiler: ``rollplex_jax/memory/targets.py``), per program and per phase, the plan's JAX-side bytes
over them (``planned_vs_compiled``) and the compiled peak with the plan's torch-side bytes (``compiled_peak_bytes``),
and what one run of each program costs per device as read from its compiled HLO (FLOPs, bytes moved, kernels,
collective bytes; ``rollplex_jax/programs/hlo_cost.py``).

  python -m launch.plan --flagfile=... --baseline=megatron_vllm [--gpu_memory_utilization=0.9]

adds the paper's baseline (HYPOTHETICAL: its stack, planned, not run): naive colocation as Megatron-Core +
vLLM would hold it, every role resident (``rollplex_jax/memory/planner/baseline.py``), its assumptions and how much
each one moves the peak (x0.5 / x2 or its alternative), beside the paper's ~165 GiB. The weight-sharing lines
(every plan) give the engine's aligned / view / rebuilt bytes and the physical floor of the rebuilt ones.

  python -m launch.plan --simulate --flagfile=... [--sim_hardware=H800|H100|H200|cpu] [--simulate_sweep]
      [--sim_response_mean=T] [--sim_disagg_split=0.5] [--plot_out=PATH]

predicts the step time instead (phases x schedules serial / rollplex / overlap_only / sharing_only /
disaggregated, speedups, assumptions; the ``rollplex_jax/sim/`` modules), writes plan_timeline.png (under
--workdir unless --plot_out), JSON last. With ``--compile [--target=...]`` it first compiles the Rollplex and the
serial programs of one step and times the reference / actor / update phases of the schedules that run them on
their compiled FLOPs and bytes instead of the cost model's (``rollplex_jax/sim/compiled.py``; JSON ``sources``:
compiled or model per phase, ``details.compiled_vs_model``: both counts per phase).
"""

import dataclasses
import json

from absl import app, flags

from launch import flags as launch_flags

_FORMAT = flags.DEFINE_enum("format", "table", ["table", "json"], "table: for a person, then the JSON line; "
                            "json: only the JSON line.")
_DEVICES = flags.DEFINE_integer("plan_devices", 0, "Devices to plan for: 0 or the training mesh's (--train_dp x "
                                "--train_fsdp x --train_tp); another count is refused (the planner plans the mesh "
                                "that runs: set --train_dp for more data-parallel groups).", lower_bound=0)
_PROMPT = flags.DEFINE_integer("plan_prompt_tokens", 0, "Prompt tokens per row, vision tokens included "
                               "(0 = --max_prompt_len).", lower_bound=0)
_VISION = flags.DEFINE_integer("plan_vision_tokens", -1, "Vision (merged) tokens per prompt (-1 = the largest "
                               "image --max_pixels admits, or the video of --plan_video_frames).", lower_bound=-1)
_RESPONSE = flags.DEFINE_integer("plan_response_tokens", 0, "Answer tokens per row (0 = --max_new_tokens).",
                                 lower_bound=0)
_FRAMES = flags.DEFINE_integer("plan_video_frames", 0, "Plan a video of this many frames per prompt, each at "
                               "--max_pixels (0 = one image).", lower_bound=0)
_ATTENTION = flags.DEFINE_enum("plan_attention", "", ["", "flash", "dense"],
                               "Plan another attention kernel than the run's (--attention): flash (memory-efficient: "
                               "the blockwise and cuDNN kernels) or dense ([heads, Tq, Tk] fp32 scores). Empty = the "
                               "programs the flags build.")
_SIMULATE = flags.DEFINE_bool("simulate", False, "Predict each phase's time and the step time of serial, rollplex "
                               "(+ overlap_only, sharing_only) and disaggregated on --sim_hardware instead of memory "
                               "(rollplex_jax/sim/); writes plan_timeline.png.")
_SWEEP = flags.DEFINE_bool("simulate_sweep", False, "With --simulate: also print which assumption moves the "
                           "rollplex/serial speedup most (each scaled x0.5 and x2).")
_HW = flags.DEFINE_string("sim_hardware", "H800", "Hardware preset: H800, H100, H200 or cpu (measured by a short "
                          "calibration probe, cached in <workdir>/cpu_calibration.json).")
_RESP_MEAN = flags.DEFINE_float("sim_response_mean", 0.0, "Mean answer tokens (0 = the max, --plan_response_tokens "
                                "or --max_new_tokens): decode steps use the max, KV reads and FLOPs the mean.")
_SPLIT = flags.DEFINE_float("sim_disagg_split", 0.5, "Fraction of the devices in the disaggregated rollout pool.")
_PLOT = flags.DEFINE_string("plot_out", "", "Where to write the simulated timeline "
                            "(default <workdir>/plan_timeline.png).")
_RECAL = flags.DEFINE_bool("sim_recalibrate", False, "Re-run the CPU calibration probe even if cached.")
_REMAT = flags.DEFINE_enum("plan_remat", "", ["", "layer", "none", "dots"],
                           "Plan another activation checkpointing than the run's (--remat): layer (only each layer's "
                           "input is saved for the backward), dots, or none (every residual is saved). Empty = the "
                           "programs the flags build.")
_BASELINE = flags.DEFINE_enum("baseline", "", ["", "megatron_vllm"],
                              "Also plan the paper's baseline (HYPOTHETICAL: its stack, not run): megatron_vllm = "
                              "naive colocation as Megatron-Core (distributed optimizer over data parallelism, fp32 "
                              "main_grad) + vLLM (KV pool of --gpu_memory_utilization x HBM) hold it, every role "
                              "resident; with its assumptions and a sweep of them.")
_GPU_UTIL = flags.DEFINE_float("gpu_memory_utilization", 0.9, "With --baseline=megatron_vllm: vLLM's "
                               "gpu_memory_utilization (its weights + activations + KV pool = this x HBM, HBM = "
                               "--hbm_budget or 80 GiB; 0.9 = vLLM's default and ROLL's Qwen2.5-VL example).",
                               lower_bound=0.0, upper_bound=1.0)
_COMPILE = flags.DEFINE_bool("compile", False, "Also AOT-compile the run's real programs for these shapes for "
                             "--target (nothing is allocated; cpu: with fake CPU devices for a mesh larger than the "
                             "visible devices) and print XLA's bytes per program and phase beside the plan "
                             "(rollplex_jax/memory/aot.py) and each program's FLOPs and bytes moved from its compiled "
                             "HLO. With --simulate: the reference, actor and update phases timed on the compiled "
                             "programs' FLOPs and bytes (rollplex_jax/sim/compiled.py).")


_TARGET = flags.DEFINE_enum("target", "h100", ["cpu", "h100", "h200", "h800", "a100"],
                            "The device planned for, and with --compile compiled for. h100 (default) / h200 / h800 / "
                            "a100: the planner counts buffers as XLA's GPU compiler assigns them, and --compile runs "
                            "XLA's GPU compiler for that card on the flagfile's mesh of fake GPUs, no GPU needed (the "
                            "programs a GPU runs: its attention blocks and compiler options; needs `make gpu-aot`; "
                            "rollplex_jax/memory/targets.py). cpu: as XLA's CPU compiler and this CPU's runs do (the "
                            "compile on the visible or fake CPU devices, its CPU stand-ins labelled).")


def _programs(cfg):
    """The program model: the run's (--attention, --remat), or --plan_attention / --plan_remat where given."""
    from rollplex_jax.memory import planner

    pm = planner.ProgramModel.of(cfg.programs, platform=_TARGET.value)
    return dataclasses.replace(pm, attention=_ATTENTION.value or pm.attention, remat=_REMAT.value or pm.remat)


def _lengths(cfg):
    from rollplex_jax.memory import planner

    return planner.Lengths.from_config(
        cfg, prompt_tokens=_PROMPT.value or None,
        vision_tokens=None if _VISION.value < 0 else _VISION.value,
        response_tokens=_RESPONSE.value or None, video_frames=_FRAMES.value)


def table(p, budget_line: str) -> str:
    """The plan as text: one block per layout, classes as rows, phases as columns, GiB per device."""
    from rollplex_jax.memory import planner
    from rollplex_jax.memory.classes import CLASSES, PHASES

    top = max(p.peak_bytes(name) for name in planner.LAYOUTS)
    unit, size = next((u, s) for u, s in (("GiB", planner.GiB), ("MiB", planner.MiB), ("KiB", planner.KiB),
                                          ("B", 1)) if top >= s or u == "B")
    w = max(len(c) for c in CLASSES) + 2
    lines = []
    for name in planner.LAYOUTS:
        phases = p.layouts[name]
        title = name + (f"  (optimizer state: {p.optimizer_policy})" if name == "rollplex" else "")
        lines += ["", f"{title} -- {unit} per device", f"{'class':<{w}}" + "".join(f"{ph:>10}" for ph in PHASES)]
        for c in CLASSES:
            if any(phases[ph][c] for ph in PHASES):
                lines.append(f"{c:<{w}}" + "".join(f"{phases[ph][c] / size:>10.2f}" for ph in PHASES))
        lines.append(f"{'PEAK':<{w}}" + "".join(f"{p.peak(name, ph) / size:>10.2f}" for ph in PHASES))
        fits = p.fits(name)
        budget = planner.human_bytes(p.budget_bytes)
        verdict = "no --hbm_budget" if fits is None else (f"fits {budget}" if fits else f"DOES NOT FIT {budget}")
        lines.append(f"peak {planner.human_bytes(p.peak_bytes(name))} ({p.peak_phase(name)}): {verdict}")
    lines += ["", budget_line, "", "assumptions:"]
    lines += [f"  {i}. {a}" for i, a in enumerate(p.assumptions, 1)]
    return "\n".join(lines)


def sharing_table(ws: dict) -> str:
    """The weight-sharing classification (issue 7): counts, bytes and byte fractions per class, per device; the
    physical floor of the engine-owned bytes and the distance to it (issue 20)."""
    from rollplex_jax.memory import planner

    c = ws["classification"]
    if not c:
        return ""
    lines = ["", f"weight sharing ({c['layout']} layout, train mesh {c['train_mesh']}, rollout tp {c['rollout_tp']}, "
              f"{c['replicas']} replicas on {c['devices']} devices, {c['placement']} placement):",
             f"  {'class':<9}{'tensors':>9}{'GiB (all devices)':>19}{'fraction':>10}{'GiB/device (max)':>18}"]
    for k in ("aligned", "view", "rebuilt"):
        lines.append(f"  {k:<9}{c['counts'][k]:>9}{c['bytes'][k] / planner.GiB:>19.2f}{c['fractions'][k]:>10.1%}"
                     f"{c['per_device_max'][k] / planner.GiB:>18.2f}")
    lines.append(f"  extra (engine-owned) {planner.human_bytes(c['extra_bytes_per_device'])} per device vs "
                 f"{planner.human_bytes(c['second_copy_bytes_per_device'])} for a second copy of the rollout shard "
                 f"({c['extra_vs_second_copy']:.1%}); not held locally: "
                 f"{planner.human_bytes(c['remote_bytes_per_device'])}")
    if c.get("floor_bytes_per_device") is not None:
        floor, over = c["floor_bytes_per_device"], c["extra_over_floor_bytes_per_device"]
        lines.append(f"  physical floor {planner.human_bytes(floor)} per device ({c['floor_vs_second_copy']:.1%} of a "
                     "second copy: what the rollout rank reads that its device's training shards cannot hold in any "
                     f"layout); rebuilt is {planner.human_bytes(over)} above it")
        if over > 0 and floor > 0:
            remote = c["remote_bytes_per_device"]
            lines.append("  reaching it takes engine tensors in two parts, the local training shard read in place and "
                         f"the rest in a received buffer (split linears: {planner.human_bytes(remote)} here)"
                         + ("" if remote <= floor else ", and each rank placed on a device that holds part of its "
                            "rows (e.g. strided replicas on a tp-only mesh)"))
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    cfg = launch_flags.config_from_flags(flags.FLAGS)
    if _COMPILE.value and _TARGET.value == "cpu":
        _fake_devices(cfg.mesh.train_devices)
    elif _COMPILE.value:  # a GPU target: the CUDA plugin registered before JAX starts (targets.use_plugin)
        from rollplex_jax.memory import targets

        targets.use_plugin()
    from rollplex_jax.memory import planner
    from rollplex_jax.run.summary import versions

    if _SIMULATE.value:
        return simulate_main(cfg)
    try:
        lengths = _lengths(cfg)
        programs = _programs(cfg)
        p = planner.plan(cfg, lengths, _DEVICES.value or None, programs=programs)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    best = planner.smallest_budget(cfg, lengths, p.devices, programs=programs)
    out = p.to_dict()
    out["smallest_budget"] = {"bytes": best.bytes, "gib": round(best.bytes / planner.GiB, 3), "policy": best.policy,
                              "text": planner.human_bytes(best.bytes, round_up=True)}
    budget_line = (f"smallest per-device budget for rollplex: {planner.human_bytes(best.bytes, round_up=True)} "
                   f"(--optimizer_policy={best.policy})")
    if p.budget_bytes:
        try:
            chosen = planner.choose_optimizer_policy(cfg, lengths, p.devices, p.budget_bytes, programs=programs)
            out["budget_decision"] = {"policy": chosen, "error": None}
            budget_line += (f"; under --hbm_budget={cfg.memory.hbm_budget}, --optimizer_policy=auto would choose "
                            f"{chosen}")
        except planner.BudgetError as e:
            out["budget_decision"] = {"policy": None, "error": str(e)}
            budget_line += f"; with --hbm_budget={cfg.memory.hbm_budget}: {e}"
    out["memory_fractions"] = fractions_section(cfg, p)
    out["versions"] = versions()  # the stack this ran on (constraints.txt pins it for make setup)
    if _BASELINE.value:
        out["baseline"] = baseline_section(cfg, lengths, p.devices)
    if _COMPILE.value:
        out.update(compiled_section(cfg, lengths, p))
    if _FORMAT.value == "table":
        print(f"memory plan: {cfg.model.dtype}, {p.params.total:,} params, {p.devices} devices, per device")
        print(table(p, budget_line))
        print(sharing_table(out["weight_sharing"]))
        print(fractions_line(out["memory_fractions"]))
        if _BASELINE.value:
            print(baseline_table(out["baseline"]))
        if _COMPILE.value:
            print(compiled_table(out))
    print(json.dumps(out))


def fractions_section(cfg, p) -> dict:
    """``planner.memory_fractions`` for the card: ``--hbm_budget``, else ``--target``'s memory, else (``--target=cpu``)
    an H100's (said in ``card``)."""
    from rollplex_jax.memory import planner, targets

    if cfg.memory.budget_bytes:
        card, hbm = f"--hbm_budget={cfg.memory.hbm_budget}", cfg.memory.budget_bytes
    elif _TARGET.value != "cpu":
        t = targets.target(_TARGET.value)
        card, hbm = f"{t.name} (--target={t.key})", t.memory_bytes
    else:
        t = targets.target("h100")
        card, hbm = f"{t.name} (assumed: give --target or --hbm_budget)", t.memory_bytes
    return dict(planner.memory_fractions(p, hbm), card=card)


def fractions_line(f: dict) -> str:
    from rollplex_jax.memory import planner

    fit = "fits" if f["fits"] else "DOES NOT FIT"
    return (f"\nsharing one device with the engine ({f['card']}, {planner.human_bytes(f['hbm_bytes'])}): "
            f"{f['env']} (JAX peak {planner.human_bytes(f['jax_peak_bytes'])}); vLLM gpu_memory_utilization="
            f"{f['vllm_gpu_memory_utilization']:.2f} (its profiled weight copy, KV cache and working set: "
            f"{planner.human_bytes(f['vllm_profiled_bytes'])}; {planner.human_bytes(f['torch_peak_bytes'])} once "
            f"bound); {fit}, each with {f['slack']:.0%} of the card as slack")


def baseline_section(cfg, lengths, devices: int) -> dict:
    """The --baseline preset's plan (``planner.baseline``) with its sweep, under the paper stack's programs
    (FlashAttention, per-layer recompute), not --attention / --remat / --plan_attention."""
    from rollplex_jax.memory.planner import baseline

    a = baseline.Assumptions(gpu_memory_utilization=_GPU_UTIL.value,
                             hbm_bytes=cfg.memory.budget_bytes or baseline.Assumptions.hbm_bytes)
    try:
        out = baseline.megatron_vllm(cfg, lengths, devices, None, a)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    out["sweep"] = baseline.sweep(cfg, lengths, devices, None, a)
    return out


def baseline_table(b: dict) -> str:
    """The baseline preset as text: classes x phases (GiB per device), the peak beside the paper's, every
    assumption, and the sweep (largest move first)."""
    from rollplex_jax.memory import planner
    from rollplex_jax.memory.classes import CLASSES, PHASES

    m, w, g = b["mesh"], max(len(c) for c in CLASSES) + 2, planner.GiB
    lines = ["", f"baseline {b['name']} -- GiB per device (Megatron tp {m['tp']} x dp {m['dp']}, vLLM tp "
             f"{m['rollout_tp']}); {b['hypothetical']}", f"{'class':<{w}}" + "".join(f"{ph:>10}" for ph in PHASES)]
    for c in CLASSES:
        if any(b["phases"][ph][c] for ph in PHASES):
            lines.append(f"{c:<{w}}" + "".join(f"{b['phases'][ph][c] / g:>10.2f}" for ph in PHASES))
    lines.append(f"{'PEAK':<{w}}" + "".join(f"{b['peaks'][ph] / g:>10.2f}" for ph in PHASES))
    lines.append(f"peak {planner.human_bytes(b['peak_bytes'])} ({b['peak_phase']}) vs the paper's about "
                 f"{b['paper_gib']:g} GiB: {b['vs_paper_gib']:+.1f} GiB (vLLM holds {b['vllm_bytes'] / g:.2f} GiB)")
    lines += ["baseline assumptions:"] + [f"  {i}. {a}" for i, a in enumerate(b["assumptions"], 1)]
    lines.append("how each assumption moves the baseline's peak (GiB per device, largest move first):")
    for r in b["sweep"]:
        alts = "; ".join(f"{v['label']}: {v['peak_gib']:.1f} ({v['delta_gib']:+.1f})" for v in r["variants"])
        lines.append(f"  {r['assumption']:<30} base {r['base_gib']:.1f} -> {alts}")
    return "\n".join(lines)


def compiled_section(cfg, lengths, p) -> dict:
    """``compiled`` (per program: XLA's temp/argument/output/alias/total bytes per device) and, per phase of the
    schedule's layout, the compiled bytes and ``planned_vs_compiled`` (the plan's JAX-side bytes / compiled)."""
    from rollplex_jax.memory import targets

    t, c = _compile(cfg, lengths, p.optimizer_policy)
    out = {"compiled": {k: v.to_dict() for k, v in c.programs.items()},
           "compiled_phases": c.to_dict()["phases"], "compiled_note": c.note,
           "compiled_target": t.to_dict() if t is not None else {"target": "cpu", "device": "XLA CPU"},
           "compiled_versions": targets.versions()}
    if cfg.run.schedule == "rollplex":  # the planner has no layout of our serial schedule (naive = a baseline)
        out["planned_vs_compiled"] = {ph: round(p.jax_bytes("rollplex", ph) / max(b, 1), 4)
                                      for ph, b in c.phase_bytes.items()}
        # the worst phase as compiled, with the plan's torch-side bytes of that phase (engine weights, KV cache)
        torch_side = {ph: p.peak("rollplex", ph) - p.jax_bytes("rollplex", ph) for ph in c.phase_bytes}
        worst = max(c.phase_bytes, key=lambda ph: c.phase_bytes[ph] + torch_side[ph])
        out["compiled_peak_bytes"] = int(c.phase_bytes[worst] + torch_side[worst])
        out["compiled_peak_phase"] = worst
    return out


def _compile(cfg, lengths, policy: str):
    """(the target or None for the CPU, ``aot.compiled_memory`` of one step of ``cfg`` for ``--target``)."""
    from rollplex_jax.memory import aot, targets

    t = None if _TARGET.value == "cpu" else targets.target(_TARGET.value)
    try:
        return t, aot.compiled_memory(cfg, lengths, policy=policy, frames=_FRAMES.value, target=t)
    except RuntimeError as e:
        if t is None or targets.INSTALL_HINT not in str(e):
            raise
        raise app.UsageError(f"--target={_TARGET.value}: {e}") from None


def _compiled_costs(cfg, lengths) -> dict:
    """{schedule: ``Compiled.step_costs()``} of the Rollplex and the serial programs compiled for ``--target``
    (``--simulate --compile``: the simulator takes their FLOPs and bytes, ``sim/compiled.py``)."""
    policy = "resident" if cfg.memory.optimizer_policy == "auto" else cfg.memory.optimizer_policy
    out = {}
    for schedule in ("rollplex", "serial"):
        one = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, schedule=schedule))
        out[schedule] = _compile(one, lengths, policy)[1].step_costs()
    return out


def compiled_table(out: dict) -> str:
    from rollplex_jax.memory import planner

    gib = lambda b: f"{b / planner.GiB:10.3f}"  # noqa: E731
    target = out["compiled_target"]
    lines = ["", f"AOT-compiled programs for {target['device']} ({target['target']}; GiB per device): temp, "
             "arguments, outputs, aliases, total"]
    for name, v in out["compiled"].items():
        lines.append(f"  {name:<16}" + "".join(gib(v[k]) for k in ("temp_bytes", "argument_bytes", "output_bytes",
                                                                       "alias_bytes", "total_bytes")))
    lines += _cost_lines(out["compiled"])
    lines.append("per phase: the largest program with the phase's other live state (GiB per device)"
                 + ("; planned / compiled" if "planned_vs_compiled" in out else ""))
    for ph, v in out["compiled_phases"].items():
        ratio = out.get("planned_vs_compiled", {}).get(ph)
        lines.append(f"  {ph:<8}{gib(v['bytes'])}  ({v['program']})" + (f"  {ratio:.3f}" if ratio else ""))
    if "compiled_peak_bytes" in out:
        peak = planner.human_bytes(out["compiled_peak_bytes"])
        lines.append(f"compiled peak with the plan's torch-side bytes: {peak} ({out['compiled_peak_phase']})")
    lines.append(f"note: {out['compiled_note']}")
    return "\n".join(lines)


def _cost_lines(programs: dict) -> list[str]:
    """One run of each compiled program, per device, read from its optimized HLO (``programs/hlo_cost.py``)."""
    lines = ["one run of each (per device, from the compiled HLO): GFLOP (matmuls), GB moved, GB by collectives, "
             "kernels, loops of unknown trip count (counted once: a lower bound)"]
    for name, v in programs.items():
        c = v.get("cost") or {}
        if c:
            lines.append(f"  {name:<16}{c['flops'] / 1e9:12.1f}{c['bytes'] / 1e9:10.2f}{c['comm_bytes'] / 1e9:10.2f}"
                         f"{c['kernels']:10.0f}{c['unknown_loops']:6d}")
    return lines


def _fake_devices(n: int) -> None:
    """Enough CPU devices for an n-device mesh (``--compile``; a GPU backend, if any, stays the default and
    aot.py falls back to the CPU devices when it has fewer): JAX's ``jax_num_cpu_devices``, which JAX reads
    when its backends start (the first JAX operation, after this), not at import, so it holds although
    the flag modules imported JAX already; no XLA_FLAGS needed. A larger count already in XLA_FLAGS
    (``--xla_force_host_platform_device_count``) is kept. Raises ``app.UsageError`` naming the fix when the
    backends started before (nothing in this command runs a JAX operation before here)."""
    import os
    import re

    import jax

    given = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if n <= 1 or (given and int(given.group(1)) >= n) or jax.config.jax_num_cpu_devices >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # JAX's backends already started: the count cannot change in this process
        raise app.UsageError(f"--compile for {n} devices needs {n} CPU devices, and JAX started with fewer ({e}); "
                             f"run it in a fresh process or set XLA_FLAGS=--xla_force_host_platform_device_count={n}"
                             ) from None


def simulate_main(cfg):
    import os

    from rollplex_jax import sim as simulator
    from rollplex_jax.sim import hardware

    try:
        lengths = _lengths(cfg)
        hw = hardware.preset(_HW.value, workdir=cfg.run.workdir, torch_threads=cfg.rollout.torch_threads,
                             recalibrate=_RECAL.value)
        programs = None if hw.default_programs == "dense" else _programs(cfg)
        kw = dict(response_mean=_RESP_MEAN.value or None, programs=programs)
        compiled = _compiled_costs(cfg, lengths) if _COMPILE.value else None
        sim = simulator.simulate(cfg, hw, lengths, _DEVICES.value or None, disagg_split=_SPLIT.value,
                                 compiled=compiled, **kw)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    out = sim.to_dict()
    path = _PLOT.value or os.path.join(cfg.run.workdir, "plan_timeline.png")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    simulator.plot(sim, path)
    out["plot"] = path
    if _SWEEP.value:
        rows = simulator.sweep(cfg, hw, lengths, _DEVICES.value or None, **kw)
        out["sweep"] = rows
    if _FORMAT.value == "table":
        print(f"simulated step: {cfg.model.dtype}, {sim.details['params']:,} params, {sim.devices} x {hw.name}, "
              f"batch {cfg.rl.batch_prompts} x {cfg.rollout.group_size}")
        print(simulator.table(sim))
        if _SWEEP.value:
            print("\nsensitivity of the rollplex/serial speedup (each assumption x0.5 and x2, largest move first):")
            print(simulator.sweep_table(out["sweep"]))
        print(f"\ntimeline: {path}")
    print(json.dumps(out))


if __name__ == "__main__":
    launch_flags.define_flags()
    app.run(main)
