"""Reward functions and a runner that calls them safely (host-side Python, no JAX).

What: built-in verifiable rewards ``(response, answer) -> float`` (``exact_match``,
``numeric``, ``format_reward``), ``resolve_reward_fn`` to pick one (or a user function
``"module:function"``) from a config string, and ``RewardRunner``, which scores a batch
of decoded answers in a thread pool with a per-call timeout.

Why a runner: a user reward function may raise, hang (an external verifier, a slow
sympy call) or return garbage. One bad sample must not stop or stall a training run,
nor pass silently: each such call gives reward 0 and is counted as a failure (or, with
``on_failure="raise"``, raises ``RewardError`` naming the sample), and results always
come back in input order so a run is reproducible.

Limits of thread-based timeouts (documented, not hidden):
- A timed-out call is abandoned, not killed: Python cannot stop a thread. It keeps
  running in the background; its pool is retired and a fresh one serves later calls.
  Python joins executor threads at interpreter exit, so a call that *never* returns
  also delays process exit; reward functions that can truly hang should bound their
  own work (subprocess with a timeout) or the launcher should exit with ``os._exit``.
- A call stuck inside C code that holds the GIL (a catastrophic regex) stalls every
  thread, the timeout included; such functions need a process pool.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import math
import numbers
import re
import time
from typing import Callable

import numpy as np

RewardFn = Callable[[str, str], float]

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_RE = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
# Tag bodies may not contain another think/answer tag, so "<answer>a</answer><answer>b</answer>"
# is not one well-formed answer.
_BODY = r"(?:(?!</?(?:think|answer)>).)*"
_FORMAT_RE = re.compile(rf"\s*(?:<think>{_BODY}</think>\s*)?<answer>{_BODY}</answer>\s*", re.DOTALL)


def extract_answer(response: str) -> str:
    """The inside of the last ``<answer>...</answer>`` in ``response``, or ``response`` if none."""
    found = _ANSWER_RE.findall(response)
    return found[-1] if found else response


def exact_match(response: str, answer: str) -> float:
    """1.0 if the (tagged) answer equals ``answer`` after stripping surrounding whitespace, else 0.0.

    Args:
      response: decoded model answer; if it contains ``<answer>...</answer>``, the inside
        of the last such tag is compared.
      answer: reference answer.

    Returns:
      1.0 or 0.0.
    """
    return float(extract_answer(response).strip() == answer.strip())


def parse_last_number(text: str) -> float | None:
    """The last number in ``text`` (``-3``, ``1,234.5``, ``.5``, ``2e-3``), or None if there is none."""
    found = _NUMBER_RE.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def numeric(response: str, answer: str) -> float:
    """1.0 if the last number of the (tagged) answer equals ``float(answer)`` within rel tol 1e-6.

    Args:
      response: decoded model answer; the inside of its last ``<answer>`` tag if present.
      answer: reference number as text (thousands commas allowed).

    Returns:
      1.0 or 0.0 (0.0 when the response holds no number).

    Raises:
      ValueError: ``answer`` is not a number (a data error; the runner counts it as a failure).
    """
    value = parse_last_number(extract_answer(response))
    if value is None:
        return 0.0
    return float(math.isclose(value, float(answer.replace(",", "")), rel_tol=1e-6))


def format_reward(response: str, answer: str) -> float:
    """1.0 if ``response`` is exactly ``[<think>...</think>] <answer>...</answer>``, else 0.0.

    Whitespace around and between the blocks is allowed; any other text, a repeated or
    nested tag, or a missing answer block gives 0.0. ``answer`` is not used.

    Returns:
      1.0 or 0.0.
    """
    del answer
    return float(_FORMAT_RE.fullmatch(response) is not None)


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "numeric": numeric,
    "format": format_reward,
}


def resolve_reward_fn(spec: str) -> RewardFn:
    """The reward function named by ``spec``.

    Args:
      spec: a built-in name (``"exact_match"``, ``"numeric"``, ``"format"``) or
        ``"module:function"`` (``"pkg.mod:fn"``; ``fn`` may be dotted, ``"mod:Cls.fn"``),
        imported by name; the module must be importable (installed or on ``PYTHONPATH``).

    Returns:
      A callable ``(response, answer) -> float``.

    Raises:
      ValueError: unknown name, missing module or attribute, or not callable; the message
        names the spec and the fix.
    """
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    usage = f"use a built-in ({', '.join(BUILTIN_REWARDS)}) or 'module:function'"
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reward spec {spec!r} is not a built-in reward nor 'module:function'; {usage}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward spec {spec!r}: cannot import module {module_name!r} ({e}); make it importable "
            f"(install it or add its folder to PYTHONPATH) or {usage}"
        ) from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward spec {spec!r}: module {module_name!r} has no attribute {attr_path!r}; "
                f"check the function name after ':'"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"reward spec {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable; "
            f"point it at a function (response: str, answer: str) -> float"
        )
    return obj


class RewardError(RuntimeError):
    """A reward call failed (exception, timeout, bad return) with ``on_failure="raise"``."""

    def __init__(self, index: int, response: str, cause: BaseException):
        self.index = index
        self.response = response
        self.cause = cause
        shown = response if len(response) <= 200 else response[:200] + "..."
        super().__init__(
            f"reward function failed on sample {index} (response {shown!r}): {type(cause).__name__}: {cause}"
        )


def _as_reward(value: object) -> float:
    """``value`` as a finite float; raises TypeError/ValueError otherwise (strings are rejected)."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned non-finite {out!r}")
    return out


