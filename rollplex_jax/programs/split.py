"""Programs of the Rollplex schedule: prefix work that may run while the rollout decodes, and suffixes.

The loss is the serial one (``actor._loss``) computed through the split: the prompt's
boundary KV comes from a *prefix* program, the answers' log-probs from a *suffix* program
that attends to it. The actor's prefix either keeps its autograd residuals
(``jax.vjp`` inside jit, returned as a pytree) or keeps only the boundary KV and is
recomputed inside the update (``--actor_prefix=recompute``). Either way the gradient is
the full gradient: suffix gradients plus ``prefix_vjp(d boundary KV)``, which reaches the
decoder's prompt positions, the merger and the vision tower.

| program (``SplitPrograms``) | donates | notes                                                        |
|-----------------------------|---------|--------------------------------------------------------------|
| ``vision``                  | nothing | frozen vision tower: encoded once, shared by actor and ref   |
| ``actor_prefix``            | nothing | reads theta_k; boundary KV (+ vjp residuals)                 |
| ``ref_prefix``              | nothing | reads the reference params; boundary KV                      |
| ``suffix_logp``             | nothing | answer log-probs given a boundary KV: under the reference    |
|                             |         | (reference scoring) or under theta_k (old log-probs, KL)     |
| ``grads_residuals``         | nothing | suffix loss -> gradients w.r.t. params and boundary, then    |
|                             |         | the prefix's vjp of the latter (``--actor_prefix=residuals``) |
| ``grads_recompute``         | nothing | the same gradient with the prefix forward recomputed inside  |
|                             |         | (``--actor_prefix=recompute``, and later mini-batches)       |

Both gradient programs run the whole B*G answers of the step, with zero token weights outside the
mini-batch's rows (``step_ops.RollplexOps.grads``); ``--micro_batch`` does not split them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, RlConfig
from rollplex_jax.models.qwen2_5_vl.model import (
    ModelInputs,
    PrefixState,
    encode_vision,
    prefix_forward,
    suffix_forward,
    suffix_logprobs,
)
from rollplex_jax.programs.actor import objective


def _prefix(cfg: ModelConfig, params, inputs: ModelInputs, vision_embeds):
    """(k, v, last_logits) of the prompts; the vision tower runs inside unless embeds are given."""
    state, last = prefix_forward(params, cfg, inputs, vision_embeds=vision_embeds)
    return state.k, state.v, last


def _actor_prefix_residuals(cfg, params, inputs, vision_embeds):
    (k, v, last), vjp = jax.vjp(lambda p: _prefix(cfg, p, inputs, vision_embeds), params)
    return k, v, last, vjp


def _suffix_logp(cfg, params, k, v, last, mask, next_pos, response_ids, response_mask):
    state = PrefixState(k, v, mask, next_pos)
    logits = suffix_forward(params, cfg, state, response_ids, response_mask)
    return suffix_logprobs(last, logits, response_ids, response_mask), logits


def _suffix_loss(cfg: ModelConfig, rl: RlConfig, params, k, v, last, mask, next_pos, response_ids, weights,
                 advantages, old_logp, ref_logp):
    """The serial objective (``actor.objective``) on [B, N, Tr] answers over a shared prefix."""
    logp, logits = _suffix_logp(cfg, params, k, v, last, mask, next_pos, response_ids, weights > 0)
    b, n, t, vsz = logits.shape
    pred = jnp.concatenate([jnp.broadcast_to(last[:, None, None], (b, n, 1, vsz)), logits[:, :, :-1]], axis=2)
    return objective(rl, logp, pred, weights, advantages, old_logp, ref_logp)


def _grads_residuals(cfg, rl, params, k, v, last, vjp, mask, next_pos, response_ids, weights, advantages,
                     old_logp, ref_logp):
    """Suffix gradients w.r.t. params and the boundary state, then the prefix's vjp of the latter."""
    loss_fn = functools.partial(_suffix_loss, cfg, rl)
    (_, metrics), (g_suffix, gk, gv, glast) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3), has_aux=True)(
        params, k, v, last, mask, next_pos, response_ids, weights, advantages, old_logp, ref_logp)
    (g_prefix,) = vjp((gk, gv, glast))
    return jax.tree.map(jnp.add, g_suffix, g_prefix), metrics


def _grads_recompute(cfg, rl, params, inputs, vision_embeds, response_ids, weights, advantages, old_logp,
                     ref_logp):
    """Same gradient, with the prefix forward recomputed inside (only the boundary KV was kept)."""
    def loss_fn(p):
        k, v, last = _prefix(cfg, p, inputs, vision_embeds)
        return _suffix_loss(cfg, rl, p, k, v, last, inputs.attention_mask.astype(bool), inputs.next_position,
                            response_ids, weights, advantages, old_logp, ref_logp)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, metrics


@dataclasses.dataclass(frozen=True)
class SplitPrograms:
    vision: Callable
    actor_prefix: Callable  # residuals: (k, v, last, vjp); recompute: (k, v, last)
    ref_prefix: Callable
    suffix_logp: Callable
    grads_residuals: Callable
    grads_recompute: Callable


def make_split_programs(cfg: ModelConfig, rl: RlConfig, residuals: bool) -> SplitPrograms:
    """Builds (jits) the Rollplex programs once."""
    prefix = jax.jit(functools.partial(_prefix, cfg))
    return SplitPrograms(
        vision=jax.jit(lambda params, inputs: encode_vision(params, cfg, inputs)),
        actor_prefix=jax.jit(functools.partial(_actor_prefix_residuals, cfg)) if residuals else prefix,
        ref_prefix=prefix,
        suffix_logp=jax.jit(lambda *a: _suffix_logp(cfg, *a)[0]),
        grads_residuals=jax.jit(functools.partial(_grads_residuals, cfg, rl)),
        grads_recompute=jax.jit(functools.partial(_grads_recompute, cfg, rl)),
    )
