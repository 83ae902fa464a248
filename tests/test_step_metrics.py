"""The verl / EasyR1 per-step metrics (step_metrics.py) on tiny runs, hand-computed from the step's rollouts."""

import jax
import numpy as np
import pytest

from launch.api import runner_from_flagfile
from rollplex_contract.batch import Prompts, Rollouts
from rollplex_jax.config import tiny_model_config
from rollplex_jax.step import metrics as step_metrics
from tests import reward_fns
from tests.test_runner_api import TINY


def _quiet(msg):
    pass


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
def test_metrics_of_a_tiny_step_match_its_rollouts(tmp_path, schedule):
    r = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path, schedule=schedule, log=_quiet,
                             **{**TINY, "steps": 1, "reward": "tests.reward_fns:easyr1_batch", "max_new_tokens": 4})
    (m,) = list(r.run())
    ro, examples, g = r.last.rollouts, r.last_prompts, r.cfg.rollout.group_size
    lengths = ro.lengths.astype(float)
    assert m["response_length/mean"] == pytest.approx(lengths.mean())
    assert (m["response_length/max"], m["response_length/min"]) == (lengths.max(), lengths.min())
    cut = [f == "length" for row in ro.finish_reasons for f in row]
    assert m["response_length/clip_ratio"] == pytest.approx(np.mean(cut))
    assert m["response_length/clip_ratio"] == pytest.approx(np.mean(ro.lengths == r.cfg.rollout.max_new_tokens))

    prompt_len = [len(e.prompt_ids) for e in examples]  # real tokens, before any padding
    vision = [int(np.sum(e.prompt_ids == r.cfg.model.image_token_id)) for e in examples]
    assert (m["prompt_length/mean"], m["prompt_length/max"]) == (np.mean(prompt_len), max(prompt_len))
    assert m["prompt_length/vision_mean"] == np.mean(vision) and min(vision) > 0

    tokens = sum(prompt_len) * g + int(ro.lengths.sum())
    assert m["perf/total_num_tokens"] == tokens
    assert m["perf/time_per_step"] == m["timing_s/step"] == m["time/step_s"]
    assert m["perf/throughput"] == pytest.approx(tokens / m["time/step_s"] / jax.device_count())
    # the HF engine prefills each prompt once for its G answers (tiny_cpu: max_batch holds whole groups)
    assert m["rollout/prefill_tokens"] == sum(prompt_len)
    assert m["rollout/prefill_shared_frac"] == pytest.approx(1 - 1 / g)
    phases = [k[len("time/"):-len("_s")] for k in m if k.startswith("time/") and k != "time/step_s"]
    assert {"rollout", "reward"} <= set(phases)
    for p in phases:
        assert m[f"timing_s/{p}"] == m[f"time/{p}_s"]

    # easyr1_batch: overall = 0.5 accuracy + 0.5 format; its parts, recomputed from the decoded answers
    flat = [t for row in r.last.texts for t in row]
    want = reward_fns.easyr1_batch([{"response": t, "ground_truth": e.answer, "response_length": int(n)}
                                    for t, e, n in zip(flat, [e for e in examples for _ in range(g)],
                                                       ro.lengths.reshape(-1), strict=True)])
    for part in ("overall", "format", "accuracy", "tokens"):
        assert m[f"reward/{part}"] == pytest.approx(np.mean([w[part] for w in want]), abs=1e-6), part
    overall = [w["overall"] for w in want]
    assert m["reward/mean"] == m["reward/overall"] == m["critic/score/mean"]
    assert (m["critic/score/max"], m["critic/score/min"]) == pytest.approx((max(overall), min(overall)))
    np.testing.assert_allclose(r.last.reward_parts["tokens"].reshape(-1), lengths.reshape(-1))
    r.close()


def test_metric_functions_by_hand():
    model = tiny_model_config()
    img, vid, pad = model.image_token_id, model.video_token_id, model.pad_token_id
    prompts = Prompts(input_ids=np.array([[pad, pad, 5, img, img, 6], [7, img, vid, vid, vid, 8]], np.int32),
                      attention_mask=np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32))
    ro = Rollouts(response_ids=np.zeros((2, 2, 4), np.int32), lengths=np.array([[4, 1], [2, 4]]),
                  finish_reasons=[["length", "stop"], ["stop", "length"]], logprobs=np.zeros((2, 2, 4), np.float32))
    got = step_metrics.length_metrics(model, prompts, ro)
    assert got == {"response_length/mean": 2.75, "response_length/max": 4.0, "response_length/min": 1.0,
                   "response_length/clip_ratio": 0.5, "prompt_length/mean": 5.0, "prompt_length/max": 6.0,
                   "prompt_length/vision_mean": 3.0}  # (2 + 4) / 2 vision pads
    assert step_metrics.total_tokens(prompts, ro) == (4 + 6) * 2 + 11
    t = step_metrics.timing_metrics({"rollout": 1.5}, 2.0, 62, 4)
    assert t == {"time/rollout_s": 1.5, "timing_s/rollout": 1.5, "time/step_s": 2.0, "timing_s/step": 2.0,
                 "perf/time_per_step": 2.0, "perf/total_num_tokens": 62.0, "perf/throughput": 62 / 2.0 / 4}
    rm = step_metrics.reward_metrics(np.array([[1.0, 0.0], [0.5, 0.5]]), {"format": np.array([[1, 0], [1, 1]]),
                                                                          "mean": np.array([[3, 3], [3, 3]])}, 2)
    assert rm == {"reward/mean": 0.5, "reward/std": pytest.approx(np.std([1, 0, 0.5, 0.5])), "reward/overall": 0.5,
                  "reward/failures": 2.0, "critic/score/mean": 0.5, "critic/score/max": 1.0,
                  "critic/score/min": 0.0, "reward/format": 0.75, "reward/part/mean": 3.0}
