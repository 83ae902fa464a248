"""python -m launch.main end to end (a few steps): every run output of ARCHITECTURE.md exists and is sane."""

import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

SMALL = ["--flagfile=configs/tiny_cpu.flags", "--steps=3", "--batch_prompts=4", "--group_size=4",
         "--synthetic_n=16", "--eval_n=8", "--checkpoint_every=2", "--noprogress"]


def _main(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_main_writes_the_run_outputs(tmp_path):
    wd = tmp_path / "run"
    r = _main(*SMALL, f"--workdir={wd}", "--log_kl")  # kl_coef 0: the reference runs only for the metric
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["steps_done"] == 3
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for key in ("reward/mean", "time/step_s", "time/rollout_s", "time/reward_s", "kl", "time/reference_s"):
        assert all(key in row for row in rows), key
    summary = json.loads((wd / "run_summary.json").read_text())
    for key in ("config", "versions", "device_kind", "steps_done", "reward/mean", "eval/greedy_accuracy",
                "params_sha256", "weight_sharing"):
        assert key in summary, key
    assert summary["weight_sharing"]["counts"]["rebuilt"] == 0
    assert summary["params_sha256"] == last["params_sha256"]
    assert summary["reward/mean"] == rows[-1]["reward/mean"]  # the final step's (last20_mean is the mean of 20)
    assert summary["reward/last20_mean"] == pytest.approx(sum(row["reward/mean"] for row in rows) / 3, rel=1e-12)
    assert (wd / "plots" / "reward.png").stat().st_size > 1000
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(wd / "tensorboard"))
    assert sorted(os.listdir(wd / "checkpoints")) == ["2", "3"]
    assert (wd / "data" / "data.jsonl").exists()  # the synthetic task, in the user-facing format


def test_bad_flag_fails_at_start_naming_it(tmp_path):
    r = _main("--flagfile=configs/tiny_cpu.flags", f"--workdir={tmp_path}", "--group_size=1")
    assert r.returncode != 0
    assert "--group_size=1" in r.stderr and "must be >= 2" in r.stderr


def test_no_flags_runs_the_tiny_demo_task(tmp_path):
    """No flagfile: the defaults (demo model, tiny tokenizer, synthetic colour task, one step) run to the end.
    Their KL coefficient is 0, so no reference pass runs and no reference weights are held."""
    wd = tmp_path / "bare"
    r = _main(f"--workdir={wd}")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((wd / "run_summary.json").read_text())
    # One step cannot show learning (tests/test_notebook.py checks that after 200): the greedy evaluation is the
    # final greedy validation, a count of right answers over the defaults' 256 held-out images.
    n = summary["eval/n"]
    assert summary["steps_done"] == 1 and n == 256 and summary["eval/greedy_accuracy"] == summary["val/accuracy"]
    assert summary["eval/greedy_accuracy"] * n == round(summary["eval/greedy_accuracy"] * n)
    row = json.loads((wd / "metrics.jsonl").read_text().splitlines()[0])
    assert "kl" not in row and "time/reference_s" not in row
    assert not any(k.endswith("/ref_weights_bytes") and v for k, v in row.items())


@pytest.mark.parametrize("schedule", ["rollplex", "serial"])
def test_video_flagfile_trains_on_mp4_clips(tmp_path, schedule):
    """configs/video_cpu.flags end to end for a few steps, both schedules: the synthetic mp4 clips are written,
    loaded by Qwen's video rules (16 video tokens per prompt), decoded per batch and trained on."""
    wd = tmp_path / schedule
    r = _main("--flagfile=configs/video_cpu.flags", "--steps=2", "--batch_prompts=4", "--group_size=4",
              "--synthetic_n=8", "--eval_n=4", "--checkpoint_every=0", "--noprogress", f"--schedule={schedule}",
              f"--workdir={wd}", "--log_kl")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(os.listdir(wd / "data" / "videos")) == 8
    rows = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2] and all(row["kl"] >= -1e-6 for row in rows)
    assert "kept 8 of 8 rows" in r.stdout + r.stderr


def test_a_verl_parquet_trains_with_a_verl_reward_function(tmp_path):
    """A verl-layout parquet (chat-message prompts with <image>, image bytes, reward_model.ground_truth,
    data_source, extra_info) trains and validates as it is on disk; the row's data_source and extra_info reach
    verl's compute_score signature (tests/reward_fns.verl_score: +extra_info.bonus, part from_source)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rgb = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (235, 215, 40)}
    rows = []
    for i in range(8):
        colour = list(rgb)[i % 4]
        buf = io.BytesIO()
        Image.new("RGB", (56, 56), rgb[colour]).save(buf, format="PNG")
        rows.append({"data_source": "geo3k", "prompt": [{"role": "user", "content": "<image>what colour?"}],
                     "images": [{"bytes": buf.getvalue(), "path": None}], "ability": "vision",
                     "reward_model": {"style": "rule", "ground_truth": colour}, "extra_info": {"bonus": 0.5}})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    wd = tmp_path / "run"
    r = _main(*SMALL, f"--dataset={tmp_path / 'train.parquet'}", f"--val_dataset={tmp_path / 'train.parquet'}",
              "--answer_key=reward_model.ground_truth", "--reward=tests.reward_fns:verl_score", "--steps=2",
              "--val_before_train", "--val_every=1", f"--workdir={wd}")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in lines if "reward/mean" in row]
    assert len(train) == 2 and all(row["reward/from_source"] == 1.0 for row in train)
    assert all(row["reward/overall"] >= 0.5 for row in train)  # extra_info's bonus reached the function
    assert [row["step"] for row in lines if "val/reward/overall" in row] == [0, 1, 2]
