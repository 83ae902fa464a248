"""One RL step per schedule.

``serial`` (the baseline every speedup is measured against, and the oracle of every
equivalence test): rollout in torch over views of theta_k -> rewards -> reference
log-probs over full sequences -> advantages -> actor forward/backward over full
sequences in micro-batches -> optax update (donating params and optimizer state).

Barriers: the engine's views of theta_k are released before any program that donates
theta_k runs; a batch whose advantages are all zero skips the optimizer (LEARNING.md:
otherwise AdamW drifts on noise), and so does a non-finite gradient norm.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollout_torch.engine import Engine, Prompts, Rollouts, SamplingParams
from rollplex_jax.config import Config
from rollplex_jax.programs.actor import Programs
from rollplex_jax.programs.sequences import micro_batches
from rollplex_jax.rl import advantages as adv_lib
from rollplex_jax.rl import losses
from rollplex_jax.sharing import WeightPublisher


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Actor params theta_k, optimizer state, and the frozen reference params."""

    params: dict
    opt_state: Any
    ref_params: dict


@dataclasses.dataclass
class StepContext:
    """What a step needs besides the state: config, programs, engine, reward function, decoder."""

    cfg: Config
    programs: Programs
    engine: Engine
    publisher: WeightPublisher
    reward_fn: Callable[[list[str], list[str]], tuple[np.ndarray, int]]
    decode: Callable[[list[int]], str]
    stop_ids: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StepResult:
    state: TrainState
    metrics: dict[str, float]
    rollouts: Rollouts
    texts: list[list[str]]
    rewards: np.ndarray


class _Timer:
    def __init__(self):
        self.times: dict[str, float] = {}

    def __call__(self, phase: str):
        timer = self

        class _Span:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.times[phase] = timer.times.get(phase, 0.0) + time.perf_counter() - self.t

        return _Span()


def response_texts(rollouts: Rollouts, decode, stop_ids) -> list[list[str]]:
    """Each answer decoded up to (not including) its stop token."""
    out = []
    for i in range(rollouts.response_ids.shape[0]):
        row = []
        for j in range(rollouts.response_ids.shape[1]):
            ids = rollouts.response_ids[i, j, :rollouts.lengths[i, j]].tolist()
            if ids and ids[-1] in stop_ids:
                ids = ids[:-1]
            row.append(decode(ids))
        out.append(row)
    return out


def sample(ctx: StepContext, params: dict, prompts: Prompts, *, n: int, seed: int, greedy: bool = False) -> Rollouts:
    """Rollout under ``params``: publish (bind views), generate, release (so params may be donated)."""
    r = ctx.cfg.rollout
    sp = SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, stop_token_ids=ctx.stop_ids, seed=seed)
    ctx.publisher.publish(params, version=seed)
    try:
        return ctx.engine.generate(prompts, n, sp)
    finally:
        ctx.publisher.release()


def serial_step(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], *,
                seed: int) -> StepResult:
    """One synchronous on-policy GRPO-family step. ``answers`` has one entry per prompt."""
    cfg, prog, timer = ctx.cfg, ctx.programs, _Timer()
    t_start = time.perf_counter()
    g = cfg.rollout.group_size
    with timer("rollout"):
        rollouts = sample(ctx, state.params, prompts, n=g, seed=seed)
    b, _, tr = rollouts.response_ids.shape
    with timer("reward"):
        texts = response_texts(rollouts, ctx.decode, ctx.stop_ids)
        flat, failures = ctx.reward_fn([t for row in texts for t in row], [a for a in answers for _ in range(g)])
        rewards = np.asarray(flat, np.float32).reshape(b, g)

    use_ref = cfg.rl.kl_mode != "off"
    mbs = [mb for rows in mini_batch_rows(b * g, cfg.rl.mini_batches)
           for mb in micro_batches(cfg.model, prompts, rollouts, cfg.rl.micro_batch, rows)]
    ref_logp = None
    if use_ref:
        with timer("reference"):
            ref_logp = jnp.concatenate([prog.ref_logprobs(state.ref_params, mb.inputs, mb.prompt_len,
                                                          mb.response_ids, mb.response_mask) for mb in mbs])
    scores = jnp.asarray(rewards)
    mask = jnp.asarray(rollouts.mask.reshape(b * g, tr))
    if cfg.rl.kl_mode == "reward":
        with timer("reference"):
            old = _logprobs_all(prog, state.params, mbs)
        scores = losses.kl_penalized_rewards(scores, old.reshape(b, g, tr), ref_logp.reshape(b, g, tr),
                                             mask.reshape(b, g, tr), cfg.rl.kl_coef, cfg.rl.kl_estimator)
    adv = adv_lib.compute_advantages(scores, cfg.rl.advantage, norm_by_std=cfg.rl.norm_by_std)
    metrics = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
               "reward/failures": float(failures), "response_length/mean": float(rollouts.lengths.mean()),
               "response/stop_frac": float(np.mean([r == "stop" for row in rollouts.finish_reasons for r in row]))}

    # No signal: every advantage is zero, or every answer is empty -> no optimizer step at all
    # (a zero gradient would still move AdamW's params through its moments).
    if not should_update(adv, rollouts.lengths):
        metrics.update({"skipped_steps/no_signal": 1.0, "skipped_steps/nonfinite": 0.0})
        if use_ref:
            metrics["kl"] = _kl_metric(prog, state, mbs, ref_logp, mask, cfg)
        new_state = state
    else:
        with timer("actor"):
            new_state, train_metrics = _train(prog, cfg, state, mbs, adv.reshape(b * g), mask, ref_logp, timer)
        metrics.update(train_metrics)
        metrics["skipped_steps/no_signal"] = 0.0
    metrics.update({f"time/{k}_s": v for k, v in timer.times.items()})
    metrics["time/step_s"] = time.perf_counter() - t_start
    return StepResult(new_state, metrics, rollouts, texts, rewards)


