"""Actor and reference programs of the serial schedule: full-sequence scoring, loss, gradients, update.

Programs (built once per run by ``make_programs``) and what they donate:

| program            | donates              | notes                                              |
|--------------------|----------------------|----------------------------------------------------|
| ``ref_logprobs``   | nothing              | reference params are never donated                 |
| ``old_logprobs``   | nothing              | actor under theta_k, only with several mini-batches |
| ``grad``           | nothing              | one micro-batch: loss, gradients, metric sums       |
| ``accumulate``     | the running sum      | gradient accumulation over micro-batches            |
| ``update``         | params, opt state    | chunked AdamW (programs/optimizer.py); params unchanged if non-finite |

Token weights are computed on the whole mini-batch and sliced per micro-batch, so the sum of
micro-batch losses/gradients equals the mini-batch loss/gradient exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, OptimConfig, ProgramConfig, RlConfig
from rollplex_jax.models.qwen2_5_vl.layers import compiler_options
from rollplex_jax.models.qwen2_5_vl.model import ModelInputs, full_forward, gather_logprobs
from rollplex_jax.programs.optimizer import ChunkedOptimizer
from rollplex_jax.rl import losses


def response_logits(params, cfg: ModelConfig, inputs: ModelInputs, prompt_len, n_response: int,
                    prog: ProgramConfig = ProgramConfig()):
    """fp32 logits [R, Tr, V] predicting each answer token (rows = prompt ++ answer): the vocabulary projection
    runs on those positions only."""
    return full_forward(params, cfg, inputs, prog=prog, logits_window=(prompt_len - 1, n_response))


def _logprobs(cfg, prog, params, inputs, prompt_len, response_ids, response_mask):
    logits = response_logits(params, cfg, inputs, prompt_len, response_ids.shape[1], prog)
    return gather_logprobs(logits, response_ids, response_mask)


def objective(rl: RlConfig, logp, pred_logits, weights, advantages, old_logp, ref_logp):
    """The actor's loss from answer log-probs and the logits that predicted them (both schedules).

    Policy loss (+ KL in the loss when ``--kl_mode=loss``); metrics: loss, pg_loss, kl, entropy,
    clip_frac, ratio_mean, approx_kl, weight_sum. ``old_logp=None`` means ratio 1 (one update
    on fresh samples: old = stop_gradient(logp), exactly theta_k's log-probs).
    """
    old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
    loss, metrics = losses.policy_loss(logp, old, advantages, weights, clip_low=rl.clip_low, clip_high=rl.clip_high)
    metrics = dict(metrics, pg_loss=loss)
    if ref_logp is not None:
        kl = losses.kl_loss(logp, ref_logp, weights, rl.kl_estimator)
        metrics["kl"] = kl
        if rl.kl_mode == "loss":
            loss = loss + rl.kl_coef * kl
    metrics["entropy"] = losses.entropy_from_logits(jax.lax.stop_gradient(pred_logits), weights)
    metrics["loss"] = loss
    return loss, metrics


def _loss(cfg: ModelConfig, prog: ProgramConfig, rl: RlConfig, params, inputs, prompt_len, response_ids, weights,
          advantages, old_logp, ref_logp):
    """The objective on one micro-batch of full sequences (prompt ++ answer rows)."""
    logits = response_logits(params, cfg, inputs, prompt_len, response_ids.shape[1], prog)
    logp = gather_logprobs(logits, response_ids, weights > 0)
    return objective(rl, logp, logits, weights, advantages, old_logp, ref_logp)


@dataclasses.dataclass(frozen=True)
class Programs:
    ref_logprobs: Callable
    old_logprobs: Callable
    grad: Callable
    accumulate: Callable
    optimizer: ChunkedOptimizer

    def update(self, params, opt_state, grads):
        """The optimizer step (programs/optimizer.py); donates params and optimizer state."""
        return self.optimizer.update(params, opt_state, grads)


def make_programs(cfg: ModelConfig, rl: RlConfig, optim: OptimConfig, total_steps: int, *, optimizer_chunks: int = 1,
                  offload_optimizer: bool = False, prog: ProgramConfig = ProgramConfig()) -> Programs:
    """Builds (jits) every program of the serial schedule once (``prog``: attention kernel and remat)."""
    opts = compiler_options(prog.remat)
    logprobs = jax.jit(functools.partial(_logprobs, cfg, prog), compiler_options=opts)
    grad = jax.jit(jax.value_and_grad(functools.partial(_loss, cfg, prog, rl), has_aux=True), compiler_options=opts)
    accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=0)
    optimizer = ChunkedOptimizer(optim, total_steps, n_chunks=optimizer_chunks, offload=offload_optimizer)
    return Programs(ref_logprobs=logprobs, old_logprobs=logprobs, grad=grad, accumulate=accumulate,
                    optimizer=optimizer)
