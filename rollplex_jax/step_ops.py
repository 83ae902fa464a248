"""What each schedule computes for a step's scoring and gradients: one ``Ops`` object per step and schedule.

``scheduler.py`` runs the step (rollout, rewards, reference, advantages, mini-batch updates) and asks
its ``Ops`` for the schedule-specific parts through one protocol:

- ``SerialOps`` (the baseline): B*G full rows (prompt ++ answer), scored and differentiated in
  micro-batches of ``--micro_batch`` rows;
- ``RollplexOps``: the prompts' prefix programs (vision, actor prefix under ``jax.vjp``, reference
  prefix) are dispatched once per prompt (``--prefix_sharing``) or once per answer, possibly while the
  rollout decodes (``dispatch``); scoring and gradients run on the answers' suffix over the boundary KV.
  Boundary states carry the params version they were computed under (``Boundary``): a consumer at
  another version raises ``StaleBoundaryError``.

Both free their state after its last consumer (``after_ref``, ``after_grads``) and say what they
still hold by buffer class (``live``) for the memory meter.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from rollplex_contract.batch import Prompts, Rollouts
from rollplex_jax.config import Config
from rollplex_jax.models.qwen2_5_vl.model import prepare_inputs
from rollplex_jax.programs.actor import Programs
from rollplex_jax.programs.sequences import micro_batches, mini_batch_rows, repeat_rows
from rollplex_jax.trace import Tracer


class Ops(Protocol):
    """The schedule-specific part of one step (``scheduler._learn`` and ``_train`` call these in order)."""

    def ref_logp(self) -> jax.Array:
        """Reference log-probs [B*G, Tr] of the answers (only called when the reference is used)."""

    def logp(self, params) -> jax.Array:
        """Answer log-probs [B*G, Tr] under ``params`` (old log-probs, KL metric, KL in the reward)."""

    def grads(self, params, rows: slice, weights, adv, old, ref, version: int) -> tuple[Any, list[dict]]:
        """Gradient of the loss on answer rows ``rows`` (token ``weights`` of those rows; ``adv``/``old``/``ref``
        of all rows) under ``params`` at params ``version``; the metric sums of each program call."""

    def after_ref(self) -> None:
        """The reference's last consumer is done: free what only it needed."""

    def after_grads(self) -> None:
        """The first mini-batch's gradient is done: free what only it needed."""

    def live(self) -> dict:
        """What this step still holds, by buffer class (``memory_classes.CLASSES``)."""


class SerialOps:
    """Full-sequence scoring and gradients (the baseline): B*G rows of prompt ++ answer."""

    def __init__(self, cfg: Config, programs: Programs, ref_params, prompts: Prompts, rollouts: Rollouts,
                 tracer: Tracer, step: int):
        b, g, _ = rollouts.response_ids.shape
        self.prog, self.tracer, self.step = programs, tracer, step
        self.mbs = [mb for rows in mini_batch_rows(b * g, cfg.rl.mini_batches)
                    for mb in micro_batches(cfg.model, prompts, rollouts, cfg.rl.micro_batch, rows)]
        self.ref_params = ref_params

    def live(self) -> dict:
        return {"other": [(mb.inputs, mb.response_ids, mb.response_mask) for mb in self.mbs]}

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

    def grads(self, params, rows: slice, weights, adv, old, ref, version):
        acc, parts = None, []
        for mb in (m for m in self.mbs if rows.start <= m.rows.start < rows.stop):
            r = slice(mb.rows.start - rows.start, mb.rows.stop - rows.start)
            o = None if old is None else old[mb.rows]
            f = None if ref is None else ref[mb.rows]
            (_, m), gr = self.prog.grad(params, mb.inputs, mb.prompt_len, mb.response_ids, weights[r], adv[mb.rows],
                                        o, f)
            acc = gr if acc is None else self.prog.accumulate(acc, gr)
            parts.append(m)
        return acc, parts


class StaleBoundaryError(RuntimeError):
    """A boundary state computed under one params version was handed to a consumer at another."""


@dataclasses.dataclass
class Boundary:
    """Prefix outputs of B' prompts (B' = B with prefix sharing, B*G without), tagged with a params version."""

    version: int
    k: jax.Array
    v: jax.Array
    last: jax.Array
    vjp: object | None = None

    def check(self, version: int, consumer: str) -> None:
        if self.version != version:
            raise StaleBoundaryError(f"{consumer}: boundary state was computed under params version {self.version} "
                                     f"but the consumer runs at version {version}; recompute the prefix")


