"""PPO / GRPO policy loss, KL estimators, loss-aggregation weights and entropy (pure jax.numpy).

What: the per-token terms of the GRPO objective and the weights that aggregate them.
Every loss here is ``sum(weights * per_token_term)``, with ``weights`` from
``token_weights`` computed once on the whole mini-batch. Why: a mean computed per
micro-batch does not add up to the mini-batch mean (ragged lengths, uneven token counts);
a weighted *sum* does, so gradient accumulation over micro-batch slices of ``weights``
gives exactly the mini-batch gradient.

Masking: a position with weight 0 contributes nothing to the loss and exactly 0 to the
gradient, even when its log-probs there are garbage (``-inf`` from padding): the inputs
are selected with ``jnp.where`` before any arithmetic, since ``0 * inf`` would give NaN.
All-masked or empty batches give loss 0 and zero gradients.

Shapes: written for ``[N, T]`` (``N`` answers, ``T`` answer tokens), but any leading
dims work (``[B, G, T]`` as ``suffix_forward`` produces). Math runs in float32.

Differences from the papers / verl, on purpose:
- ``policy_loss`` has DAPO's clip-higher (separate ``clip_low`` / ``clip_high``), no
  dual-clip; the log-ratio is clamped to [-20, 20] before ``exp`` as verl does.
- ``"seq-mean-*"`` modes divide by the number of answers with at least one valid token
  (verl divides by all rows; equal whenever no row is empty), so all-masked padding rows,
  added to keep shapes static, do not dilute the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_KINDS = ("k1", "k2", "k3")
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
_LOG_RATIO_CLAMP = 20.0


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    """``num / den``, 0 where ``den == 0`` (and no NaN in its gradient)."""
    nonzero = den != 0
    return jnp.where(nonzero, num / jnp.where(nonzero, den, 1.0), 0.0)


def _masked(x: jax.Array, valid: jax.Array) -> jax.Array:
    """``x`` in float32 where valid, else 0; the gradient at invalid positions is exactly 0."""
    return jnp.where(valid, jnp.asarray(x, jnp.float32), 0.0)


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str) -> jax.Array:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    Args:
      logp: ``[..., T]`` log-prob of each sampled token under the policy.
      ref_logp: same shape, under the reference.
      kind: ``"k1"``: ``logp - ref`` (unbiased, high variance, can be negative);
        ``"k2"``: ``0.5 * (logp - ref)**2``; ``"k3"``: ``exp(ref - logp) - (ref - logp) - 1``
        (Schulman's unbiased, low-variance, always >= 0; the log-ratio is clamped to
        [-20, 20] before ``exp`` as verl does).

    Returns:
      ``[..., T]`` float32 per-token KL estimate (not masked).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind={kind!r} is not supported; allowed: {', '.join(KL_KINDS)}")
    diff = jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff * diff
    log_ratio = jnp.clip(-diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    # expm1 keeps small ratios accurate; the max removes float rounding below 0.
    return jnp.maximum(jnp.expm1(log_ratio) - log_ratio, 0.0)


def token_weights(mask: jax.Array, mode: str) -> jax.Array:
    """Weights that turn ``sum(weights * per_token_term)`` into the chosen loss aggregation.

    Compute them on the whole mini-batch, then slice them with the micro-batches: the
    micro-batch losses then add up exactly to the mini-batch loss.

    Args:
      mask: ``[N, T]`` (or ``[..., T]``) bool/0-1, True at valid answer tokens.
      mode: ``"token-mean"``: ``1 / (valid tokens in the batch)`` (DAPO; every token counts
        the same); ``"seq-mean-token-sum"``: ``1 / S`` (sum over an answer's tokens, mean
        over answers); ``"seq-mean-token-mean"``: ``1 / (S * len_i)`` (original GRPO: mean
        per answer, then over answers). ``S`` = number of answers with >= 1 valid token.

    Returns:
      ``[N, T]`` float32, 0 at masked positions; all zeros for an all-masked or empty batch.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"mode={mode!r} is not supported; allowed: {', '.join(AGG_MODES)}")
    m = jnp.asarray(mask).astype(jnp.float32)
    if mode == "token-mean":
        return _safe_div(m, jnp.sum(m))
    lengths = jnp.sum(m, axis=-1, keepdims=True)
    num_seqs = jnp.sum(lengths > 0)
    if mode == "seq-mean-token-sum":
        return _safe_div(m, num_seqs.astype(jnp.float32))
    return _safe_div(m, num_seqs * lengths)


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    weights: jax.Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped surrogate with asymmetric (DAPO clip-higher) ratio bounds.

    Per token: ``ratio = exp(logp - old_logp)``,
    ``term = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))``;
    ``loss = sum(weights * term)``. With one update per rollout batch ``ratio == 1``
    and this is the plain policy gradient.

    Args:
      logp: ``[N, T]`` log-probs of the sampled tokens under the policy being trained.
      old_logp: ``[N, T]`` log-probs under the policy that sampled them; gradient stopped
        here, so with one update per batch ``old_logp=logp`` is valid (ratio 1, no extra pass).
      advantages: ``[N]`` per answer (broadcast over tokens) or ``[N, T]`` per token.
      weights: ``[N, T]`` from ``token_weights`` (sliced for a micro-batch); 0 = masked.
      clip_low, clip_high: ratio bounds ``[1 - clip_low, 1 + clip_high]``.

    Returns:
      ``(loss, metrics)``: scalar float32 loss, and scalars ``clip_frac`` (share of tokens
      where the clipped branch is active, i.e. the gradient is cut), ``ratio_mean``,
      ``approx_kl`` (mean of ``old_logp - logp``), each a ``weights``-weighted mean over
      this call's tokens, plus ``weight_sum`` (``sum(weights)``) to combine micro-batch
      metrics exactly: ``sum(m_i * weight_sum_i) / sum(weight_sum_i)``.
    """
    weights = jnp.asarray(weights, jnp.float32)
    valid = weights != 0
    adv = jnp.asarray(advantages, jnp.float32)
    if adv.ndim == weights.ndim - 1:
        adv = adv[..., None]
    adv = jnp.broadcast_to(adv, weights.shape)
    log_ratio = _masked(logp, valid) - jax.lax.stop_gradient(_masked(old_logp, valid))
    log_ratio = jnp.clip(log_ratio, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.sum(weights * jnp.maximum(unclipped, clipped))

    weight_sum = jnp.sum(weights)

    def wmean(x):
        return _safe_div(jnp.sum(weights * jax.lax.stop_gradient(x)), weight_sum)

    metrics = {
        "clip_frac": wmean((clipped > unclipped).astype(jnp.float32)),
        "ratio_mean": wmean(ratio),
        "approx_kl": wmean(-log_ratio),
        "weight_sum": weight_sum,
    }
    return loss, metrics


def kl_loss(logp: jax.Array, ref_logp: jax.Array, weights: jax.Array, kind: str) -> jax.Array:
    """KL-to-reference loss term, ``sum(weights * kl_estimate(logp, ref_logp, kind))``.

    Args:
      logp: ``[N, T]`` policy log-probs of the sampled tokens.
      ref_logp: ``[N, T]`` reference log-probs (gradient stopped).
      weights: ``[N, T]`` from ``token_weights``; 0 = masked.
      kind: ``"k1"``, ``"k2"`` or ``"k3"`` (see ``kl_estimate``; verl's default is ``"k3"``).

    Returns:
      Scalar float32; multiply by the KL coefficient in the caller.
    """
    weights = jnp.asarray(weights, jnp.float32)
    valid = weights != 0
    ref = jax.lax.stop_gradient(_masked(ref_logp, valid))
    return jnp.sum(weights * kl_estimate(_masked(logp, valid), ref, kind))


def entropy_from_logits(logits: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted mean per-token entropy of the policy's next-token distribution (a metric).

    Args:
      logits: ``[N, T, V]`` logits at the answer positions.
      weights: ``[N, T]``; the result is ``sum(w * H) / sum(w)`` (0 if all weights are 0).

    Returns:
      Scalar float32 entropy in nats (``log V`` for a uniform distribution). Materialises
      an ``[N, T, V]`` float32 array: compute it per micro-batch.
    """
    weights = jnp.asarray(weights, jnp.float32)
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    # p * log p is 0 where p == 0 (logit -inf), not 0 * -inf = NaN; the inner where keeps the
    # gradient NaN-free too (an entropy bonus may differentiate this).
    finite = jnp.isfinite(logp)
    safe_logp = jnp.where(finite, logp, 0.0)
    plogp = jnp.where(finite, jnp.exp(safe_logp) * safe_logp, 0.0)
    entropy = jnp.where(weights != 0, -jnp.sum(plogp, axis=-1), 0.0)
    return _safe_div(jnp.sum(weights * entropy), jnp.sum(weights))


def kl_penalized_rewards(
    rewards: jax.Array,
    logp: jax.Array,
    ref_logp: jax.Array,
    mask: jax.Array,
    coef: float,
    kind: str = "k1",
) -> jax.Array:
    """KL in the reward (the alternative to ``kl_loss``): ``r - coef * sum_t kl_t`` per answer.

    Args:
      rewards: ``[B, G]`` task rewards.
      logp: ``[B, G, T]`` log-probs of the sampled tokens under the sampling policy.
      ref_logp: ``[B, G, T]`` under the reference.
      mask: ``[B, G, T]`` bool/0-1 valid answer tokens.
      coef: KL coefficient (``0`` returns the rewards unchanged).
      kind: ``"k1"`` (default, as in RLHF's reward shaping), ``"k2"`` or ``"k3"``.

    Returns:
      ``[B, G]`` float32 penalized rewards, to feed ``compute_advantages``.
    """
    valid = jnp.asarray(mask).astype(bool)
    kl = jnp.where(valid, kl_estimate(_masked(logp, valid), _masked(ref_logp, valid), kind), 0.0)
    return jnp.asarray(rewards, jnp.float32) - coef * jnp.sum(kl, axis=-1)
