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
    # 2 prompts of 17 real tokens each (a 56 x 56 image: 4 merged image pads, + 13 of the chat template and the
    # question), 4 answers each: shared prefills each prompt once (34 tokens), per_answer once per answer
    # (4 x 34 = 136): 3/4 of the answers' prompt tokens are shared
    shared, per_answer = (out["ways"][w]["prefill_tokens"] for w in ("shared", "per_answer"))
    assert (out["prompt_tokens"], shared, per_answer) == (34, 34, 136) and 1 - shared / per_answer == 0.75
    # sampling is per answer: the same tokens either way; log-probs within fp32 noise (test_stepwise_logprobs)
    assert out["same_answers"] is True and out["max_logprob_diff"] <= 1e-5
    # the speed itself is a measurement (not asserted); the reported ratio is the one of the reported minima
    assert out["speedup"] == out["ways"]["per_answer"]["min_s"] / out["ways"]["shared"]["min_s"]
