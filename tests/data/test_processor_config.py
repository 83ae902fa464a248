"""A checkpoint's processor file (``preprocessor_config.json``, or transformers 5's ``processor_config.json``)
sets the image normalization (``config.hf_config.with_processor_config``): the pipeline's pixels then equal
transformers' image processor loaded from the same directory (1e-5, as ``test_image_processing``); a file whose
patch sizes contradict ``config.json`` or that rescales / normalizes otherwise is refused naming the file."""

import json

import numpy as np
import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from rollplex_jax.config import ConfigError, tiny_model_config
from rollplex_jax.config.model import tiny_qwen3_vl_config
from rollplex_jax.data.image_processing import preprocess_images
from rollplex_jax.models.vl.hf_checkpoint import read_config

MEAN, STD = [0.4, 0.45, 0.5], [0.2, 0.25, 0.3]


def _checkpoint(tmp_path, cfg, name="preprocessor_config.json", nest=False, **extra):
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    v = cfg.vision
    unit = (v.patch_size * v.spatial_merge_size) ** 2
    pre = {"image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": v.patch_size,
           "merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
           "size": {"shortest_edge": 4 * unit, "longest_edge": 64 * unit}, "image_mean": MEAN, "image_std": STD,
           **extra}
    (tmp_path / name).write_text(json.dumps({"image_processor": pre} if nest else pre))
    return unit


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_pixels_follow_the_checkpoints_processor(tmp_path, family):
    cfg = tiny_model_config() if family == "qwen2_5_vl" else tiny_qwen3_vl_config()
    unit = _checkpoint(tmp_path, cfg)
    vision = read_config(tmp_path).vision
    assert (vision.image_mean, vision.image_std) == (tuple(MEAN), tuple(STD))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)) for h, w in ((70, 90), (130, 64))]
    ref = Qwen2VLImageProcessorPil.from_pretrained(tmp_path)(images, return_tensors="np")
    pv, grid = preprocess_images(images, vision, 4 * unit, 64 * unit)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    assert np.abs(pv - ref["pixel_values"]).max() <= 1e-5
    # the family's own values differ: the file really changed the pixels
    pv0, _ = preprocess_images(images, cfg.vision, 4 * unit, 64 * unit)
    assert np.abs(pv0 - pv).max() > 0.1


def test_transformers_5_processor_config_is_read(tmp_path):
    _checkpoint(tmp_path, tiny_model_config(), name="processor_config.json", nest=True)
    assert read_config(tmp_path).vision.image_std == tuple(STD)


def test_without_a_processor_file_the_familys_values_stay(tmp_path):
    cfg = tiny_qwen3_vl_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert read_config(tmp_path).vision.image_mean == (0.5, 0.5, 0.5)


@pytest.mark.parametrize("extra, match", [({"patch_size": 16}, "patch_size=16 but config.json"),
                                          ({"merge_size": 4}, "merge_size=4"),
                                          ({"rescale_factor": 1.0}, "rescale_factor"),
                                          ({"do_normalize": False}, "do_normalize"),
                                          ({"image_std": [0.5, 0.0, 0.5]}, "image_std")])
def test_a_processor_file_at_odds_with_the_model_is_refused(tmp_path, extra, match):
    _checkpoint(tmp_path, tiny_model_config(), **extra)
    with pytest.raises(ConfigError, match=match) as e:
        read_config(tmp_path)
    assert "preprocessor_config.json" in str(e.value)
