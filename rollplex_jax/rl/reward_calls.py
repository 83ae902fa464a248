"""How a reward function is called, and what it may return: the signature rule and the score rule.

Why: users bring reward functions written for three frameworks, and each should run unchanged with
``--reward=module:function``. ``RewardRunner`` detects the form from the function's parameter NAMES
(``inspect.signature``), once, when it is built:

1. first parameter named ``reward_inputs`` -> EasyR1 batch (``BatchFunctionRewardManager``):
   ``fn(reward_inputs: list[dict]) -> list[score]``, called ONCE per batch with one dict per answer;
2. first parameter named ``reward_input`` -> EasyR1 sequential (``SequentialFunctionRewardManager``):
   ``fn(reward_input: dict) -> score``, one call per answer;
3. a parameter named ``solution_str`` -> verl (``NaiveRewardManager``): ``fn(data_source=..., solution_str=...,
   ground_truth=..., extra_info=...)`` by keyword (``extra_info`` only when the function takes it or ``**kwargs``);
4. otherwise, a function callable with two positional arguments -> ``fn(response, answer)`` (rollplex's own form,
   and EasyR1's older ``compute_score(response, ground_truth)``); also when the signature cannot be read.

Anything else (one unnamed parameter, three required ones, ...) is refused with a ``ValueError`` that names the
function and the four forms. EasyR1's dicts hold ``response``, ``response_length`` (answer tokens, stop token
included) and ``ground_truth``, plus the row's extra columns (``Example.extra``: ``data_source``,
``problem_type``, ``options``, ...) under their own names; verl's ``data_source`` and ``extra_info`` come from those
columns (``""`` and ``{}`` when a row has none).

A score is a number (bool, int, float, numpy scalar) or a dict with ``"overall"`` (EasyR1) or ``"score"`` (verl);
its other numeric entries are parts (``"format"``, ``"accuracy"``, ...), logged as ``reward/<part>``; non-numeric
entries (verl's ``"pred"`` strings, EasyR1's ``None`` parts) are ignored. Anything else, or a non-finite number,
raises (the runner counts the call as failed).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping

import numpy as np

PAIR, VERL, EASYR1, EASYR1_BATCH = "pair", "verl", "easyr1", "easyr1_batch"
FORMS = (
    "fn(response, answer) -> score",
    "verl: compute_score(data_source, solution_str, ground_truth, extra_info=None) -> score",
    "EasyR1: compute_score(reward_input: dict) -> score",
    "EasyR1 batch: compute_score(reward_inputs: list[dict]) -> list[score]",
)


@dataclasses.dataclass(frozen=True)
class RewardInput:
    """One answer to score: the decoded response, the reference answer, its length in tokens, the row's extras."""

    response: str
    ground_truth: str
    response_length: int | None = None
    extra: Mapping = dataclasses.field(default_factory=dict)

    def easyr1(self) -> dict:
        """EasyR1's ``RewardInput`` dict (its three keys win over an extra column of the same name)."""
        out = dict(self.extra)
        out.update(response=self.response, ground_truth=self.ground_truth)
        if self.response_length is not None:
            out["response_length"] = self.response_length
        return out


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None) or repr(fn)


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def signature_kind(fn: Callable) -> str:
    """``PAIR``, ``VERL``, ``EASYR1`` or ``EASYR1_BATCH`` for ``fn`` by the rule in the module docstring.

    Raises:
      ValueError: ``fn`` fits none of the forms (the message names it and lists them), or takes keyword
        arguments it cannot bind (e.g. a ``--reward_kwargs`` name it does not have).
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        if isinstance(fn, functools.partial):  # keyword arguments (--reward_kwargs) the function does not take
            raise ValueError(f"reward function {_name(fn)}{_signature(fn.func)} does not take the keyword arguments "
                             f"{fn.keywords!r} ({e.__cause__ or e}); check --reward_kwargs") from None
        return PAIR  # builtins and C callables: assume today's form
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first = positional[0].name if positional else None
    names = {p.name for p in params}
    takes_kwargs = any(p.kind == p.VAR_KEYWORD for p in params)
    if first == "reward_inputs":
        kind, probe = EASYR1_BATCH, ((([],), {}))
    elif first == "reward_input":
        kind, probe = EASYR1, (({},), {})
    elif "solution_str" in names:
        kind, probe = VERL, ((), dict(data_source="", solution_str="", ground_truth="",
                                      **({"extra_info": {}} if "extra_info" in names or takes_kwargs else {})))
    else:
        kind, probe = PAIR, (("", ""), {})
    try:
        sig.bind(*probe[0], **probe[1])
    except TypeError as e:
        raise ValueError(f"reward function {_name(fn)}{sig} cannot be called as a reward ({e}); write it in one of "
                         f"these forms (detected by parameter names): {'; '.join(FORMS)}") from None
    return kind


def verl_kwargs(fn: Callable) -> bool:
    """Whether a verl-form ``fn`` takes ``extra_info`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "extra_info" or p.kind == p.VAR_KEYWORD for p in params)


def call_one(fn: Callable, kind: str, x: RewardInput, takes_extra_info: bool = True):
    """One call of a per-answer ``fn`` of form ``kind`` on ``x``; its raw return value."""
    if kind == PAIR:
        return fn(x.response, x.ground_truth)
    if kind == EASYR1:
        return fn(x.easyr1())
    if kind == VERL:
        kw = dict(data_source=x.extra.get("data_source", ""), solution_str=x.response, ground_truth=x.ground_truth)
        if takes_extra_info:
            kw["extra_info"] = x.extra.get("extra_info", {})
        return fn(**kw)
    raise ValueError(f"call_one: form {kind!r} is not a per-answer form")


def call_batch(fn: Callable, xs: list[RewardInput]) -> list:
    """One call of an EasyR1 batch ``fn`` on every input; its list of raw scores, checked for type and length."""
    out = fn([x.easyr1() for x in xs])
    if isinstance(out, np.ndarray):
        out = out.tolist()
    if not isinstance(out, (list, tuple)):
        raise TypeError(f"batch reward function {_name(fn)} returned {type(out).__name__}, expected a list of "
                        f"{len(xs)} scores (numbers or dicts with 'overall')")
    if len(out) != len(xs):
        raise ValueError(f"batch reward function {_name(fn)} returned {len(out)} scores for {len(xs)} inputs")
    return list(out)


def _number(value: object, what: str) -> float | None:
    """``value`` as a finite float; None when it is not a number; raises on a non-finite one."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if not isinstance(value, numbers.Real):
        return None
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned non-finite {what} {out!r}")
    return out


def as_score(value: object) -> tuple[float, dict[str, float]]:
    """``(overall, parts)`` from a reward function's return value, by the score rule of the module docstring.

    Raises:
      TypeError: not a number nor a dict with "overall"/"score" (strings are rejected), or that key not a number.
      ValueError: a non-finite overall or part.
    """
    if isinstance(value, Mapping):
        key = "overall" if "overall" in value else "score" if "score" in value else None
        if key is None:
            raise TypeError(f"returned a dict without 'overall' (EasyR1) or 'score' (verl): keys {sorted(value)!r}")
        overall = _number(value[key], key)
        if overall is None:
            raise TypeError(f"returned {key}={value[key]!r} ({type(value[key]).__name__}), expected a number")
        parts = {}
        for k, v in value.items():
            if k != key and isinstance(k, str) and (x := _number(v, f"part {k!r}")) is not None:
                parts[k] = x
        return overall, parts
    overall = _number(value, "reward")
    if overall is None:
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a number or a dict with 'score' (verl) "
                        "or 'overall' (EasyR1)")
    return overall, {}
