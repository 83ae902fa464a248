"""The rewards users of EasyR1, verl and Video-R1 expect, as ``--reward`` names: ``math``, ``r1v``, ``choice``.

Why here: a run on a math or multiple-choice data set should not need a user module for what every
recipe ships, and its numbers should mean what they mean there:

- ``math`` (EasyR1 ``examples/reward_function/math.py``, verl ``reward_score/geo3k.py``): accuracy = the
  content of the LAST ``\\boxed{...}`` (balanced braces) equals the ground truth mathematically (math-verify:
  ``\\frac{1}{2}`` = ``0.5``); format = ``<think>...</think> ... \\boxed{...}``; overall =
  ``(1 - format_weight) * accuracy + format_weight * format``, ``format_weight=0.1``.
- ``r1v`` (EasyR1 ``r1v.py``, Video-R1's rules): format = ``<think>...</think> <answer>...</answer>``; accuracy
  = the answer's content against the ground truth's own ``<answer>`` content when it has one: choice letters
  case-insensitively (``(B)``, ``B.`` = ``B``), numbers equal after rounding to 2 places, else the same string;
  ``format_weight=0.5``.
- ``choice``: the chosen letter (``<answer>``, else ``\\boxed{}``, else the last standalone capital letter)
  equals the ground truth's letter.

Each returns EasyR1's score dict ``{"overall", "format", "accuracy"}`` (``choice``: no format); the
runner logs every part as ``reward/<part>``. Also the text helpers the older rewards share
(``extract_answer``, ``parse_number``).

Thread safety: ``RewardRunner`` calls rewards in a thread pool, and math-verify's own timeouts use
``signal.alarm`` (main thread only), so ``math`` disables them (``parsing_timeout=None``,
``timeout_seconds=None``) and relies on the runner's per-call timeout.
"""

from __future__ import annotations

import functools
import logging
import math
import re

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
NUMBER_RE = re.compile(_NUMBER)
_BOXED_RE = re.compile(r"\\boxed\s*\{")
_MATH_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # EasyR1 math.py
_R1V_FORMAT_RE = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)  # EasyR1 r1v.py
_TAG_SPACES_RE = re.compile(r"\s*(<|>|/)\s*")  # EasyR1 math.py: Qwen2.5-VL-32B writes "< think >"
# "B", "b", "(B)", "[B]", "B.", "B:", "(B)."; or a labelled option "B. 3 cm", "(B) 3 cm", "B) 3 cm".
_LETTER_ONLY_RE = re.compile(r"\s*[(\[]?\s*([A-Za-z])\s*[)\]]?\s*[.:]?\s*")
_LETTER_LABEL_RE = re.compile(r"\s*(?:\(([A-Za-z])\)|([A-Za-z])[.:)])\s+\S.*", re.DOTALL)
_STANDALONE_CAPITAL_RE = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")


def last_answer_tag(text: str) -> str | None:
    """The inside of the last ``<answer>...</answer>`` in ``text``, or None if there is none."""
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


def extract_answer(response: str) -> str:
    """The inside of the last ``<answer>...</answer>`` in ``response``, or ``response`` if none."""
    tagged = last_answer_tag(response)
    return response if tagged is None else tagged


def parse_number(text: str) -> float | None:
    """``text`` as a number when it is exactly one (``-3``, ``1,234.5``, ``.5``, ``2e-3``; spaces around), else None."""
    t = text.strip()
    return float(t.replace(",", "")) if NUMBER_RE.fullmatch(t) else None


