"""Our JAX Qwen2.5-VL equals transformers' Qwen2_5_VLForConditionalGeneration (fp32).

Tolerance: logits and every decoder layer's output max abs diff <= 1e-4; vision tower
output <= 1e-4. Several configs: windows > 1, several images of different sizes per
prompt, a video (t > 1), GQA ratios 2 and 4, tied embeddings, padded batches.
Each with the default programs (at these lengths every attention fits one 512 block, so it runs the
dense path) and with 8-long blocks (the blockwise kernel over several blocks, lengths not divided).
"""

import numpy as np
import pytest
import torch

from rollplex_jax.config import ProgramConfig, tiny_model_config
from rollplex_jax.models.qwen2_5_vl import model as M
from rollplex_jax.models.qwen2_5_vl import rope
from rollplex_jax.models.qwen2_5_vl.vision import vision_forward
from tests.hf_reference import hf_forward, hf_model, mm_inputs, params_of

TOL = 1e-4
PROGS = {"default": ProgramConfig(), "blocks8": ProgramConfig(attention_block=8)}

CONFIGS = {
    "gqa2_windows": dict(),
    "gqa4": dict(text=dict(num_attention_heads=8, num_key_value_heads=2, mrope_section=(1, 1, 2))),
    "tied": dict(tie_word_embeddings=True),
    "deep_vision_win112": dict(vision=dict(depth=3, window_size=112, fullatt_block_indexes=(0, 2))),
}

ROWS = [
    # two images of different sizes (the first has 2x2 windows of 2x2 merged tokens), text between
    [5, 6, ("image", (1, 8, 8)), 7, 8, ("image", (1, 4, 6)), 9],
    # shorter row (left padded), a video of 2 temporal patches and a non-square image
    [10, ("video", (2, 4, 4)), 11, ("image", (1, 6, 10)), 12, 13],
    # text only
    [20, 21, 22, 23],
]


def _tiny(name):
    over = dict(CONFIGS[name])
    tie = over.pop("tie_word_embeddings", False)
    cfg = tiny_model_config(**over)
    if tie:
        import dataclasses
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return cfg


@pytest.mark.parametrize("prog", list(PROGS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_layers_match_transformers(name, prog):
    cfg = _tiny(name)
    hf = hf_model(cfg, seed=1)
    params = params_of(hf, cfg)
    inp = mm_inputs(cfg, ROWS, np.random.default_rng(0))
    ref = hf_forward(hf, cfg, inp, output_hidden_states=True)
    logits, hidden = M.full_forward(params, cfg, M.prepare_inputs(cfg, **inp), return_hidden=True, prog=PROGS[prog])
    real = inp["attention_mask"].astype(bool)
    assert np.abs(np.asarray(logits)[real] - ref.logits.numpy()[real]).max() <= TOL
    # transformers' hidden_states: embeddings, then each layer's output, the last one after the final norm.
    n = cfg.text.num_hidden_layers
    for i in range(n - 1):
        diff = np.abs(np.asarray(hidden[i])[real] - ref.hidden_states[i + 1].numpy()[real]).max()
        assert diff <= TOL, f"layer {i}: {diff}"
    normed = M.final_norm(params, hidden[-1], cfg.text)
    assert np.abs(np.asarray(normed)[real] - ref.hidden_states[n].numpy()[real]).max() <= TOL


@pytest.mark.parametrize("prog", list(PROGS))
@pytest.mark.parametrize("name", ["gqa2_windows", "deep_vision_win112"])
def test_vision_tower_matches_transformers(name, prog):
    cfg = _tiny(name)
    hf = hf_model(cfg, seed=2)
    params = params_of(hf, cfg)
    grids = np.array([[1, 8, 8], [1, 4, 6], [2, 8, 12], [1, 18, 14]], np.int64)
    pix = np.random.default_rng(3).standard_normal((int(np.prod(grids, -1).sum()), cfg.vision.patch_dim))
    pix = pix.astype(np.float32)
    with torch.no_grad():
        ref = hf.model.visual(torch.from_numpy(pix), grid_thw=torch.from_numpy(grids)).pooler_output.numpy()
    layout = rope.vision_layout(grids, cfg.vision).arrays()
    ours = np.asarray(vision_forward(params, cfg.vision, pix, layout, prog=PROGS[prog]))
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= TOL


def test_rope_index_matches_transformers():
    cfg = tiny_model_config()
    hf = hf_model(cfg)
    inp = mm_inputs(cfg, ROWS, np.random.default_rng(0))
    ids = torch.from_numpy(inp["input_ids"])
    types = torch.from_numpy(rope.token_types(inp["input_ids"], cfg))
    ref, deltas = hf.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=torch.from_numpy(inp["image_grid_thw"]),
        video_grid_thw=torch.from_numpy(inp["video_grid_thw"]),
        attention_mask=torch.from_numpy(inp["attention_mask"]))
    ours, _ = rope.get_rope_index(inp["input_ids"], inp["attention_mask"], cfg, inp["image_grid_thw"],
                                  inp["video_grid_thw"])
    real = inp["attention_mask"].astype(bool)
    np.testing.assert_array_equal(ours[:, real], ref.numpy()[:, real])


def test_token_count_mismatch_is_a_clear_error():
    cfg = tiny_model_config()
    inp = mm_inputs(cfg, [[5, ("image", (1, 4, 4)), 6]], np.random.default_rng(0))
    inp["input_ids"][0, 2] = 7  # drop one image pad
    with pytest.raises(ValueError, match="image features and image tokens do not match"):
        M.prepare_inputs(cfg, **inp)
