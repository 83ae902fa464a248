"""Reward functions and a runner that calls them safely (host-side Python, no JAX).

What: built-in verifiable rewards ``(response, answer) -> float`` (``exact_match``,
``numeric``, ``format_reward``) and, from ``graders.py``, ``math``, ``r1v`` and ``choice`` (score dicts
with parts); ``resolve_reward_fn`` to pick one (or a user function ``"module:function"`` in any of
the forms of ``reward_calls.py``: rollplex, verl, EasyR1, EasyR1 batch) from a config string; and
``RewardRunner``, which scores a batch of decoded answers in a thread pool with a per-call timeout
and returns ``RewardScores`` (overall, parts, failures).

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
import dataclasses
import importlib
import math
import re
import time
from collections.abc import Mapping, Sequence
from typing import Callable

import numpy as np

from rollplex_jax.rl import graders
from rollplex_jax.rl import reward_calls as calls
from rollplex_jax.rl.graders import NUMBER_RE as _NUMBER_RE
from rollplex_jax.rl.graders import extract_answer  # noqa: F401  (re-exported: the rewards' shared helper)

RewardFn = Callable[..., object]  # a reward in any form of reward_calls.py
# Tag bodies may not contain another think/answer tag, so "<answer>a</answer><answer>b</answer>"
# is not one well-formed answer.
_BODY = r"(?:(?!</?(?:think|answer)>).)*"
_FORMAT_RE = re.compile(rf"\s*(?:<think>{_BODY}</think>\s*)?<answer>{_BODY}</answer>\s*", re.DOTALL)


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
    "math": graders.math_reward,
    "r1v": graders.r1v_reward,
    "choice": graders.choice_reward,
}


def resolve_reward_fn(spec: str) -> RewardFn:
    """The reward function named by ``spec``.

    Args:
      spec: a built-in name (``"exact_match"``, ``"numeric"``, ``"format"``, ``"math"``, ``"r1v"``, ``"choice"``) or
        ``"module:function"`` (``"pkg.mod:fn"``; ``fn`` may be dotted, ``"mod:Cls.fn"``),
        imported by name; the module must be importable (installed or on ``PYTHONPATH``).

    Returns:
      The callable; ``RewardRunner`` detects its form (``reward_calls.signature_kind``).

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
            f"point it at a function such as (response: str, answer: str) -> float"
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


@dataclasses.dataclass(frozen=True, eq=False)
class RewardScores:
    """A batch's scores, in input order: ``overall`` [N] float32 (what the advantages use), ``parts`` {name:
    [N] float32} (the parts the function returned, e.g. ``format``, ``accuracy``; 0 where a call failed or did
    not return that part), and the number of failed calls (their overall and parts are 0)."""

    overall: np.ndarray
    parts: dict[str, np.ndarray]
    failures: int

    @classmethod
    def concatenate(cls, scores: Sequence[RewardScores]) -> RewardScores:
        """One batch from several, in order (a part missing from one batch is 0 there)."""
        names = sorted({k for s in scores for k in s.parts})
        cat = lambda xs: np.concatenate([np.zeros(0, np.float32), *xs]).astype(np.float32)  # noqa: E731
        return cls(cat([s.overall for s in scores]),
                   {k: cat([s.parts.get(k, np.zeros_like(s.overall)) for s in scores]) for k in names},
                   sum(s.failures for s in scores))


_Result = tuple[float, dict[str, float]]


