"""The benchmarks' reward (``--reward=launch.bench_reward:varied_reward``).

A timing benchmark needs every step to run an update: this reward has variance inside every
group of answers (it depends on the answer's length), unlike exact match on a random model.
"""


def varied_reward(response: str, answer: str) -> float:
    return float(len(response) % 2)
