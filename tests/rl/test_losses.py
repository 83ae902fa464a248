"""Loss math against hand-computed values: KL estimators, aggregation weights, PPO clipping, entropy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.rl.losses import (
    entropy_from_logits,
    kl_estimate,
    kl_loss,
    kl_penalized_rewards,
    policy_loss,
    token_weights,
)

RAGGED = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)  # lengths 3, 1, 0 (a padding row)


# --- KL estimators ---------------------------------------------------------------------------------

def test_kl_estimators_hand_values():
    logp = jnp.array([-1.0, -2.0, -0.5])
    ref = jnp.array([-1.5, -1.0, -0.5])  # logp - ref = [.5, -1, 0]
    np.testing.assert_allclose(kl_estimate(logp, ref, "k1"), [0.5, -1.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(kl_estimate(logp, ref, "k2"), [0.125, 0.5, 0.0], atol=1e-6)
    # k3 with x = ref - logp = [-.5, 1, 0]: exp(x) - x - 1.
    np.testing.assert_allclose(kl_estimate(logp, ref, "k3"), [0.10653066, 0.71828183, 0.0], atol=1e-6)


def test_k3_nonnegative_and_clamped():
    rng = np.random.default_rng(0)
    logp = rng.normal(size=1000).astype(np.float32) * 3.0
    ref = logp + rng.normal(size=1000).astype(np.float32) * 10.0 ** np.linspace(-9, 1, 1000, dtype=np.float32)
    assert np.all(np.asarray(kl_estimate(logp, ref, "k3")) >= 0.0)
    # log-ratio clamped to [-20, 20]: exp(-20) + 20 - 1 and exp(20) - 20 - 1, both finite.
    np.testing.assert_allclose(kl_estimate(jnp.array([0.0, -100.0]), jnp.array([-100.0, 0.0]), "k3"),
                               [19.0, math.exp(20.0) - 21.0], rtol=1e-6)


def test_kl_bad_kind():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(jnp.zeros(2), jnp.zeros(2), "k4")


# --- aggregation weights ---------------------------------------------------------------------------

def test_token_weights_ragged():
    np.testing.assert_allclose(token_weights(RAGGED, "token-mean"),
                               [[0.25, 0.25, 0.25, 0], [0.25, 0, 0, 0], [0, 0, 0, 0]], atol=1e-7)
    # Two answers with tokens (the empty padding row does not count).
    np.testing.assert_allclose(token_weights(RAGGED, "seq-mean-token-sum"),
                               [[0.5, 0.5, 0.5, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]], atol=1e-7)
    # 1 / (2 * len): 1/6 for the 3-token answer, 1/2 for the 1-token answer.
    np.testing.assert_allclose(token_weights(RAGGED, "seq-mean-token-mean"),
                               [[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]], atol=1e-7)


def test_token_weights_give_the_named_means():
    x = jnp.array([[1.0, 2, 3, 99], [4, 99, 99, 99], [99, 99, 99, 99]])
    assert float(jnp.sum(token_weights(RAGGED, "token-mean") * x)) == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert float(jnp.sum(token_weights(RAGGED, "seq-mean-token-sum") * x)) == pytest.approx((6 + 4) / 2)
    assert float(jnp.sum(token_weights(RAGGED, "seq-mean-token-mean") * x)) == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_token_weights_all_masked_and_empty(mode):
    w = token_weights(jnp.zeros((3, 4), bool), mode)
    assert np.all(np.asarray(w) == 0.0)
    assert token_weights(jnp.zeros((0, 4), bool), mode).shape == (0, 4)


def test_token_weights_bad_mode():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        token_weights(RAGGED, "sum")


# --- PPO clipped surrogate --------------------------------------------------------------------------

def _one_token(ratio, adv, **clip):
    """Loss, d loss / d logp and metrics for one token with the given ratio and advantage."""
    old = jnp.full((1, 1), -1.0)
    logp = old + jnp.log(ratio)

    def f(lp):
        return policy_loss(lp, old, jnp.array([adv]), jnp.ones((1, 1)), **clip)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(logp)
    return float(loss), float(grad[0, 0]), metrics


@pytest.mark.parametrize(
    "ratio, adv, want_loss, want_grad, clipped",
    [
        (1.5, 1.0, -1.28, 0.0, True),    # A > 0, above 1 + clip_high: capped, no gradient
        (1.25, 1.0, -1.25, -1.25, False),  # A > 0, inside the raised upper bound (clip-higher)
        (0.5, 1.0, -0.5, -0.5, False),   # A > 0, below 1 - clip_low: not clipped (pessimistic min)
        (1.5, -1.0, 1.5, 1.5, False),    # A < 0, above the range: not clipped
        (0.75, -1.0, 0.8, 0.0, True),    # A < 0, below 1 - clip_low: capped, no gradient
        (1.0, 2.0, -2.0, -2.0, False),   # on-policy: plain policy gradient, d/dlogp = -A
    ],
)
def test_ppo_clip_asymmetric(ratio, adv, want_loss, want_grad, clipped):
    loss, grad, metrics = _one_token(ratio, adv, clip_low=0.2, clip_high=0.28)
    assert loss == pytest.approx(want_loss, abs=1e-5)
    assert grad == pytest.approx(want_grad, abs=1e-5)  # d(-A * ratio) / d logp = -A * ratio
    assert float(metrics["clip_frac"]) == float(clipped)
    assert float(metrics["ratio_mean"]) == pytest.approx(ratio, abs=1e-5)
    assert float(metrics["approx_kl"]) == pytest.approx(-math.log(ratio), abs=1e-5)


def test_ppo_symmetric_clip_caps_what_clip_higher_lets_through():
    loss, grad, metrics = _one_token(1.25, 1.0, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-1.2, abs=1e-5) and grad == 0.0 and float(metrics["clip_frac"]) == 1.0


def test_on_policy_old_logp_equal_to_logp():
    # old_logp's gradient is stopped, so passing logp itself gives ratio 1 and d/dlogp = -A * w.
    logp = jnp.array([[-1.0, -2.0]])
    w = jnp.array([[0.5, 0.5]])
    grad = jax.jit(jax.grad(lambda lp: policy_loss(lp, lp, jnp.array([3.0]), w)[0]))(logp)
    np.testing.assert_allclose(grad, [[-1.5, -1.5]], atol=1e-6)


def test_policy_loss_weighted_batch_and_metrics():
    # Two answers: [ratio 1, 1.5, pad], [0.5, pad, pad]; A = [1, -1]; token-mean weights 1/3.
    old = jnp.full((2, 3), -1.0)
    logp = old + jnp.log(jnp.array([[1.0, 1.5, 1.0], [0.5, 1.0, 1.0]]))
    mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
    w = token_weights(mask, "token-mean")
    loss, m = policy_loss(logp, old, jnp.array([1.0, -1.0]), w)
    # Terms: -1 * 1, -1 * 1.2 (clipped), +1 * 0.8 (clipped): mean (-1 - 1.2 + 0.8) / 3.
    assert float(loss) == pytest.approx((-1.0 - 1.2 + 0.8) / 3, abs=1e-5)
    assert float(m["clip_frac"]) == pytest.approx(2 / 3, abs=1e-6)
    assert float(m["ratio_mean"]) == pytest.approx((1 + 1.5 + 0.5) / 3, abs=1e-5)
    assert float(m["weight_sum"]) == pytest.approx(1.0)
    # Per-token advantages give the same loss as per-answer ones.
    loss_t, _ = policy_loss(logp, old, jnp.array([[1.0] * 3, [-1.0] * 3]), w)
    assert float(loss_t) == pytest.approx(float(loss), abs=1e-7)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batches_add_up(mode):
    rng = np.random.default_rng(1)
    logp = jnp.asarray(-rng.uniform(size=(4, 6)) * 3, jnp.float32)
    old = logp + jnp.asarray(0.3 * rng.normal(size=(4, 6)), jnp.float32)
    adv = jnp.asarray(rng.normal(size=4), jnp.float32)
    mask = jnp.arange(6)[None, :] < jnp.array([6, 2, 4, 1])[:, None]
    w = token_weights(mask, mode)

    @jax.jit
    @jax.value_and_grad
    def f(lp, old, adv, w):
        return policy_loss(lp, old, adv, w)[0]

    full_loss, full_grad = f(logp, old, adv, w)
    l1, g1 = f(logp[:1], old[:1], adv[:1], w[:1])
    l2, g2 = f(logp[1:], old[1:], adv[1:], w[1:])
    assert float(l1 + l2) == pytest.approx(float(full_loss), abs=1e-6)
    np.testing.assert_allclose(jnp.concatenate([g1, g2]), full_grad, atol=1e-7)


def test_masked_and_empty_batches_give_zero_loss_and_grads():
    # Padding log-probs may be -inf; with weight 0 they must not leak NaN into loss or gradient.
    logp = jnp.array([[-0.5, -jnp.inf], [-jnp.inf, -jnp.inf]])
    old = jnp.array([[-0.7, -jnp.inf], [-jnp.inf, 0.0]])
    one_valid = token_weights(jnp.array([[1, 0], [0, 0]], bool), "token-mean")
    all_masked = token_weights(jnp.zeros((2, 2), bool), "seq-mean-token-mean")
    @jax.jit
    @jax.value_and_grad
    def f(lp, w):
        return policy_loss(lp, old, jnp.array([1.0, -1.0]), w)[0] + kl_loss(lp, old, w, "k3")

    for w in (one_valid, all_masked):
        loss, grad = f(logp, w)
        assert np.isfinite(float(loss))
        assert np.all(np.asarray(grad)[np.asarray(w) == 0] == 0.0)
        assert np.all(np.isfinite(np.asarray(grad)))
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)  # the all-masked batch
    empty = jnp.zeros((0, 5))

    def g(lp):
        return policy_loss(lp, empty, jnp.zeros((0,)), empty)

    (e_loss, e_metrics), e_grad = jax.value_and_grad(g, has_aux=True)(empty)
    assert float(e_loss) == 0.0 and all(float(v) == 0.0 for v in e_metrics.values())
    assert e_grad.shape == (0, 5)


def test_entropy_grad_is_finite_with_neg_inf_logits():
    logits = jnp.array([[[0.0, 1.0, -jnp.inf]]])
    grad = jax.jit(jax.grad(lambda x: entropy_from_logits(x, jnp.ones((1, 1)))))(logits)
    assert np.all(np.isfinite(np.asarray(grad)))


# --- KL loss, KL in the reward, entropy -------------------------------------------------------------

def test_kl_loss_is_weighted_sum():
    logp = jnp.array([[-1.0, -2.0, -7.0]])
    ref = jnp.array([[-1.5, -1.0, 0.0]])
    w = token_weights(jnp.array([[1, 1, 0]], bool), "token-mean")  # [.5, .5, 0]
    assert float(kl_loss(logp, ref, w, "k3")) == pytest.approx((0.10653066 + 0.71828183) / 2, abs=1e-6)
    assert float(kl_loss(logp, ref, w, "k1")) == pytest.approx((0.5 - 1.0) / 2, abs=1e-6)


def test_kl_penalized_rewards():
    rewards = jnp.array([[1.0, 0.0]])
    logp = jnp.array([[[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]]])
    ref = jnp.array([[[-1.5, -2.0, -9.0], [-0.5, -1.0, -1.0]]])
    mask = jnp.array([[[1, 1, 0], [1, 1, 1]]], bool)
    # k1 sums: .5 + 0 (third token masked) and -.5 + 0 + 0.
    np.testing.assert_allclose(kl_penalized_rewards(rewards, logp, ref, mask, 0.1), [[0.95, 0.05]], atol=1e-6)
    np.testing.assert_allclose(kl_penalized_rewards(rewards, logp, ref, mask, 0.0), rewards)


def test_entropy():
    w = jnp.ones((2, 3))
    assert float(entropy_from_logits(jnp.zeros((2, 3, 7)), w)) == pytest.approx(math.log(7), abs=1e-6)
    # p = [.5, .25, .25, 0]: H = 1.5 ln 2; the -inf logit must not give NaN.
    logits = jnp.broadcast_to(jnp.log(jnp.array([0.5, 0.25, 0.25, 0.0])), (2, 3, 4))
    assert float(entropy_from_logits(logits, w)) == pytest.approx(1.5 * math.log(2), abs=1e-6)
    # Weighted mean: the masked position (NaN logits) is ignored.
    mixed = jnp.stack([jnp.zeros((7,)), jnp.full((7,), jnp.nan)])[None]  # [1, 2, 7]
    assert float(entropy_from_logits(mixed, jnp.array([[2.0, 0.0]]))) == pytest.approx(math.log(7), abs=1e-6)
    assert float(entropy_from_logits(jnp.zeros((1, 2, 7)), jnp.zeros((1, 2)))) == 0.0
