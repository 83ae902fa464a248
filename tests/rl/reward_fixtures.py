"""Reward functions for tests/rl/test_rewards.py, resolved by "reward_fixtures:<name>"."""

import time

import numpy as np

NOT_CALLABLE = 3


def normal(response: str, answer: str) -> float:
    return float(response == answer)


def raising(response: str, answer: str) -> float:
    if response == "bad":
        raise ValueError("boom")
    return 1.0


def sleep_if_hang(response: str, answer: str) -> float:
    if response == "hang":
        time.sleep(1.5)
    return 1.0


def staggered(response: str, answer: str) -> float:
    """Later samples finish first, so a runner that kept completion order would be caught."""
    index = int(response)
    time.sleep(0.004 * (10 - index % 10))
    return float(index)


_RETURNS = {"nan": float("nan"), "inf": float("inf"), "str": "1.0", "none": None,
            "np": np.float32(0.5), "np0d": np.array(0.25), "bool": True, "int": 2}


def returns(response: str, answer: str):
    return _RETURNS[response]
