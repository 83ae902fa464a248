"""Validation during training (validation.py, Runner.validate): when it runs, what it writes, reproducibility."""

import json

import numpy as np
import pytest

from launch.api import config_from_flagfile, runner_from_flagfile
from rollplex_jax.config import ConfigError
from rollplex_jax.run.outputs import read_metrics
from tests.test_runner_api import TINY

VAL = dict(TINY, eval_n=6, reward="tests.reward_fns:easyr1_batch", max_batch=4)  # 6 prompts: 2 chunks of 4 + 2


def _quiet(msg):
    pass


def test_val_every_and_before_train_write_val_metrics_at_their_steps(tmp_path):
    logged = []
    r = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path, schedule="serial", log=logged.append,
                             **{**VAL, "steps": 5, "val_every": 2, "val_before_train": True,
                                "val_generations_to_log": 2})
    yielded = list(r.run())
    summary = r.finish()
    rows = read_metrics(str(tmp_path))
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5]  # one row per step; step 0: validation only
    val_steps = [row["step"] for row in rows if "val/reward_score" in row]
    assert val_steps == [0, 2, 4, 5]  # before training, every 2 steps, and at the end (finish)
    assert set(rows[0]) == {"step"} | {k for k in rows[2] if k.startswith("val/")} | {"timing_s/validation"}
    assert "val/reward_score" in yielded[1] and "val/reward_score" not in yielded[0]  # run() yields them too
    for row in (rows[i] for i in (0, 2, 4, 5)):
        assert row["val/reward_score"] == row["val/reward/overall"]
        assert {"val/reward/format", "val/reward/accuracy", "val/reward/tokens", "val/accuracy"} <= set(row)
        assert row["val/n"] == 6 and 0.0 <= row["val/accuracy"] <= 1.0
    gens = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in gens] == [0, 0, 2, 2, 4, 4, 5, 5]  # the first 2 prompts, each validation
    assert {"prompt", "response", "ground_truth", "score", "format", "accuracy"} <= set(gens[0])
    assert gens[0]["prompt"] == r.eval_set[0].prompt and gens[1]["ground_truth"] == r.eval_set[1].answer
    assert sum(line.startswith("val step 2 [") for line in logged) == 2
    # greedy validation at the last step is the final evaluation: no second pass, the same accuracy
    assert summary["eval/greedy_accuracy"] == rows[-1]["val/accuracy"] and summary["eval/n"] == 6
    assert summary["val/reward_score"] == rows[-1]["val/reward_score"]
    assert summary["reward/mean"] == rows[-1]["reward/mean"]  # the step-0 row does not count as a step
    assert (tmp_path / "plots" / "reward.png").is_file()


def test_greedy_validation_is_deterministic_and_sampled_reproducible(tmp_path):
    r = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path, schedule="serial", log=_quiet,
                             **{**VAL, "steps": 1, "val_generations_to_log": 6})
    list(r.run())

    def once(**kw):
        m = r.validate(**kw)
        v = r.last_validation
        m.pop("timing_s/validation")
        return m, v.responses_logged, v.scores.overall.tolist(), {k: p.tolist() for k, p in v.scores.parts.items()}

    greedy = once()
    assert once() == greedy and len(greedy[1]) == 6
    sampled = once(temperature=1.0)
    assert once(temperature=1.0) == sampled
    # the same validation from another runner at the same params (fork: same state, fresh engine and pool)
    other = r.fork(tmp_path / "fork")
    other.validate(temperature=1.0)
    assert other.last_validation.responses_logged == sampled[1]
    assert r.last_validation.temperature == 1.0 and greedy[1] != sampled[1]  # sampling did sample
    other.close()
    r.close()


def test_validation_config_errors_and_alias(tmp_path):
    with pytest.raises(ConfigError, match="val_every=2.*needs validation prompts.*--val_dataset"):
        config_from_flagfile("configs/tiny_cpu.flags", val_every=2, eval_n=0)
    with pytest.raises(ConfigError, match="--val_dataset.*differs from its alias --eval_dataset"):
        config_from_flagfile("configs/tiny_cpu.flags", val_dataset="a.jsonl", eval_dataset="b.jsonl")
    with pytest.raises(ConfigError, match="--val_temperature"):
        config_from_flagfile("configs/tiny_cpu.flags", val_temperature=-1.0)
    old = config_from_flagfile("configs/tiny_cpu.flags", eval_dataset="held_out.jsonl")
    new = config_from_flagfile("configs/tiny_cpu.flags", val_dataset="held_out.jsonl")
    assert old.data.validation_dataset == new.data.validation_dataset == "held_out.jsonl"
    with pytest.raises(ConfigError, match="reward_kwargs.*not JSON"):
        config_from_flagfile("configs/tiny_cpu.flags", reward_kwargs="{format_weight: 1}")


def test_reward_kwargs_reach_the_reward(tmp_path):
    r = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path, log=_quiet,
                             **{**VAL, "steps": 0, "reward_kwargs": '{"format_weight": 0.0}'})
    s = r.reward(["<a>", "<b>"], ["<a>", "x"], response_lengths=[1, 1])
    np.testing.assert_array_equal(s.overall, [1.0, 0.0])  # format weight 0: accuracy only
    r.close()
    with pytest.raises(ConfigError, match="does not take the keyword arguments.*--reward_kwargs"):
        runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path / "b", log=_quiet,
                             **{**VAL, "steps": 0, "reward": "math", "reward_kwargs": '{"weight": 0.0}'})


def test_reward_plot_draws_the_validation_curve():
    from matplotlib.figure import Figure

    from rollplex_jax.run import outputs

    rows = [{"step": 0, "val/reward_score": 0.1}, {"step": 1, "reward/mean": 0.2},
            {"step": 2, "reward/mean": 0.4, "val/reward_score": 0.5}]
    ax = Figure().subplots()
    outputs.draw_reward(ax, rows)
    lines = {line.get_label(): line for line in ax.get_lines()}
    val = lines["validation reward (one answer per held-out prompt)"]
    assert val.get_xdata().tolist() == [0, 2] and val.get_ydata().tolist() == [0.1, 0.5]
    assert lines["mean reward of the step's answers"].get_xdata().tolist() == [1, 2]  # no step-0 training point
