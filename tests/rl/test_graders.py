"""The math / r1v / choice rewards (hand-computed cases, DATA.md's EasyR1 and verl examples), the user-function
forms (rollplex, verl, EasyR1, EasyR1 batch) and score dicts, and graders running inside RewardRunner's pool."""

import functools
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from rollplex_jax.rl import graders, reward_calls
from rollplex_jax.rl.rewards import RewardError, RewardRunner, resolve_reward_fn
from tests import reward_fns
from tests.paths import REPO

W = 0.1  # the math reward's default format weight (EasyR1 math.py, verl geo3k)


# --- math ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    (r"so \boxed{3}.", "3"),
    (r"\boxed{\sqrt{x^{2}}}", r"\sqrt{x^{2}}"),  # nested braces
    (r"\boxed{\frac{1}{2}} then \boxed{4}", "4"),  # the last one wins
    (r"\boxed {5}", "5"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # LaTeX's literal braces do not count
    (r"\boxed{\boxed{3}}", r"\boxed{3}"),  # a box inside a box belongs to it
    (r"\boxed{2} and \boxed{3", "2"),  # an unclosed last box leaves the previous complete one
    ("no box here: 3", None),
    (r"\boxed{}", ""),
])
def test_extract_boxed_content(text, want):
    assert graders.extract_boxed_content(text) == want


@pytest.mark.parametrize("response, truth, fmt, acc", [
    (r"<think>2 + 1 = 3</think> The answer is \boxed{3}", "3", 1.0, 1.0),  # DATA.md / EasyR1 math.py
    (r"<think>half</think> \boxed{\frac{1}{2}}", "0.5", 1.0, 1.0),  # equal as numbers, not as strings
    (r"<think>x</think> \boxed{0.5}", r"\frac{1}{2}", 1.0, 1.0),
    (r"<think>x</think> \boxed{\sqrt{x^{2}}}", "|x|", 1.0, 1.0),  # nested braces, symbolic equality
    (r"<think>x</think> \boxed{3} no wait \boxed{4}", "3", 1.0, 0.0),  # the LAST box is the answer
    (r"<think>x</think> \boxed{2} no wait \boxed{3}", "3", 1.0, 1.0),
    (r"<think>x</think> the answer is 3", "3", 0.0, 0.0),  # no box: accuracy 0, and not the format
    (r"\boxed{3}", "3", 0.0, 1.0),  # no <think>: format 0, overall 0.9
    (r"< think >x< /think > \boxed{3}", "3", 1.0, 1.0),  # EasyR1 removes spaces around < > /
    (r"<think>x</think> \boxed{x = 3}", "3", 1.0, 1.0),
    (r"<think>x</think> \boxed{7}", "3", 1.0, 0.0),
    (r"<think>x</think> \boxed{3.14}", "3.14159", 1.0, 0.0),  # math is exact; r1v rounds
    (r"<think>x</think> \boxed{}", "3", 1.0, 0.0),
])
def test_math_reward(response, truth, fmt, acc):
    got = graders.math_reward(response, truth)
    assert got == pytest.approx({"overall": (1 - W) * acc + W * fmt, "format": fmt, "accuracy": acc})


def test_math_reward_format_weight_and_overall_values():
    assert graders.math_reward(r"\boxed{3}", "3")["overall"] == pytest.approx(0.9)
    assert graders.math_reward(r"<think>x</think>\boxed{4}", "3")["overall"] == pytest.approx(0.1)
    assert graders.math_reward(r"\boxed{3}", "3", format_weight=0.3)["overall"] == pytest.approx(0.7)
    assert graders.math_reward(r"<think>a</think>\boxed{3}", r"The solution ... \boxed{3}.")["accuracy"] == 1.0
    with pytest.raises(ValueError, match="format_weight=1.5 must be in"):
        graders.math_reward("x", "3", format_weight=1.5)


