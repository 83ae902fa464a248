"""compute_advantages / has_signal against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.rl.advantages import compute_advantages, has_signal


def test_grpo_hand_values():
    # Row 0: mean .5, centered +-.5, var (4 * .25) / 3 = 1/3, std .57735 -> +-.866025.
    # Row 1: mean 3, centered [-2, -1, 0, 3], var 14/3, std 2.160247 -> [-.925820, -.462910, 0, 1.388730].
    adv = compute_advantages(jnp.array([[1.0, 0, 0, 1], [1, 2, 3, 6]]), "grpo")
    np.testing.assert_allclose(adv, [[0.866025, -0.866025, -0.866025, 0.866025],
                                     [-0.925820, -0.462910, 0.0, 1.388730]], atol=1e-5)


def test_dr_grpo_is_centered_only():
    adv = compute_advantages(jnp.array([[1.0, 2, 3, 6], [1, 0, 0, 1]]), "grpo", norm_by_std=False)
    np.testing.assert_allclose(adv, [[-2, -1, 0, 3], [0.5, -0.5, -0.5, 0.5]], atol=1e-6)


def test_rloo_leave_one_out():
    # r_i - mean of the other three: 1 - 11/3, 2 - 10/3, 3 - 9/3, 6 - 6/3.
    adv = compute_advantages(jnp.array([[1.0, 2, 3, 6]]), "rloo")
    np.testing.assert_allclose(adv, [[-8 / 3, -4 / 3, 0, 4]], atol=1e-5)


def test_reinforce_pp_uses_batch_statistics():
    # Batch mean .25, centered [.75, -.25, -.25, -.25], var .75 / 3 = .25, std .5.
    adv = compute_advantages(jnp.array([[1.0, 0], [0, 0]]), "reinforce_pp")
    np.testing.assert_allclose(adv, [[1.5, -0.5], [-0.5, -0.5]], atol=1e-5)
    # The all-zero group gets a nonzero advantage: the baseline is global.
    assert bool(has_signal(adv[1]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_equal_groups_get_exact_zero(estimator, norm_by_std):
    # 0.1 * 3 / 3 != 0.1 in floats, so a plain r - mean would leave ~1e-8 (and std ~0 would amplify it).
    rewards = jnp.array([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 1.0]])
    adv = np.asarray(compute_advantages(rewards, estimator, norm_by_std=norm_by_std))
    assert np.all(adv[:2] == 0.0)
    assert np.all(adv[2] != 0.0)
    assert np.all(np.isfinite(adv))


def test_reinforce_pp_equal_batch_is_zero():
    adv = compute_advantages(jnp.full((2, 3), 0.1), "reinforce_pp")
    assert np.all(np.asarray(adv) == 0.0)
    assert not bool(has_signal(adv))


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_of_one_is_zero(estimator):
    adv = compute_advantages(jnp.array([[1.0], [0.0]]), estimator)
    assert np.all(np.asarray(adv) == 0.0)


def test_reinforce_pp_group_of_one():
    # Batch [1, 0]: mean .5, var (.25 + .25) / 1, std .707107.
    adv = compute_advantages(jnp.array([[1.0], [0.0]]), "reinforce_pp")
    np.testing.assert_allclose(adv, [[0.707106], [-0.707106]], atol=1e-5)


def test_has_signal():
    assert not bool(has_signal(jnp.zeros((4, 8))))
    assert bool(has_signal(jnp.zeros((4, 8)).at[3, 2].set(-1e-3)))
    assert not bool(has_signal(jnp.zeros((0, 8))))


def test_jit_matches_eager():
    rewards = jnp.array([[1.0, 0, 0, 1], [1, 2, 3, 6]])
    jitted = jax.jit(compute_advantages, static_argnames=("estimator", "norm_by_std"))
    for estimator in ("grpo", "rloo", "reinforce_pp"):
        np.testing.assert_allclose(jitted(rewards, estimator), compute_advantages(rewards, estimator), atol=1e-6)


def test_bad_inputs():
    with pytest.raises(ValueError, match="grpo, rloo, reinforce_pp"):
        compute_advantages(jnp.zeros((2, 2)), "ppo")
    with pytest.raises(ValueError, match=r"\[B, G\]"):
        compute_advantages(jnp.zeros((4,)), "grpo")
