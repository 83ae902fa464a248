"""One RL step per schedule: the data flow of a step, as calls.

``serial_step`` (the baseline every speedup is measured against, and the oracle of every
equivalence test): rollout in torch over views of theta_k -> rewards -> reference log-probs over
full sequences -> advantages -> actor forward/backward over full sequences in micro-batches ->
optax update (donating params and optimizer state). ``rollplex_step``: the same update through the
prefix/suffix split, the prefix programs dispatched while the rollout decodes (``--overlap``). What
differs between the two is an ``Ops`` object (``step/ops.py``); this module runs the shared order.

Barriers: the engine's views of theta_k are released before any program that donates theta_k runs;
a batch whose advantages are all zero skips the optimizer (LEARNING.md: otherwise AdamW drifts on
noise), and so does a non-finite gradient norm. The reference runs only when the KL matters
(``RlConfig.uses_reference``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollplex_contract.batch import Engine, Prompts, Rollouts, SamplingParams
from rollplex_jax.config import Config
from rollplex_jax.config.shapes import step_shapes
from rollplex_jax.models.vl.packing import to_device
from rollplex_jax.parallel.multihost import Processes, first_rows, gather_rollouts, gather_scores
from rollplex_jax.programs.actor import Programs
from rollplex_jax.programs.sequences import mini_batch_rows, pad_answers, select_rows
from rollplex_jax.rl import advantages as adv_lib
from rollplex_jax.rl import losses
from rollplex_jax.rl.rewards import RewardScores
from rollplex_jax.step import metrics as step_metrics
from rollplex_jax.step.ops import Ops, SerialOps, Targets
from rollplex_jax.step.rollplex_ops import RollplexOps
from rollplex_jax.trace import Tracer
from rollplex_jax.weights.sharing import WeightPublisher


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Actor params theta_k, optimizer state, and the frozen reference params (None when the reference is not
    used: ``RlConfig.uses_reference``)."""

    params: dict
    opt_state: Any
    ref_params: dict | None


@dataclasses.dataclass
class StepContext:
    """What a step needs besides the state: config, programs, engine, reward function, decoder.

    ``reward_fn(responses, answers, extras, response_lengths=...) -> RewardScores`` (a ``RewardRunner``)."""

    cfg: Config
    programs: Programs
    engine: Engine
    publisher: WeightPublisher
    reward_fn: Callable[..., RewardScores]
    decode: Callable[[list[int]], str]
    stop_ids: tuple[int, ...]
    split: Any = None  # programs.split.SplitPrograms, for --schedule=rollplex
    meter: Any = None  # memory.MemoryMeter: live device bytes per phase and buffer class
    procs: Processes = Processes()  # this process among those of a jax.distributed job (multihost.py)


def _mark_chunk(ctx: StepContext, params, opt_state, ref_params, grads, held: dict, live: dict) -> None:
    """What is live while the optimizer updates one chunk (``live``: that chunk's new params/state/master;
    ``held``: what the step's ops still hold, by class)."""
    ctx.meter.mark("update", compute_weights=(params, live["params"]), ref_weights=ref_params,
                   gradients=(grads, live["clipped"]), optimizer_state=(opt_state.chunks, live["state"]),
                   master_weights=(opt_state.master, live["master"]), **held)


def _mark(ctx: StepContext, phase: str, params, opt_state, ref_params, ops=None, grads=None) -> None:
    """Records what is live at the end of ``phase``, by buffer class (memory/classes.py)."""
    if ctx.meter is None:
        return
    ctx.meter.mark(phase, compute_weights=params, ref_weights=ref_params, optimizer_state=opt_state.chunks,
                   master_weights=opt_state.master, gradients=grads, **(ops.live() if ops is not None else {}))


def _mark_live(ctx: StepContext, params, opt_state, ref_params, held: dict) -> None:
    """What is live in the middle of a mini-batch's gradient loop (``held``: the ops' ``live()`` and the loop's own
    buffers, by class)."""
    ctx.meter.mark("train", compute_weights=params, ref_weights=ref_params, optimizer_state=opt_state.chunks,
                   master_weights=opt_state.master, **held)


@dataclasses.dataclass(frozen=True)
class StepResult:
    state: TrainState
    metrics: dict[str, float]
    rollouts: Rollouts
    texts: list[list[str]]
    rewards: np.ndarray  # [B, G] overall scores
    reward_parts: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # {part: [B, G]}


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


@dataclasses.dataclass(frozen=True)
class Draw:
    """What one rollout call samples: ``n`` answers per prompt, seeded by ``seed`` and each prompt's index in the
    step's batch (``first_prompt``: the index of the call's first prompt, so a process decoding a share samples
    what one process would); at ``temperature`` (None: ``--temperature``; 0: greedy, validation only)."""

    n: int
    seed: int
    temperature: float | None = None
    first_prompt: int = 0


