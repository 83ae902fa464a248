"""The HF engine generates on prompts with decoded videos, and its log-probs are the JAX actor's.

Prompts are built by hand from ``video_io.load_video`` (a 32-frame mp4 sampled at 2 fps: 8 frames, 1 s per
grid step; a 5-frame PNG list at 4 fps: 0.5 s per step) with their ``second_per_grid_ts``. Criterion as
tests/rollout/test_hf_engine.py: mean exp(|engine log-prob - JAX log-prob|) <= 1.0001 (fp32).

The first video's temporal positions (0, 2, 4, 6 past its start) run past the text that follows it (its 2x2
merged grid advances the text by 2 only): transformers' ``rope_deltas`` (max position + 1 - length) would decode
from 10, its forward of prompt ++ answer continues from 7. Its generate extends the prompt's position ids (7),
so the engine agrees with the actor there too; this row checks it.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rollout_torch.hf_engine import HFEngine
from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_jax.config import tiny_model_config
from rollplex_jax.data.video_io import load_video, probe_video, video_spec
from rollplex_jax.data.video_sampling import VideoRule
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.weights.sharing import WeightPublisher
from tests.hf_reference import mm_inputs
from tests.video_files import write_frames, write_video

STOP = (2, 7, 9)
SMALL = VideoRule(min_pixels=28 * 28, max_pixels=56 * 56)


def video_prompts(cfg, tmp_path) -> Prompts:
    """3 rows: a video (t 4, 1 s per step) then 1 text token; an image and a frame-list video (t 3, 0.5 s); text."""
    (tmp_path / "frames").mkdir()
    specs = [video_spec(write_video(tmp_path / "a.mp4", 32, noise=True)),
             video_spec({"video": write_frames(tmp_path / "frames", 5), "fps": 4.0})]
    plans = [probe_video(s, SMALL) for s in specs]
    assert [p.grid_thw for p in plans] == [(4, 4, 4), (3, 4, 4)]
    assert [p.second_per_grid_t for p in plans] == [1.0, 0.5]
    rows = [[5, 6, ("video", plans[0].grid_thw), 8],
            [10, ("image", (1, 4, 4)), 11, ("video", plans[1].grid_thw), 12, 13], [20, 21]]
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    videos = [load_video(s, p, cfg.vision) for s, p in zip(specs, plans, strict=True)]
    inp["pixel_values"] = np.concatenate([inp["pixel_values"][:16], *videos])  # the image's 16 patches, videos
    return Prompts(**inp, second_per_grid_ts=np.asarray([p.second_per_grid_t for p in plans], np.float32))


def _setup(tmp_path):
    cfg = tiny_model_config()
    params = init_params(cfg, jax.random.key(0), std=0.1)
    eng = HFEngine(cfg.to_hf_dict(), max_batch=4)
    WeightPublisher(eng, cfg).publish(params, version=0)
    return cfg, params, video_prompts(cfg, tmp_path), eng


def _jax_logprobs(cfg, params, prompts: Prompts, ro) -> np.ndarray:
    inputs = M.prepare_inputs(cfg, prompts.input_ids, prompts.attention_mask, prompts.pixel_values,
                              prompts.image_grid_thw, prompts.video_grid_thw, prompts.second_per_grid_ts)
    state, last = M.prefix_forward(params, cfg, inputs)
    ids, mask = jnp.asarray(ro.response_ids), jnp.asarray(ro.mask)
    return np.asarray(M.suffix_logprobs(last, M.suffix_forward(params, cfg, state, ids, mask), ids, mask))


def _crit(cfg, params, prompts, ro) -> float:
    lp = _jax_logprobs(cfg, params, prompts, ro)
    real = ro.mask.astype(bool)
    return float(np.exp(np.abs(lp[real] - ro.logprobs[real])).mean())


def test_engine_logprobs_on_video_prompts_match_jax(tmp_path):
    cfg, params, prompts, eng = _setup(tmp_path)
    ro = eng.generate(prompts, 4, SamplingParams(max_new_tokens=6, stop_token_ids=STOP, seed=3))
    crit = _crit(cfg, params, prompts, ro)
    print(f"video prompts: mean exp|dlogp| = {crit:.7f} over {int(ro.mask.sum())} tokens")
    assert crit <= 1.0001
    eng.release()


def test_the_engine_uses_the_time_scale(tmp_path):
    """Without second_per_grid_ts the engine would place the videos' frames elsewhere in time: its log-probs then
    differ from the actor's (which is given them). Guards the plumbing, not transformers."""
    cfg, params, prompts, eng = _setup(tmp_path)
    sp = SamplingParams(max_new_tokens=6, stop_token_ids=STOP, seed=3)
    unscaled = dataclasses.replace(prompts, second_per_grid_ts=None)
    off = _crit(cfg, params, prompts, eng.generate(unscaled, 4, sp))
    print(f"engine without second_per_grid_ts: mean exp|dlogp| = {off:.7f}")
    assert off > 1.0001
    eng.release()
