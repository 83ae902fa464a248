"""python -m launch.main end to end (a few steps): every run output of ARCHITECTURE.md exists and is sane."""

import json
import os
import subprocess
import sys

from tests.paths import REPO

SMALL = ["--flagfile=configs/tiny_cpu.flags", "--steps=3", "--batch_prompts=4", "--group_size=4",
         "--synthetic_n=16", "--eval_n=8", "--checkpoint_every=2", "--noprogress"]


def _main(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_main_writes_the_run_outputs(tmp_path):
    wd = tmp_path / "run"
    r = _main(*SMALL, f"--workdir={wd}")
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["steps_done"] == 3
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in ("reward/mean", "time/step_s", "time/rollout_s", "time/reward_s", "kl"):
        assert all(key in row for row in rows), key
    summary = json.loads((wd / "run_summary.json").read_text())
    for key in ("config", "versions", "device_kind", "steps_done", "reward/mean", "eval/greedy_accuracy",
                "params_sha256", "weight_sharing"):
        assert key in summary, key
    assert summary["weight_sharing"]["counts"]["rebuilt"] == 0
    assert summary["params_sha256"] == last["params_sha256"]
    assert (wd / "plots" / "reward.png").stat().st_size > 1000
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(wd / "tensorboard"))
    assert sorted(os.listdir(wd / "checkpoints")) == ["2", "3"]
    assert (wd / "data" / "data.jsonl").exists()  # the synthetic task, in the user-facing format


def test_bad_flag_fails_at_start_naming_it(tmp_path):
    r = _main("--flagfile=configs/tiny_cpu.flags", f"--workdir={tmp_path}", "--group_size=1")
    assert r.returncode != 0
    assert "--group_size=1" in r.stderr and "must be >= 2" in r.stderr