class RewardRunner:
    """Scores batches with a reward function in a thread pool, with a per-call timeout.

    Calls run in waves of ``max_workers``, each call starting with its wave, so every call
    gets its full ``timeout_s`` (a wave waits at most ``timeout_s``; a batch at most
    ``ceil(N / max_workers) * timeout_s``). A wave with a timed-out call retires the pool
    (its hung thread keeps running in the background, see the module docstring) and the
    next wave gets a fresh one.

    Args:
      fn: ``(response, answer) -> float``, e.g. from ``resolve_reward_fn``.
      timeout_s: per-call limit in seconds (> 0).
      max_workers: threads (>= 1).
      on_failure: ``"zero"``: a failed call gives reward 0 and counts as a failure;
        ``"raise"``: raise ``RewardError`` for the first failed sample (in input order).
    """

    def __init__(self, fn: RewardFn, *, timeout_s: float, max_workers: int, on_failure: str = "zero"):
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {type(fn).__name__}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers!r} must be >= 1")
        if on_failure not in ("zero", "raise"):
            raise ValueError(f"on_failure={on_failure!r} is not supported; allowed: zero, raise")
        self._fn = fn
        self._timeout_s = float(timeout_s)
        self._max_workers = max_workers
        self._on_failure = on_failure
        self._pool: cf.ThreadPoolExecutor | None = None  # created on first use
        self._closed = False

    def _new_pool(self) -> cf.ThreadPoolExecutor:
        return cf.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="reward")

    def _retire_pool(self) -> None:
        """Drop the pool without waiting for its (possibly hung) threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _call(self, response: str, answer: str) -> float:
        return _as_reward(self._fn(response, answer))

    def _run_wave(self, responses: list[str], answers: list[str], start: int, stop: int) -> list[float | Exception]:
        """Rewards (float) or failure causes (exception) for samples ``start:stop``, in order."""
        if self._pool is None:
            self._pool = self._new_pool()
        futures = [self._pool.submit(self._call, responses[i], answers[i]) for i in range(start, stop)]
        deadline = time.monotonic() + self._timeout_s
        out: list[float | Exception] = []
        timed_out = False
        for future in futures:
            try:
                out.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except cf.TimeoutError:
                timed_out = True
                out.append(TimeoutError(f"call did not return within timeout_s={self._timeout_s:g}"))
            except Exception as e:  # any error raised by the user's function is a failed sample
                out.append(e)
        if timed_out:
            self._retire_pool()
        return out

    def __call__(self, responses: list[str], answers: list[str]) -> tuple[np.ndarray, int]:
        """Scores ``responses`` against ``answers``.

        Args:
          responses: ``N`` decoded answers.
          answers: ``N`` reference answers (one per response).

        Returns:
          ``(rewards, failures)``: ``[N]`` float32 rewards in input order (0 for failed
          calls) and the number of failed calls.

        Raises:
          RewardError: with ``on_failure="raise"``, for the first failed sample.
          ValueError: ``responses`` and ``answers`` differ in length.
        """
        if self._closed:
            raise RuntimeError("RewardRunner is closed")
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        rewards = np.zeros(len(responses), np.float32)
        failures = 0
        for start in range(0, len(responses), self._max_workers):
            stop = min(start + self._max_workers, len(responses))
            for i, result in enumerate(self._run_wave(responses, answers, start, stop), start):
                if isinstance(result, float):
                    rewards[i] = result
                    continue
                if self._on_failure == "raise":
                    raise RewardError(i, responses[i], result) from result
                failures += 1
        return rewards, failures

    def close(self) -> None:
        """Releases the pool without waiting for running calls; the runner cannot be used after."""
        self._retire_pool()
        self._closed = True

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
