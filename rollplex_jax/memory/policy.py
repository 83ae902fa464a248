"""The run's memory policy and report: the planner asked about this run's programs, lengths and mesh.

- ``optimizer_policy``: resident or offload, as configured, or the one the planner says fits
  ``--hbm_budget`` (per device of the training mesh); refuses to start, naming the smallest budget
  that fits, when none does;
- ``memory_report``: the measured per-phase peaks of a run (the busiest device, ``memory.MemoryMeter``)
  beside the planner's per-device prediction for the same run (rollplex schedule).
"""

from __future__ import annotations

from rollplex_jax.config import Config, ConfigError
from rollplex_jax.data.dataset import Dataset
from rollplex_jax.memory import planner
from rollplex_jax.memory.meter import peak_row
from rollplex_jax.models.platform import platform


def data_lengths(cfg: Config, examples: Dataset) -> planner.Lengths:
    """The planner's lengths for this run: the dataset's longest prompt and most vision tokens (from the
    load-time metadata: no line or pixel is read), the longest answer the rollout may sample; each as the
    programs hold it under ``--shape_buckets`` (``Lengths.bucketed``)."""
    prompt, vision = int(examples.prompt_lengths.max()), int(examples.vision_tokens.max())
    return planner.Lengths(prompt, vision, cfg.rollout.max_new_tokens,
                           source=f"the training set's longest prompt ({prompt} tokens, {vision} vision tokens) "
                                  f"and --max_new_tokens ({cfg.rollout.max_new_tokens})").bucketed(cfg)


def run_programs(cfg: Config) -> planner.ProgramModel:
    """The planner's model of this run's programs (``--attention``, ``--remat``) as the backend this process runs
    on compiles them (``models.platform``: gpu or cpu; a TPU is planned as a GPU)."""
    return planner.ProgramModel.of(cfg.programs, platform=platform())


def plan_run(cfg: Config, lengths: planner.Lengths, policy: str) -> planner.Plan:
    """The planner's figures for this run: its programs (``--attention``, ``--remat``), per device of the mesh."""
    return planner.plan(cfg, lengths, cfg.mesh.train_devices, programs=run_programs(cfg),
                        optimizer_policy=policy)


def optimizer_policy(cfg: Config, lengths: planner.Lengths, log) -> str:
    """resident or offload: as configured, or the one the planner says fits --hbm_budget (the run's programs,
    per device of the training mesh); raises ``ConfigError`` naming the smallest budget that fits when none
    does."""
    mem, devices = cfg.memory, cfg.mesh.train_devices
    if not mem.budget_bytes:
        return "resident" if mem.optimizer_policy == "auto" else mem.optimizer_policy
    if cfg.run.schedule != "rollplex":
        raise ConfigError(f"--hbm_budget={mem.hbm_budget} plans the rollplex schedule's memory; use "
                          "--schedule=rollplex, or drop --hbm_budget")
    try:
        if mem.optimizer_policy == "auto":
            policy = planner.choose_optimizer_policy(cfg, lengths, devices, mem.budget_bytes,
                                                     programs=run_programs(cfg))
        else:
            policy = mem.optimizer_policy
            need = plan_run(cfg, lengths, policy).peak_bytes("rollplex")
            if need > mem.budget_bytes:
                planner.choose_optimizer_policy(cfg, lengths, devices, mem.budget_bytes,
                                                programs=run_programs(cfg))
                raise ConfigError(f"--hbm_budget={mem.hbm_budget} is too small with --optimizer_policy={policy} "
                                  f"(planned peak {planner.human_bytes(need, round_up=True)} per device); use "
                                  "--optimizer_policy=auto to let the run offload")
    except planner.BudgetError as e:
        raise ConfigError(f"--hbm_budget={mem.hbm_budget}: {e}") from None
    need = plan_run(cfg, lengths, policy).peak_bytes("rollplex")
    log(f"memory: --hbm_budget={mem.hbm_budget}: optimizer state {policy} (planned peak {planner.human_bytes(need)} "
        f"per device over {devices} device(s))")
    return policy


def planned_vs_measured(plan: planner.Plan, measured: dict) -> dict:
    """Per phase: the planned peak of what the meter measures (JAX's buffers and the engine's rebuilt weights;
    the torch engine's KV cache and working set excluded: measured on GPU by the backend's stats, not on
    CPU), the measured peak, and their ratio."""
    out = {}
    for phase in plan.layouts["rollplex"]:
        key = f"memory/{phase}_peak_bytes"
        if key not in measured:
            continue
        planned = plan.metered_bytes("rollplex", phase)
        out[phase] = {"planned_bytes": planned, "measured_bytes": int(measured[key]),
                      "planned_over_measured": round(planned / max(measured[key], 1.0), 4),
                      "planned_unmetered_bytes": plan.peak("rollplex", phase) - planned}  # engine KV + working set
    return out


def memory_report(cfg: Config, history: list[dict], lengths: planner.Lengths, policy: str) -> dict:
    """Measured peak per phase (max over the steps run, busiest device), and for the rollplex schedule the
    planner's per-device prediction for this run next to it (``planned_over_measured``)."""
    peaks = {k: v for k, v in peak_row(history).items() if k.endswith("_peak_bytes")}
    out = {"optimizer_policy": policy, "hbm_budget_bytes": cfg.memory.budget_bytes,
           "devices": cfg.mesh.train_devices,
           "measured_peak_bytes": {k.split("/")[1][:-len("_peak_bytes")]: int(v) for k, v in peaks.items()}}
    if peaks and cfg.run.schedule == "rollplex":
        out["planned_vs_measured"] = planned_vs_measured(plan_run(cfg, lengths, policy), peaks)
    return out
