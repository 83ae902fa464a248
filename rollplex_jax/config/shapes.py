"""Shape buckets: the few lengths and counts a run's programs are compiled for.

Why: every distinct array shape is a distinct XLA program. Real data (images of every size, prompts and
answers of every length) gives every step new shapes, and a step that compiles its programs again is 20-30x
slower on this CPU (minutes per program for a 7B model on a GPU). Rounding each size a program sees up to the
next *bucket* makes the number of distinct shapes grow with log(largest / smallest), not with the data.

``Buckets(step, linear_until, ratio)`` (``--shape_buckets=STEP:LINEAR_UNTIL:RATIO``, default ``64:512:1.25``):
multiples of ``step`` up to ``linear_until``, then steps of x ``ratio`` (each rounded up to a multiple of
``step``): 64, 128, ..., 512, 640, 832, 1088, ... A size never shrinks; ``up(n, cap)`` stops at ``cap`` (the
longest the config allows) so nothing is padded past what the run can hold. Counts (rows, windows, frames)
round to powers of two (``pow2``). What it costs: padding, at most ``step`` slots below ``linear_until`` and
``ratio - 1`` of the size above it; every padded slot is masked out of the computation (tested bitwise).
"""

from __future__ import annotations

import dataclasses
import math

DEFAULT = "64:512:1.25"


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Lengths: multiples of ``step`` up to ``linear_until``, then x ``ratio`` steps (multiples of ``step``)."""

    step: int = 64
    linear_until: int = 512
    ratio: float = 1.25

    def __post_init__(self):
        if self.step < 1 or self.linear_until < self.step or self.ratio <= 1.0:
            raise ValueError(f"shape buckets {self}: need step >= 1, linear_until >= step and ratio > 1")

    def up(self, n: int, cap: int | None = None) -> int:
        """The smallest bucket >= ``n`` (``n`` itself when ``n`` <= 0), at most ``max(n, cap)``."""
        n = int(n)
        if n <= 0:
            return n
        b = -(-n // self.step) * self.step
        if b > self.linear_until:
            b = self.linear_until
            while b < n:
                b = -(-math.ceil(b * self.ratio) // self.step) * self.step
        return b if cap is None else max(n, min(b, int(cap)))


def parse_buckets(text: str) -> Buckets | None:
    """``STEP:LINEAR_UNTIL:RATIO`` -> ``Buckets``; ``off`` or empty -> None (exact shapes, a compile per new
    shape). Raises ValueError naming the form on anything else."""
    text = (text or "").strip()
    if text in ("", "off", "none"):
        return None
    parts = text.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        return Buckets(int(parts[0]), int(parts[1]), float(parts[2]))
    except ValueError as e:
        raise ValueError(f"shape buckets {text!r}: give STEP:LINEAR_UNTIL:RATIO (e.g. {DEFAULT}: multiples of 64 up "
                         f"to 512, then x1.25 steps) or 'off'{'; ' + str(e) if str(e) else ''}") from None


def pow2(n: int, cap: int | None = None) -> int:
    """The smallest power of two >= ``n`` (>= 1), at most ``max(n, cap)``."""
    b = 1 << max(int(n) - 1, 0).bit_length()
    return b if cap is None else max(int(n), min(b, int(cap)))
