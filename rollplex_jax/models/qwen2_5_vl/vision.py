"""Qwen2.5-VL vision tower as a pure function of (params, config, patches, layout).

Patch embedding of (temporal 2 x 14 x 14) patches, window reordering, RMSNorm +
SwiGLU blocks whose attention is restricted to a window (or to the whole frame
at ``fullatt_block_indexes``), axial 2-D rotary positions, and the 2x2 patch
merger into the language model's width, then the reordering undone.

Attention segments are expressed as equality of segment ids (a dense mask):
exact, and simple to shard; a block-sparse kernel is a later optimisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rollplex_jax.config import VisionConfig
from rollplex_jax.models.qwen2_5_vl.layers import linear, rms_norm, rotate_half
from rollplex_jax.models.qwen2_5_vl.rope import vision_cos_sin

_ACTS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def _attention(p: dict, prefix: str, x, cos, sin, segment, cfg: VisionConfig):
    """Bidirectional attention of x [N, D] within equal ``segment`` ids [N]."""
    n = x.shape[0]
    qkv = linear(x, p[prefix + "qkv.weight"], p[prefix + "qkv.bias"])
    q, k, v = jnp.moveaxis(qkv.reshape(n, 3, cfg.num_heads, cfg.head_dim), 1, 0)
    c, s = cos[:, None, :], sin[:, None, :]
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    q = (qf * c + rotate_half(qf) * s).astype(x.dtype)
    k = (kf * c + rotate_half(kf) * s).astype(x.dtype)
    scores = jnp.einsum("qhd,khd->hqk", q, k) * (cfg.head_dim**-0.5)
    mask = segment[:, None] == segment[None, :]
    scores = jnp.where(mask[None], scores.astype(jnp.float32), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    out = jnp.einsum("hqk,khd->qhd", probs, v).reshape(n, -1)
    return linear(out, p[prefix + "proj.weight"], p[prefix + "proj.bias"])


def _block(p: dict, i: int, x, cos, sin, segment, cfg: VisionConfig):
    pre = f"visual.blocks.{i}."
    x = x + _attention(p, pre + "attn.", rms_norm(x, p[pre + "norm1.weight"], 1e-6), cos, sin, segment, cfg)
    h = rms_norm(x, p[pre + "norm2.weight"], 1e-6)
    act = _ACTS[cfg.hidden_act]
    gate = act(linear(h, p[pre + "mlp.gate_proj.weight"], p[pre + "mlp.gate_proj.bias"]))
    up = linear(h, p[pre + "mlp.up_proj.weight"], p[pre + "mlp.up_proj.bias"])
    return x + linear(gate * up, p[pre + "mlp.down_proj.weight"], p[pre + "mlp.down_proj.bias"])


def vision_forward(params: dict, cfg: VisionConfig, pixel_values, layout: dict) -> jax.Array:
    """Encodes concatenated images/videos into LLM-width tokens.

    Args:
      params: the model's parameter dict (only ``visual.*`` is read).
      cfg: vision config.
      pixel_values: [N, C*T*P*P] flattened patches of all items, in grid order.
      layout: ``VisionLayout.arrays()`` for the same grids (jnp or np int arrays).

    Returns:
      [N / merge**2, out_hidden_size] merged tokens in the original (grid) order.
    """
    unit = cfg.spatial_merge_size**2
    w = params["visual.patch_embed.proj.weight"]
    x = linear(pixel_values.astype(w.dtype), w.reshape(w.shape[0], -1))  # Conv3d with stride = kernel
    n, d = x.shape
    x = x.reshape(n // unit, unit, d)[layout["window_index"]].reshape(n, d)
    cos, sin = vision_cos_sin(jnp.asarray(layout["rot_pos"]), cfg)
    full_seg = jnp.repeat(jnp.asarray(layout["full_segment"]), unit)
    win_seg = jnp.repeat(jnp.asarray(layout["window_segment"]), unit)
    for i in range(cfg.depth):
        seg = full_seg if i in cfg.fullatt_block_indexes else win_seg
        x = _block(params, i, x, cos, sin, seg, cfg)
    return merger(params, cfg, x)[layout["reverse_index"]]


def merger(params: dict, cfg: VisionConfig, x) -> jax.Array:
    """RMSNorm, then groups of merge**2 patches concatenated and projected by a GELU MLP."""
    x = rms_norm(x, params["visual.merger.ln_q.weight"], 1e-6)
    x = x.reshape(-1, x.shape[-1] * cfg.spatial_merge_size**2)
    x = linear(x, params["visual.merger.mlp.0.weight"], params["visual.merger.mlp.0.bias"])
    x = jax.nn.gelu(x, approximate=False)
    return linear(x, params["visual.merger.mlp.2.weight"], params["visual.merger.mlp.2.bias"])
