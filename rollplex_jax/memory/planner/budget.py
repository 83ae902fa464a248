"""``plan()``, and the optimizer policy under a per-device budget: the planner's entry points.

``plan(cfg, lengths, devices)`` resolves the rollplex layout's optimizer policy (the config's, or an
override; 'auto' picks resident or offload against ``cfg.memory.hbm_budget``) and builds both layouts
(``layouts.build_plan``). ``choose_optimizer_policy`` is that choice: 'resident' if the rollplex plan
fits the budget with the optimizer state resident, else 'offload' if it fits offloaded, else a
``BudgetError`` naming the smallest budget that fits (``smallest_budget``).

Everything here is a pure function of the config (and the lengths, device count and program model):
the runtime (``runner``) calls ``choose_optimizer_policy`` with the same inputs to decide whether to
offload the optimizer state, or to refuse to start naming the smallest budget that fits.
"""

from __future__ import annotations

import dataclasses

from rollplex_jax.config import Config
from rollplex_jax.memory.planner.layouts import build_plan
from rollplex_jax.memory.planner.types import BudgetError, Lengths, Plan, PlanMesh, ProgramModel, human_bytes


def _resolve_policy(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, policy: str | None) -> str:
    policy = policy or cfg.memory.optimizer_policy
    if policy != "auto":
        return policy
    budget = cfg.memory.budget_bytes
    if not budget:
        return "resident"
    try:
        return choose_optimizer_policy(cfg, lengths, mesh.devices, budget, programs=pm)
    except BudgetError:
        return "offload"  # the plan shows it does not fit; offload is the closest


def plan(cfg: Config, lengths: Lengths | None = None, devices: int | None = None, *,
         programs: ProgramModel | None = None, optimizer_policy: str | None = None) -> Plan:
    """Per-device bytes of every buffer class in every phase, for both layouts (``layouts`` module doc).

    Args:
      cfg: the run's config.
      lengths: tokens per row (default ``Lengths.from_config(cfg)``, the worst case).
      devices: None / 0 or the training mesh's device count (train_dp * train_fsdp * train_tp); another count
        raises ``ValueError`` naming ``--train_dp`` (``PlanMesh.of``: the mesh that runs is planned).
      programs: the program model (default: the programs the config builds, ``ProgramModel.of(cfg.programs)``).
      optimizer_policy: overrides the config's for the rollplex layout ('auto' resolves against
        ``cfg.memory.hbm_budget``, no budget -> resident).
    Returns:
      The ``Plan`` (layouts, peaks, assumptions, details).
    """
    lengths = lengths or Lengths.from_config(cfg)
    programs = programs or ProgramModel.of(cfg.programs)
    mesh = PlanMesh.of(cfg, devices)
    policy = _resolve_policy(cfg, lengths, mesh, programs, optimizer_policy)
    return build_plan(cfg, lengths, mesh, programs, policy)


@dataclasses.dataclass(frozen=True)
class Budget:
    bytes: int
    policy: str


def smallest_budget(cfg: Config, lengths: Lengths | None = None, devices: int | None = None, *,
                    programs: ProgramModel | None = None) -> Budget:
    """The smallest per-device budget the rollplex layout fits in, with the policy that achieves it
    (resident when it is as small: no host transfers)."""
    peaks = {pol: plan(cfg, lengths, devices, programs=programs, optimizer_policy=pol).peak_bytes("rollplex")
             for pol in ("resident", "offload")}
    best = "resident" if peaks["resident"] <= peaks["offload"] else "offload"
    return Budget(peaks[best], best)


def choose_optimizer_policy(cfg: Config, lengths: Lengths | None, devices: int | None, budget_bytes: int, *,
                            programs: ProgramModel | None = None) -> str:
    """'resident' if the rollplex plan fits ``budget_bytes`` with the optimizer state resident, else
    'offload' if it fits offloaded, else ``BudgetError`` naming the smallest budget that fits.
    ``budget_bytes`` = 0: no budget -> 'resident'. (Ignores ``cfg.memory.optimizer_policy``.)"""
    if not budget_bytes:
        return "resident"
    peaks = {}
    for pol in ("resident", "offload"):
        p = plan(cfg, lengths, devices, programs=programs, optimizer_policy=pol)
        peaks[pol] = (p.peak_bytes("rollplex"), p.peak_phase("rollplex"))
        if peaks[pol][0] <= budget_bytes:
            return pol
    best = min(peaks, key=lambda k: peaks[k][0])
    need, phase = peaks[best]
    raise BudgetError(
        f"the run does not fit a per-device budget of {human_bytes(budget_bytes)}: the smallest budget that fits "
        f"is {human_bytes(need, round_up=True)} (--hbm_budget={human_bytes(need, round_up=True).replace(' ', '')} "
        f"--optimizer_policy={best}; peak in the {phase} phase); resident optimizer state needs "
        f"{human_bytes(peaks['resident'][0], round_up=True)}. Lower --batch_prompts, --micro_batch or the lengths, "
        "or add devices (see python -m launch.plan)")
