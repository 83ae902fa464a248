"""Our JAX Qwen2.5-VL equals transformers' Qwen2_5_VLForConditionalGeneration (fp32).

Tolerance: logits and every decoder layer's output max abs diff <= 1e-4; vision tower
output <= 1e-4. Several configs: windows > 1, several images of different sizes per
prompt, a video (t > 1), GQA ratios 2 and 4, tied embeddings, padded batches.
Each with the default programs (at these lengths every attention fits one 512 block, so it runs the
dense path) and with 8-long blocks (the blockwise kernel over several blocks, lengths not divided).
"""

import numpy as np
import pytest

from rollplex_jax.config import ProgramConfig, tiny_model_config
from rollplex_jax.models.qwen2_5_vl.vision import vision_forward
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import rope
from tests.hf_reference import assert_forward_parity, assert_rope_index_parity, mm_inputs, vision_tower_case

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
    assert_forward_parity(_tiny(name), ROWS, PROGS[prog], TOL)


@pytest.mark.parametrize("prog", list(PROGS))
@pytest.mark.parametrize("name", ["gqa2_windows", "deep_vision_win112"])
def test_vision_tower_matches_transformers(name, prog):
    cfg = _tiny(name)
    pix, grids, ref, params = vision_tower_case(cfg)
    layout = rope.vision_layout(grids, cfg.vision).arrays()
    ours = np.asarray(vision_forward(params, cfg.vision, pix, layout, prog=PROGS[prog]))
    assert ours.shape == ref.pooler_output.shape
    assert np.abs(ours - ref.pooler_output.numpy()).max() <= TOL


def test_rope_index_matches_transformers():
    assert_rope_index_parity(tiny_model_config(), ROWS)


def test_token_count_mismatch_is_a_clear_error():
    cfg = tiny_model_config()
    inp = mm_inputs(cfg, [[5, ("image", (1, 4, 4)), 6]], np.random.default_rng(0))
    inp["input_ids"][0, 2] = 7  # drop one image pad
    with pytest.raises(ValueError, match="image features and image tokens do not match"):
        M.prepare_inputs(cfg, **inp)