class RollplexOps:
    """Prefix/suffix scoring and gradients; the prefix programs may run during the decode.

    Life of its state: ``dispatch`` (prefix programs, asynchronously) -> ``wait_prefix`` -> ``set_rollouts``
    (the answers) -> ``ref_logp`` -> ``after_ref`` (reference boundary freed) -> ``grads`` of the first
    mini-batch -> ``after_grads`` (actor boundary and residuals freed) -> ``drop``.
    """

    def __init__(self, cfg: Config, split, state, prompts: Prompts, tracer: Tracer, step: int, version: int):
        self.cfg, self.sp, self.tracer, self.step, self.version = cfg, split, tracer, step, version
        g = cfg.rollout.group_size
        self.n = g if cfg.run.prefix_sharing else 1  # answers per prefix row
        rows = prompts if cfg.run.prefix_sharing else repeat_rows(cfg.model, prompts, g)
        self.inputs = prepare_inputs(cfg.model, rows.input_ids, rows.attention_mask, rows.pixel_values,
                                     rows.image_grid_thw, rows.video_grid_thw)
        self.state = state
        self.residuals = cfg.run.actor_prefix == "residuals"
        self.use_ref = cfg.rl.uses_reference
        self.emb = None  # frozen vision tower's embeddings (--freeze_vision), shared by actor and reference
        self.actor: Boundary | None = None
        self.ref: Boundary | None = None
        self.shape: tuple[int, int, int] | None = None  # answers as [prefix rows, answers per row, Tr]
        self.resp = self.rmask = None
        self._dispatch_t0 = 0.0

    def dispatch(self) -> RollplexOps:
        """Asynchronously dispatches vision (if frozen), actor prefix and reference prefix under theta_k."""
        self._dispatch_t0 = self.tracer.now()
        p, inputs = self.state.params, self.inputs
        self.emb = self.sp.vision(p, inputs) if self.cfg.optim.freeze_vision else None
        out = self.sp.actor_prefix(p, inputs, self.emb)
        self.actor = Boundary(self.version, *out) if self.residuals else Boundary(self.version, *out[:3])
        if self.use_ref:
            k, v, last = self.sp.ref_prefix(self.state.ref_params, inputs, self.emb)
            self.ref = Boundary(self.version, k, v, last)
        return self

    def wait_prefix(self) -> None:
        """Blocks until the prefix work is done; records its span (dispatch -> ready)."""
        jax.block_until_ready((self.actor.k, self.actor.last, None if self.ref is None else self.ref.last))
        self.tracer.add("JAX prefix", "prefix", self.step, self._dispatch_t0, self.tracer.now())

    def set_rollouts(self, rollouts: Rollouts) -> None:
        b, g, tr = rollouts.response_ids.shape
        self.shape = (b * g // self.n, self.n, tr)
        self.resp = jnp.asarray(rollouts.response_ids.reshape(self.shape), jnp.int32)
        self.rmask = jnp.asarray(rollouts.mask.reshape(self.shape) > 0)

    def _mask_pos(self):
        return self.inputs.attention_mask.astype(bool), self.inputs.next_position

    def ref_logp(self):
        self.ref.check(self.version, "reference suffix")
        with self.tracer.span("JAX suffix", "reference", self.step):
            lp = self.sp.suffix_logp(self.state.ref_params, self.ref.k, self.ref.v, self.ref.last, *self._mask_pos(),
                                     self.resp, self.rmask)
            return jax.block_until_ready(lp.reshape(-1, self.shape[-1]))

    def logp(self, params):
        self.actor.check(self.version, "actor suffix")
        lp = self.sp.suffix_logp(params, self.actor.k, self.actor.v, self.actor.last, *self._mask_pos(), self.resp,
                                 self.rmask)
        return lp.reshape(-1, self.shape[-1])

    def grads(self, params, rows: slice, weights, adv, old, ref, version):
        """Gradient of the loss on rows ``rows`` (weights elsewhere 0). Only the first mini-batch (params still
        theta_k) may use the precomputed prefix; later ones recompute it under the current params."""
        full_w = jnp.zeros(self.shape, jnp.float32).reshape(-1, self.shape[-1]).at[rows].set(weights)
        shaped = lambda x: None if x is None else x.reshape(self.shape)  # noqa: E731
        args = (full_w.reshape(self.shape), adv.reshape(self.shape[:2]), shaped(old), shaped(ref))
        if version == self.version and self.residuals and self.actor is not None:
            self.actor.check(version, "actor update")
            g, m = self.sp.grads_residuals(params, self.actor.k, self.actor.v, self.actor.last, self.actor.vjp,
                                           *self._mask_pos(), self.resp, *args)
        else:
            g, m = self.sp.grads_recompute(params, self.inputs, self.emb, self.resp, *args)
        return g, [m]

    def live(self) -> dict:
        """The boundary state and residuals still held, by buffer class."""
        kv = [(b.k, b.v, b.last) for b in (self.actor, self.ref) if b is not None]
        res = self.actor.vjp if self.actor is not None else None
        return {"boundary_kv": kv or None, "prefix_residuals": res,
                "other": (self.inputs, self.emb, self.resp, self.rmask)}

    def after_ref(self) -> None:
        """The reference boundary's last consumer (the reference suffix) is done: free it."""
        self.ref = None

    def after_grads(self) -> None:
        """The actor boundary's last consumer (the first mini-batch's gradient) is done: free it and the
        residuals; later mini-batches recompute the prefix under their own params."""
        self.actor = None

    def drop(self) -> None:
        """Ends the life of the boundary state and residuals (their buffers are freed)."""
        self.actor = self.ref = None

