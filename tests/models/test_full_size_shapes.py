"""The published Qwen2.5-VL-Instruct sizes: our config JSONs give the known parameter counts,
the same tensor names and count as transformers builds from the same JSON, and round-trip."""

import json
import os

import jax
import pytest
import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rollplex_jax.config import ModelConfig
from rollplex_jax.models.vl.hf_checkpoint import normalize_name
from rollplex_jax.models.vl.params import checkpoint_specs, count_params, init_params, param_shapes

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models")

# Totals Hugging Face shows for the published checkpoints (the names round them to 3B/7B/32B).
SIZES = {"qwen2_5_vl_3b.json": 3.75e9, "qwen2_5_vl_7b.json": 8.29e9, "qwen2_5_vl_32b.json": 33.5e9}


@pytest.mark.parametrize("fname", list(SIZES))
def test_param_count_matches_published_size(fname):
    cfg = ModelConfig.from_json_file(os.path.join(CONFIG_DIR, fname))
    assert cfg.dtype == "bfloat16"
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert shapes == param_shapes(cfg)
    n = count_params(shapes)
    print(f"{fname}: {n:,} parameters ({n / 1e9:.3f}e9)")
    assert abs(n - SIZES[fname]) / SIZES[fname] < 0.01, (fname, n)


@pytest.mark.parametrize("fname", list(SIZES))
def test_same_tensors_as_transformers(fname):
    with open(os.path.join(CONFIG_DIR, fname)) as f:
        d = json.load(f)
    cfg = ModelConfig.from_hf_dict(d)
    with torch.device("meta"):  # no memory: shapes only
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**d))
    hf = {normalize_name(k): tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
        del hf["lm_head.weight"]
    ours = {k: tuple(s) for k, (s, _) in checkpoint_specs(cfg).items()}  # the checkpoint's tensors
    assert ours == hf
    assert count_params(param_shapes(cfg)) == sum(p.numel() for p in model.parameters())
    laid = cfg.with_param_layout(fuse_groups=8, vocab_multiple=64)  # the actor's (vLLM's) layout: same params
    assert count_params(param_shapes(laid)) - count_params(param_shapes(cfg)) == (
        (laid.text.vocab_rows - cfg.text.vocab_size) * cfg.text.hidden_size * (1 if cfg.tie_word_embeddings else 2))


@pytest.mark.parametrize("fname", list(SIZES))
def test_config_round_trips(fname):
    cfg = ModelConfig.from_json_file(os.path.join(CONFIG_DIR, fname))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    v, t = cfg.vision, cfg.text
    assert (v.depth, v.hidden_size, v.num_heads, v.patch_size, v.window_size) == (32, 1280, 16, 14, 112)
    assert v.fullatt_block_indexes == (7, 15, 23, 31)
    assert (t.rope_theta, t.mrope_section, t.max_position_embeddings) == (1e6, (16, 24, 24), 128000)
    assert (cfg.image_token_id, cfg.video_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        151655, 151656, 151645, 151643)
