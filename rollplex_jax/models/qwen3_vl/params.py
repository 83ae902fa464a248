"""Qwen3-VL's vision tower parameters (checkpoint names and logical axes; the decoder's are the shared
``vl/params._text_specs`` with q/k norms and no q/k/v biases, per ``TextConfig``)."""

from __future__ import annotations

from rollplex_jax.config import ModelConfig


def _merger(prefix: str, d: int, wide: int, out: int, postshuffle: bool) -> dict:
    norm = wide if postshuffle else d
    return {
        prefix + "norm.weight": ((norm,), ("norm",)),
        prefix + "norm.bias": ((norm,), ("norm",)),
        prefix + "linear_fc1.weight": ((wide, wide), ("vision_merge_mlp", "vision_merge_in")),
        prefix + "linear_fc1.bias": ((wide,), ("vision_merge_mlp",)),
        prefix + "linear_fc2.weight": ((out, wide), ("embed", "vision_merge_mlp")),
        prefix + "linear_fc2.bias": ((out,), ("embed",)),
    }


def vision_specs(cfg: ModelConfig) -> dict:
    """(shape, logical axes) of every vision tensor of a Qwen3-VL checkpoint (transformers 5.25's names)."""
    v = cfg.vision
    d, f = v.hidden_size, v.intermediate_size
    wide = d * v.spatial_merge_size**2
    specs = {
        "visual.patch_embed.proj.weight": (
            (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
            ("vision_embed", None, None, None, None)),
        "visual.patch_embed.proj.bias": ((d,), ("vision_embed",)),
        "visual.pos_embed.weight": ((v.num_position_embeddings, d), (None, "vision_embed")),
    }
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        specs.update({
            p + "norm1.weight": ((d,), ("norm",)),
            p + "norm1.bias": ((d,), ("norm",)),
            p + "norm2.weight": ((d,), ("norm",)),
            p + "norm2.bias": ((d,), ("norm",)),
            p + "attn.qkv.weight": ((3 * d, d), ("vision_qkv", "vision_embed")),
            p + "attn.qkv.bias": ((3 * d,), ("vision_qkv",)),
            p + "attn.proj.weight": ((d, d), ("vision_embed", "vision_heads")),
            p + "attn.proj.bias": ((d,), ("vision_embed",)),
            p + "mlp.linear_fc1.weight": ((f, d), ("vision_mlp", "vision_embed")),
            p + "mlp.linear_fc1.bias": ((f,), ("vision_mlp",)),
            p + "mlp.linear_fc2.weight": ((d, f), ("vision_embed", "vision_mlp")),
            p + "mlp.linear_fc2.bias": ((d,), ("vision_embed",)),
        })
    specs.update(_merger("visual.merger.", d, wide, v.out_hidden_size, postshuffle=False))
    for k in range(len(v.deepstack_visual_indexes)):
        specs.update(_merger(f"visual.deepstack_merger_list.{k}.", d, wide, v.out_hidden_size, postshuffle=True))
    return specs