def sample(ctx: StepContext, params: dict, prompts: Prompts, draw: Draw, *, tracer: Tracer | None = None,
           step: int = 0, during_decode=None) -> Rollouts:
    """Rollout under ``params``: publish (bind views), generate, release (so params may be donated).

    ``during_decode()`` is called after binding and before decoding: the Rollplex schedule dispatches
    its prefix programs there so that XLA computes them while torch decodes.
    """
    r = ctx.cfg.rollout
    temp = r.temperature if draw.temperature is None else draw.temperature
    sp = SamplingParams(temperature=temp, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, stop_token_ids=ctx.stop_ids, seed=draw.seed,
                        first_prompt=draw.first_prompt)
    tracer = tracer or Tracer()
    with tracer.span("host", "weights_ready", step):  # the update's tail (and the refill of its output)
        ctx.publisher.ready(params)
    with tracer.span("host", "bind", step):  # views (+ copies into rebuilt buffers not refilled)
        ctx.publisher.publish(params, version=step)
    try:
        if during_decode is not None:
            during_decode()
        with tracer.span("torch decode", "rollout", step):
            return ctx.engine.generate(prompts, draw.n, sp)
    finally:
        with tracer.span("host", "release", step):
            ctx.publisher.release()


@dataclasses.dataclass(frozen=True)
class _Step:
    """One step's identity: its index (trace spans, params version), seed, tracer and start time."""

    step: int
    seed: int
    tracer: Tracer
    t0: float


@dataclasses.dataclass(frozen=True)
class _Sampled:
    """A step's prompts with what the rollout and the rewards made of them."""

    prompts: Prompts
    rollouts: Rollouts
    texts: list[list[str]]
    scores: RewardScores


def _rollout_and_rewards(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], extras,
                         run: _Step, during_decode=None) -> _Sampled:
    """G answers per prompt under theta_k (see ``sample``), then their rewards (``RewardScores`` over the B x G
    answers, prompt-major). With several processes each decodes and rewards its share of the prompts (a TP group's
    ranks the group's share, together), then all gather the whole batch (rollouts, overall scores and parts,
    failures; a group's first rank's rows). The answers come back right-padded to their length bucket
    (``--shape_buckets``)."""
    g, procs, tracer, step, tp = ctx.cfg.rollout.group_size, ctx.procs, run.tracer, run.step, ctx.cfg.mesh.rollout_tp
    mine = procs.decode_share(prompts.batch_size, tp)
    local = select_rows(ctx.cfg.model, prompts, np.arange(mine.start, mine.stop)) if procs.many else prompts
    rollouts = sample(ctx, state.params, local, Draw(n=g, seed=run.seed, first_prompt=mine.start), tracer=tracer,
                      step=step, during_decode=during_decode)
    extras = [{}] * len(answers) if extras is None else extras
    with tracer.span("rewards", "reward", step):
        texts = response_texts(rollouts, ctx.decode, ctx.stop_ids)
        scores = ctx.reward_fn([t for row in texts for t in row], [a for a in answers[mine] for _ in range(g)],
                               [x for x in extras[mine] for _ in range(g)],
                               response_lengths=np.asarray(rollouts.lengths).reshape(-1).tolist())
    if procs.many:
        if not procs.keeps_rollouts(tp):
            rollouts, scores = first_rows(rollouts, scores, 0)
        with tracer.span("host", "gather", step):
            rollouts = gather_rollouts(rollouts, ctx.cfg.rollout.max_new_tokens, ctx.cfg.model.pad_token_id, procs)
            scores = gather_scores(scores, procs)
            texts = response_texts(rollouts, ctx.decode, ctx.stop_ids)
    tr = rollouts.response_ids.shape[-1]
    rollouts = pad_answers(rollouts, step_shapes(ctx.cfg).answer_len(tr), ctx.cfg.model.pad_token_id)
    return _Sampled(prompts, rollouts, texts, scores)


def serial_step(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], *, seed: int,
                step: int = 0, tracer: Tracer | None = None, extras: list[dict] | None = None) -> StepResult:
    """One synchronous on-policy step, the classic way (the baseline and the equivalence oracle). ``extras``: each
    prompt's extra columns (``Example.extra``), passed to the reward function."""
    run = _Step(step, seed, tracer or Tracer(), time.perf_counter())
    out = _rollout_and_rewards(ctx, state, prompts, answers, extras, run)
    _mark(ctx, "rollout", state.params, state.opt_state, state.ref_params)
    ops = SerialOps(ctx.cfg, ctx.programs, state.ref_params, prompts, out.rollouts, run.tracer, step)
    return _learn(ctx, state, ops, out, run)


