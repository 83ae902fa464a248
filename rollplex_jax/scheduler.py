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
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollout_torch.engine import Engine, Prompts, Rollouts, SamplingParams
from rollplex_jax.config import Config
from rollplex_jax.models.qwen2_5_vl.model import prepare_inputs
from rollplex_jax.multihost import Processes, allgather_rows, gather_rollouts, share
from rollplex_jax.programs.actor import Programs
from rollplex_jax.programs.sequences import micro_batches, repeat_rows, select_rows
from rollplex_jax.rl import advantages as adv_lib
from rollplex_jax.rl import losses
from rollplex_jax.sharing import WeightPublisher
from rollplex_jax.trace import Tracer


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
    """Records what is live at the end of ``phase``, by buffer class (memory_classes.py)."""
    if ctx.meter is None:
        return
    ctx.meter.mark(phase, compute_weights=params, ref_weights=ref_params, optimizer_state=opt_state.chunks,
                   master_weights=opt_state.master, gradients=grads, **(ops.live() if ops is not None else {}))


@dataclasses.dataclass(frozen=True)
class StepResult:
    state: TrainState
    metrics: dict[str, float]
    rollouts: Rollouts
    texts: list[list[str]]
    rewards: np.ndarray


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


def sample(ctx: StepContext, params: dict, prompts: Prompts, *, n: int, seed: int, greedy: bool = False,
           tracer: Tracer | None = None, step: int = 0, during_decode=None, first_prompt: int = 0) -> Rollouts:
    """Rollout under ``params``: publish (bind views), generate, release (so params may be donated).

    ``during_decode()`` is called after binding and before decoding: the Rollplex schedule dispatches
    its prefix programs there so that XLA computes them while torch decodes. ``first_prompt``: the
    index of ``prompts``' first row in the step's batch (each answer's sampling is seeded by its
    prompt's index in the batch, so a process decoding a share samples what one process would).
    """
    r = ctx.cfg.rollout
    sp = SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, stop_token_ids=ctx.stop_ids, seed=seed,
                        first_prompt=first_prompt)
    tracer = tracer or Tracer()
    with tracer.span("host", "bind", step):
        ctx.publisher.publish(params, version=step)
    try:
        if during_decode is not None:
            during_decode()
        with tracer.span("torch decode", "rollout", step):
            return ctx.engine.generate(prompts, n, sp)
    finally:
        with tracer.span("host", "release", step):
            ctx.publisher.release()


def _rollout_and_rewards(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], seed: int,
                         tracer: Tracer, step: int, during_decode=None):
    """G answers per prompt under theta_k (see ``sample``), then their rewards. With several processes
    each decodes and rewards its share of the prompts, then all gather the whole batch."""
    g, procs = ctx.cfg.rollout.group_size, ctx.procs
    mine = share(prompts.batch_size, procs.index, procs.count)
    local = select_rows(ctx.cfg.model, prompts, np.arange(mine.start, mine.stop)) if procs.many else prompts
    rollouts = sample(ctx, state.params, local, n=g, seed=seed, tracer=tracer, step=step,
                      during_decode=during_decode, first_prompt=mine.start)
    b = rollouts.response_ids.shape[0]
    with tracer.span("rewards", "reward", step):
        texts = response_texts(rollouts, ctx.decode, ctx.stop_ids)
        flat, failures = ctx.reward_fn([t for row in texts for t in row],
                                       [a for a in answers[mine] for _ in range(g)])
        rewards = np.asarray(flat, np.float32).reshape(b, g)
    if procs.many:
        with tracer.span("host", "gather", step):
            rollouts = gather_rollouts(rollouts, ctx.cfg.rollout.max_new_tokens, ctx.cfg.model.pad_token_id, procs)
            rewards = allgather_rows(rewards, procs)
            failures = int(allgather_rows(np.array([failures], np.int64), procs).sum())
            texts = response_texts(rollouts, ctx.decode, ctx.stop_ids)
    return rollouts, texts, rewards, failures


