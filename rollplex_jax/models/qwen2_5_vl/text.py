"""Qwen2 decoder (GQA with q/k/v bias, RMSNorm, SwiGLU, M-RoPE) as pure functions.

One attention routine serves the plain forward and the prefix/suffix split:
queries attend to a list of key/value *sources*, each with its own boolean mask.
A source may be shared by the N responses of a prompt (its arrays have no N
axis): that is how one prompt's boundary KV serves G responses without being
copied G times.

Shapes: B prompts, N responses per prompt (1 for a plain forward), T tokens,
H query heads, K kv heads, G = H / K, d head dim, D model width.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, TextConfig
from rollplex_jax.models.qwen2_5_vl.layers import apply_rope, constrain_rows, linear, rms_norm


class KVSource(NamedTuple):
    """Keys/values a query block attends to.

    k, v: [B, S, K, d] (shared by the N axis) or [B, N, S, K, d].
    mask: boolean, broadcastable to [B, N, Tq, S].
    """

    k: jax.Array
    v: jax.Array
    mask: jax.Array


def _scores(q, src: KVSource):
    sub = "bskd" if src.k.ndim == 4 else "bnskd"
    return jnp.einsum(f"bnqkgd,{sub}->bnkgqs", q, src.k)


def _mix(p, src: KVSource):
    sub = "bskd" if src.v.ndim == 4 else "bnskd"
    return jnp.einsum(f"bnkgqs,{sub}->bnqkgd", p, src.v)


def attend(q: jax.Array, sources: list[KVSource], num_kv_heads: int) -> jax.Array:
    """Softmax attention (fp32 softmax) of q [B, N, Tq, H, d] over the concatenated sources."""
    b, n, t, h, d = q.shape
    q = q.reshape(b, n, t, num_kv_heads, h // num_kv_heads, d)
    neg = jnp.finfo(jnp.float32).min
    scores = [jnp.where(src.mask[:, :, None, None], _scores(q, src).astype(jnp.float32) * d**-0.5, neg)
              for src in sources]
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
    splits = jnp.split(probs, list(itertools.accumulate(s.shape[-1] for s in scores))[:-1], axis=-1)
    out = sum(_mix(p, src) for p, src in zip(splits, sources, strict=True))
    return out.reshape(b, n, t, h * d)


def qkv_projection(p: dict, layer: int, x: jax.Array, cos, sin, cfg: TextConfig):
    """Rotated q [..., T, H, d], k/v [..., T, K, d] of one layer from normed input x [..., T, D]."""
    pre = f"model.layers.{layer}.self_attn."
    lead = x.shape[:-1]
    q = linear(x, p[pre + "q_proj.weight"], p[pre + "q_proj.bias"]).reshape(*lead, -1, cfg.head_dim)
    k = linear(x, p[pre + "k_proj.weight"], p[pre + "k_proj.bias"]).reshape(*lead, -1, cfg.head_dim)
    v = linear(x, p[pre + "v_proj.weight"], p[pre + "v_proj.bias"]).reshape(*lead, -1, cfg.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def mlp(p: dict, layer: int, x: jax.Array) -> jax.Array:
    pre = f"model.layers.{layer}.mlp."
    return linear(jax.nn.silu(linear(x, p[pre + "gate_proj.weight"])) * linear(x, p[pre + "up_proj.weight"]),
                  p[pre + "down_proj.weight"])


def decoder_layer(p: dict, layer: int, h: jax.Array, cos, sin, extra: list[KVSource], self_mask,
                  cfg: TextConfig):
    """One decoder layer over h [B, N, T, D].

    Args:
      extra: sources attended to before the block's own keys (e.g. a prefix's boundary KV).
      self_mask: [B, N, T, T] mask of the block's own keys (causal & not padding).

    Returns:
      (h_out [B, N, T, D], (k, v) of this block [B, N, T, K, d]).
    """
    pre = f"model.layers.{layer}."
    h = constrain_rows(h)
    x = rms_norm(h, p[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
    q, k, v = qkv_projection(p, layer, x, cos, sin, cfg)
    a = attend(q, list(extra) + [KVSource(k, v, self_mask)], cfg.num_key_value_heads)
    h = h + linear(a, p[pre + "self_attn.o_proj.weight"])
    h = h + mlp(p, layer, rms_norm(h, p[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps))
    return h, (k, v)


def causal_mask(key_mask: jax.Array) -> jax.Array:
    """[..., T] padding mask -> [..., T, T] causal mask that also hides padded keys."""
    t = key_mask.shape[-1]
    tri = jnp.tril(jnp.ones((t, t), bool))
    return tri & key_mask[..., None, :].astype(bool)


def final_norm(p: dict, h: jax.Array, cfg: TextConfig) -> jax.Array:
    return rms_norm(h, p["model.norm.weight"], cfg.rms_norm_eps)


def lm_logits(p: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final-normed hidden states [..., D] -> fp32 logits [..., V]."""
    w = p["model.embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
    return linear(h, w).astype(jnp.float32)


def embed(p: dict, cfg: ModelConfig, input_ids: jax.Array, vision_embeds: jax.Array | None,
          token_types: jax.Array | None = None) -> jax.Array:
    """Token embeddings with image/video pad tokens replaced by vision tokens, in order.

    Image pads (over the whole batch, row-major) take ``vision_embeds[:n_image]`` and video
    pads the rows after, as in transformers (images first, then videos). ``token_types``
    (0 text, 1 image, 2 video) says which tokens are placeholders.
    """
    e = p["model.embed_tokens.weight"][input_ids]
    if vision_embeds is None:
        return e
    img = (token_types == 1).reshape(-1)
    vid = (token_types == 2).reshape(-1)
    idx = jnp.where(img, jnp.cumsum(img) - 1, jnp.sum(img) + jnp.cumsum(vid) - 1)
    feats = vision_embeds[jnp.clip(idx, 0, vision_embeds.shape[0] - 1)].reshape(e.shape)
    return jnp.where((img | vid).reshape(input_ids.shape)[..., None], feats.astype(e.dtype), e)
