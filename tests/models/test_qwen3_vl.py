"""Our JAX Qwen3-VL equals transformers' Qwen3VLForConditionalGeneration (fp32), and the shared machinery
(prefix/suffix split, checkpoint IO, configs) covers it.

Tolerances: logits and every decoder layer's output max abs diff <= 1e-4 (as Qwen2.5-VL's parity: fp32 over a
few layers, measured 3e-7), the vision tower's merged and DeepStack outputs <= 1e-4, prefix + suffix == full
<= 1e-5 (``test_prefix_suffix.py``'s), positions and checkpoint bytes exact. The rows hold two images of different
sizes, a 2-step video written as Qwen3-VL's processor writes it (a timestamp, then each frame's pads between
vision start and end), a non-square image and a text-only row, left padded. Configs: DeepStack from one block and
from two (into decoder layers 0 and 1), an explicit head_dim (32, not 64 / 4 heads), GQA 2 and 4, tied and untied
embeddings; the blockwise attention kernel over several blocks (8-long) once.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from rollplex_jax.config import ModelConfig, ProgramConfig
from rollplex_jax.config.model import ConfigError, tiny_qwen3_vl_config
from rollplex_jax.models.qwen3_vl.vision import vision_forward
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint
from rollplex_jax.models.vl.params import checkpoint_specs, init_params
from tests.hf_reference import assert_forward_parity, assert_rope_index_parity, hf_model, mm_inputs, vision_tower_case
from tests.paths import REPO

TOL = 1e-4
CONFIGS = {
    "deepstack1": dict(),
    "deepstack2_gqa4": dict(vision=dict(depth=3, deepstack_visual_indexes=(2, 0)),
                            text=dict(num_attention_heads=8, num_key_value_heads=2, attention_head_dim=16,
                                      mrope_section=(4, 2, 2))),
}
ROWS = [
    [5, 6, ("image", (1, 8, 8)), 7, 8, ("image", (1, 4, 6)), 9],
    [10, ("video", (2, 4, 4)), 11, ("image", (1, 6, 10)), 12, 13],
    [20, 21, 22, 23],
]


def _forward_parity(cfg: ModelConfig, prog: ProgramConfig):
    # transformers records each layer's output before its DeepStack addition: the last layer's tap comes after
    taps = len(cfg.vision.deepstack_visual_indexes)
    assert_forward_parity(cfg, ROWS, prog, TOL, last_normed=taps < cfg.text.num_hidden_layers)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_layers_match_transformers(name):
    _forward_parity(tiny_qwen3_vl_config(**CONFIGS[name]), ProgramConfig())


def test_tied_and_blockwise_match_transformers():
    """Tied embeddings, with the blockwise kernel over 8-long blocks (several blocks, lengths not divided)."""
    _forward_parity(tiny_qwen3_vl_config(tie_word_embeddings=True), ProgramConfig(attention_block=8))


def test_vision_tower_and_deepstack_match_transformers():
    cfg = tiny_qwen3_vl_config(**CONFIGS["deepstack2_gqa4"])
    pix, grids, ref, params = vision_tower_case(cfg)
    layout = rope.vision_layout(grids, cfg.vision).arrays()
    ours = np.asarray(vision_forward(params, cfg.vision, pix, layout))
    d = cfg.vision.out_hidden_size
    assert ours.shape == (ref.pooler_output.shape[0], cfg.vision.embed_width)
    for k, want in enumerate([ref.pooler_output, *ref.deepstack_features]):
        assert np.abs(ours[:, k * d:(k + 1) * d] - want.numpy()).max() <= TOL, k


def test_rope_index_matches_transformers():
    assert_rope_index_parity(tiny_qwen3_vl_config(), ROWS)


def test_interleaved_bands():
    """transformers' recomposition on (24, 20, 20) over 64 bands: t h w repeated 20 times, then 4 t."""
    cfg = ModelConfig.from_hf_dict(Qwen3VLConfig(text_config=dict(hidden_size=4096), vision_config=dict(
        out_hidden_size=4096)).to_dict())
    assert rope.axis_of_band(cfg.text).tolist() == [0, 1, 2] * 20 + [0] * 4


