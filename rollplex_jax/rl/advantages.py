"""Advantage estimators for group-sampled RL (GRPO, Dr. GRPO, RLOO, REINFORCE++).

What: turns the rewards of ``G`` sampled answers to each of ``B`` prompts, ``[B, G]``,
into per-answer advantages ``[B, G]`` (the caller broadcasts them over the answer's tokens).

Why here, and why this way: the estimators are a few lines of array math, kept apart
from the model and the loop so they can be tested against hand-computed numbers.
A group whose rewards are all equal carries no learning signal; such groups get
advantages of *exactly* 0 (not 1e-9 from rounding, never NaN), so ``has_signal`` can tell
the loop to skip the optimizer step: LEARNING.md measured that stepping on an
all-zero-advantage batch (where only KL/entropy terms or noise remain, scaled to a
full-lr step by Adam) breaks an already-solved policy.

Estimators (``r`` = rewards, mean/std over the group's ``G`` answers unless noted):

- ``"grpo"``: ``(r - mean) / (std + eps)``, ``std`` with ``ddof=1`` as ``torch.std``
  (DeepSeekMath / verl). ``G == 1``: the std is taken as 0 and the advantage is 0.
  ``norm_by_std=False`` gives Dr. GRPO (Liu et al. 2025): ``r - mean``, no std division.
- ``"rloo"``: ``r_i - mean_{j != i} r_j`` (leave-one-out baseline; Ahmadian et al. 2024),
  which equals ``G / (G - 1) * (r_i - mean)``. ``G == 1``: 0.
- ``"reinforce_pp"``: ``(r - batch mean) / (batch std + eps)`` over all ``B * G`` rewards,
  ``ddof=1`` (REINFORCE++, Hu 2025; verl whitens with the unbiased variance). Its baseline
  is global, so a group of equal rewards still gets a nonzero advantage when other groups
  differ; only a batch whose rewards are *all* equal gives exactly 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ESTIMATORS = ("grpo", "rloo", "reinforce_pp")


def _centered(rewards: jax.Array, axis) -> jax.Array:
    """``rewards - mean`` over ``axis``, forced to exactly 0 where all rewards there are equal.

    The mean of equal floats is not always bit-equal to them (``(0.1 + 0.1 + 0.1) / 3``),
    so the "no signal" case is decided on max == min rather than on the subtraction.
    """
    mean = jnp.mean(rewards, axis=axis, keepdims=True)
    constant = jnp.max(rewards, axis=axis, keepdims=True) == jnp.min(rewards, axis=axis, keepdims=True)
    return jnp.where(constant, 0.0, rewards - mean)


def _std_ddof1(centered: jax.Array, axis, count: int) -> jax.Array:
    """Unbiased std from already-centered values; 0 when ``count == 1`` (torch would give NaN)."""
    var = jnp.sum(centered * centered, axis=axis, keepdims=True) / max(count - 1, 1)
    return jnp.sqrt(var)


def compute_advantages(
    rewards: jax.Array,
    estimator: str,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> jax.Array:
    """Per-answer advantages from grouped rewards.

    Args:
      rewards: ``[B, G]`` float, reward of answer ``g`` to prompt ``b``.
      estimator: one of ``ESTIMATORS`` (``"grpo"``, ``"rloo"``, ``"reinforce_pp"``); static under jit.
      norm_by_std: divide by the std (``"grpo"`` and ``"reinforce_pp"``); ``False`` with
        ``"grpo"`` is Dr. GRPO. Ignored by ``"rloo"``.
      eps: added to the std before dividing.

    Returns:
      ``[B, G]`` float32 advantages; exactly 0 for every group of equal rewards
      (``"grpo"``, ``"rloo"``) or for a batch of equal rewards (``"reinforce_pp"``).

    Raises:
      ValueError: unknown estimator, or ``rewards`` not 2-D.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator={estimator!r} is not supported; allowed: {', '.join(ESTIMATORS)}")
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [B, G] (2-D), got shape {rewards.shape}")
    num_groups, group_size = rewards.shape
    if estimator == "grpo":
        centered = _centered(rewards, axis=-1)
        if not norm_by_std:
            return centered
        return centered / (_std_ddof1(centered, -1, group_size) + eps)
    if estimator == "rloo":
        if group_size == 1:
            return jnp.zeros_like(rewards)
        return _centered(rewards, axis=-1) * (group_size / (group_size - 1))
    # reinforce_pp: one baseline (and scale) for the whole batch.
    centered = _centered(rewards, axis=None)
    if not norm_by_std:
        return centered
    return centered / (_std_ddof1(centered, None, num_groups * group_size) + eps)


def has_signal(advantages: jax.Array) -> jax.Array:
    """Whether any advantage is nonzero, i.e. whether a policy-gradient step can learn anything.

    Args:
      advantages: any shape (``[B, G]`` from ``compute_advantages``).

    Returns:
      A bool scalar array; False for an all-zero (or empty) batch, which the loop should
      skip (no optimizer step) and count in its metrics (see LEARNING.md).
    """
    return jnp.any(jnp.asarray(advantages) != 0)
