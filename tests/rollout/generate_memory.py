"""Host memory of one HFEngine generate call, the step-by-step log-probs vs the old output_logits path.

Not a test (a measurement for issue 17): run each path in its own process, so that each peak is its own::

    .venv/bin/python -m tests.rollout.generate_memory --path=new
    .venv/bin/python -m tests.rollout.generate_memory --path=old

Tiny Qwen2.5-VL (tiny_model_config) with a 32,000-token vocabulary, 2 image prompts x 8 answers = 16 rows,
256 new tokens (no stop token, so every row runs every step), sampling at temperature 1. Prints one JSON
line: RSS before the call, the call's peak RSS (VmHWM, reset just before via /proc/self/clear_refs) and the
difference; ``rows x steps x V x 4`` is one copy of all the steps' fp32 logits.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from rollout_torch.hf_engine import HFEngine
from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.weights.sharing import WeightPublisher
from tests.hf_reference import mm_inputs
from tests.rollout.test_hf_engine import ROWS
from tests.rollout.test_stepwise_logprobs import old_generate


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=("new", "old"), required=True)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--answers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=256)
    a = ap.parse_args()
    cfg = tiny_model_config(text={"vocab_size": a.vocab})
    params = init_params(cfg, jax.random.key(0), std=0.1)
    prompts = Prompts(**mm_inputs(cfg, ROWS[:2], np.random.default_rng(0)))
    rows = prompts.batch_size * a.answers
    eng = HFEngine(cfg.to_hf_dict(), max_batch=rows)
    WeightPublisher(eng, cfg).publish(params, version=0)
    sp = SamplingParams(max_new_tokens=a.steps, seed=0)
    warm = SamplingParams(max_new_tokens=2, seed=0)  # first-call allocations (threads, kernels) out of the figure
    (old_generate(eng, prompts, a.answers, warm) if a.path == "old" else eng.generate(prompts, a.answers, warm))
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    t0 = time.perf_counter()
    ro = old_generate(eng, prompts, a.answers, sp) if a.path == "old" else eng.generate(prompts, a.answers, sp)
    wall = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    assert ro.response_ids.shape == (prompts.batch_size, a.answers, a.steps)
    print(json.dumps({"path": a.path, "rows": rows, "steps": a.steps, "vocab": a.vocab,
                      "rss_before_mib": round(before / 1024, 1), "peak_rss_mib": round(peak / 1024, 1),
                      "call_peak_over_before_mib": round((peak - before) / 1024, 1),
                      "rows_x_steps_x_vocab_fp32_mib": round(rows * a.steps * a.vocab * 4 / 2**20, 1),
                      "wall_s": round(wall, 2)}))
    eng.release()


if __name__ == "__main__":
    main()
