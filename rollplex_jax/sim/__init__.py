"""Step-time simulator: predict each phase's time and the step time of serial, rollplex and disaggregated.

``simulate(cfg, hw, lengths, devices)`` -> ``Simulation`` (per schedule: phases in seconds, step time,
spans for a Gantt chart). Reuses the planner's ``Lengths``, ``PlanMesh``, ``param_counts``,
``ProgramModel`` and its weight-sharing classification. Hardware: ``rollplex_jax.sim.hardware`` (presets
and the CPU probe; its docstring lists the datasheet numbers, efficiency factors and the probes that
measure this CPU). Where each part lives (each module's docstring has its equations):

- ``costs``: what one program costs (FLOPs, elementwise / attention bytes, kernel launches,
  communication: ``Cost``, ``text_forward_cost``, ``vision_forward_cost``, ``backward_of``) and its time on a
  device (``time_of``), with the dense program model's constants measured against XLA;
- ``phases``: the seconds of each phase (rollout, reference and actor, the gradient sum over dp, update, weight
  sync, host input assembly) for one step's ``Setup`` on a pool of devices; the reference and actor phases from their
  programs' costs (``training_costs``: per phase, ``Work`` = a cost per call and the calls), which
  tests/test_simulator.py checks against XLA's counts of the same programs;
- ``schedules``: the phases on a timeline per schedule (serial, rollplex, overlap_only, sharing_only,
  disaggregated), ``overlap_stage`` (the prefix beside the decode) and ``simulate()``;
- ``report``: ``table``, ``plot``, ``sweep`` and ``sweep_table``; ``calibration`` / ``bench_calibration``: a
  bench run's measured step times beside the prediction (``launch.bench --bench_simulate``).
"""

from rollplex_jax.sim.costs import (
    DENSE_ATT_BWD,
    DENSE_EW_BWD,
    DENSE_TEXT_ATT_FWD,
    DENSE_TEXT_EW,
    DENSE_VIS_ATT_FWD,
    DENSE_VIS_EW,
    FLASH_EW_BWD,
    OPS_PER_LAYER,
    Cost,
    backward_of,
    text_forward_cost,
    time_of,
    vision_forward_cost,
)
from rollplex_jax.sim.phases import Setup, WeightSync, Work, training_costs, weight_sync
from rollplex_jax.sim.report import TABLE_SCHEDULES, bench_calibration, calibration, plot, sweep, sweep_table, table
from rollplex_jax.sim.schedules import (
    PHASES,
    SCHEDULES,
    Schedule,
    Simulation,
    build_schedule,
    overlap_stage,
    simulate,
)

__all__ = [
    "DENSE_ATT_BWD", "DENSE_EW_BWD", "DENSE_TEXT_ATT_FWD", "DENSE_TEXT_EW", "DENSE_VIS_ATT_FWD", "DENSE_VIS_EW",
    "FLASH_EW_BWD", "OPS_PER_LAYER", "PHASES", "SCHEDULES", "TABLE_SCHEDULES",
    "Cost", "Schedule", "Setup", "Simulation", "WeightSync", "Work",
    "backward_of", "bench_calibration", "build_schedule", "calibration", "overlap_stage", "plot", "simulate", "sweep",
    "sweep_table", "table", "text_forward_cost", "time_of", "training_costs", "vision_forward_cost", "weight_sync",
]