def should_update(advantages, lengths) -> bool:
    """False when no answer carries signal: all advantages zero, or every answer with one is empty."""
    return bool(adv_lib.has_signal(jnp.where(jnp.asarray(lengths) > 0, advantages, 0.0)))


def mini_batch_rows(n_rows: int, n_mini: int) -> list[slice]:
    """Contiguous row ranges of the mini-batches (whole rows; sizes differ by at most one)."""
    edges = np.linspace(0, n_rows, n_mini + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def _logprobs_all(prog: Programs, params, mbs) -> jax.Array:
    return jnp.concatenate([prog.old_logprobs(params, mb.inputs, mb.prompt_len, mb.response_ids, mb.response_mask)
                            for mb in mbs])


def _kl_metric(prog, state, mbs, ref_logp, mask, cfg) -> float:
    logp = _logprobs_all(prog, state.params, mbs)
    w = losses.token_weights(mask, "token-mean")
    return float(losses.kl_loss(logp, ref_logp, w, cfg.rl.kl_estimator))


def _train(prog: Programs, cfg: Config, state: TrainState, mbs, adv, mask, ref_logp, timer):
    """Mini-batch loop: gradient accumulation over micro-batches, then one donated optax update each."""
    n_mini = cfg.rl.mini_batches
    old_logp = _logprobs_all(prog, state.params, mbs) if n_mini > 1 else None  # theta_k, before any update
    params, opt_state = state.params, state.opt_state
    sums: dict[str, float] = {}
    skipped = 0
    for rows in mini_batch_rows(mask.shape[0], n_mini):
        lo, hi = rows.start, rows.stop
        weights = losses.token_weights(mask[lo:hi], cfg.rl.loss_agg)
        acc = None
        for mb in (m for m in mbs if lo <= m.rows.start < hi):
            r = slice(mb.rows.start - lo, mb.rows.stop - lo)
            old = None if old_logp is None else old_logp[mb.rows]
            ref = None if ref_logp is None else ref_logp[mb.rows]
            (_, m), grads = prog.grad(params, mb.inputs, mb.prompt_len, mb.response_ids, weights[r],
                                      adv[mb.rows], old, ref)
            acc = grads if acc is None else prog.accumulate(acc, grads)
            _combine(sums, {k: float(v) for k, v in m.items()}, n_mini)
        with timer("update"):
            params, opt_state, um = prog.update(params, opt_state, acc)
            ok = bool(um["update_ok"])
        skipped += not ok
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(um["grad_norm"]) / n_mini
    sums["skipped_steps/nonfinite"] = float(skipped)
    for key in _MEAN_METRICS:
        if key in sums:
            sums[key] /= max(sums["_weight"], 1e-12)
    sums.pop("_weight", None)
    sums.pop("weight_sum", None)
    return TrainState(params, opt_state, state.ref_params), sums


# Weighted sums over tokens (add up over micro-batches); the others are weighted means within a call.
_SUM_METRICS = ("loss", "pg_loss", "kl")
_MEAN_METRICS = ("clip_frac", "ratio_mean", "approx_kl", "entropy")


def _combine(sums: dict, m: dict, n_mini: int) -> None:
    """Adds one micro-batch's metrics: sums averaged over mini-batches, means weighted by weight_sum."""
    w = m.get("weight_sum", 0.0)
    sums["_weight"] = sums.get("_weight", 0.0) + w
    for key, v in m.items():
        if key in _SUM_METRICS:
            sums[key] = sums.get(key, 0.0) + v / n_mini
        elif key in _MEAN_METRICS:
            sums[key] = sums.get(key, 0.0) + v * w