class _SerialOps:
    """Full-sequence scoring and gradients (the baseline): B*G rows of prompt ++ answer."""

    def __init__(self, ctx: StepContext, state: TrainState, prompts: Prompts, rollouts: Rollouts, tracer, step):
        cfg = ctx.cfg
        b, g, _ = rollouts.response_ids.shape
        self.prog, self.tracer, self.step = ctx.programs, tracer, step
        self.mbs = [mb for rows in mini_batch_rows(b * g, cfg.rl.mini_batches)
                    for mb in micro_batches(cfg.model, prompts, rollouts, cfg.rl.micro_batch, rows)]
        self.ref_params = state.ref_params

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


class _RollplexOps:
    """Prefix/suffix scoring and gradients; the prefix programs may run during the decode."""

    def __init__(self, ctx: StepContext, state: TrainState, prompts: Prompts, tracer, step, version):
        cfg = ctx.cfg
        self.cfg, self.sp, self.tracer, self.step, self.version = cfg, ctx.split, tracer, step, version
        g = cfg.rollout.group_size
        self.n = g if cfg.run.prefix_sharing else 1
        rows = prompts if cfg.run.prefix_sharing else repeat_rows(cfg.model, prompts, g)
        self.inputs = prepare_inputs(cfg.model, rows.input_ids, rows.attention_mask, rows.pixel_values,
                                     rows.image_grid_thw, rows.video_grid_thw)
        self.state = state
        self.residuals = cfg.run.actor_prefix == "residuals"
        self.use_ref = cfg.rl.kl_mode != "off"

    def dispatch(self):
        """Asynchronously dispatches vision (if frozen), actor prefix and reference prefix under theta_k."""
        t0 = self.tracer.now()
        p, inputs = self.state.params, self.inputs
        self.emb = self.sp.vision(p, inputs) if self.cfg.optim.freeze_vision else None
        out = self.sp.actor_prefix(p, inputs, self.emb)
        self.actor = Boundary(self.version, *out) if self.residuals else Boundary(self.version, *out[:3])
        self.ref = None
        if self.use_ref:
            k, v, last = self.sp.ref_prefix(self.state.ref_params, inputs, self.emb)
            self.ref = Boundary(self.version, k, v, last)
        self._dispatch_t0 = t0
        return self

    def wait_prefix(self):
        """Blocks until the prefix work is done; records its span (dispatch -> ready)."""
        jax.block_until_ready((self.actor.k, self.actor.last, None if self.ref is None else self.ref.last))
        self.tracer.add("JAX prefix", "prefix", self.step, self._dispatch_t0, self.tracer.now())

    def set_rollouts(self, rollouts: Rollouts):
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
        if version == self.version and self.residuals:
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
                "other": (self.inputs, self.emb, getattr(self, "resp", None), getattr(self, "rmask", None))}

    def after_ref(self) -> None:
        """The reference boundary's last consumer (the reference suffix) is done: free it."""
        self.ref = None

    def after_grads(self) -> None:
        """The actor boundary's last consumer (the first mini-batch's gradient) is done: free it and the
        residuals; later mini-batches recompute the prefix under their own params."""
        self.actor = None

    def drop(self):
        """Ends the life of the boundary state and residuals (their buffers are freed)."""
        self.actor = self.ref = None


def serial_step(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], *, seed: int,
                step: int = 0, tracer: Tracer | None = None) -> StepResult:
    """One synchronous on-policy step, the classic way (the baseline and the equivalence oracle)."""
    tracer = tracer or Tracer()
    t0 = time.perf_counter()
    rollouts, texts, rewards, failures = _rollout_and_rewards(ctx, state, prompts, answers, seed, tracer, step)
    _mark(ctx, "rollout", state.params, state.opt_state, state.ref_params)
    ops = _SerialOps(ctx, state, prompts, rollouts, tracer, step)
    return _learn(ctx, state, ops, rollouts, texts, rewards, failures, tracer, step, t0)