def extract_boxed_content(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text``, braces balanced (nested ones kept), or None.

    ``\\{`` and ``\\}`` are LaTeX's literal braces and do not count. A ``\\boxed{`` inside another one belongs to
    it (``\\boxed{\\boxed{3}}`` -> ``\\boxed{3}``); an unclosed last one leaves the previous complete one.
    """
    last, pos = None, 0
    while (m := _BOXED_RE.search(text, pos)) is not None:
        depth, i = 1, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c == "\\":
                i += 2
                continue
            depth += (c == "{") - (c == "}")
            i += 1
        if depth:
            break
        last, pos = text[m.end():i - 1], i
    return last


@functools.cache
def _math_verify():
    """math-verify's ``parse`` and ``verify``, imported on first use (sympy takes ~1 s to import). Its one-time
    warning that timeouts are off is dropped: the runner's per-call timeout bounds every call."""
    from math_verify import parse, verify

    class _NoTimeoutWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not record.getMessage().startswith("Timeout is disabled")

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_NoTimeoutWarning())
    return parse, verify


def _as_latex(text: str) -> str:
    """``text`` as math-verify's LaTeX extraction expects it: kept when it already has ``$``/``\\boxed``/``\\(``,
    else inside ``\\boxed{}`` (math-verify's first extraction target)."""
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return "\\boxed{" + text + "}"


MAX_DIGITS = 10_000  # exact numbers beyond this many digits are not compared (see _digits)


def _digits(e) -> float:
    """An upper bound on the decimal digits exact evaluation of the sympy expression ``e`` may produce (inf when
    unbounded). Why: ``verify`` evaluates numbers exactly, and ``9^{9^{9^{9}}}`` is one integer power computed
    in C while holding the GIL: no timeout (the runner's, or math-verify's signal.alarm) can interrupt it, and
    every thread of the trainer stalls with it. Powers and factorials are bounded; symbols, constants and
    floats count 0 digits."""
    import sympy

    if e.is_Rational:
        return max(abs(int(e.p)), abs(int(e.q)), 1).bit_length() * 0.30103
    if e.is_Atom:  # symbols, constants, floats (approximate arithmetic is cheap)
        return 0.0
    if e.is_Pow:
        base, exp = _digits(e.base), _digits(e.exp)
        return 0.0 if base <= 0.30103 else math.inf if exp > 15 else base * 10.0 ** exp
    if isinstance(e, sympy.factorial):
        n = _digits(e.args[0])
        return math.inf if n > 7 else 10.0 ** n * n
    args = [_digits(a) for a in e.args]
    return (sum(args) if e.is_Mul else max(args) + 1.0) if args else 0.0


def _comparable(parsed: list) -> bool:
    import sympy

    return all(_digits(x) <= MAX_DIGITS for x in parsed if isinstance(x, sympy.Basic))


def grade_math(pred: str, gold: str) -> bool:
    """Whether ``pred`` (an extracted final answer) equals ``gold`` mathematically (math-verify; equal strings
    short-cut). ``gold`` may be a bare answer (``0.5``), LaTeX (``\\frac{1}{2}``) or a solution with a boxed answer.
    False, without comparing, when either side holds an exact number over ``MAX_DIGITS`` digits (``_digits``)."""
    p, g = pred.strip(), gold.strip()
    if not p or not g:
        return False
    if p == g:
        return True
    parse, verify = _math_verify()
    gold_parsed = parse(_as_latex(g), parsing_timeout=None)
    pred_parsed = parse(_as_latex(p), parsing_timeout=None)
    if not gold_parsed or not pred_parsed or not (_comparable(gold_parsed) and _comparable(pred_parsed)):
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def _check_weight(format_weight: float, reward: str) -> float:
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"{reward} reward: format_weight={format_weight!r} must be in [0, 1] "
                         "(set it with --reward_kwargs='{\"format_weight\": 0.1}')")
    return float(format_weight)


def math_format(response: str) -> float:
    """1.0 if ``response`` is ``<think>...</think> ... \\boxed{...} ...`` (EasyR1 math.py's regex, whole string)."""
    return float(_MATH_FORMAT_RE.fullmatch(response) is not None)


def math_accuracy(response: str, ground_truth: str) -> float:
    """1.0 if the last ``\\boxed{}`` of ``response`` equals ``ground_truth`` mathematically; 0.0 with no box."""
    boxed = extract_boxed_content(response)
    return float(boxed is not None and grade_math(boxed, ground_truth))


