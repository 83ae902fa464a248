"""What each schedule computes for a step's scoring and gradients: one ``Ops`` object per step and schedule.

``step/rl_step.py`` runs the step (rollout, rewards, reference, advantages, mini-batch updates) and asks
its ``Ops`` for the schedule-specific parts through one protocol:

- ``SerialOps`` (the baseline): B*G full rows (prompt ++ answer), scored and differentiated in
  micro-batches of ``--micro_batch`` rows;
- ``rollplex_ops.RollplexOps``: the prompts' prefix programs (vision, actor prefix under ``jax.vjp``,
  reference prefix) are dispatched once per prompt (``--prefix_sharing``) or once per answer, possibly
  while the rollout decodes (``dispatch``); scoring and gradients run on the answers' suffix over the
  boundary KV, in micro-batches.

Both free their state after its last consumer (``after_ref``, ``after_grads``) and say what they
still hold by buffer class (``live``) for the memory meter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from rollplex_contract.batch import Prompts, Rollouts
from rollplex_jax.config import Config
from rollplex_jax.config.shapes import step_shapes
from rollplex_jax.programs.actor import Answers, Programs
from rollplex_jax.programs.sequences import (
    input_options,
    micro_batches,
    mini_batch_rows,
    pad_prompts,
    row_slots,
)
from rollplex_jax.trace import Tracer


@dataclasses.dataclass(frozen=True)
class Targets:
    """What the loss weighs a mini-batch's answers by: ``weights`` [mini-batch rows, Tr] (its token weights); over
    all B*G answer rows: ``advantages`` [B*G] and the ``old``, ``ref`` and ``engine`` log-probs [B*G, Tr], each
    or None (``actor.Answers`` says what None means)."""

    weights: jax.Array
    advantages: jax.Array
    old: jax.Array | None = None
    ref: jax.Array | None = None
    engine: jax.Array | None = None

    def answers(self, ids, local, rows) -> Answers:
        """The program's ``Answers`` of answer ``ids``: the weights at ``local`` (mini-batch-relative index), the rest
        at ``rows`` (an index into the B*G rows, or into the [prefix rows, n] view of ``reshaped``)."""
        return Answers(ids=ids, weights=self.weights[local], advantages=self.advantages[rows],
                       old=_pick(self.old, rows), ref=_pick(self.ref, rows), engine=_pick(self.engine, rows))

    def reshaped(self, weights_shape, rows_shape) -> Targets:
        """The same targets with the weights in ``weights_shape`` and the all-rows arrays in ``rows_shape``
        (+ [Tr] for the log-probs)."""
        tr = self.weights.shape[-1]
        return Targets(weights=self.weights.reshape(*weights_shape, tr),
                       advantages=self.advantages.reshape(rows_shape),
                       **{k: None if x is None else x.reshape(*rows_shape, tr)
                          for k, x in (("old", self.old), ("ref", self.ref), ("engine", self.engine))})


def _pick(x, idx):
    return None if x is None else x[idx]


class Ops(Protocol):
    """The schedule-specific part of one step (``rl_step._learn`` and ``_train`` call these in order).

    ``on_live``: set by the scheduler around ``grads`` when memory is measured; ``grads`` calls it with what
    it holds by class (its ``live()`` and its loop's ``{"activations": ..., "gradients": ...}``) at its fullest
    point, or never. The hook does not reference the ops (no ops -> hook -> ops cycle: see ``rl_step._train``)."""

    on_live: Any

    def ref_logp(self) -> jax.Array:
        """Reference log-probs [B*G, Tr] of the answers (only called when the reference is used)."""

    def logp(self, params) -> jax.Array:
        """Answer log-probs [B*G, Tr] under ``params`` (old log-probs, KL metric, KL in the reward)."""

    def grads(self, params, rows: slice, targets: Targets, version: int) -> tuple[Any, list[dict]]:
        """Gradient of the loss on answer rows ``rows`` (``targets``: token weights of those rows, the rest of all
        rows) under ``params`` at params ``version``; the metric sums of each program call."""

    def after_ref(self) -> None:
        """The reference's last consumer is done: free what only it needed."""

    def after_grads(self) -> None:
        """The first mini-batch's gradient is done: free what only it needed."""

    def live(self) -> dict:
        """What this step still holds, by buffer class (``classes.CLASSES``)."""

    def slots(self) -> np.ndarray:
        """[real tokens, left-padded token slots, token slots run] of one scoring pass (``sequences.row_slots``)."""


class SerialOps:
    """Full-sequence scoring and gradients (the baseline): B*G rows of prompt ++ answer (the prompts padded to
    their length bucket; the answers come padded to theirs, ``rl_step``), in micro-batches of ``--micro_batch``
    rows or of ``--micro_batch_tokens`` slots."""

    def __init__(self, cfg: Config, programs: Programs, ref_params, prompts: Prompts, rollouts: Rollouts,
                 tracer: Tracer, step: int):
        b, g, tr = rollouts.response_ids.shape
        self.prog, self.tracer, self.step = programs, tracer, step
        shapes = step_shapes(cfg)
        prompts = pad_prompts(prompts, shapes.prompt_len(prompts.input_ids.shape[1]))
        micro = shapes.serial_rows(prompts.input_ids.shape[1] + tr)
        self.mbs = [mb for rows in mini_batch_rows(b * g, cfg.rl.mini_batches)
                    for mb in micro_batches(cfg.model, prompts, rollouts, micro, rows, input_options(cfg))]
        self.ref_params = ref_params
        self.on_live = None  # nothing of its own is live beyond one program call

    def live(self) -> dict:
        return {"other": [(mb.inputs, mb.response_ids, mb.response_mask) for mb in self.mbs]}

    def slots(self) -> np.ndarray:
        return sum(row_slots(mb.inputs) for mb in self.mbs)

    def after_ref(self) -> None:
        pass

    def after_grads(self) -> None:
        pass

    def ref_logp(self):
        with self.tracer.span("JAX suffix", "reference", self.step):
            return jax.block_until_ready(jnp.concatenate(
                [self.prog.ref_logprobs(self.ref_params, mb.inputs, mb.prompt_len, mb.response_ids, mb.response_mask)
                 for mb in self.mbs]))

    def logp(self, params):
        return jnp.concatenate([self.prog.old_logprobs(params, mb.inputs, mb.prompt_len, mb.response_ids,
                                                       mb.response_mask) for mb in self.mbs])

    def grads(self, params, rows: slice, targets: Targets, version):
        acc, parts = None, []
        for mb in (m for m in self.mbs if rows.start <= m.rows.start < rows.stop):
            local = slice(mb.rows.start - rows.start, mb.rows.stop - rows.start)
            (_, m), gr = self.prog.grad(params, mb.inputs, mb.prompt_len,
                                        targets.answers(mb.response_ids, local, mb.rows))
            acc = gr if acc is None else self.prog.accumulate(acc, gr)
            parts.append(m)
        return acc, parts
