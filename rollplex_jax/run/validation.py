"""Validation during training, as EasyR1 runs it (``val_freq``, ``val_before_train``, ``val_generations_to_log``).

Why: a training reward says how the sampled answers of training prompts score; whether the policy
generalises is the score of one answer per held-out prompt, the same prompts each time. ``validate``
decodes one answer per validation prompt under the current params (greedy at ``--val_temperature=0``,
else sampled with one fixed seed, the same at every validation, so two validations of the same params
agree and a run is reproducible), scores them with the run's reward runner and returns:

- ``val/reward/overall`` and ``val/reward_score`` (EasyR1's name; both the mean overall score),
  ``val/reward/<part>`` (mean of each part, e.g. ``val/reward/accuracy``), ``val/accuracy`` (fraction of
  answers whose ``accuracy`` part reaches 1, or whose overall score does when the reward has no such part;
  the greedy one is ``eval/greedy_accuracy`` in run_summary.json), ``val/failures``,
  ``val/response_length/mean``, ``val/n``, and its wall time ``timing_s/validation``;
- the first ``k`` prompts' generations (prompt, response, ground truth, score and parts), which the runner
  appends to ``<workdir>/val_generations.jsonl`` and prints.

With several processes each validates its share (``multihost.share``; each answer seeded by its global
prompt index, so the split changes no answer) and scores, the first ``k`` responses are all-gathered;
every process returns the same result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import textwrap
import time
from collections.abc import Callable

import numpy as np

from rollplex_jax.data import dataset as data_lib
from rollplex_jax.parallel import multihost
from rollplex_jax.rl.rewards import RewardScores
from rollplex_jax.step import rl_step

GENERATIONS_FILE = "val_generations.jsonl"


def val_seed(run_seed: int) -> int:
    """The sampling seed of every validation of a run (far from any training step's ``seed * 1_000_003 + step``)."""
    return run_seed * 1_000_003 + 999_999


@dataclasses.dataclass(frozen=True)
class Validation:
    """One validation: where it ran, its metrics, the logged generations, and every answer's scores."""

    step: int
    temperature: float
    metrics: dict[str, float]
    generations: list[dict]
    scores: RewardScores
    responses_logged: list[str]


def val_metrics(scores: RewardScores, lengths: np.ndarray) -> dict[str, float]:
    """The ``val/*`` metrics of one answer per validation prompt (definitions in the module docstring)."""
    overall = np.asarray(scores.overall, np.float64)
    out = {"val/reward/overall": float(overall.mean()), "val/reward_score": float(overall.mean())}
    for name, values in scores.parts.items():
        if name != "overall":
            out[f"val/reward/{name}"] = float(np.mean(values))
    correct = scores.parts.get("accuracy", scores.overall)
    out.update({"val/accuracy": float(np.mean(np.asarray(correct) >= 1.0)), "val/failures": float(scores.failures),
                "val/response_length/mean": float(np.mean(lengths)), "val/n": float(len(overall))})
    return out


@dataclasses.dataclass(frozen=True)
class ValPrompts:
    """What every validation of a run shares: the held-out ``examples``, the ``reward`` runner that scores them
    (a ``RewardRunner``), the tokenizer's ``pad_id``, the sampling ``seed`` (``val_seed``) and ``scope()``, the
    context program calls run in (the runner's mesh scope)."""

    examples: data_lib.Dataset
    reward: Callable[..., RewardScores]
    pad_id: int
    seed: int
    scope: Callable[[], contextlib.AbstractContextManager]


def validate(ctx: rl_step.StepContext, params, val: ValPrompts, *, step: int, temperature: float,
             n_log: int) -> Validation:
    """One answer per prompt of ``val.examples`` under ``params`` (greedy at ``temperature`` 0, else sampled with
    ``val.seed``), scored by ``val.reward``; the first ``n_log`` generations kept. Every process must call this
    together (the scores are all-gathered).
    """
    examples, reward, pad_id, seed, scope = val.examples, val.reward, val.pad_id, val.seed, val.scope
    t0 = time.perf_counter()
    procs, bs, tp = ctx.procs, ctx.cfg.rollout.max_batch, ctx.cfg.mesh.rollout_tp
    mine = procs.decode_share(len(examples), tp)  # a TP group's ranks decode its share together
    local = examples[mine]
    scores, lengths, texts = [], [], []
    for i in range(0, len(local), bs):
        chunk = list(local[i:i + bs])
        prompts = data_lib.collate(chunk, pad_id)
        with scope():
            ro = rl_step.sample(ctx, params, prompts, rl_step.Draw(n=1, seed=seed, temperature=temperature,
                                                                   first_prompt=mine.start + i))
        responses = [row[0] for row in rl_step.response_texts(ro, ctx.decode, ctx.stop_ids)]
        n_tokens = np.asarray(ro.lengths)[:, 0]
        scores.append(reward(responses, [e.answer for e in chunk], [getattr(e, "extra", {}) for e in chunk],
                             response_lengths=n_tokens.tolist()))
        lengths.append(n_tokens)
        texts += responses
    if not procs.keeps_rollouts(tp):  # the group's first rank's rows stand for it
        scores, lengths, texts = [], [], []
    local_scores = RewardScores.concatenate(scores)
    everything = multihost.gather_scores(local_scores, procs)
    all_lengths = multihost.allgather_rows(np.concatenate([np.zeros(0, np.int64), *lengths]), procs)
    first = multihost.allgather_strings(texts[:max(0, n_log - mine.start)], procs)[:n_log]
    rows = [_generation(step, examples[j], first[j], everything, j) for j in range(len(first))]
    metrics = {**val_metrics(everything, all_lengths), "timing_s/validation": time.perf_counter() - t0}
    return Validation(step, float(temperature), metrics, rows, everything, first)


def _generation(step: int, example: data_lib.Example, response: str, scores: RewardScores, j: int) -> dict:
    return {"step": step, "prompt": example.prompt, "response": response, "ground_truth": example.answer,
            "score": float(scores.overall[j]), **{k: float(v[j]) for k, v in scores.parts.items()}}


def write_generations(workdir: str, rows: list[dict], log) -> None:
    """Appends ``rows`` to ``<workdir>/val_generations.jsonl`` and prints each, shortened, through ``log``."""
    if not rows:
        return
    with open(os.path.join(workdir, GENERATIONS_FILE), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for i, r in enumerate(rows):
        short = lambda t: textwrap.shorten(str(t), 160, placeholder=" ...")  # noqa: E731
        log(f"val step {r['step']} [{i}] prompt: {short(r['prompt'])!r} | response: {short(r['response'])!r} | "
            f"ground truth: {short(r['ground_truth'])!r} | score: {r['score']:.3f}")
