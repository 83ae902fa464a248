"""The per-step metrics a verl / EasyR1 user looks for, as pure functions of a step's batch (host numpy).

Why a module: the names are a contract with users' dashboards (EasyR1 ``verl/trainer/metrics.py``, verl
``metric_utils.py``), so their definitions live in one readable place, beside the rollplex names they
duplicate (``reward/mean`` = ``reward/overall``; ``time/<phase>_s`` = ``timing_s/<phase>``):

- rewards: ``reward/overall`` (mean overall score), ``reward/<part>`` (mean of each part the reward function
  returned, e.g. ``reward/format``, ``reward/accuracy``), ``critic/score/{mean,max,min}`` (the overall scores,
  before any KL penalty), ``reward/mean``, ``reward/std``, ``reward/failures``;
- lengths: ``response_length/{mean,max,min}`` (answer tokens, the stop token included),
  ``response_length/clip_ratio`` (fraction of answers cut at ``max_new_tokens``: finish reason "length"),
  ``prompt_length/{mean,max}`` (real prompt tokens, from the attention mask; image/video pads included),
  ``prompt_length/vision_mean`` (image + video pad tokens per prompt);
- time: ``timing_s/<phase>``, ``timing_s/step``, ``perf/time_per_step`` (s), ``perf/total_num_tokens`` (real
  prompt + answer tokens of every answer: a prompt counts once per answer, as verl counts a sequence),
  ``perf/throughput`` (those tokens per second per training device: divided by the training mesh's fsdp x tp,
  which spans every process's devices as the gathered batch does; devices the run does not train on, e.g. the
  4 fake CPU devices of the test environment under a 1-device run, do not count); added by the runner
  (``run/compiles.py``): ``perf/compiles`` (XLA compilations during the step), ``timing_s/compile`` (their
  seconds, summed over threads), ``perf/compile_cache_hits`` (programs loaded from the persistent cache instead);
- the rollout's numerics: ``rollout/logprob_abs_diff_{mean,max}`` (as verl's ``training/rollout_probs_diff_*``):
  |engine log-prob - trainer log-prob under theta_k| over the answer tokens, both of ``softmax(logits / T)``
  (``programs.actor.Spec``): float noise when the engine and the trainer agree on the policy (fp32 demo model:
  ~1e-6), larger under bf16, a wrong temperature or top-k/top-p truncation (the vLLM engine's log-probs are of
  the truncated distribution: ``rollout_torch/vllm_engine.py``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from rollplex_contract.batch import Prompts, Rollouts
from rollplex_jax.config import ModelConfig
from rollplex_jax.programs.actor import mismatch_sums

_REWARD_NAMES = ("mean", "std", "failures", "overall")


def reward_metrics(overall: np.ndarray, parts: dict[str, np.ndarray], failures: int) -> dict[str, float]:
    """``reward/*`` and ``critic/score/*`` of a step's overall scores and parts (any shape, one per answer).

    A part whose name is one of rollplex's own (``mean``, ``std``, ``failures``, ``overall``) is logged as
    ``reward/part/<name>``, so it cannot overwrite them.
    """
    r = np.asarray(overall, np.float64)
    out = {"reward/mean": float(r.mean()), "reward/std": float(r.std()), "reward/overall": float(r.mean()),
           "reward/failures": float(failures), "critic/score/mean": float(r.mean()),
           "critic/score/max": float(r.max()), "critic/score/min": float(r.min())}
    for name, values in parts.items():
        key = f"reward/part/{name}" if name in _REWARD_NAMES else f"reward/{name}"
        out[key] = float(np.mean(values))
    return out


def prompt_tokens(prompts: Prompts) -> np.ndarray:
    """Real tokens of each prompt [B] (attention mask)."""
    return np.asarray(prompts.attention_mask).sum(axis=1).astype(np.int64)


def length_metrics(model: ModelConfig, prompts: Prompts, rollouts: Rollouts) -> dict[str, float]:
    """``response_length/*`` and ``prompt_length/*`` of a step's B prompts and B x G answers."""
    lengths = np.asarray(rollouts.lengths, np.float64)
    reasons = [r for row in rollouts.finish_reasons for r in row]
    mask = np.asarray(prompts.attention_mask) > 0
    ids = np.asarray(prompts.input_ids)
    vision = ((ids == model.image_token_id) | (ids == model.video_token_id)) & mask
    plen = prompt_tokens(prompts).astype(np.float64)
    return {"response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
            "response_length/min": float(lengths.min()),
            "response_length/clip_ratio": float(np.mean([r == "length" for r in reasons])),
            "prompt_length/mean": float(plen.mean()), "prompt_length/max": float(plen.max()),
            "prompt_length/vision_mean": float(vision.sum(axis=1).mean())}


def prefill_metrics(prompts: Prompts, rollouts: Rollouts) -> dict[str, float]:
    """``rollout/prefill_tokens`` (prompt tokens the engine ran its model over) and ``rollout/prefill_shared_frac``
    (the share of the B x G answers' prompt tokens it did not have to prefill: (G - 1) / G when each prompt is
    prefilled once for its G answers, 0 when every answer prefills its own); nothing when the engine does not say."""
    if rollouts.prefill_tokens < 0:
        return {}
    per_answer = float(prompt_tokens(prompts).sum() * rollouts.lengths.shape[1])
    return {"rollout/prefill_tokens": float(rollouts.prefill_tokens),
            "rollout/prefill_shared_frac": 1.0 - rollouts.prefill_tokens / max(per_answer, 1.0)}


def padding_metrics(slots) -> dict[str, float]:
    """``perf/padding_frac``: the share of the token slots the scoring / training decoder ran over that were
    padding (packed rows with ``--packing``); ``perf/padding_frac_unpacked``: the same share in left-padded rows.
    ``slots``: [real tokens, left-padded slots, slots run] (``Ops.slots``)."""
    real, padded, run = (float(x) for x in slots)
    return {"perf/padding_frac": 1.0 - real / max(run, 1.0),
            "perf/padding_frac_unpacked": 1.0 - real / max(padded, 1.0)}


def total_tokens(prompts: Prompts, rollouts: Rollouts) -> int:
    """Real prompt + answer tokens over every answer: sum_b G * prompt_b + sum_{b, g} answer_{b, g}."""
    g = rollouts.lengths.shape[1]
    return int(prompt_tokens(prompts).sum() * g + np.asarray(rollouts.lengths, np.int64).sum())


def logprob_mismatch(engine, trainer, mask) -> dict[str, float]:
    """``rollout/logprob_abs_diff_{mean,max}`` of the engine's and the trainer's log-probs [B*G, Tr] over the answer
    tokens (``mask`` > 0)."""
    # On the device (the gradient programs' own sums), not np.asarray: with one process per device the trainer's
    # rows span processes (not addressable here); the sums are replicated scalars every process can read.
    sums = mismatch_sums(jnp.asarray(trainer, jnp.float32), jnp.asarray(engine, jnp.float32), jnp.asarray(mask) > 0)
    return mismatch_metrics(*(float(sums[k]) for k in ("logprob_abs_diff_sum", "logprob_abs_diff_max",
                                                         "logprob_tokens")))


def mismatch_metrics(total: float | None, largest: float | None, tokens: float | None) -> dict[str, float]:
    """The mismatch metrics from its sums over the answer tokens (``programs.actor.mismatch_sums``); nothing when
    they were not measured (``tokens`` None)."""
    if tokens is None:
        return {}
    return {"rollout/logprob_abs_diff_mean": total / max(tokens, 1.0), "rollout/logprob_abs_diff_max": largest}


def timing_metrics(phase_s: dict[str, float], step_s: float, tokens: int, devices: int) -> dict[str, float]:
    """``time/<phase>_s`` and ``timing_s/<phase>`` (the same seconds), the step's time, ``perf/*`` (``devices``: the
    run's training devices, ``MeshConfig.train_devices``)."""
    out: dict[str, float] = {}
    for name, secs in phase_s.items():
        out[f"time/{name}_s"] = secs
        out[f"timing_s/{name}"] = secs
    out.update({"time/step_s": step_s, "timing_s/step": step_s, "perf/time_per_step": step_s,
                "perf/total_num_tokens": float(tokens), "perf/throughput": tokens / max(step_s, 1e-12) / devices})
    return out
