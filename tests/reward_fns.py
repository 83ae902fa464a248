"""Reward functions for tests, addressed as --reward=tests.reward_fns:NAME (tests/ is importable)."""


def always_one(response: str, answer: str) -> float:
    return 1.0


def always_raise(response: str, answer: str) -> float:
    raise RuntimeError("reward service unavailable")


def flaky(response: str, answer: str) -> float:
    """Exact match, but raises on answers that start with 'b' (blue, ...)."""
    if response.startswith("b"):
        raise ValueError("flaky verifier")
    return float(response.strip() == answer.strip())


def length_parity(response: str, answer: str) -> float:
    """A deterministic reward with variance inside groups (for equivalence tests of the update)."""
    return float(len(response) % 2)


def hang(response: str, answer: str) -> float:
    """Never returns in time: sleeps 120 s (tests pass --reward_timeout_s well below that)."""
    import time

    time.sleep(120)
    return 1.0


_calls = __import__("itertools").count()


def hang_raise_or_one(response: str, answer: str) -> float:
    """By call number (per process): 0 mod 4 hangs 120 s, 1 mod 4 raises, otherwise 1.0.

    Reward calls of one wave all start before the next wave is submitted, so each batch of 4k
    samples gets exactly k hangs, k exceptions and 2k rewards of 1.0, whatever the thread order.
    """
    import time

    n = next(_calls)  # itertools.count: atomic under the GIL
    if n % 4 == 0:
        time.sleep(120)
    if n % 4 == 1:
        raise RuntimeError(f"verifier crashed on call {n}")
    return 1.0


# --- the frameworks' forms (rollplex_jax/rl/reward_calls.py), for tests/rl/test_graders.py -----------------
def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's custom compute_score: a dict with "score" and parts, plus a non-numeric entry verl allows."""
    acc = float(solution_str.strip() == ground_truth.strip())
    bonus = float((extra_info or {}).get("bonus", 0.0))
    return {"score": acc + bonus, "acc": acc, "pred": solution_str, "from_source": float(data_source == "geo3k")}


def verl_no_extra_info(data_source, solution_str, ground_truth):
    """verl form without extra_info: the runner must not pass it."""
    return float(solution_str == ground_truth)


def easyr1_sequential(reward_input):
    """EasyR1 SequentialFunctionRewardManager form: one dict in, a score dict with "overall" out."""
    acc = float(reward_input["response"] == reward_input["ground_truth"])
    return {"overall": acc, "accuracy": acc, "length": float(reward_input["response_length"]),
            "kind": reward_input.get("problem_type", "none")}


_batch_calls = []


def easyr1_batch(reward_inputs, format_weight=0.5):
    """EasyR1 BatchFunctionRewardManager form: the whole batch in one call; records each call's size."""
    _batch_calls.append(len(reward_inputs))
    out = []
    for x in reward_inputs:
        acc = float(x["response"] == x["ground_truth"])
        fmt = float(x["response"].startswith("<"))
        out.append({"overall": (1 - format_weight) * acc + format_weight * fmt, "format": fmt, "accuracy": acc,
                    "tokens": float(x["response_length"])})
    return out


def easyr1_batch_wrong_length(reward_inputs):
    return [1.0] * (len(reward_inputs) + 1)


def easyr1_batch_bad_item(reward_inputs):
    """A bad score for responses "bad" only: that answer fails, the others count."""
    return ["oops" if x["response"] == "bad" else 1.0 for x in reward_inputs]


def returns_list(response, answer):
    """A bad return type (a list): the runner counts a failure naming what a reward may return."""
    return [1.0]


def dict_without_score(response, answer):
    return {"accuracy": 1.0}


def three_required(response, answer, rubric):
    """Fits none of the forms: refused when the runner is built."""
    return 1.0



def varied_parts(reward_inputs):
    """EasyR1 batch form of launch.bench_reward.varied_reward (len(response) % 2: variance in every group), with
    parts, so that a multi-process run gathers parts and their names (tests/test_multiprocess.py)."""
    return [{"overall": float(len(x["response"]) % 2), "parity": float(len(x["response"]) % 2),
             "tokens": float(x["response_length"])} for x in reward_inputs]


_batches = __import__("itertools").count()


def varied_parts_stalling(reward_inputs):
    """``varied_parts``, except that in a process whose environment has ROLLPLEX_TEST_STALL_MARK=<path> its second
    batch (the second step's rewards) writes <path> and then waits for good: the process is mid-step, its peers in
    the gather of the scores, when tests/test_multiprocess.py SIGKILLs it."""
    import os
    import time

    mark = os.environ.get("ROLLPLEX_TEST_STALL_MARK")
    if next(_batches) == 1 and mark:
        with open(mark, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
    return varied_parts(reward_inputs)