def rollplex_step(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], *, seed: int,
                  step: int = 0, tracer: Tracer | None = None, extras: list[dict] | None = None) -> StepResult:
    """One step of the Rollplex schedule: the same update as ``serial_step`` (tested), computed through the
    prefix/suffix split, with the prefix programs dispatched before decoding when ``--overlap``."""
    run = _Step(step, seed, tracer or Tracer(), time.perf_counter())
    ops = RollplexOps(ctx.cfg, ctx.split, ctx.programs.accumulate, state, prompts, run.tracer, step)
    overlap = ctx.cfg.run.overlap
    out = _rollout_and_rewards(ctx, state, prompts, answers, extras, run,
                               during_decode=ops.dispatch if overlap else None)
    if not overlap:
        ops.dispatch()
    ops.wait_prefix()
    _mark(ctx, "rollout", state.params, state.opt_state, state.ref_params, ops)
    ops.set_rollouts(out.rollouts)
    result = _learn(ctx, state, ops, out, run)
    ops.drop()
    return result


def _learn(ctx: StepContext, state: TrainState, ops: Ops, out: _Sampled, run: _Step) -> StepResult:
    """Reference scoring, advantages, and the mini-batch updates, for either schedule's ``ops``.

    The actor's log-probs under theta_k over all answers (``old``) run as a pass of their own only where
    something needs them: several mini-batches (the ratio's denominator), the KL in the reward, a skipped
    step's KL or engine-mismatch metric. Otherwise the first mini-batch's gradient programs measure the mismatch
    (``actor.mismatch_sums``) on the log-probs they compute anyway."""
    cfg, prompts, rollouts = ctx.cfg, out.prompts, out.rollouts
    b, g, tr = rollouts.response_ids.shape
    rewards = out.scores.overall.reshape(b, g)
    parts = {k: v.reshape(b, g) for k, v in out.scores.parts.items()}
    ref_logp = ops.ref_logp() if cfg.rl.uses_reference else None
    _mark(ctx, "score", state.params, state.opt_state, state.ref_params, ops)
    ops.after_ref()
    penalized = jnp.asarray(rewards)
    mask = to_device(rollouts.mask.reshape(b * g, tr))
    kl_reward = cfg.rl.kl_mode == "reward" and ref_logp is not None
    old = ops.logp(state.params) if kl_reward or cfg.rl.mini_batches > 1 else None
    if kl_reward:
        penalized = losses.kl_penalized_rewards(penalized, old.reshape(b, g, tr), ref_logp.reshape(b, g, tr),
                                                mask.reshape(b, g, tr), cfg.rl.kl_coef, cfg.rl.kl_estimator)
    adv = adv_lib.compute_advantages(penalized, cfg.rl.advantage, norm_by_std=cfg.rl.norm_by_std)
    engine = to_device(rollouts.logprobs.reshape(b * g, tr), np.float32)
    metrics = {**step_metrics.reward_metrics(rewards, parts, out.scores.failures),
               **step_metrics.length_metrics(cfg.model, prompts, rollouts),
               **step_metrics.prefill_metrics(prompts, rollouts), **step_metrics.padding_metrics(ops.slots()),
               "response/stop_frac": float(np.mean([r == "stop" for row in rollouts.finish_reasons for r in row]))}
    # No signal: every advantage is zero, or every answer is empty -> no optimizer step at all
    # (a zero gradient would still move AdamW's params through its moments).
    if not should_update(adv, rollouts.lengths):
        old = ops.logp(state.params) if old is None else old
        metrics.update({"skipped_steps/no_signal": 1.0, "skipped_steps/nonfinite": 0.0})
        if ref_logp is not None:
            w = losses.token_weights(mask, "token-mean")
            metrics["kl"] = float(losses.kl_loss(old, ref_logp, w, cfg.rl.kl_estimator))
        new_state = state
    else:
        targets = Targets(weights=mask, advantages=adv.reshape(b * g), old=old if cfg.rl.mini_batches > 1 else None,
                          ref=ref_logp, engine=engine if old is None else None)
        new_state, train_metrics = _train(ctx, state, ops, targets, run)
        metrics.update(train_metrics)
        metrics["skipped_steps/no_signal"] = 0.0
    if old is not None:
        metrics.update(step_metrics.logprob_mismatch(engine, old, mask))
    metrics.update(step_metrics.timing_metrics(run.tracer.phase_totals(run.step), time.perf_counter() - run.t0,
                                               step_metrics.total_tokens(prompts, rollouts), cfg.mesh.train_devices))
    return StepResult(new_state, metrics, rollouts, out.texts, rewards, parts)


