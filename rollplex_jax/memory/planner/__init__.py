"""Analytic per-device memory of one RL step, per phase and buffer class, from a ``Config`` alone.

``plan(cfg, lengths, devices)`` predicts the bytes each buffer class of ``classes.CLASSES``
occupies on one device in each phase of ``classes.PHASES``, for naive colocation and for
rollplex; ``launch/plan.py`` prints it, the runtime uses it to pick the optimizer policy under
``--hbm_budget``. Where each part lives (each module's docstring has its formulas and assumptions):

- ``types``: the inputs and the result: ``Lengths`` (tokens per row), ``ProgramModel`` (attention
  kernel and remat; ``DENSE_PROGRAMS`` = the dense oracle (``--attention=dense --remat=none``),
  ``DEFAULT_PROGRAMS`` = the defaults; ``ProgramModel.of`` = the run's programs),
  ``PlanMesh`` (how devices divide into training shards, batch shards and engine replicas),
  ``param_counts``, ``Plan``, ``BudgetError``, ``human_bytes``;
- ``shards``: what one device holds of the parameters on the mesh (undivided dimensions whole) and the
  FSDP-gathered weights a program holds beside them;
- ``rows``: the rows each rollplex program takes, and how many of them a device holds;
- ``activations``: saved activations, vjp residuals and working sets of a layer / block / forward;
- ``sizes``: what both layouts share (weights, optimizer state, the engine, inputs), the rollout
  weights from the per-tensor sharing classification (``sharing_classification``);
- ``rollplex``: the rollplex layout phase by phase (what the runtime holds, as the meter measures it);
- ``layouts``: the figures of both layouts (module doc), ``naive_colocation``, ``build_plan``, the
  assumptions every plan lists;
- ``baseline``: the paper's baseline as a preset (``megatron_vllm``: naive colocation as Megatron-Core + vLLM
  hold it, HYPOTHETICAL; ``launch.plan --baseline=megatron_vllm``) and the sweep of its assumptions;
- ``budget``: ``plan()`` itself (the optimizer policy resolved, then both layouts),
  ``choose_optimizer_policy`` and ``smallest_budget``.

Everything is a pure function of the config (and the lengths, device count and program model).
"""

from rollplex_jax.memory.planner.activations import (
    BWD_FACTOR,
    Pass,
    prefix_residual_bytes,
    saved_activations,
)
from rollplex_jax.memory.planner.baseline import BASELINES, megatron_vllm
from rollplex_jax.memory.planner.budget import Budget, choose_optimizer_policy, plan, smallest_budget
from rollplex_jax.memory.planner.fractions import memory_fractions
from rollplex_jax.memory.planner.layouts import WEIGHT_SHARING_RULE, build_plan
from rollplex_jax.memory.planner.rollplex import chunk_count, vision_chunks
from rollplex_jax.memory.planner.sizes import sharing_classification
from rollplex_jax.memory.planner.types import (
    ATTENTIONS,
    DEFAULT_PROGRAMS,
    DENSE_PROGRAMS,
    LAYOUTS,
    REMATS,
    BudgetError,
    GiB,
    KiB,
    Lengths,
    MiB,
    ParamCounts,
    Plan,
    PlanMesh,
    ProgramModel,
    human_bytes,
    param_counts,
)

__all__ = [
    "ATTENTIONS", "BASELINES", "BWD_FACTOR", "DENSE_PROGRAMS", "DEFAULT_PROGRAMS", "LAYOUTS", "REMATS",
    "WEIGHT_SHARING_RULE", "Budget", "BudgetError", "GiB", "KiB", "Lengths", "MiB", "ParamCounts", "Pass", "Plan",
    "PlanMesh", "ProgramModel", "build_plan", "choose_optimizer_policy", "chunk_count",
    "human_bytes", "megatron_vllm", "memory_fractions",
    "param_counts", "plan", "prefix_residual_bytes", "saved_activations", "sharing_classification",
    "smallest_budget", "vision_chunks",
]
