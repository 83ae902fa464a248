"""How the rollplex schedule divides a step's prefix rows among its programs, and how many a device holds.

The planner's row counts follow what ``step.rollplex_ops.RollplexOps`` runs (its module doc), from the
config alone:

- ``actor_parts``: the actor prefix runs once over all prefix rows, or (``--actor_prefix=residuals``) over
  the first mini-batch's rows (keeping their vjp residuals) and then the rest: one boundary state each;
- ``input_copies``: the ops keep the inputs of every row subset a program took (``RollplexOps._part``: the
  parts above, the recomputed mini-batches' micro-batches) for the rest of the step, beside the whole
  batch's: copies of the step's inputs while the prefix runs (rollout, score) and by the end of the
  gradients (train, update; the largest, as the planner takes each class's largest in a phase);
- ``per_device``: rows a device holds of a program's rows. The programs constrain the rows of every block
  to be split over the batch shards (``layers.constrain_rows``) when the shards divide them; otherwise the
  rows stay whole on every device (GSPMD may split another dimension instead: whole is the upper bound).
  A suffix micro-batch [prefix rows, answers] splits its prefix rows, or else its answers;
- ``packed``: rows the prefix programs run for a device's prompts where shape buckets pad each row past the
  longest prompt and packing fills it (the boundary KV stays one row per prompt).
"""

from __future__ import annotations

import math

from rollplex_jax.config import Config
from rollplex_jax.config.shapes import planned_micro_batch, pow2, prefix_rows_total
from rollplex_jax.memory.planner.types import Lengths, PlanMesh, split_dim


def answers_per_row(cfg: Config) -> int:
    return cfg.rollout.group_size if cfg.run.prefix_sharing else 1


def mini_batches(cfg: Config) -> list[tuple[int, int]]:
    """Prefix rows [p0, p1) of each mini-batch (``sequences.mini_batch_rows`` over the answers)."""
    from rollplex_jax.programs.sequences import mini_batch_rows  # here: importing the planner does not load jax

    n = answers_per_row(cfg)
    return [(r.start // n, r.stop // n) for r in mini_batch_rows(prefix_rows_total(cfg) * n, cfg.rl.mini_batches)]


def actor_parts(cfg: Config) -> list[tuple[int, int]]:
    """Prefix rows of each actor prefix call during the rollout (``RollplexOps.dispatch``)."""
    total = prefix_rows_total(cfg)
    first = mini_batches(cfg)[0] if cfg.run.actor_prefix == "residuals" else (0, total)
    return [first] + ([(first[1], total)] if first[1] < total else [])


def input_copies(cfg: Config) -> tuple[float, float]:
    """(copies of the step's prefix-row inputs held during rollout and score, held by the end of the
    gradients): 1 for the whole batch's, plus each cached subset's share of the rows (``RollplexOps._part``)."""
    from rollplex_jax.programs.sequences import answer_blocks

    total, n = prefix_rows_total(cfg), answers_per_row(cfg)
    cached = {p for p in actor_parts(cfg) if p != (0, total)}
    at_dispatch = sum(p1 - p0 for p0, p1 in cached)
    for i, (m0, m1) in enumerate(mini_batches(cfg)):
        if i == 0 and cfg.run.actor_prefix == "residuals":
            continue  # the first mini-batch's gradient reads the kept residuals, not the inputs
        cached |= {(b.p0, b.p1) for b in answer_blocks(m0, m1, n, planned_micro_batch(cfg))} - {(0, total)}
    return 1 + at_dispatch / total, 1 + sum(p1 - p0 for p0, p1 in cached) / total


def per_device(rows: int, mesh: PlanMesh) -> float:
    """Rows one device holds of a program's ``rows``: split over the batch shards where they divide them."""
    return split_dim(rows, mesh.batch_shards)


def packed(rows: float, lengths: Lengths) -> float:
    """Rows the prefix programs run for ``rows`` prompts on a device: the prompts packed
    ``lengths.prompts_per_row`` to a row, in a power of two rows (``packing.pack_layout(stable=True)``)."""
    k = lengths.prompts_per_row
    return rows if k <= 1 else float(pow2(math.ceil(rows / k), cap=max(1, math.ceil(rows))))


def micro_batch_rows(cfg: Config, mesh: PlanMesh) -> float:
    """Answer rows one device holds of a suffix micro-batch (the first and largest ``answer_blocks``)."""
    from rollplex_jax.programs.sequences import answer_blocks

    blk = answer_blocks(0, prefix_rows_total(cfg), answers_per_row(cfg), planned_micro_batch(cfg))[0]
    rows, answers = blk.p1 - blk.p0, blk.a1 - blk.a0
    if split_dim(rows, mesh.batch_shards) != rows:
        return rows // mesh.batch_shards * answers
    return rows * split_dim(answers, mesh.batch_shards)