def should_update(advantages, lengths) -> bool:
    """False when no answer carries signal: all advantages zero, or every answer with one is empty."""
    return bool(adv_lib.has_signal(jnp.where(jnp.asarray(lengths) > 0, advantages, 0.0)))


def _train(ctx: StepContext, state: TrainState, ops: Ops, targets: Targets, run: _Step):
    """Mini-batch loop: gradients (accumulated over micro-batches), then one donated optax update each.

    ``targets.weights`` is the answers' mask [B*G, Tr] here (each mini-batch's token weights are computed from its
    rows); ``targets.engine``, when given, goes to the first mini-batch only (the mismatch metric under theta_k).
    The optimizer commits theta_{k+1} only after every reader of theta_k (rollout views, prefix
    programs, the first mini-batch's gradient) is done: the update blocks on its inputs.
    """
    cfg, prog, tracer, step = ctx.cfg, ctx.programs, run.tracer, run.step
    n_mini, mask = cfg.rl.mini_batches, targets.weights
    params, opt_state, version = state.params, state.opt_state, step
    ctx.publisher.join()  # no refill may still read buffers the update donates
    sums: dict[str, float] = {}
    skipped = 0
    for i, rows in enumerate(mini_batch_rows(mask.shape[0], n_mini)):
        mb = dataclasses.replace(targets, weights=losses.token_weights(mask[rows], cfg.rl.loss_agg),
                                 engine=targets.engine if i == 0 else None)
        # What is live inside the gradient loop (e.g. the boundary cotangents). The hook must not reference the
        # ops: ops -> hook -> ops is a cycle that keeps each step's ops (inputs, boundary, answers) and the
        # step's params alive until Python's cyclic GC runs, i.e. allocated across the next step's decode.
        ops.on_live = None if ctx.meter is None else functools.partial(_mark_live, ctx, params, opt_state,
                                                                        state.ref_params)
        with tracer.span("JAX suffix", "actor", step):
            try:
                grads, parts = ops.grads(params, rows, mb, version)
            finally:
                ops.on_live = None
            jax.block_until_ready(grads)
        _mark(ctx, "train", params, opt_state, state.ref_params, ops, grads)
        ops.after_grads()
        for m in parts:
            _combine(sums, {k: float(v) for k, v in m.items()}, n_mini)
        if ctx.meter is not None:  # the optimizer reports each chunk while it is on the device
            prog.optimizer.on_chunk = functools.partial(_mark_chunk, ctx, params, opt_state, state.ref_params, grads,
                                                        ops.live())
        with tracer.span("update", "update", step):
            old, (params, opt_state, um) = params, prog.update(params, opt_state, grads)
            ok = bool(um["update_ok"])
        prog.optimizer.on_chunk = None
        if ctx.meter is not None:  # theta_k's buffers should be gone (donated); count any that survived
            ctx.meter.undonated(old)
        version += 1
        skipped += not ok
        sums["grad_norm"] = sums.get("grad_norm", 0.0) + float(um["grad_norm"]) / n_mini
    # theta_{k+1} into the engine's rebuilt buffers now, on a side thread, not inside the next bind
    ctx.publisher.refill(params, tracer, step)
    sums["skipped_steps/nonfinite"] = float(skipped)
    for key in _MEAN_METRICS:
        if key in sums:
            sums[key] /= max(sums["_weight"], 1e-12)
    sums.pop("_weight", None)
    sums.pop("weight_sum", None)
    sums.update(step_metrics.mismatch_metrics(sums.pop("logprob_abs_diff_sum", None),
                                              sums.pop("logprob_abs_diff_max", None), sums.pop("logprob_tokens", None)))
    return TrainState(params, opt_state, state.ref_params), sums


# Weighted sums over tokens (add up over micro-batches); the others are weighted means within a call.
_SUM_METRICS = ("loss", "pg_loss", "kl")
_MEAN_METRICS = ("clip_frac", "ratio_mean", "approx_kl", "entropy")


def _combine(sums: dict, m: dict, n_mini: int) -> None:
    """Adds one micro-batch's metrics: sums averaged over mini-batches, means weighted by weight_sum; the engine
    mismatch's sums added and its maximum kept (``actor.mismatch_sums``)."""
    w = m.get("weight_sum", 0.0)
    sums["_weight"] = sums.get("_weight", 0.0) + w
    for key, v in m.items():
        if key in _SUM_METRICS:
            sums[key] = sums.get(key, 0.0) + v / n_mini
        elif key in _MEAN_METRICS:
            sums[key] = sums.get(key, 0.0) + v * w
        elif key in ("logprob_abs_diff_sum", "logprob_tokens"):
            sums[key] = sums.get(key, 0.0) + v
        elif key == "logprob_abs_diff_max":
            sums[key] = max(sums.get(key, 0.0), v)