def math_reward(response: str, ground_truth: str, *, format_weight: float = 0.1) -> dict[str, float]:
    """EasyR1 math / verl geo3k: ``{"overall": (1 - w) * accuracy + w * format, "format", "accuracy"}``.

    Spaces around ``<``, ``>`` and ``/`` are removed first, as EasyR1 does (``< think >`` = ``<think>``).
    """
    w = _check_weight(format_weight, "math")
    response = _TAG_SPACES_RE.sub(r"\1", response)
    fmt, acc = math_format(response), math_accuracy(response, ground_truth)
    return {"overall": (1.0 - w) * acc + w * fmt, "format": fmt, "accuracy": acc}


def choice_letter(text: str) -> str | None:
    """The option letter ``text`` is (``B``, ``(B)``, ``B.``, ``B. 3 cm``, ``(b) 3 cm``), upper-cased; or None."""
    m = _LETTER_ONLY_RE.fullmatch(text) or _LETTER_LABEL_RE.fullmatch(text)
    if m is None:
        return None
    return next(g for g in m.groups() if g).upper()


def chosen_letter(response: str) -> str | None:
    """The letter a response chose: from its last ``<answer>``, else its last ``\\boxed{}``, else the whole text;
    each the option letter it is, else its last standalone capital letter (``Answer: B`` -> ``B``)."""
    for source in (last_answer_tag(response), extract_boxed_content(response), response):
        if source is None:
            continue
        letter = choice_letter(source)
        if letter is None:
            capitals = _STANDALONE_CAPITAL_RE.findall(source)
            letter = capitals[-1] if capitals else None
        if letter is not None:
            return letter
    return None


def choice_reward(response: str, ground_truth: str) -> dict[str, float]:
    """``{"overall": accuracy, "accuracy"}``: 1.0 if the chosen letter equals the ground truth's, case-insensitive.

    Raises:
      ValueError: the ground truth (or its ``<answer>`` content) is not one letter A-Z (a data error).
    """
    gold = choice_letter(extract_answer(ground_truth))
    if gold is None:
        raise ValueError(f"choice reward: ground truth {ground_truth!r} is not an option letter A-Z ('B', '(B)', "
                         "'B.'); use --reward=r1v or --reward=exact_match for other answers")
    acc = float(chosen_letter(response) == gold)
    return {"overall": acc, "accuracy": acc}


def answers_match(given: str, gold: str) -> bool:
    """Video-R1's rules by the gold answer's kind: an option letter -> the same letter (case-insensitive); a number
    -> numerically equal after rounding both to 2 places; else the same string (both stripped)."""
    letter = choice_letter(gold)
    if letter is not None:
        return choice_letter(given) == letter
    g, p = parse_number(gold), parse_number(given)
    if g is not None:
        return p is not None and round(g, 2) == round(p, 2)
    return given.strip() == gold.strip()


def r1v_format(response: str) -> float:
    """1.0 if ``response`` is ``<think>...</think> <answer>...</answer>`` (EasyR1 r1v.py's regex, whole string)."""
    return float(_R1V_FORMAT_RE.fullmatch(response) is not None)


def r1v_accuracy(response: str, ground_truth: str) -> float:
    """1.0 if the response's last ``<answer>`` content (the whole response without one) matches the ground truth's
    ``<answer>`` content (or the ground truth itself) by ``answers_match``."""
    return float(answers_match(extract_answer(response).strip(), extract_answer(ground_truth).strip()))


def r1v_reward(response: str, ground_truth: str, *, format_weight: float = 0.5) -> dict[str, float]:
    """EasyR1 r1v: ``{"overall": (1 - w) * accuracy + w * format, "format", "accuracy"}``, ``w = 0.5``."""
    w = _check_weight(format_weight, "r1v")
    fmt, acc = r1v_format(response), r1v_accuracy(response, ground_truth)
    return {"overall": (1.0 - w) * acc + w * fmt, "format": fmt, "accuracy": acc}
