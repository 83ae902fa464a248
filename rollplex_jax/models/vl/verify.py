"""Compare our forward with transformers' on a checkpoint, on a deterministic multimodal input.

The input exercises every path of the model: text, an image large enough for at
least 2x2 attention windows of the checkpoint's window size (Qwen3-VL, without windows: 3x4 merged tokens), a
second image of another size, and a 2-frame video (Qwen3-VL: each step after its time as text), all in one
prompt. Either family (``models/family.py``: transformers' class of the checkpoint's). Used by
``python -m launch.verify_checkpoint`` and by its test.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from rollplex_jax.config import ModelConfig
from rollplex_jax.data.image_processing import num_merged_tokens, preprocess_images, preprocess_video


def _synthetic_image(h: int, w: int, seed: int) -> Image.Image:
    """A deterministic picture: colour gradients plus seeded noise (no files, no downloads)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), (xx + yy) % 256], -1)
    img = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img, "RGB")


def verification_inputs(cfg: ModelConfig) -> dict:
    """Deterministic prompt: text, a >= 2x2-window image, a smaller image and a video with grid t = 2.

    Returns numpy ``input_ids`` [1, T], ``attention_mask``, ``pixel_values`` (images then the
    video), ``image_grid_thw`` [2, 3], ``video_grid_thw`` [1, 3].
    """
    v = cfg.vision
    unit = v.patch_size * v.spatial_merge_size
    win_px = v.window_size or unit  # one attention window is window_size pixels on a side
    big = (2 * win_px + unit, 2 * win_px + 2 * unit)  # (h, w): at least 3x3 windows, the last partial
    small = (2 * unit, 3 * unit)
    frame = (2 * unit, 2 * unit)
    limits = dict(min_pixels=unit * unit, max_pixels=max(big[0] * big[1], 1) * 4)
    pix_i, grid_i = preprocess_images([_synthetic_image(*big, 0), _synthetic_image(*small, 1)], v, **limits)
    frames = [_synthetic_image(*frame, 2 + i) for i in range(2 * v.temporal_patch_size)]
    pix_v, grid_v = preprocess_video(frames, v, **limits)  # grid t = 2

    special = {cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id,
               cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id}
    text = [t for t in range(3, min(cfg.text.vocab_size, 1000)) if t not in special]

    def block(tok, grid):
        n = num_merged_tokens(grid, v.spatial_merge_size)
        if tok == cfg.video_token_id and v.video_timestamps:  # per step: its time (text tokens here), its pads
            t = int(grid[0])
            return [i for s in range(t) for i in [text[12 + s], cfg.vision_start_token_id]
                    + [tok] * (n // t) + [cfg.vision_end_token_id]]
        return [cfg.vision_start_token_id] + [tok] * n + [cfg.vision_end_token_id]

    ids = (text[0:4] + block(cfg.image_token_id, grid_i[0]) + text[4:6] + block(cfg.image_token_id, grid_i[1])
           + text[6:8] + block(cfg.video_token_id, grid_v[0]) + text[8:12])
    ids = np.asarray([ids], np.int64)
    return dict(input_ids=ids, attention_mask=np.ones_like(ids), pixel_values=np.concatenate([pix_i, pix_v]),
                image_grid_thw=grid_i, video_grid_thw=grid_v)


def transformers_logits(model_dir: str, cfg: ModelConfig, inp: dict) -> np.ndarray:
    """transformers' fp32/bf16 logits [1, T, V] for the same input (M-RoPE via mm_token_type_ids)."""
    import torch
    import transformers

    from rollplex_jax.models.family import family_of

    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    model_cls = getattr(transformers, family_of(cfg).architecture)
    model = model_cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    model.eval()
    ids = torch.from_numpy(inp["input_ids"])
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == cfg.image_token_id] = 1
    types[ids == cfg.video_token_id] = 2
    n_img = int(np.prod(inp["image_grid_thw"], -1).sum())
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.from_numpy(inp["attention_mask"]), mm_token_type_ids=types,
                    pixel_values=torch.from_numpy(inp["pixel_values"][:n_img]).to(dtype),
                    image_grid_thw=torch.from_numpy(inp["image_grid_thw"]),
                    pixel_values_videos=torch.from_numpy(inp["pixel_values"][n_img:]).to(dtype),
                    video_grid_thw=torch.from_numpy(inp["video_grid_thw"]))
    return out.logits.float().numpy()


def default_tolerance(dtype: str, ref_logits: np.ndarray) -> float:
    """Absolute tolerance scaled by the logits' magnitude: 1e-4 (fp32) or 5e-2 (bf16) per unit logit."""
    scale = max(1.0, float(np.abs(ref_logits).max()))
    return (1e-4 if dtype == "float32" else 5e-2) * scale