def rollplex_step(ctx: StepContext, state: TrainState, prompts: Prompts, answers: list[str], *, seed: int,
                  step: int = 0, tracer: Tracer | None = None) -> StepResult:
    """One step of the Rollplex schedule: the same update as ``serial_step`` (tested), computed through the
    prefix/suffix split, with the prefix programs dispatched before decoding when ``--overlap``."""
    tracer = tracer or Tracer()
    t0 = time.perf_counter()
    ops = _RollplexOps(ctx, state, prompts, tracer, step, version=step)
    overlap = ctx.cfg.run.overlap
    rollouts, texts, rewards, failures = _rollout_and_rewards(
        ctx, state, prompts, answers, seed, tracer, step, during_decode=ops.dispatch if overlap else None)
    if not overlap:
        ops.dispatch()
    ops.wait_prefix()
    _mark(ctx, "rollout", state.params, state.opt_state, state.ref_params, ops)
    ops.set_rollouts(rollouts)
    result = _learn(ctx, state, ops, rollouts, texts, rewards, failures, tracer, step, t0)
    ops.drop()
    return result


def _learn(ctx: StepContext, state: TrainState, ops, rollouts: Rollouts, texts, rewards, failures, tracer, step,
           t0) -> StepResult:
    """Reference scoring, advantages, and the mini-batch updates, for either schedule's ``ops``."""
    cfg = ctx.cfg
    b, g, tr = rollouts.response_ids.shape
    ref_logp = ops.ref_logp() if cfg.rl.kl_mode != "off" else None
    _mark(ctx, "score", state.params, state.opt_state, state.ref_params, ops)
    ops.after_ref()
    scores = jnp.asarray(rewards)
    mask = jnp.asarray(rollouts.mask.reshape(b * g, tr))
    if cfg.rl.kl_mode == "reward":
        old = ops.logp(state.params)
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
        if ref_logp is not None:
            w = losses.token_weights(mask, "token-mean")
            metrics["kl"] = float(losses.kl_loss(ops.logp(state.params), ref_logp, w, cfg.rl.kl_estimator))
        new_state = state
    else:
        new_state, train_metrics = _train(ctx, state, ops, adv.reshape(b * g), mask, ref_logp, tracer, step)
        metrics.update(train_metrics)
        metrics["skipped_steps/no_signal"] = 0.0
    for name, secs in tracer.phase_totals(step).items():
        metrics[f"time/{name}_s"] = secs
    metrics["time/step_s"] = time.perf_counter() - t0
    return StepResult(new_state, metrics, rollouts, texts, rewards)


def should_update(advantages, lengths) -> bool:
    """False when no answer carries signal: all advantages zero, or every answer with one is empty."""
    return bool(adv_lib.has_signal(jnp.where(jnp.asarray(lengths) > 0, advantages, 0.0)))


def mini_batch_rows(n_rows: int, n_mini: int) -> list[slice]:
    """Contiguous row ranges of the mini-batches (whole rows; sizes differ by at most one)."""
    edges = np.linspace(0, n_rows, n_mini + 1).round().astype(int)
    return [slice(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def _train(ctx: StepContext, state: TrainState, ops, adv, mask, ref_logp, tracer, step):
    """Mini-batch loop: gradients (accumulated over micro-batches), then one donated optax update each.

    The optimizer commits theta_{k+1} only after every reader of theta_k (rollout views, prefix
    programs, the first mini-batch's gradient) is done: the update blocks on its inputs.
    """
    cfg, prog = ctx.cfg, ctx.programs
    n_mini = cfg.rl.mini_batches
    old_logp = ops.logp(state.params) if n_mini > 1 else None  # theta_k, before any update
    params, opt_state, version = state.params, state.opt_state, step
    sums: dict[str, float] = {}
    skipped = 0
    for rows in mini_batch_rows(mask.shape[0], n_mini):
        weights = losses.token_weights(mask[rows], cfg.rl.loss_agg)
        with tracer.span("JAX suffix", "actor", step):
            grads, parts = ops.grads(params, rows, weights, adv, old_logp, ref_logp, version)
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