def test_prefix_and_suffix_equal_full_forward():
    cfg = tiny_qwen3_vl_config(**CONFIGS["deepstack2_gqa4"])
    params = init_params(cfg, jax.random.key(0), std=0.1)
    rng = np.random.default_rng(1)
    prompt = mm_inputs(cfg, ROWS[:2], rng)
    b, n, tr = 2, 3, 5
    resp = rng.integers(3, 200, size=(b, n, tr))
    resp_mask = (np.arange(tr)[None, None] < rng.integers(1, tr + 1, size=(b, n))[..., None]).astype(np.int64)
    state, last = jax.jit(M.prefix_forward, static_argnums=1)(params, cfg, M.prepare_inputs(cfg, **prompt))
    suffix = jax.jit(M.suffix_forward, static_argnums=1)(params, cfg, state, jnp.asarray(resp), jnp.asarray(resp_mask))
    ids = np.concatenate([np.repeat(prompt["input_ids"][:, None], n, 1), resp], -1).reshape(b * n, -1)
    mask = np.concatenate([np.repeat(prompt["attention_mask"][:, None], n, 1), resp_mask], -1).reshape(b * n, -1)
    full_in = dict(prompt, input_ids=ids, attention_mask=mask)
    for key in ("pixel_values", "image_grid_thw", "video_grid_thw"):  # every answer repeats its prompt's items
        full_in[key] = _repeat_items(prompt, key, n)
    region = np.zeros_like(ids, bool)
    region[:, :prompt["input_ids"].shape[1]] = True
    opts = M.InputOptions(vision_region=region)
    full = jax.jit(functools.partial(M.full_forward), static_argnums=1)(params, cfg, M.prepare_inputs(
        cfg, **full_in, opts=opts)).reshape(b, n, ids.shape[1], -1)
    tp = prompt["input_ids"].shape[1]
    got = np.asarray(M.predicting_logits(last, suffix))
    want = np.asarray(full[:, :, tp - 1:tp - 1 + tr])
    assert np.abs(np.where(resp_mask[..., None] > 0, got - want, 0)).max() <= 1e-5


def _repeat_items(prompt: dict, key: str, n: int):
    """The prompt rows' images and videos for each row repeated n times (row 0 has 2 images, row 1 a video then
    an image: ROWS[:2])."""
    img, vid = prompt["image_grid_thw"], prompt["video_grid_thw"]
    if key == "image_grid_thw":
        return np.concatenate([img[:2]] * n + [img[2:]] * n)
    if key == "video_grid_thw":
        return np.concatenate([vid] * n)
    sizes = [int(np.prod(g)) for g in img] + [int(np.prod(g)) for g in vid]
    parts = np.split(prompt["pixel_values"], np.cumsum(sizes)[:-1])
    row0, row1_img, row1_vid = np.concatenate(parts[:2]), parts[2], parts[3]
    return np.concatenate([row0] * n + [row1_img] * n + [row1_vid] * n)


@pytest.mark.parametrize("tie", [False, True])
def test_checkpoint_round_trip_is_byte_identical(tie, tmp_path):
    cfg = tiny_qwen3_vl_config(tie_word_embeddings=tie)
    model = hf_model(cfg, seed=4)
    model.save_pretrained(tmp_path / "hf")
    cfg2, params = load_hf_checkpoint(tmp_path / "hf")
    assert cfg2 == cfg
    save_hf_checkpoint(tmp_path / "ours", cfg2, params)
    back = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    sd, sd_back = model.state_dict(), back.state_dict()
    assert set(sd) == set(sd_back)
    for k in sd:
        assert sd[k].numpy().tobytes() == sd_back[k].numpy().tobytes(), k


@pytest.mark.parametrize("size", ["2b", "8b", "32b"])
def test_real_size_specs_equal_transformers(size):
    """Every tensor of configs/models/qwen3_vl_<size>.json, name and shape, as transformers builds the model
    (on the meta device: no memory)."""
    path = REPO / "configs" / "models" / f"qwen3_vl_{size}.json"
    cfg = ModelConfig.from_json_file(path)
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**json.loads(path.read_text())))
    from rollplex_jax.models.vl.names import normalize_name

    theirs = {normalize_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    assert {k: s for k, (s, _) in checkpoint_specs(cfg).items()} == theirs


def test_qwen3_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_hf_dict(dict(tiny_qwen3_vl_config().to_hf_dict(), text_config=dict(
            tiny_qwen3_vl_config().to_hf_dict()["text_config"], attention_bias=True)))
    with pytest.raises(ConfigError, match="window_size"):
        dataclasses.replace(tiny_qwen3_vl_config(), family="qwen2_5_vl")
    with pytest.raises(ConfigError, match="model_type='llava'"):
        ModelConfig.from_hf_dict({"model_type": "llava"})
