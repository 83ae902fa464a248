"""Built-in rewards, reward-spec resolution and RewardRunner (failures, timeouts, order)."""

import math
import pathlib
import time

import numpy as np
import pytest

from rollplex_jax.rl.rewards import (
    RewardError,
    RewardRunner,
    exact_match,
    format_reward,
    numeric,
    resolve_reward_fn,
)


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))


@pytest.mark.parametrize("response, answer, want", [
    ("42", "42", 1.0),
    (" 42\n", "42 ", 1.0),
    ("<think>six times seven</think><answer> 42 </answer>", "42", 1.0),
    ("<answer>1</answer> no, <answer>42</answer>", "42", 1.0),  # the last tag counts
    ("the answer is 42", "42", 0.0),
    ("<answer>41</answer>", "42", 0.0),
    ("42.0", "42", 0.0),
    ("red", "Red", 0.0),
])
def test_exact_match(response, answer, want):
    assert exact_match(response, answer) == want


@pytest.mark.parametrize("response, answer, want", [
    ("The answer is 3.5", "3.5", 1.0),
    ("x = 1,234", "1234", 1.0),
    ("1234", "1,234", 1.0),
    ("<answer>-2</answer> since 5 > 3", "-2", 1.0),
    ("42.0", "42", 1.0),
    ("3.0000001", "3", 1.0),  # relative error 3e-8 < 1e-6
    ("3.001", "3", 0.0),
    ("5, no wait, 7", "5", 0.0),  # the last number counts
    (".5", "0.5", 1.0),
    ("2e-3", "0.002", 1.0),
    ("no number here", "1", 0.0),
    ("<answer>seven</answer> 7", "7", 0.0),  # inside the tag there is no number
])
def test_numeric(response, answer, want):
    assert numeric(response, answer) == want


def test_numeric_bad_reference_raises():
    with pytest.raises(ValueError):
        numeric("3", "three")


@pytest.mark.parametrize("response, want", [
    ("<answer>x</answer>", 1.0),
    ("<think>a\nb</think>\n<answer>x</answer>", 1.0),
    ("  <answer>x</answer>\n", 1.0),
    ("<answer></answer>", 1.0),
    ("hi <answer>x</answer>", 0.0),
    ("<answer>x</answer> bye", 0.0),
    ("<think>a</think>", 0.0),
    ("<answer>x</answer><think>a</think>", 0.0),
    ("<answer>a</answer><answer>b</answer>", 0.0),
    ("<think>a</think><think>b</think><answer>x</answer>", 0.0),
    ("<answer>x", 0.0),
    ("", 0.0),
])
def test_format_reward(response, want):
    assert format_reward(response, "unused") == want


def test_resolve_builtins_and_module_function():
    assert resolve_reward_fn("exact_match") is exact_match
    assert resolve_reward_fn("numeric") is numeric
    assert resolve_reward_fn("format") is format_reward
    fn = resolve_reward_fn("reward_fixtures:normal")
    assert fn("a", "a") == 1.0 and fn("a", "b") == 0.0


