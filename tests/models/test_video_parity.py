"""Videos with their time scale (second_per_grid_ts) in our JAX Qwen2.5-VL equal transformers 5.24's.

- M-RoPE positions: prompts with a video of t = 3 temporal steps at second_per_grid_t 0.5 and 1.0, and
  tokens_per_second 2 and 4, and one of t = 12 at 0.45 s (where float32 and float64 products truncate to
  different positions: transformers computes in float32), equal ``Qwen2_5_VLModel.get_rope_index`` of the installed
  transformers on the same ids, grids and second_per_grid_ts; one row is checked against positions written by hand.
- Logits (fp32) of prompts whose video pixels come from ``video_io.load_video`` of a real (tiny) mp4, sampled
  by the fps rule to second_per_grid_t 0.75 (not 1), equal transformers' forward within 1e-4 (the tolerance of
  tests/models/test_parity_transformers.py); the logits at second_per_grid_t 1 are 5x that tolerance away from
  transformers', so the time scale reaches the model (measured: 1e-3 on this tiny random model).
"""

import numpy as np
import pytest
import torch

from rollplex_jax.config import tiny_model_config
from rollplex_jax.data.video_io import load_video, probe_video, video_spec
from rollplex_jax.data.video_sampling import VideoRule
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import rope
from tests.hf_reference import hf_forward, hf_model, mm_inputs, params_of
from tests.video_files import write_video

TOL = 1e-4


def _hf_positions(hf, cfg, inp, secs):
    ref, _ = hf.model.get_rope_index(
        torch.from_numpy(inp["input_ids"]), mm_token_type_ids=torch.from_numpy(rope.token_types(inp["input_ids"], cfg)),
        image_grid_thw=None if inp["image_grid_thw"] is None else torch.from_numpy(inp["image_grid_thw"]),
        video_grid_thw=torch.from_numpy(inp["video_grid_thw"]),
        second_per_grid_ts=torch.from_numpy(np.asarray(secs, np.float32)),
        attention_mask=torch.from_numpy(inp["attention_mask"]))
    return ref.numpy()


@pytest.mark.parametrize("tps", [2, 4])
@pytest.mark.parametrize("secs", [(0.5, 1.0), (1.0, 0.5)])
def test_video_rope_index_matches_transformers(tps, secs):
    cfg = tiny_model_config(vision=dict(tokens_per_second=tps))
    hf = hf_model(cfg)
    rows = [[5, 6, ("video", (3, 4, 4)), 7, 8], [9, ("image", (1, 4, 4)), 10, ("video", (3, 4, 6)), 11]]
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    ours, _ = rope.get_rope_index(inp["input_ids"], inp["attention_mask"], cfg, inp["image_grid_thw"],
                                  inp["video_grid_thw"], np.asarray(secs, np.float32))
    real = inp["attention_mask"].astype(bool)
    np.testing.assert_array_equal(ours[:, real], _hf_positions(hf, cfg, inp, secs)[:, real])


def test_hand_computed_row():
    cfg = tiny_model_config()  # tokens_per_second 2, merge 2
    inp = mm_inputs(cfg, [[5, 6, ("video", (3, 4, 4)), 7, 8]], np.random.default_rng(0))
    pos, nxt = rope.get_rope_index(inp["input_ids"], inp["attention_mask"], cfg, None, inp["video_grid_thw"],
                                   np.asarray([1.0], np.float32))
    # 5, 6, <vision_start> at 0, 1, 2; the video's 3 x 2 x 2 merged tokens from 3: time 3 + 0/2/4 (2 tokens per
    # second x 1 s per step), rows 3, 3, 4, 4, columns 3, 4, 3, 4; then text from 3 + max(2, 2) = 5
    want = np.array([[0, 1, 2, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7, 5, 6, 7],
                     [0, 1, 2, 3, 3, 4, 4, 3, 3, 4, 4, 3, 3, 4, 4, 5, 6, 7],
                     [0, 1, 2, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(pos[:, 0], want)
    assert nxt.tolist() == [8]


def test_fractional_interval_is_float32_as_transformers():
    cfg = tiny_model_config()
    hf = hf_model(cfg)
    inp = mm_inputs(cfg, [[5, ("video", (12, 4, 4)), 6]], np.random.default_rng(0))
    ours, _ = rope.get_rope_index(inp["input_ids"], inp["attention_mask"], cfg, None, inp["video_grid_thw"],
                                  np.asarray([0.45], np.float32))
    np.testing.assert_array_equal(ours, _hf_positions(hf, cfg, inp, [0.45]))
    # step 10: 10 x float32(2 x 0.45) = 8.99999976 rounds to 9.0 in float32 (float64 would truncate it to 8)
    assert rope.temporal_positions(12, 2, np.float32(0.45))[10] == 9


def test_decoded_video_logits_match_transformers(tmp_path):
    cfg = tiny_model_config()
    # 9 frames at 4 fps, 6 of them (nframes): sampled fps 6 / 9 x 4 = 2.67, second_per_grid_t 2 / 2.67 = 0.75
    spec = video_spec({"video": write_video(tmp_path / "v.mp4", 9, fps=4, noise=True), "nframes": 6})
    plan = probe_video(spec, VideoRule(min_pixels=28 * 28, max_pixels=56 * 56))
    assert plan.grid_thw == (3, 4, 4) and plan.second_per_grid_t == pytest.approx(0.75)
    video = load_video(spec, plan, cfg.vision)
    rows = [[5, 6, ("video", plan.grid_thw), 7, 8, 9], [10, ("image", (1, 4, 4)), 11, ("video", plan.grid_thw), 12]]
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    n_img = 16
    inp["pixel_values"] = np.concatenate([inp["pixel_values"][:n_img], video, video[::-1].copy()])
    inp["second_per_grid_ts"] = np.asarray([plan.second_per_grid_t, 0.5], np.float32)
    hf = hf_model(cfg, seed=1)
    params = params_of(hf, cfg)
    ref = hf_forward(hf, cfg, inp).logits.numpy()
    ours = np.asarray(M.full_forward(params, cfg, M.prepare_inputs(cfg, **inp)))
    real = inp["attention_mask"].astype(bool)
    diff = np.abs(ours[real] - ref[real]).max()
    at_one = np.asarray(M.full_forward(params, cfg, M.prepare_inputs(cfg, **dict(inp, second_per_grid_ts=None))))
    moved = np.abs(at_one[real] - ref[real]).max()
    print(f"max |ours - transformers| {diff:.2g}; at second_per_grid_t 1 instead: {moved:.2g}")
    assert diff <= TOL
    assert moved > 5 * TOL  # ignoring the time scale would fail the parity (measured ~1e-3 on this tiny model)
