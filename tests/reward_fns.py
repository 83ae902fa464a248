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