@pytest.mark.parametrize("spec, match", [
    ("nope", "not a built-in reward nor 'module:function'"),
    ("reward_fixtures:", "not a built-in"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'.*PYTHONPATH"),
    ("reward_fixtures:missing", "has no attribute 'missing'"),
    ("reward_fixtures:NOT_CALLABLE", "is a int, not callable"),
])
def test_resolve_errors_name_spec_and_fix(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        resolve_reward_fn(spec)
    assert repr(spec) in str(info.value)


def test_runner_keeps_input_order():
    fn = resolve_reward_fn("reward_fixtures:staggered")  # later samples finish first
    with RewardRunner(fn, timeout_s=5.0, max_workers=4) as runner:
        scores = runner([str(i) for i in range(10)], [""] * 10)
    assert scores.overall.dtype == np.float32 and scores.failures == 0 and scores.parts == {}
    np.testing.assert_array_equal(scores.overall, np.arange(10, dtype=np.float32))


def test_runner_raising_fn_counts_failure():
    fn = resolve_reward_fn("reward_fixtures:raising")
    with RewardRunner(fn, timeout_s=5.0, max_workers=2) as runner:
        s = runner(["ok", "bad", "ok"], ["", "", ""])
    np.testing.assert_array_equal(s.overall, [1.0, 0.0, 1.0])
    assert s.failures == 1


def test_runner_raise_mode_names_sample_and_cause():
    fn = resolve_reward_fn("reward_fixtures:raising")
    with RewardRunner(fn, timeout_s=5.0, max_workers=2, on_failure="raise") as runner:
        with pytest.raises(RewardError, match=r"sample 1 \(response 'bad'\): ValueError: boom") as info:
            runner(["ok", "bad", "bad"], ["", "", ""])
    assert info.value.index == 1 and isinstance(info.value.__cause__, ValueError)


def test_runner_bad_return_values():
    fn = resolve_reward_fn("reward_fixtures:returns")
    responses = ["nan", "np", "inf", "str", "bool", "none", "np0d", "int"]
    with RewardRunner(fn, timeout_s=5.0, max_workers=3) as runner:
        s = runner(responses, [""] * len(responses))
    np.testing.assert_array_equal(s.overall, [0.0, 0.5, 0.0, 0.0, 1.0, 0.0, 0.25, 2.0])
    assert s.failures == 4


@pytest.mark.timing  # a wall-time bound (< 1 s beside a 1.5 s hung call): run alone (make test)
def test_runner_timeout_does_not_block():
    fn = resolve_reward_fn("reward_fixtures:sleep_if_hang")  # "hang" sleeps 1.5 s
    runner = RewardRunner(fn, timeout_s=0.2, max_workers=2)
    start = time.monotonic()
    s = runner(["ok", "hang", "ok", "ok", "ok"], [""] * 5)
    assert time.monotonic() - start < 1.0
    np.testing.assert_array_equal(s.overall, [1.0, 0.0, 1.0, 1.0, 1.0])
    assert s.failures == 1
    # The hung thread still runs; the runner goes on with a fresh pool.
    s = runner(["ok", "ok", "ok"], [""] * 3)
    np.testing.assert_array_equal(s.overall, [1.0, 1.0, 1.0])
    assert s.failures == 0
    runner.close()
    with pytest.raises(RuntimeError, match="closed"):
        runner(["ok"], [""])


@pytest.mark.timing  # a wall-time bound (< 1 s beside a 1.5 s hung call): run alone (make test)
def test_runner_timeout_raise_mode():
    fn = resolve_reward_fn("reward_fixtures:sleep_if_hang")
    with RewardRunner(fn, timeout_s=0.2, max_workers=4, on_failure="raise") as runner:
        start = time.monotonic()
        with pytest.raises(RewardError, match="sample 2 .*TimeoutError") as info:
            runner(["ok", "ok", "hang"], ["", "", ""])
        assert time.monotonic() - start < 1.0
        assert isinstance(info.value.__cause__, TimeoutError)


def test_runner_with_builtin_and_edge_cases():
    with RewardRunner(numeric, timeout_s=1.0, max_workers=8) as runner:
        s = runner(["<answer>4</answer>", "5", "x"], ["4", "4", "4"])
        np.testing.assert_array_equal(s.overall, [1.0, 0.0, 0.0])
        assert s.failures == 0
        s = runner([], [])
        assert s.overall.shape == (0,) and s.failures == 0
        with pytest.raises(ValueError, match="2 responses but 1 answers"):
            runner(["a", "b"], ["a"])


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout_s": 0.0, "max_workers": 1}, "timeout_s"),
    ({"timeout_s": math.nan, "max_workers": 1}, "timeout_s"),
    ({"timeout_s": 1.0, "max_workers": 0}, "max_workers"),
    ({"timeout_s": 1.0, "max_workers": 1, "on_failure": "skip"}, "zero, raise"),
])
def test_runner_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardRunner(exact_match, **kwargs)
