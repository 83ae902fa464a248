"""Qwen2 / Qwen3 decoder (GQA with q/k/v bias, or without and with q/k RMSNorm; RMSNorm, SwiGLU, M-RoPE) as pure
functions.

One attention routine (``models/attention.py``) serves the plain forward and the prefix/suffix
split: queries attend to a list of key/value *sources* in one softmax, each with a compact mask
(key validity, causal or not). A source may be shared by the N responses of a prompt (its arrays
have no N axis): that is how one prompt's boundary KV serves G responses without being copied G
times. No [T, T] mask is built: a layer's own keys are described by their validity [B, N, T]
and the causal flag.

Shapes: B prompts, N responses per prompt (1 for a plain forward), T tokens,
H query heads, K kv heads, G = H / K, d head dim, D model width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, ProgramConfig, TextConfig
from rollplex_jax.models.attention import KVSource, attention
from rollplex_jax.models.vl.fused import split_last
from rollplex_jax.models.vl.layers import apply_rope, constrain_rows, linear, rms_norm


def qkv_projection(p: dict, layer: int, x: jax.Array, cos, sin, cfg: TextConfig):
    """Rotated q [..., T, H, d], k/v [..., T, K, d] of one layer from normed input x [..., T, D]."""
    pre = f"model.layers.{layer}.self_attn."
    lead = x.shape[:-1]
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    qkv = linear(x, p[pre + "qkv_proj.weight"], p.get(pre + "qkv_proj.bias"))  # one GEMM (fused.py)
    q, k, v = (a.reshape(*lead, -1, cfg.head_dim) for a in split_last(qkv, (q, kv, kv), cfg.qkv_groups))
    if cfg.qk_norm:  # Qwen3: an RMSNorm over each head's q and k, before the rotation
        q = rms_norm(q, p[pre + "q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p[pre + "k_norm.weight"], cfg.rms_norm_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def mlp(p: dict, layer: int, x: jax.Array, cfg: TextConfig) -> jax.Array:
    pre = f"model.layers.{layer}.mlp."
    f = cfg.intermediate_size
    gate, up = split_last(linear(x, p[pre + "gate_up_proj.weight"]), (f, f), cfg.mlp_groups)
    return linear(jax.nn.silu(gate) * up, p[pre + "down_proj.weight"])


class LayerInputs(NamedTuple):
    """What every decoder layer of one call reads besides its own hidden states: the M-RoPE rotation (cos, sin)
    of the block's tokens, which of them are real (``valid`` bool [B, N, T]: its keys are causal), and packed
    rows' segment ids (``segments`` int [B, N, T], a token sees its own segment's keys only; None unpacked)."""

    cos: jax.Array
    sin: jax.Array
    valid: jax.Array
    segments: jax.Array | None = None


def decoder_layer(p: dict, layer: int, h: jax.Array, inp: LayerInputs, extra: list[KVSource], cfg: TextConfig, *,
                  prog: ProgramConfig = ProgramConfig()):
    """One decoder layer over h [B, N, T, D].

    Args:
      inp: the block's rotation, validity and segments (``LayerInputs``).
      extra: sources attended to before the block's own keys (e.g. a prefix's boundary KV).
      prog: the attention kernel and its block (``ProgramConfig``; remat is applied by the caller).

    Returns:
      (h_out [B, N, T, D], (k, v) of this block [B, N, T, K, d]).
    """
    pre = f"model.layers.{layer}."
    h = constrain_rows(h, (0, 1))
    x = rms_norm(h, p[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
    q, k, v = qkv_projection(p, layer, x, inp.cos, inp.sin, cfg)
    own = KVSource(k, v, inp.valid, causal=True, segments=inp.segments, q_segments=inp.segments)
    a = attention(q, [*extra, own], impl=prog.attention, block=prog.attention_block)
    h = h + linear(a, p[pre + "self_attn.o_proj.weight"])
    h = h + mlp(p, layer, rms_norm(h, p[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps), cfg)
    return h, (k, v)


def final_norm(p: dict, h: jax.Array, cfg: TextConfig) -> jax.Array:
    return rms_norm(h, p["model.norm.weight"], cfg.rms_norm_eps)


def lm_logits(p: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final-normed hidden states [..., D] -> fp32 logits [..., V] (the vocabulary's: padding rows dropped)."""
    w = p["model.embed_tokens.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
    logits = linear(h, w).astype(jnp.float32)
    return logits if w.shape[0] == cfg.text.vocab_size else logits[..., :cfg.text.vocab_size]


def embed(p: dict, cfg: ModelConfig, input_ids: jax.Array, vision_embeds: jax.Array | None,
          token_types: jax.Array | None = None, vision_index: jax.Array | None = None) -> jax.Array:
    """Token embeddings with image/video pad tokens replaced by vision tokens, in order (``embed_vision``)."""
    return embed_vision(p, cfg, input_ids, vision_embeds, token_types, vision_index)[0]


def embed_vision(p: dict, cfg: ModelConfig, input_ids: jax.Array, vision_embeds: jax.Array | None,
                 token_types: jax.Array | None = None, vision_index: jax.Array | None = None):
    """(token embeddings [..., T, D] with the vision tokens in place, Qwen3-VL's DeepStack additions).

    Image pads (over the whole batch, row-major) take ``vision_embeds[:n_image]`` and video
    pads the rows after, as in transformers (images first, then videos). ``token_types``
    (0 text, 1 image, 2 video) says which tokens are placeholders; ``vision_index`` (packed rows, whose order
    is not the batch's: ``packing.Packing``) which embedding each takes. ``vision_embeds`` [rows, embed_width] is
    the merger's output then each DeepStack tap's (``qwen3_vl/vision.py``): the additions are, per tapped vision
    block k, the [..., T, D] added to decoder layer k's output, that block's merged features at the vision tokens
    and 0 elsewhere (empty for Qwen2.5-VL or without vision). Each token's row is gathered once, whole.
    """
    e = p["model.embed_tokens.weight"][input_ids]
    if vision_embeds is None:
        return e, []
    d = e.shape[-1]
    feats, is_vision = _vision_features(vision_embeds, token_types, vision_index)
    h = jnp.where(is_vision[..., None], feats[..., :d].astype(e.dtype), e)
    taps = jnp.where(is_vision[..., None], feats[..., d:], 0)
    return h, [taps[..., k * d:(k + 1) * d] for k in range(len(cfg.vision.deepstack_visual_indexes))]


def _vision_features(vision_embeds: jax.Array, token_types: jax.Array, vision_index: jax.Array | None):
    """(each token's row of ``vision_embeds`` [..., T, W] (any row where it is text), which tokens are vision
    [..., T]): image pads take the first rows in order, video pads the rows after, or ``vision_index``'s."""
    img = (token_types == 1).reshape(-1)
    vid = (token_types == 2).reshape(-1)
    if vision_index is not None:
        idx = vision_index.reshape(-1)
    else:
        idx = jnp.where(img, jnp.cumsum(img) - 1, jnp.sum(img) + jnp.cumsum(vid) - 1)
    feats = vision_embeds[jnp.clip(idx, 0, vision_embeds.shape[0] - 1)]
    return feats.reshape(*token_types.shape, -1), (img | vid).reshape(token_types.shape)