# --- r1v -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("response, truth, fmt, acc", [
    ("<think>x</think><answer>b</answer>", "<answer>B</answer>", 1.0, 1.0),  # Video-R1 solution, letter case
    ("<think>x</think>\n<answer>(B)</answer>", "B", 1.0, 1.0),
    ("<think>x</think> <answer>B.</answer>", "(b)", 1.0, 1.0),
    ("<think>x</think><answer>B. a red cube</answer>", "B", 1.0, 1.0),
    ("<think>x</think><answer>C</answer>", "B", 1.0, 0.0),
    ("<think>x</think><answer>3.14159</answer>", "3.14", 1.0, 1.0),  # equal after rounding to 2 places
    ("<think>x</think><answer>3.149</answer>", "3.14", 1.0, 0.0),  # 3.15 != 3.14
    ("<think>x</think><answer>1,000</answer>", "1000", 1.0, 1.0),
    ("<think>x</think><answer>seven</answer>", "7", 1.0, 0.0),
    ("<think>x</think><answer> a red cube </answer>", "<answer>a red cube</answer>", 1.0, 1.0),
    ("<think>x</think><answer>A red cube</answer>", "a red cube", 1.0, 0.0),  # free text: exact
    ("<answer>B</answer>", "B", 0.0, 1.0),  # no think: format 0
    ("<think>x</think><answer>B</answer> trailing", "B", 0.0, 1.0),  # fullmatch
    ("B", "B", 0.0, 1.0),  # no tags: the whole response is the answer
])
def test_r1v_reward(response, truth, fmt, acc):
    got = graders.r1v_reward(response, truth)
    assert got == pytest.approx({"overall": 0.5 * acc + 0.5 * fmt, "format": fmt, "accuracy": acc})
    assert graders.r1v_reward(response, truth, format_weight=0.2)["overall"] == pytest.approx(0.8 * acc + 0.2 * fmt)


# --- choice ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("response, truth, acc", [
    ("<answer>b</answer>", "B", 1.0),
    ("<think>A or B? I say B</think><answer>(B)</answer>", "b", 1.0),
    (r"The answer is \boxed{C}", "C", 1.0),
    ("I think the answer is D.", "D", 1.0),  # the last standalone capital
    ("Between A and C, C", "(C)", 1.0),
    ("Between A and C, A", "C", 0.0),
    ("<answer>Answer: B</answer>", "B", 1.0),
    ("<answer>B. a red cube</answer>", "<answer>B</answer>", 1.0),
    ("no letter here", "A", 0.0),
    ("<answer>A</answer>", "B", 0.0),
])
def test_choice_reward(response, truth, acc):
    assert graders.choice_reward(response, truth) == {"overall": acc, "accuracy": acc}


def test_choice_reward_refuses_a_non_letter_truth():
    with pytest.raises(ValueError, match="ground truth '42' is not an option letter.*--reward=r1v"):
        graders.choice_reward("A", "42")


def test_builtins_resolve_by_name():
    assert resolve_reward_fn("math") is graders.math_reward
    assert resolve_reward_fn("r1v") is graders.r1v_reward
    assert resolve_reward_fn("choice") is graders.choice_reward


# --- the forms of user functions -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kind", [
    ("always_one", reward_calls.PAIR), ("verl_score", reward_calls.VERL), ("verl_no_extra_info", reward_calls.VERL),
    ("easyr1_sequential", reward_calls.EASYR1), ("easyr1_batch", reward_calls.EASYR1_BATCH),
])
def test_signature_detected_by_parameter_names(name, kind):
    assert reward_calls.signature_kind(getattr(reward_fns, name)) == kind


def test_unfit_signature_is_refused_naming_the_forms():
    with pytest.raises(ValueError, match=r"three_required\(response, answer, rubric\) cannot be called.*verl"):
        RewardRunner(reward_fns.three_required, timeout_s=1.0, max_workers=1)
    with pytest.raises(ValueError, match=r"math_reward\(response.*does not take .*'nope'.*--reward_kwargs"):
        RewardRunner(functools.partial(graders.math_reward, nope=1), timeout_s=1.0, max_workers=1)


