"""How an engine's weight tensors are made of the actor's training shards: the one definition both sides use.

Terms (the trainer classifies, ``rollplex_jax.sharing_plan``; the engine binds, ``rollout_torch.weights``):
- a *box* is a tuple of (start, stop) per dimension of a parameter: the part of it a shard holds;
- a ``Shard`` is one addressable training shard: its device position (the training mesh's
  ``devices.flat`` order), its box and a DLPack-capable buffer holding exactly that box;
- a ``RankTensor`` is one engine tensor as one engine rank needs it: ``pieces`` (source parameter, box)
  concatenated along dim 0, then ``pad_rows`` zero rows, then transposed if ``transpose``; and its class:
  ``aligned`` (one piece = the whole local shard, no transpose: a DLPack view, same pointer), ``view`` (one
  piece inside the local shard, or a transpose: a strided view of the same buffer) or ``rebuilt``
  (anything else: fused sources, several row ranges, padding, remote pieces: an engine-owned buffer
  refilled in place).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

ALIGNED, VIEW, REBUILT = "aligned", "view", "rebuilt"
KINDS = (ALIGNED, VIEW, REBUILT)
Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    """The box of a whole array of ``shape``."""
    return tuple((0, int(d)) for d in shape)


def contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner, strict=True))


def intersection(a: Box, b: Box) -> Box | None:
    """The common box of ``a`` and ``b``, or None when they do not overlap."""
    box = tuple((max(x, z), min(y, w)) for (x, y), (z, w) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


def box_size(box: Box | None) -> int:
    """Elements in ``box`` (0 for None)."""
    return 0 if box is None else math.prod(b - a for a, b in box)


def slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Index of box ``inner`` inside an array holding box ``outer``."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer, strict=True))


class RankTensor(NamedTuple):
    """What one engine rank gets for one engine tensor (see the module docstring).

    ``shape``: before the transpose. ``nbytes``: of the whole tensor. ``local_bytes``: bytes of the pieces
    already inside the device's own training shard (a rebuilt tensor need only receive the rest).
    """

    target: str
    kind: str
    pieces: tuple[tuple[str, Box], ...]
    pad_rows: int
    transpose: bool
    shape: tuple[int, ...]
    nbytes: int
    local_bytes: int

    @property
    def sources(self) -> tuple[str, ...]:
        """The actor parameters this tensor is made of, in order (a source may appear once per piece)."""
        return tuple(dict.fromkeys(s for s, _ in self.pieces))


class Shard(NamedTuple):
    """One addressable training shard: device position, index box, DLPack-capable buffer holding that box."""

    position: int
    box: Box
    array: Any


@dataclasses.dataclass(frozen=True)
class SharingReport:
    """Counts and bytes of an engine's tensors per class; ``extra_bytes`` = engine-owned (rebuilt) bytes.

    ``details``: the trainer's per-device classification (``rollplex_jax.sharing_plan.SharingPlan.report``),
    when known."""

    counts: dict[str, int]
    bytes: dict[str, int]
    details: dict | None = None

    @property
    def extra_bytes(self) -> int:
        return self.bytes[REBUILT]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def fractions(self) -> dict[str, float]:
        total = max(self.total_bytes, 1)
        return {k: v / total for k, v in self.bytes.items()}

    def to_dict(self) -> dict:
        out = {"counts": dict(self.counts), "bytes": dict(self.bytes), "fractions": self.fractions(),
               "extra_bytes": self.extra_bytes, "second_copy_bytes": self.total_bytes}
        if self.details is not None:
            out["classification"] = self.details
        return out

    @classmethod
    def of(cls, tensors: Sequence[RankTensor], details: dict | None = None) -> SharingReport:
        """Counts and bytes per class of ``tensors`` (one or several ranks' lists, concatenated)."""
        counts = dict.fromkeys(KINDS, 0)
        nbytes = dict.fromkeys(KINDS, 0)
        for rt in tensors:
            counts[rt.kind] += 1
            nbytes[rt.kind] += int(rt.nbytes)
        return cls(counts, nbytes, details)
