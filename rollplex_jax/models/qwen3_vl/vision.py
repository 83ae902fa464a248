"""Qwen3-VL's vision tower as a pure function of (params, config, patches, layout).

What differs from Qwen2.5-VL's (transformers 5.25 ``Qwen3VLVisionModel``): the patch embedding has a bias; a
learned position table is bilinearly resampled to each frame's grid and added to the patch embeddings (the
layout's ``pos_taps`` / ``pos_weights``, ``rope.position_taps``); every block attends to whole frames (no
windows); blocks are LayerNorm + a plain GELU MLP (``linear_fc1``, ``linear_fc2``); the merger applies a
LayerNorm before the 2x2 concatenation, and DeepStack: the output of each block in ``deepstack_visual_indexes``
goes through a merger of its own (LayerNorm after the concatenation). The tower returns every vision token's
merged embedding and its DeepStack features side by side, [tokens, (1 + K) x out_hidden_size]
(``VisionConfig.embed_width``): one array, so the vision buffer, the programs and the chunks carry them as they
carry Qwen2.5-VL's; ``text.embed_vision`` splits them.

Attention, the rotary positions, segment gathers and the groups over the mesh are Qwen2.5-VL's
(``qwen2_5_vl/vision.py``): the layout's full-attention segments (``frame_gather``, ``frame_ids``) serve every
block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from rollplex_jax.config import ProgramConfig, VisionConfig
from rollplex_jax.models.qwen3_vl.params import vision_specs  # noqa: F401  (the family's, models/family.py)
from rollplex_jax.models.vl.layers import constrain_rows, layer_norm, layer_params, linear, rematerialise
from rollplex_jax.models.vl.rope import vision_cos_sin
from rollplex_jax.models.vl.vision_ops import ACTIVATIONS, frame_segments, segment_attention, take_groups

_EPS = 1e-6


def _block(cfg: VisionConfig, prog: ProgramConfig, i: int, p: dict, x, cos, sin, seg):
    pre = f"visual.blocks.{i}."
    x = constrain_rows(x)
    h = layer_norm(x, p[pre + "norm1.weight"], p[pre + "norm1.bias"], _EPS)
    x = x + segment_attention(p, pre + "attn.", h, cos, sin, seg, cfg, prog)
    h = layer_norm(x, p[pre + "norm2.weight"], p[pre + "norm2.bias"], _EPS)
    h = ACTIVATIONS[cfg.hidden_act](linear(h, p[pre + "mlp.linear_fc1.weight"], p[pre + "mlp.linear_fc1.bias"]))
    return x + linear(h, p[pre + "mlp.linear_fc2.weight"], p[pre + "mlp.linear_fc2.bias"])


def merger(params: dict, prefix: str, cfg: VisionConfig, x, postshuffle: bool) -> jax.Array:
    """Groups of merge**2 patches [N, d] -> [N / merge**2, out_hidden_size]: LayerNorm (over d before the
    concatenation, or over the concatenated 4d with ``postshuffle``: DeepStack's), then a GELU MLP."""
    wide = x.shape[-1] * cfg.spatial_merge_size**2
    norm = (params[prefix + "norm.weight"], params[prefix + "norm.bias"])
    x = layer_norm(x.reshape(-1, wide), *norm, _EPS) if postshuffle else layer_norm(x, *norm, _EPS).reshape(-1, wide)
    x = jax.nn.gelu(linear(x, params[prefix + "linear_fc1.weight"], params[prefix + "linear_fc1.bias"]),
                    approximate=False)
    return linear(x, params[prefix + "linear_fc2.weight"], params[prefix + "linear_fc2.bias"])


def position_embeddings(params: dict, layout: dict, dtype) -> jax.Array:
    """The learned table resampled to every patch: sum of its 4 taps' rows x weights [N, d] (fp32 weights, as
    transformers; padding patches have weight 0)."""
    table = params["visual.pos_embed.weight"]
    rows = table[jnp.asarray(layout["pos_taps"])]  # [N, 4, d]
    return jnp.sum(rows * jnp.asarray(layout["pos_weights"])[..., None], axis=1).astype(dtype)


def vision_forward(params: dict, cfg: VisionConfig, pixel_values, layout: dict, *,
                   prog: ProgramConfig = ProgramConfig()) -> jax.Array:
    """Encodes concatenated images/videos: [N / merge**2, embed_width] (merged tokens, then each DeepStack
    merger's, in grid order). Arguments as Qwen2.5-VL's ``vision_forward`` (the layout with ``pos_taps``)."""
    unit = cfg.spatial_merge_size**2
    w = params["visual.patch_embed.proj.weight"]
    x = linear(constrain_rows(pixel_values.astype(w.dtype)), w.reshape(w.shape[0], -1),
               params["visual.patch_embed.proj.bias"])  # Conv3d, stride = kernel
    n, d = x.shape
    x = take_groups(x.reshape(n // unit, unit, d), layout["window_index"]).reshape(n, d)  # identity: no windows
    x = x + position_embeddings(params, layout, x.dtype)
    cos, sin = vision_cos_sin(jnp.asarray(layout["rot_pos"]), cfg)
    full = frame_segments(layout["frame_gather"], unit, n, layout.get("frame_ids"))
    taps = []
    for i in range(cfg.depth):
        block = rematerialise(functools.partial(_block, cfg, prog, i), prog.remat)
        x = block(layer_params(params, f"visual.blocks.{i}."), x, cos, sin, full)
        if i in cfg.deepstack_visual_indexes:  # in block order, as transformers appends them
            k = cfg.deepstack_visual_indexes.index(i)
            taps.append(merger(params, f"visual.deepstack_merger_list.{k}.", cfg, x, postshuffle=True))
    out = jnp.concatenate([merger(params, "visual.merger.", cfg, x, postshuffle=False), *taps], axis=-1)
    return take_groups(out, layout["reverse_index"]).reshape(out.shape)
