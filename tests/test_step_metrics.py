"""The verl / EasyR1 per-step metrics (step/metrics.py): each function against figures worked out by hand, and a
tiny run's metrics against what its step held (its rollouts, prompts and reward parts)."""

import dataclasses

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

    # Every prompt of the tiny colour task holds 17 real tokens: a 56 x 56 image = 4 x 4 patches = 4 merged
    # image pads, and 13 of the chat template and the question; B = 2 prompts, G = 4 answers each.
    assert [len(e.prompt_ids) for e in examples] == [17, 17] and g == 4
    assert (m["prompt_length/mean"], m["prompt_length/max"], m["prompt_length/vision_mean"]) == (17.0, 17.0, 4.0)
    tokens = 2 * 4 * 17 + int(ro.lengths.sum())  # each answer counts its prompt
    assert m["perf/total_num_tokens"] == tokens
    assert m["perf/time_per_step"] == m["timing_s/step"] == m["time/step_s"]
    # per training device: this run trains on 1 of the 4 fake devices (XLA_FLAGS under make)
    assert r.cfg.mesh.train_devices == 1
    assert m["perf/throughput"] == pytest.approx(tokens / m["time/step_s"])
    # the HF engine prefills each prompt once for its 4 answers (tiny_cpu: max_batch holds whole groups): 2 x 17
    # tokens of the 8 x 17 its answers hold, 3/4 shared
    assert (m["rollout/prefill_tokens"], m["rollout/prefill_shared_frac"]) == (34.0, 0.75)
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
    """Each metric function on a 2-prompt, 2-answer example, against figures worked out by hand."""
    model = tiny_model_config()
    img, vid, pad = model.image_token_id, model.video_token_id, model.pad_token_id
    # prompt 0: 2 pads then 4 real tokens (2 image pads); prompt 1: 6 real tokens (1 image pad, 3 video pads)
    prompts = Prompts(input_ids=np.array([[pad, pad, 5, img, img, 6], [7, img, vid, vid, vid, 8]], np.int32),
                      attention_mask=np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], np.int32))
    ro = Rollouts(response_ids=np.zeros((2, 2, 4), np.int32), lengths=np.array([[4, 1], [2, 4]]),
                  finish_reasons=[["length", "stop"], ["stop", "length"]], logprobs=np.zeros((2, 2, 4), np.float32),
                  prefill_tokens=10)
    got = step_metrics.length_metrics(model, prompts, ro)
    # answers 4, 1, 2, 4: mean 11 / 4 = 2.75; two of four cut ("length"); prompts 4 and 6 real tokens: mean 5;
    # vision pads 2 and 4: mean 3
    assert got == {"response_length/mean": 2.75, "response_length/max": 4.0, "response_length/min": 1.0,
                   "response_length/clip_ratio": 0.5, "prompt_length/mean": 5.0, "prompt_length/max": 6.0,
                   "prompt_length/vision_mean": 3.0}
    # every answer counts its prompt: (4 + 6) x 2 answers + (4 + 1 + 2 + 4) = 20 + 11
    assert step_metrics.total_tokens(prompts, ro) == 31
    # the engine prefilled 10 tokens = each prompt once, of the 20 its 4 answers hold: half of them shared
    assert step_metrics.prefill_metrics(prompts, ro) == {"rollout/prefill_tokens": 10.0,
                                                         "rollout/prefill_shared_frac": 0.5}
    assert step_metrics.prefill_metrics(prompts, dataclasses.replace(ro, prefill_tokens=20)) == {
        "rollout/prefill_tokens": 20.0, "rollout/prefill_shared_frac": 0.0}  # every answer prefilled its own
    assert step_metrics.prefill_metrics(prompts, dataclasses.replace(ro, prefill_tokens=-1)) == {}  # not reported
    # 31 real tokens in 48 left-padded slots, 40 slots run packed: 1 - 31/40 and 1 - 31/48
    assert step_metrics.padding_metrics([31, 48, 40]) == {"perf/padding_frac": pytest.approx(9 / 40),
                                                          "perf/padding_frac_unpacked": pytest.approx(17 / 48)}
    # 62 tokens in 2 s on 4 devices: 7.75 tokens per second per device
    t = step_metrics.timing_metrics({"rollout": 1.5}, 2.0, 62, 4)
    assert t == {"time/rollout_s": 1.5, "timing_s/rollout": 1.5, "time/step_s": 2.0, "timing_s/step": 2.0,
                 "perf/time_per_step": 2.0, "perf/total_num_tokens": 62.0, "perf/throughput": 7.75}
    rm = step_metrics.reward_metrics(np.array([[1.0, 0.0], [0.5, 0.5]]), {"format": np.array([[1, 0], [1, 1]]),
                                                                          "mean": np.array([[3, 3], [3, 3]])}, 2)
    # scores 1, 0, 0.5, 0.5: mean 0.5, deviations +-0.5, 0, 0: variance 0.5 / 4 = 0.125 (population std, as
    # numpy's and verl's); the part named "mean" goes to reward/part/mean, not over reward/mean
    assert rm == {"reward/mean": 0.5, "reward/std": pytest.approx(0.125 ** 0.5), "reward/overall": 0.5,
                  "reward/failures": 2.0, "critic/score/mean": 0.5, "critic/score/max": 1.0,
                  "critic/score/min": 0.0, "reward/format": 0.75, "reward/part/mean": 3.0}
