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
micro-batch losses/gradients equals the mini-batch loss/gradient exactly. Every log-prob is of
``softmax(logits / T)`` at the rollout's temperature T (``Spec``), the distribution the rollout sampled from;
the first mini-batch's gradient program also measures how far the engine's log-probs are from it
(``mismatch_sums``), so that metric costs no extra forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, OptimConfig, ProgramConfig, RlConfig
from rollplex_jax.models.vl.layers import compiler_options
from rollplex_jax.models.vl.model import ModelInputs, full_forward, gather_logprobs
from rollplex_jax.programs.optimizer import ChunkedOptimizer
from rollplex_jax.rl import losses


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a program's trace depends on beside its arrays (static: closed over by the jit).

    ``model``: the model; ``prog``: how programs compute (attention kernel, remat, packing); ``rl``: the loss;
    ``temperature``: the rollout's training temperature (``--temperature``). Every log-prob the trainer forms
    (old, reference, actor; the entropy, the ratio and the KL built on them) is of ``softmax(logits /
    temperature)`` over the whole vocabulary: the distribution the rollout sampled from, up to its top-k / top-p
    truncation, which training does not apply (as TRL and verl). At 1 the division is exact.
    """

    model: ModelConfig
    prog: ProgramConfig
    rl: RlConfig
    temperature: float

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: training log-probs are of softmax(logits / T), "
                             "which needs T > 0 (greedy decoding, T = 0, is for validation only)")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Answers:
    """A micro-batch's answers and what the loss weighs them by (leading dims [..]: rows, or [rows, n]).

    ids [.., Tr] int; weights [.., Tr] token weights (``losses.token_weights`` of the mini-batch, sliced; 0 at
    padding); advantages [..]; old [.., Tr] log-probs under theta_k (None: ratio 1, ``objective``); ref [.., Tr]
    reference log-probs (None: no KL); engine [.., Tr] the rollout engine's log-probs of the same tokens (None:
    no mismatch metric; given for the first mini-batch only, whose params are theta_k)."""

    ids: jax.Array
    weights: jax.Array
    advantages: jax.Array
    old: jax.Array | None = None
    ref: jax.Array | None = None
    engine: jax.Array | None = None


def response_logits(params, cfg: ModelConfig, inputs: ModelInputs, prompt_len, n_response: int,
                    prog: ProgramConfig = ProgramConfig()):
    """fp32 logits [R, Tr, V] predicting each answer token (rows = prompt ++ answer): the vocabulary projection
    runs on those positions only."""
    return full_forward(params, cfg, inputs, prog=prog, logits_window=(prompt_len - 1, n_response))


def _logprobs(spec: Spec, params, inputs, prompt_len, response_ids, response_mask):
    logits = response_logits(params, spec.model, inputs, prompt_len, response_ids.shape[1], spec.prog)
    return gather_logprobs(logits / spec.temperature, response_ids, response_mask)


def mismatch_sums(logp, engine, mask) -> dict[str, jax.Array]:
    """|engine log-prob - trainer log-prob| over the answer tokens (``mask``): its sum, maximum and the token count
    (summed / maxed over micro-batches by the step: ``rollout/logprob_abs_diff_{mean,max}``)."""
    d = jnp.where(mask, jnp.abs(engine - jax.lax.stop_gradient(logp)), 0.0)
    return {"logprob_abs_diff_sum": d.sum(), "logprob_abs_diff_max": d.max(initial=0.0),
            "logprob_tokens": mask.sum().astype(jnp.float32)}


def objective(rl: RlConfig, logp, pred_logits, answers: Answers):
    """The actor's loss from answer log-probs and the (temperature-scaled) logits that predicted them (both
    schedules).

    Policy loss (+ KL in the loss when ``--kl_mode=loss``); metrics: loss, pg_loss, kl, entropy,
    clip_frac, ratio_mean, approx_kl, weight_sum, and the engine mismatch sums (``mismatch_sums``) when
    ``answers.engine`` is given. ``answers.old=None`` means ratio 1 (one update on fresh samples: old =
    stop_gradient(logp), exactly theta_k's log-probs).
    """
    weights = answers.weights
    old = jax.lax.stop_gradient(logp) if answers.old is None else answers.old
    loss, metrics = losses.policy_loss(logp, old, answers.advantages, weights, clip_low=rl.clip_low,
                                       clip_high=rl.clip_high)
    metrics = dict(metrics, pg_loss=loss)
    if answers.ref is not None:
        kl = losses.kl_loss(logp, answers.ref, weights, rl.kl_estimator)
        metrics["kl"] = kl
        if rl.kl_mode == "loss":
            loss = loss + rl.kl_coef * kl
    metrics["entropy"] = losses.entropy_from_logits(jax.lax.stop_gradient(pred_logits), weights)
    if answers.engine is not None:
        metrics.update(mismatch_sums(logp, answers.engine, weights > 0))
    metrics["loss"] = loss
    return loss, metrics


def _loss(spec: Spec, params, inputs, prompt_len, answers: Answers):
    """The objective on one micro-batch of full sequences (prompt ++ answer rows)."""
    logits = response_logits(params, spec.model, inputs, prompt_len, answers.ids.shape[1], spec.prog)
    pred = logits / spec.temperature
    logp = gather_logprobs(pred, answers.ids, answers.weights > 0)
    return objective(spec.rl, logp, pred, answers)


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


def make_programs(cfg: ModelConfig, rl: RlConfig, optim: OptimConfig, total_steps: int, *, temperature: float,
                  optimizer_chunks: int = 1, offload_optimizer: bool = False,
                  prog: ProgramConfig = ProgramConfig()) -> Programs:
    """Builds (jits) every program of the serial schedule once (``prog``: attention kernel and remat;
    ``temperature``: the rollout's training temperature, ``Spec``).

    ``grad(params, inputs, prompt_len, answers: Answers) -> ((loss, metrics), grads)``;
    ``ref_logprobs`` / ``old_logprobs(params, inputs, prompt_len, response_ids, response_mask)``."""
    spec = Spec(model=cfg, prog=prog, rl=rl, temperature=temperature)
    opts = compiler_options(prog.remat)
    logprobs = jax.jit(functools.partial(_logprobs, spec), compiler_options=opts)
    grad = jax.jit(jax.value_and_grad(functools.partial(_loss, spec), has_aux=True), compiler_options=opts)
    accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=0)
    optimizer = ChunkedOptimizer(optim, total_steps, n_chunks=optimizer_chunks, offload=offload_optimizer)
    return Programs(ref_logprobs=logprobs, old_logprobs=logprobs, grad=grad, accumulate=accumulate,
                    optimizer=optimizer)