class RewardRunner:
    """Scores batches with a reward function in a thread pool, with a per-call timeout.

    Per-answer functions (rollplex, verl, EasyR1 sequential forms: ``reward_calls.py``) run in waves of
    ``max_workers`` calls, each call starting with its wave, so every call gets its full ``timeout_s`` (a wave
    waits at most ``timeout_s``; a batch at most ``ceil(N / max_workers) * timeout_s``). An EasyR1 batch function
    is called once per batch, in the pool, with that same bound (``ceil(N / max_workers) * timeout_s``); when it
    raises, times out or returns a list of the wrong length every answer of the batch fails, and a bad score
    fails its answer only. A wave with a timed-out call retires the pool (its hung thread keeps running in the
    background, see the module docstring) and the next wave gets a fresh one.

    Args:
      fn: a reward in any form of ``reward_calls.py``, e.g. from ``resolve_reward_fn``; its form is detected here.
      timeout_s: per-call limit in seconds (> 0).
      max_workers: threads (>= 1).
      on_failure: ``"zero"``: a failed call gives reward 0 and counts as a failure;
        ``"raise"``: raise ``RewardError`` for the first failed sample (in input order).

    Raises:
      ValueError: bad settings, or ``fn`` fits none of the forms (the message lists them).
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
        self.kind = calls.signature_kind(fn)
        self._extra_info = self.kind == calls.VERL and calls.verl_kwargs(fn)
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

    def _call(self, x: calls.RewardInput) -> _Result:
        return calls.as_score(calls.call_one(self._fn, self.kind, x, self._extra_info))

    def _wait(self, futures: list[cf.Future], timeout_s: float) -> list:
        """Each future's result or failure cause (an exception), all within ``timeout_s`` from now."""
        deadline = time.monotonic() + timeout_s
        out: list = []
        timed_out = False
        for future in futures:
            try:
                out.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except cf.TimeoutError:
                timed_out = True
                out.append(TimeoutError(f"call did not return within timeout_s={timeout_s:g}"))
            except Exception as e:  # any error raised by the user's function is a failed sample
                out.append(e)
        if timed_out:
            self._retire_pool()
        return out

    def _run_wave(self, xs: list[calls.RewardInput]) -> list[_Result | Exception]:
        """Scores (overall, parts) or failure causes (exception) for ``xs``, one call each, in order."""
        if self._pool is None:
            self._pool = self._new_pool()
        return self._wait([self._pool.submit(self._call, x) for x in xs], self._timeout_s)

    def _run_batch(self, xs: list[calls.RewardInput]) -> list[_Result | Exception]:
        """An EasyR1 batch function's scores for ``xs`` (one call), or its failure for each of them."""
        if self._pool is None:
            self._pool = self._new_pool()
        limit = self._timeout_s * max(1, math.ceil(len(xs) / self._max_workers))
        (raw,) = self._wait([self._pool.submit(calls.call_batch, self._fn, xs)], limit)
        if isinstance(raw, Exception):
            return [raw] * len(xs)
        out: list[_Result | Exception] = []
        for value in raw:
            try:
                out.append(calls.as_score(value))
            except (TypeError, ValueError) as e:
                out.append(e)
        return out

    def __call__(self, responses: Sequence[str], answers: Sequence[str], extras: Sequence[Mapping] | None = None, *,
                 response_lengths: Sequence[int] | None = None) -> RewardScores:
        """Scores ``responses`` against ``answers``.

        Args:
          responses: ``N`` decoded answers.
          answers: ``N`` reference answers (one per response).
          extras: ``N`` dicts of each row's other columns (``Example.extra``; verl's ``data_source`` and
            ``extra_info``), or None (all empty).
          response_lengths: ``N`` answer lengths in tokens (EasyR1's ``response_length``), or None (left out).

        Returns:
          ``RewardScores``: overall and parts [N] float32 in input order (0 for failed calls), failures.

        Raises:
          RewardError: with ``on_failure="raise"``, for the first failed sample.
          ValueError: the inputs differ in length.
        """
        if self._closed:
            raise RuntimeError("RewardRunner is closed")
        n = len(responses)
        for name, other in (("answers", answers), ("extras", extras), ("response_lengths", response_lengths)):
            if other is not None and len(other) != n:
                raise ValueError(f"got {n} responses but {len(other)} {name}")
        lengths = [None] * n if response_lengths is None else [int(t) for t in response_lengths]
        xs = [calls.RewardInput(responses[i], answers[i], lengths[i], {} if extras is None else extras[i])
              for i in range(n)]
        if self.kind == calls.EASYR1_BATCH:
            results = self._run_batch(xs) if xs else []
        else:
            results = [r for start in range(0, n, self._max_workers) for r in
                       self._run_wave(xs[start:start + self._max_workers])]
        return self._collect(responses, results)

    def _collect(self, responses: Sequence[str], results: list[_Result | Exception]) -> RewardScores:
        overall = np.zeros(len(results), np.float32)
        names = sorted({k for r in results if not isinstance(r, Exception) for k in r[1]})
        parts = {k: np.zeros(len(results), np.float32) for k in names}
        failures = 0
        for i, result in enumerate(results):
            if isinstance(result, Exception):
                if self._on_failure == "raise":
                    raise RewardError(i, responses[i], result) from result
                failures += 1
                continue
            overall[i] = result[0]
            for k, v in result[1].items():
                parts[k][i] = v
        return RewardScores(overall, parts, failures)

    def close(self) -> None:
        """Releases the pool without waiting for running calls; the runner cannot be used after."""
        self._retire_pool()
        self._closed = True

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
