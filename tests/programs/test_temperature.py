"""The trainer trains on the distribution the rollout sampled from: ``softmax(logits / T)`` at ``--temperature``.

At T = 0.7, on the multimodal test prompts (fp32, tiny model): the transformers engine's chosen-token log-probs,
the serial programs' (``old_logprobs``, the gradient program's entropy) and the split programs' (``suffix_logp``,
the prefix's last logits predicting each answer's first token) all equal an independent float64 computation of
``log_softmax(logits / 0.7)`` from the model's raw logits, within fp32 noise; and those differ from the raw
(T = 1) log-probs by far more than the tolerance, so a side left at T = 1 fails. With top-k / top-p on, the engine
still reports the full (untruncated) tempered distribution, as the trainer uses (``RolloutConfig``). T = 0 is
refused for training.

Tolerance: both sides run the same fp32 model (torch vs XLA, other summation orders): per-token differences of a
few fp32 ulps through two layers, log-probs of magnitude <= ~6 (1e-5 is ~20 ulps of it, as
``tests/rollout/test_stepwise_logprobs.py``); the T = 0.7 vs T = 1 gap on these tokens is > 1e-2.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_jax.config import ConfigError, OptimConfig, RlConfig, RolloutConfig
from rollplex_jax.models.vl import model as M
from rollplex_jax.programs.actor import Answers, Spec, make_programs
from rollplex_jax.programs.sequences import micro_batches
from rollplex_jax.programs.split import BoundaryRows, make_split_programs
from rollplex_jax.rl import losses
from tests.rollout.test_hf_engine import STOP, _setup

T = 0.7
TOL = 1e-5


def _predicting_logits(cfg, params, inp, ro) -> np.ndarray:
    """float64 raw logits [B, G, Tr, V] that predict each answer token (the prefix's last, then the suffix's)."""
    state, last = jax.jit(lambda p, x: M.prefix_forward(p, cfg, x))(params, M.prepare_inputs(cfg, **inp))
    ids, mask = jnp.asarray(ro.response_ids), jnp.asarray(ro.mask)
    logits = np.asarray(jax.jit(lambda p, s, i, m: M.suffix_forward(p, cfg, s, i, m))(params, state, ids, mask),
                        np.float64)
    b, n, _, v = logits.shape
    return np.concatenate([np.broadcast_to(np.asarray(last, np.float64)[:, None, None], (b, n, 1, v)),
                           logits[:, :, :-1]], axis=2)


def _reference(pred, ro, temperature) -> np.ndarray:
    """float64 log-probs [B, G, Tr] of the answers under softmax(pred / temperature), by hand (no project
    log-prob helper)."""
    z = pred / temperature
    zmax = z.max(-1, keepdims=True)
    logp = z - (zmax + np.log(np.exp(z - zmax).sum(-1, keepdims=True)))
    picked = np.take_along_axis(logp, ro.response_ids[..., None].astype(np.int64), -1)[..., 0]
    return np.where(ro.mask > 0, picked, 0.0)


@pytest.fixture(scope="module")
def sampled():
    cfg, params, inp, eng = _setup("float32")
    outs = {}
    for name, sp in (("full", SamplingParams(temperature=T, max_new_tokens=6, stop_token_ids=STOP, seed=3)),
                     ("truncated", SamplingParams(temperature=T, top_k=5, top_p=0.9, max_new_tokens=6,
                                                  stop_token_ids=STOP, seed=4))):
        ro = eng.generate(Prompts(**inp), 4, sp)
        outs[name] = ro, _predicting_logits(cfg, params, inp, ro)
    eng.release()
    return cfg, params, inp, outs


@pytest.mark.parametrize("sampling", ["full", "truncated"])
def test_engine_logprobs_are_the_tempered_full_distribution(sampled, sampling):
    cfg, params, inp, outs = sampled
    ro, pred = outs[sampling]
    want, raw = _reference(pred, ro, T), _reference(pred, ro, 1.0)
    real = ro.mask > 0
    got = np.abs(ro.logprobs - want)[real]
    print(f"{sampling}: engine vs log_softmax(logits / {T}): max |d| {got.max():.3g}, mean {got.mean():.3g}; "
          f"vs T = 1: mean {np.abs(ro.logprobs - raw)[real].mean():.3g}")
    assert got.max() <= TOL
    assert np.abs(raw - want)[real].mean() > 1e3 * TOL  # a side left at T = 1 fails


def test_trainer_logprobs_and_entropy_are_the_tempered_distribution(sampled):
    cfg, params, inp, outs = sampled
    ro, pred = outs["full"]
    want = _reference(pred, ro, T)
    b, g, tr = ro.response_ids.shape
    real = ro.mask > 0
    prompts = Prompts(**inp)

    serial = make_programs(cfg, RlConfig(), OptimConfig(), 1, temperature=T)
    (mb,) = micro_batches(cfg, prompts, ro, b * g)
    old = np.asarray(serial.old_logprobs(params, mb.inputs, mb.prompt_len, mb.response_ids, mb.response_mask))
    assert np.abs(old.reshape(b, g, tr) - want)[real].max() <= TOL

    split = make_split_programs(cfg, RlConfig(), temperature=T)
    inputs = M.prepare_inputs(cfg, **inp)
    k, v, last = split.prefix(params, inputs, None)
    rows = BoundaryRows(k, v, last, inputs.attention_mask.astype(bool), inputs.next_position)
    lp = np.asarray(split.suffix_logp(b, params, rows, 0, ro.response_ids.astype(np.int32), ro.mask > 0))
    assert np.abs(lp - want)[real].max() <= TOL

    # the gradient program's own log-probs: its entropy metric, and its mismatch sums against "engine" log-probs
    # offset from the reference by a known 0.01, 0.02 or 0.03 per token
    w = losses.token_weights(jnp.asarray(ro.mask.reshape(b * g, tr)), "token-mean")
    offset = 0.01 * (1 + np.arange(b * g * tr).reshape(b, g, tr) % 3)
    answers = Answers(ids=mb.response_ids, weights=w, advantages=jnp.zeros(b * g),
                      engine=jnp.asarray((want + offset).reshape(b * g, tr), jnp.float32))
    (_, m), _ = serial.grad(params, mb.inputs, mb.prompt_len, answers)
    p = np.exp((pred / T) - np.log(np.exp(pred / T).sum(-1, keepdims=True)))
    ent = -(p * np.log(p)).sum(-1)
    want_ent = float((ent.reshape(b * g, tr) * np.asarray(w)).sum() / np.asarray(w).sum())
    assert abs(float(m["entropy"]) - want_ent) <= TOL
    assert float(m["logprob_tokens"]) == real.sum()
    assert abs(float(m["logprob_abs_diff_sum"]) / real.sum() - offset[real].mean()) <= TOL
    assert abs(float(m["logprob_abs_diff_max"]) - offset[real].max()) <= TOL


def test_zero_temperature_is_refused_for_training():
    with pytest.raises(ConfigError, match="rollout.temperature"):
        RolloutConfig(temperature=0.0)
    with pytest.raises(ValueError, match="T > 0"):
        Spec(model=None, prog=None, rl=None, temperature=0.0)
