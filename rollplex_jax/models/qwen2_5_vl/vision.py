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
from rollplex_jax.models.vl.fused import split_last
from rollplex_jax.models.vl.layers import (
    constrain_rows,
    layer_params,
    linear,
    rematerialise,
    rms_norm,
)
from rollplex_jax.models.vl.rope import vision_cos_sin
from rollplex_jax.models.vl.vision_ops import ACTIVATIONS, frame_segments, segment_attention, take_groups


def _block(cfg: VisionConfig, prog: ProgramConfig, i: int, p: dict, x, cos, sin, seg):
    pre = f"visual.blocks.{i}."
    x = constrain_rows(x)
    x = x + segment_attention(p, pre + "attn.", rms_norm(x, p[pre + "norm1.weight"], 1e-6), cos, sin, seg, cfg, prog)
    h = rms_norm(x, p[pre + "norm2.weight"], 1e-6)
    act = ACTIVATIONS[cfg.hidden_act]
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