def test_verl_function_gets_data_source_and_extra_info():
    extras = [{"data_source": "geo3k", "extra_info": {"bonus": 0.5}}, {}, {"data_source": "other"}]
    with RewardRunner(resolve_reward_fn("tests.reward_fns:verl_score"), timeout_s=5.0, max_workers=2) as runner:
        s = runner(["3", "4", "5"], ["3", "3", "5"], extras)
    np.testing.assert_array_equal(s.overall, [1.5, 0.0, 1.0])  # "score"; "pred" (a string) is not a part
    assert set(s.parts) == {"acc", "from_source"} and s.failures == 0
    np.testing.assert_array_equal(s.parts["acc"], [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(s.parts["from_source"], [1.0, 0.0, 0.0])
    with RewardRunner(reward_fns.verl_no_extra_info, timeout_s=5.0, max_workers=2) as runner:
        np.testing.assert_array_equal(runner(["a", "b"], ["a", "a"], extras[:2]).overall, [1.0, 0.0])


def test_easyr1_sequential_gets_length_and_extra_columns():
    with RewardRunner(reward_fns.easyr1_sequential, timeout_s=5.0, max_workers=2) as runner:
        s = runner(["a", "b"], ["a", "a"], [{"problem_type": "numerical"}, {}], response_lengths=[3, 5])
    np.testing.assert_array_equal(s.overall, [1.0, 0.0])
    assert set(s.parts) == {"accuracy", "length"}  # "kind" is a string: not a part
    np.testing.assert_array_equal(s.parts["length"], [3.0, 5.0])


def test_easyr1_batch_is_one_call_per_batch():
    reward_fns._batch_calls.clear()
    with RewardRunner(reward_fns.easyr1_batch, timeout_s=5.0, max_workers=2) as runner:
        s = runner(["<a>", "b", "<c>", "d", "e"], ["<a>", "b", "x", "x", "x"], response_lengths=[1, 2, 3, 4, 5])
    assert reward_fns._batch_calls == [5]  # once, with all five (not per wave of max_workers)
    np.testing.assert_allclose(s.overall, [1.0, 0.5, 0.5, 0.0, 0.0])
    np.testing.assert_array_equal(s.parts["format"], [1, 0, 1, 0, 0])
    np.testing.assert_array_equal(s.parts["accuracy"], [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(s.parts["tokens"], [1, 2, 3, 4, 5])


def test_easyr1_batch_failures():
    with RewardRunner(reward_fns.easyr1_batch_wrong_length, timeout_s=5.0, max_workers=2) as runner:
        s = runner(["a", "b", "c"], ["a", "b", "c"])
    assert s.failures == 3 and not s.overall.any()  # the whole call failed
    with RewardRunner(reward_fns.easyr1_batch_bad_item, timeout_s=5.0, max_workers=2) as runner:
        s = runner(["ok", "bad", "ok"], ["", "", ""])
        np.testing.assert_array_equal(s.overall, [1.0, 0.0, 1.0])
        assert s.failures == 1  # only the bad score
    with RewardRunner(reward_fns.easyr1_batch_bad_item, timeout_s=5.0, max_workers=2, on_failure="raise") as runner:
        with pytest.raises(RewardError, match="sample 1 .*TypeError: returned str 'oops', expected a number"):
            runner(["ok", "bad"], ["", ""])


def test_bad_returns_fail_with_a_clear_cause():
    for fn, match in ((reward_fns.returns_list, r"returned list \[1.0\], expected a number or a dict with 'score'"),
                      (reward_fns.dict_without_score, "dict without 'overall' \\(EasyR1\\) or 'score' \\(verl\\)")):
        with RewardRunner(fn, timeout_s=5.0, max_workers=1) as runner:
            s = runner(["a", "b"], ["a", "b"])
            assert s.failures == 2 and not s.overall.any()
        with RewardRunner(fn, timeout_s=5.0, max_workers=1, on_failure="raise") as runner:
            with pytest.raises(RewardError, match=match):
                runner(["a"], ["a"])


@pytest.mark.parametrize("value, want", [
    (1, (1.0, {})), (True, (1.0, {})), (np.float32(0.5), (0.5, {})),
    ({"score": 0.5, "acc": True, "pred": "x"}, (0.5, {"acc": 1.0})),  # verl
    ({"overall": 0.9, "format": 0.0, "accuracy": 1.0, "note": None}, (0.9, {"format": 0.0, "accuracy": 1.0})),
    ({"overall": 1.0, "score": 0.5}, (1.0, {"score": 0.5})),  # "overall" wins; "score" is then a part
])
def test_as_score(value, want):
    assert reward_calls.as_score(value) == want


@pytest.mark.parametrize("value, error", [
    ("1.0", TypeError), (None, TypeError), ({"score": "1"}, TypeError), ({"overall": float("nan")}, ValueError),
    ({"score": 1.0, "format": float("inf")}, ValueError), ([1.0], TypeError),
])
def test_as_score_rejects(value, error):
    with pytest.raises(error):
        reward_calls.as_score(value)


# --- graders in the pool ---------------------------------------------------------------------------------------
def test_math_reward_runs_in_the_thread_pool():
    # math-verify's own timeouts (signal.alarm) would fail in these threads; the runner must see no failure.
    responses = [r"<think>a</think>\boxed{\frac{%d}{4}}" % i for i in range(8)]
    truths = [str(i / 4) for i in range(8)]
    with RewardRunner(graders.math_reward, timeout_s=30.0, max_workers=4) as runner:
        s = runner(responses, truths)
    assert s.failures == 0
    np.testing.assert_array_equal(s.overall, np.ones(8, np.float32))
    np.testing.assert_array_equal(s.parts["format"], np.ones(8))


@pytest.mark.timing  # a wall-time bound (< 2 s beside a 5 s stuck grader): run alone (make test)
def test_slow_math_grader_times_out_in_the_pool(monkeypatch):
    parse, verify = graders._math_verify()
    done = threading.Event()

    def slow_verify(gold, pred, **kw):  # a stand-in for a sympy blow-up inside math-verify
        assert threading.current_thread() is not threading.main_thread()
        if "slow" in str(pred):
            done.wait(5.0)
        return verify(gold, pred, **kw)

    monkeypatch.setattr(graders, "_math_verify", lambda: (parse, slow_verify))
    responses = [r"\boxed{\frac{1}{2}}", r"\boxed{\text{slow}}", r"\boxed{0.5}"]
    try:
        with RewardRunner(graders.math_reward, timeout_s=0.3, max_workers=3) as runner:
            start = time.monotonic()
            s = runner(responses, ["0.5"] * 3)
            assert time.monotonic() - start < 2.0
    finally:
        done.set()  # let the abandoned thread finish
    assert s.failures == 1
    np.testing.assert_allclose(s.overall, [0.9, 0.0, 0.9])
    np.testing.assert_array_equal(s.parts["accuracy"], [1.0, 0.0, 1.0])


@pytest.mark.timing  # a wall-time bound (< 10 s for five gradings): run alone (make test)
def test_huge_exact_numbers_are_not_compared():
    # 9^(9^(9^9)) is one integer power computed in C holding the GIL: no thread timeout could stop it, so the
    # grader must refuse it before math-verify evaluates it. In a subprocess, so a regression fails, not hangs.
    code = ("import time\nfrom rollplex_jax.rl import graders\nt = time.perf_counter()\n"
            "r = [graders.math_reward(r'<think>x</think>\\boxed{%s}' % e, '1')['accuracy'] for e in "
            "('9^{9^{9^{9}}}', '10^{10^{10}}', '(10^{10})!', '9^{-9^{9}}')]\n"
            "ok = graders.math_reward(r'\\boxed{2^{10}}', '1024')['accuracy']\n"
            "print(r, ok, time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    accs, ok, secs = out.stdout.rsplit(" ", 2)
    assert accs == "[0.0, 0.0, 0.0, 0.0]" and ok == "1.0" and float(secs) < 10.0
