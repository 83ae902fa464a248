"""launch.bench_rollout on a tiny setting: its JSON line, and what each way prefilled."""

import json
import os
import subprocess
import sys

from tests.paths import REPO


def test_bench_rollout_prints_both_ways_and_their_prefills(tmp_path):
    args = ["--flagfile=configs/bench_cpu.flags", f"--workdir={tmp_path}", "--rollout_repeats=1",
            "--synthetic_n=8", "--batch_prompts=2", "--group_size=4", "--synthetic_image_size=56",
            "--min_pixels=3136", "--max_pixels=3136"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.bench_rollout", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["ways"]) == {"shared", "per_answer"} and out["rows"] == 8
    assert out["ways"]["shared"]["prefill_tokens"] == out["prompt_tokens"]  # each of the 2 prompts once
    assert out["ways"]["per_answer"]["prefill_tokens"] == 4 * out["prompt_tokens"]  # once per answer
    assert out["same_answers"] is True and out["max_logprob_diff"] <= 1e-5  # fp32 noise (test_stepwise_logprobs)
    assert out["speedup"] > 0
