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
