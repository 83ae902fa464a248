"""Helpers for parity tests: tiny random transformers Qwen2.5-VL and Qwen3-VL models and their inputs.

Everything is built in the test process (no download). Only tests import this module.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from rollplex_jax.config import ModelConfig
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.hf_checkpoint import normalize_name


def hf_model(cfg: ModelConfig, seed: int = 0, attn: str = "eager"):
    """transformers' model of ``cfg``'s family, random (norms and biases too), fp32, eval."""
    torch.manual_seed(seed)
    if cfg.family == "qwen3_vl":
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg.to_hf_dict()))
    else:
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**cfg.to_hf_dict()))
    # transformers' init leaves norms at 1 and biases at 0: randomise them so parity covers them.
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.config._attn_implementation = attn
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = attn
    return model.eval().float()


def params_of(model, cfg: ModelConfig) -> dict:
    import jax.numpy as jnp

    from rollplex_jax.models.vl.fused import to_actor

    out = {}
    for name, t in model.state_dict().items():
        key = normalize_name(name)
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        out[key] = jnp.asarray(t.detach().float().numpy())
    return to_actor(out, cfg)  # the actor's layout (fused q/k/v, gate/up; padded vocabulary)


def mm_inputs(cfg: ModelConfig, rows: list[list], rng: np.random.Generator):
    """Builds left-padded rows from specs: ints are text tokens, ('image', (t,h,w)) / ('video', (t,h,w)).

    A Qwen3-VL video is written as its processor writes it: per temporal step a timestamp (two text tokens
    here), then the frame's pads between vision start and end. Returns numpy input_ids, attention_mask,
    pixel_values (images then videos), image and video grids.
    """
    merge = cfg.vision.spatial_merge_size**2
    seqs, img_grids, vid_grids, img_pix, vid_pix = [], [], [], [], []
    for row in rows:
        seq = []
        for item in row:
            if isinstance(item, tuple):
                kind, grid = item
                n = int(np.prod(grid))
                pix = rng.standard_normal((n, cfg.vision.patch_dim)).astype(np.float32)
                tok = cfg.image_token_id if kind == "image" else cfg.video_token_id
                (img_grids if kind == "image" else vid_grids).append(grid)
                (img_pix if kind == "image" else vid_pix).append(pix)
                if kind == "video" and cfg.family == "qwen3_vl":
                    frame = n // grid[0] // merge
                    for f in range(grid[0]):
                        # text ids of the vocabulary (the demo's has 32: 8-12 there)
                        stamp = [30 + f, 40] if 41 + f < cfg.text.vocab_size else [8 + f % 4, 12]
                        seq += stamp + [cfg.vision_start_token_id] + [tok] * frame + [cfg.vision_end_token_id]
                    continue
                seq += [cfg.vision_start_token_id] + [tok] * (n // merge) + [cfg.vision_end_token_id]
            else:
                seq.append(int(item))
        seqs.append(seq)
    t = max(map(len, seqs))
    ids = np.full((len(seqs), t), cfg.pad_token_id, np.int64)
    mask = np.zeros((len(seqs), t), np.int64)
    for i, s in enumerate(seqs):
        ids[i, t - len(s):] = s
        mask[i, t - len(s):] = 1
    pix = img_pix + vid_pix
    return dict(
        input_ids=ids, attention_mask=mask,
        pixel_values=np.concatenate(pix) if pix else None,
        image_grid_thw=np.array(img_grids, np.int64) if img_grids else None,
        video_grid_thw=np.array(vid_grids, np.int64) if vid_grids else None,
    )


def hf_forward(model, cfg: ModelConfig, inp: dict, output_hidden_states: bool = False):
    """transformers forward on the same inputs (passing mm_token_type_ids so M-RoPE is used)."""
    ids = torch.from_numpy(inp["input_ids"])
    types = torch.zeros_like(ids, dtype=torch.int32)
    types[ids == cfg.image_token_id] = 1
    types[ids == cfg.video_token_id] = 2
    kw = dict(input_ids=ids, attention_mask=torch.from_numpy(inp["attention_mask"]), mm_token_type_ids=types,
              output_hidden_states=output_hidden_states)
    n_img = 0
    if inp["image_grid_thw"] is not None:
        kw["image_grid_thw"] = torch.from_numpy(inp["image_grid_thw"])
        n_img = int(np.prod(inp["image_grid_thw"], -1).sum())
        kw["pixel_values"] = torch.from_numpy(inp["pixel_values"][:n_img])
    if inp["video_grid_thw"] is not None:
        kw["video_grid_thw"] = torch.from_numpy(inp["video_grid_thw"])
        kw["pixel_values_videos"] = torch.from_numpy(inp["pixel_values"][n_img:])
        if inp.get("second_per_grid_ts") is not None:  # float32, as transformers' processor makes it
            kw["second_per_grid_ts"] = torch.from_numpy(np.asarray(inp["second_per_grid_ts"], np.float32))
    with torch.no_grad():
        return model(**kw)


def assert_forward_parity(cfg: ModelConfig, rows: list[list], prog, tol: float, last_normed: bool = True) -> None:
    """Our ``full_forward`` on ``mm_inputs(rows)`` = transformers' (a model of seed 1): the logits and every
    decoder layer's output at the real tokens within ``tol``; transformers' last hidden state is after the final
    norm (compared when ``last_normed``: not where a Qwen3-VL DeepStack tap follows the last layer's record)."""
    hf = hf_model(cfg, seed=1)
    params = params_of(hf, cfg)
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    ref = hf_forward(hf, cfg, inp, output_hidden_states=True)
    logits, hidden = M.full_forward(params, cfg, M.prepare_inputs(cfg, **inp), return_hidden=True, prog=prog)
    real = inp["attention_mask"].astype(bool)
    assert np.abs(np.asarray(logits)[real] - ref.logits.numpy()[real]).max() <= tol
    # transformers' hidden_states: embeddings, then each layer's output, the last one after the final norm
    n = cfg.text.num_hidden_layers
    for i in range(n - 1):
        diff = np.abs(np.asarray(hidden[i])[real] - ref.hidden_states[i + 1].numpy()[real]).max()
        assert diff <= tol, f"layer {i}: {diff}"
    if last_normed:
        normed = M.final_norm(params, hidden[-1], cfg.text)
        assert np.abs(np.asarray(normed)[real] - ref.hidden_states[n].numpy()[real]).max() <= tol


VISION_GRIDS = np.array([[1, 8, 8], [1, 4, 6], [2, 8, 12], [1, 18, 14]], np.int64)


def vision_tower_case(cfg: ModelConfig):
    """(patches, grids, transformers' vision tower output) for ``VISION_GRIDS`` (random patches, a model of seed 2)
    and that model's params in our names."""
    hf = hf_model(cfg, seed=2)
    pix = np.random.default_rng(3).standard_normal((int(np.prod(VISION_GRIDS, -1).sum()), cfg.vision.patch_dim))
    pix = pix.astype(np.float32)
    with torch.no_grad():
        ref = hf.model.visual(torch.from_numpy(pix), grid_thw=torch.from_numpy(VISION_GRIDS))
    return pix, VISION_GRIDS, ref, params_of(hf, cfg)


def assert_rope_index_parity(cfg: ModelConfig, rows: list[list]) -> None:
    """``rope.get_rope_index`` on ``mm_inputs(rows)`` = transformers' ``get_rope_index``: the positions of the real
    tokens and each row's next position (transformers' delta: next - real length), exactly."""
    hf = hf_model(cfg)
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    ref, deltas = hf.model.get_rope_index(
        torch.from_numpy(inp["input_ids"]), mm_token_type_ids=torch.from_numpy(rope.token_types(inp["input_ids"], cfg)),
        image_grid_thw=torch.from_numpy(inp["image_grid_thw"]), video_grid_thw=torch.from_numpy(inp["video_grid_thw"]),
        attention_mask=torch.from_numpy(inp["attention_mask"]))
    ours, nxt = rope.get_rope_index(inp["input_ids"], inp["attention_mask"], cfg, inp["image_grid_thw"],
                                    inp["video_grid_thw"])
    real = inp["attention_mask"].astype(bool)
    np.testing.assert_array_equal(ours[:, real], ref.numpy()[:, real])
    np.testing.assert_array_equal(nxt, deltas.numpy().reshape(-1) + real.sum(1))
