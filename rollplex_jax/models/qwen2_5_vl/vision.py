"""Qwen2.5-VL vision tower as a pure function of (params, config, patches, layout).

Patch embedding of (temporal 2 x 14 x 14) patches, window reordering, RMSNorm +
SwiGLU blocks whose attention is restricted to a window (or to the whole frame
at ``fullatt_block_indexes``), axial 2-D rotary positions, and the 2x2 patch
merger into the language model's width, then the reordering undone.

Attention runs per segment (a window, or a whole frame at full-attention blocks): the
patches of each segment are gathered into a [segments, longest, ...] block (shorter ones
padded at the end and masked), attended, and gathered back, so the cost is the sum of squared
segment sizes, not the square of all patches of the call (which grows with the square of the batch).
The segments are the batch axis of one ``models/attention.py`` call: windows (<= 64 patches) fit one
block and run dense; a frame of thousands of patches runs blockwise, never holding [L, L] scores;
both are right-padded, which cuDNN can express (``--attention=cudnn``, bf16 on a GPU).
Each block is checkpointed by ``ProgramConfig.remat`` (layers.rematerialise).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, ProgramConfig, VisionConfig
from rollplex_jax.models.attention import KVSource, attention
from rollplex_jax.models.qwen2_5_vl.fused import split_last
from rollplex_jax.models.qwen2_5_vl.layers import (
    constrain_rows,
    layer_params,
    linear,
    rematerialise,
    rms_norm,
    rotate_half,
)
from rollplex_jax.models.qwen2_5_vl.rope import vision_cos_sin

_ACTS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def take_groups(x, idx):
    """Per group: ``x`` [N, ...] split into idx.shape[0] groups of rows, gathered by the group-local
    ``idx`` [groups, ...] -> [groups, *idx.shape[1:], ...]. A batched gather: on a mesh whose ``fsdp`` splits
    the rows into the same groups it is local to each device (a gather of a row-split array by global
    indices comes back replicated, every device holding every row)."""
    g = idx.shape[0]
    xg = constrain_rows(x.reshape(g, x.shape[0] // g, *x.shape[1:]))
    return constrain_rows(jax.vmap(lambda a, i: a[i])(xg, idx))


def segment_attention(p: dict, prefix: str, x, cos, sin, seg, cfg: VisionConfig, prog: ProgramConfig):
    """Bidirectional attention of x [N, D] within each segment: ``seg`` = (gather, slot, ids) of
    ``frame_segments``: gather [groups, S, L] holds each segment's patch indices local to its group of
    N / groups rows, padded at the end with N / groups (masked as keys, dropped as outputs); ids [groups, S, L]
    (or None): inside a segment a patch sees the patches of its own id only (frames of a vision chunk)."""
    gather, slot, ids = seg
    n = x.shape[0]
    g, segs, length = gather.shape
    local = n // g
    qkv = linear(x, p[prefix + "qkv.weight"], p[prefix + "qkv.bias"])
    d = cfg.hidden_size
    q, k, v = (a.reshape(n, cfg.num_heads, cfg.head_dim) for a in split_last(qkv, (d, d, d), cfg.qkv_groups))
    c, s = cos[:, None, :], sin[:, None, :]
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    q = (qf * c + rotate_half(qf) * s).astype(x.dtype)
    k = (kf * c + rotate_half(kf) * s).astype(x.dtype)
    valid = gather < local
    idx = jnp.minimum(gather, local - 1)

    def by_segment(a):  # [N, h, d] -> [groups * S, L, h, d]: segments are the batch axis
        return constrain_rows(take_groups(a, idx).reshape(g * segs, length, *a.shape[1:]))

    segments = None if ids is None else constrain_rows(ids.reshape(g * segs, length))
    src = KVSource(by_segment(k), by_segment(v), constrain_rows(valid.reshape(g * segs, length)), right_padded=True,
                   segments=segments, q_segments=None if ids is None else segments[:, None])
    # frames packed in rows (ids given): each row attends over its own frames' blocks only (``row_groups``)
    out = attention(by_segment(q)[:, None], [src], impl=prog.attention, block=prog.attention_block,
                    row_groups=g)[:, 0]
    out = take_groups(out.reshape(g * segs * length, -1), slot).reshape(n, -1)  # back to patch order
    return linear(out, p[prefix + "proj.weight"], p[prefix + "proj.bias"])


def _block(cfg: VisionConfig, prog: ProgramConfig, i: int, p: dict, x, cos, sin, seg):
    pre = f"visual.blocks.{i}."
    x = constrain_rows(x)
    x = x + segment_attention(p, pre + "attn.", rms_norm(x, p[pre + "norm1.weight"], 1e-6), cos, sin, seg, cfg, prog)
    h = rms_norm(x, p[pre + "norm2.weight"], 1e-6)
    act = _ACTS[cfg.hidden_act]
    f = cfg.intermediate_size
    gate, up = split_last(linear(h, p[pre + "mlp.gate_up_proj.weight"], p[pre + "mlp.gate_up_proj.bias"]), (f, f),
                          cfg.mlp_groups)
    gate = act(gate)
    return x + linear(gate * up, p[pre + "mlp.down_proj.weight"], p[pre + "mlp.down_proj.bias"])


def vision_forward(params: dict, cfg: VisionConfig, pixel_values, layout: dict, *,
                   prog: ProgramConfig = ProgramConfig()) -> jax.Array:
    """Encodes concatenated images/videos into LLM-width tokens.

    Args:
      params: the model's parameter dict (only ``visual.*`` is read).
      cfg: vision config.
      pixel_values: [N, C*T*P*P] flattened patches of all items, in grid order.
      layout: ``VisionLayout.arrays()`` for the same grids (jnp or np int arrays).
      prog: attention kernel, block and remat policy (``ProgramConfig``).

    Returns:
      [N / merge**2, out_hidden_size] merged tokens in the original (grid) order.
    """
    unit = cfg.spatial_merge_size**2
    w = params["visual.patch_embed.proj.weight"]
    # the patches split over fsdp: they are the patch embedding's vjp residual (replicated, the bucketed
    # prefix's residuals held the whole batch's patches on every device: 1.2 of 1.65 MB at the demo's size)
    x = linear(constrain_rows(pixel_values.astype(w.dtype)), w.reshape(w.shape[0], -1))  # Conv3d, stride = kernel
    n, d = x.shape
    x = take_groups(x.reshape(n // unit, unit, d), layout["window_index"]).reshape(n, d)
    cos, sin = vision_cos_sin(jnp.asarray(layout["rot_pos"]), cfg)
    full = frame_segments(layout["frame_gather"], unit, n, layout.get("frame_ids"))
    win = frame_segments(layout["window_gather"], unit, n)
    for i in range(cfg.depth):
        block = rematerialise(functools.partial(_block, cfg, prog, i), prog.remat)
        x = block(layer_params(params, f"visual.blocks.{i}."), x, cos, sin,
                  full if i in cfg.fullatt_block_indexes else win)
    merged = merger(params, cfg, x)
    return take_groups(merged, layout["reverse_index"]).reshape(merged.shape)


def frame_segments(unit_gather, unit: int, n: int, unit_ids=None):
    """(gather, slot, ids) of one segmentation over n patches, computed once for every block: merge-unit indices
    [groups, S, L] -> patch indices [groups, S, L * unit] (padding stays out of range), per group each of
    its n / groups patches' slot among the S x L * unit gathered rows, and the units' ids [groups, S, L] (frame
    ids of a vision chunk's full-attention rows, ``vision_chunks.py``) per patch, or None. The attention's output
    goes back to patch order by gathering those slots (each patch is in exactly one segment), not by scattering [N, D]
    values (whose index arrays XLA broadcasts to [N, D])."""
    g = jnp.asarray(unit_gather)
    gather = (g[..., None] * unit + jnp.arange(unit, dtype=g.dtype)).reshape(*g.shape[:2], -1)
    local, rows = n // gather.shape[0], gather.shape[1] * gather.shape[2]

    def slots(gi):  # [S, L] -> [local]: the slot numbers scattered to their patches (padding dropped)
        return jnp.zeros((local,), jnp.int32).at[gi.reshape(-1)].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")

    ids = None if unit_ids is None else jnp.repeat(jnp.asarray(unit_ids), unit, axis=-1)
    return gather, jax.vmap(slots)(gather), ids


def merger(params: dict, cfg: VisionConfig, x) -> jax.Array:
    """RMSNorm, then groups of merge**2 patches concatenated and projected by a GELU MLP."""
    x = rms_norm(x, params["visual.merger.ln_q.weight"], 1e-6)
    x = x.reshape(-1, x.shape[-1] * cfg.spatial_merge_size**2)
    x = linear(x, params["visual.merger.mlp.0.weight"], params["visual.merger.mlp.0.bias"])
    x = jax.nn.gelu(x, approximate=False)
    return linear(x, params["visual.merger.mlp.2.weight"], params["visual.merger.mlp.2.bias"])


def vision_specs(cfg: ModelConfig) -> dict:
    """(shape, logical axes) of every vision tensor of a Qwen2.5-VL checkpoint."""
    v = cfg.vision
    d, f = v.hidden_size, v.intermediate_size
    m = d * v.spatial_merge_size**2
    specs: dict = {
        "visual.patch_embed.proj.weight": (
            (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
            ("vision_embed", None, None, None, None)),
        "visual.merger.ln_q.weight": ((d,), ("norm",)),
        "visual.merger.mlp.0.weight": ((m, m), ("vision_merge_mlp", "vision_merge_in")),
        "visual.merger.mlp.0.bias": ((m,), ("vision_merge_mlp",)),
        "visual.merger.mlp.2.weight": ((cfg.text.hidden_size, m), ("embed", "vision_merge_mlp")),
        "visual.merger.mlp.2.bias": ((cfg.text.hidden_size,), ("embed",)),
    }
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        specs.update({
            p + "norm1.weight": ((d,), ("norm",)),
            p + "norm2.weight": ((d,), ("norm",)),
            p + "attn.qkv.weight": ((3 * d, d), ("vision_qkv", "vision_embed")),
            p + "attn.qkv.bias": ((3 * d,), ("vision_qkv",)),
            p + "attn.proj.weight": ((d, d), ("vision_embed", "vision_heads")),
            p + "attn.proj.bias": ((d,), ("vision_embed",)),
            p + "mlp.gate_proj.weight": ((f, d), ("vision_mlp", "vision_embed")),
            p + "mlp.gate_proj.bias": ((f,), ("vision_mlp",)),
            p + "mlp.up_proj.weight": ((f, d), ("vision_mlp", "vision_embed")),
            p + "mlp.up_proj.bias": ((f,), ("vision_mlp",)),
            p + "mlp.down_proj.weight": ((d, f), ("vision_embed", "vision_mlp")),
            p + "mlp.down_proj.bias": ((d,), ("vision_embed",)),
        })
    return specs
