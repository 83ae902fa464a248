"""The benchmarks' rewards (``--reward=launch.bench_reward:varied_reward`` or ``:count_reward``).

A timing benchmark needs every step to run an update: these rewards have variance inside every
group of answers (they depend on the answer's length), unlike exact match on a random model,
whose steps would skip their updates (no signal) and time less than a real run does.
"""

import re


def varied_reward(response: str, answer: str) -> float:
    return float(len(response) % 2)


def count_reward(response: str, answer: str) -> dict:
    """The counting task's grader (``launch/bench_shapes.py``): accuracy 1 when the response's last digit is the
    answer; overall = accuracy + 0.1 x (the response's length in characters mod 2), the length term so that a
    random model's groups still have variance."""
    digits = re.findall(r"\d", response)
    accuracy = float(bool(digits) and digits[-1] == str(answer).strip())
    return {"overall": accuracy + 0.1 * (len(response) % 2), "accuracy": accuracy}
