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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollplex_jax.config.tree import Config

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

    def between(self, lo: int, hi: int) -> list[int]:
        """The buckets b with lo <= b <= hi, ascending."""
        out, b = [], self.up(max(int(lo), 1))
        while b <= hi:
            out.append(b)
            b = self.up(b + 1)
        return out


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


@dataclasses.dataclass(frozen=True)
class StepShapes:
    """The bucketed lengths a step's programs run at (``--shape_buckets``; None: exact shapes) and the rows of a
    micro-batch under ``--micro_batch_tokens`` (``micro_batch_tokens`` 0: ``micro_batch`` rows)."""

    buckets: Buckets | None
    prompt_cap: int
    answer_cap: int
    micro_batch: int
    micro_batch_tokens: int = 0

    def prompt_len(self, n: int) -> int:
        return n if self.buckets is None else self.buckets.up(n, cap=self.prompt_cap)

    def prefix_len(self, n: int) -> int:
        """The Rollplex prefix rows' padded length: the cap itself (at least ``n``), one boundary length for the run,
        so the suffix programs and the prefix's padded layout never change shape with the batch (the decoder runs
        on the packed rows: the padding costs the boundary's gathers and the suffix's masked keys, not decoder
        slots; measured on ``launch.bench_shapes``: 8 of its 17 late compiles were a new prompt bucket)."""
        return n if self.buckets is None else max(n, self.prompt_cap)

    def answer_len(self, n: int) -> int:
        return n if self.buckets is None else self.buckets.up(n, cap=self.answer_cap)

    def serial_rows(self, length: int) -> int:
        """Rows (prompt ++ answer, ``length`` slots each) of a serial micro-batch."""
        return self.micro_batch if not self.micro_batch_tokens else max(1, self.micro_batch_tokens // length)

    def answers(self, prompt_len: int, answer_len: int, n: int) -> int:
        """Answers of a Rollplex micro-batch: whole prefix rows (``prompt_len`` + ``n`` answers of ``answer_len``
        each) while the budget holds one, else as many of one row's answers as fit beside its prefix."""
        if not self.micro_batch_tokens:
            return self.micro_batch
        row = prompt_len + n * answer_len
        if self.micro_batch_tokens >= row:
            return self.micro_batch_tokens // row * n
        return max(1, (self.micro_batch_tokens - prompt_len) // answer_len)


def step_shapes(cfg: Config) -> StepShapes:
    """The run's ``StepShapes`` (lengths capped at ``--prompt_bucket_cap`` (else ``--max_prompt_len``) and
    ``--max_new_tokens``)."""
    cap = min(cfg.data.prompt_bucket_cap or cfg.data.max_prompt_len, cfg.data.max_prompt_len)
    return StepShapes(cfg.programs.buckets, cap, cfg.rollout.max_new_tokens, cfg.rl.micro_batch,
                      cfg.rl.micro_batch_tokens)


def planned_micro_batch(cfg: Config) -> int:
    """A micro-batch's rows (serial) or answers (Rollplex) at the longest lengths the config allows, the largest
    buckets: ``--micro_batch``, or what ``--micro_batch_tokens`` holds there (the planner's and the AOT compile's
    micro-batch; at shorter lengths the budget holds more rows of the same token count)."""
    s = step_shapes(cfg)
    tp, tr = cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    if not s.micro_batch_tokens or cfg.run.schedule == "serial":
        return s.serial_rows(tp + tr)
    return s.answers(tp, tr, cfg.rollout.group_size if cfg.run.prefix_sharing else 1)


@dataclasses.dataclass(frozen=True)
class VisionChunkSizes:
    """A run's vision chunk settings (``--vision_chunk_units``, ``--vision_frame_units``, ``--vision_batch_units``)."""

    chunk_units: int
    frame_units: int
    batch_units: int


def prefix_rows_total(cfg: Config) -> int:
    """Prefix rows of a step: one per prompt with prefix sharing, else one per answer."""
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    return B if cfg.run.prefix_sharing else B * G


def vision_chunk_sizes(cfg: Config, largest_frame: int, mean_tokens: float, max_tokens: int) -> VisionChunkSizes:
    """The vision chunk settings left to the data (0) resolved from a training set's (or the planner's) vision
    tokens: a device's part of a chunk holds its largest frame and, up to one prompt's tokens
    (``--max_prompt_len``), a device's share of a mean batch (a power of two: one-size small data encodes a batch
    in one chunk; at scale a call's working set stays about one prompt's, as the prefix programs' was), a
    full-attention row its largest frame (a power of two), the buffer twice a batch of its largest rows plus a
    chunk (first-fit leaves every part but one at least half full). Rows: the step's prefix rows (one per prompt
    with prefix sharing), split over the batch shards (``--train_dp x --train_fsdp``)."""
    d = cfg.data
    rows = prefix_rows_total(cfg)
    shards = cfg.mesh.batch_shards
    share = min(math.ceil(rows * mean_tokens / shards), d.max_prompt_len)
    units = d.vision_chunk_units or pow2(max(largest_frame, share))
    return VisionChunkSizes(units, d.vision_frame_units or pow2(largest_frame),
                            d.vision_batch_units or 2 * rows * max_tokens + units * shards)


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    """A chunk: ``groups`` parts (one per batch shard, ``--train_fsdp``: the mesh splits a chunk's parts over its
    devices), each of ``units`` merge units and ``windows`` attention windows; the rows of the batch's embeddings
    buffer (a multiple of a chunk's units) and the length of a full-attention row (``frame``: the largest frame,
    a power of two): fixed for a run (``--vision_chunk_units``, ``--vision_batch_units``, ``--vision_frame_units``)."""

    units: int
    windows: int
    buffer: int
    frame: int
    groups: int = 1

    @property
    def chunk_units(self) -> int:
        """Merge units of a whole chunk (all its parts)."""
        return self.units * self.groups

    @classmethod
    def for_run(cls, chunk_units: int, batch_units: int, window_units: int, frame_units: int = 0,
                groups: int = 1) -> ChunkSpec:
        units = pow2(chunk_units)
        frame = min(units, pow2(frame_units)) if frame_units > 0 else units
        whole = units * groups
        return cls(units, windows_for(units, window_units), -(-max(batch_units, whole) // whole) * whole, frame,
                   groups)


def windows_for(units: int, window_units: int) -> int:
    """Windows of a chunk of ``units``: half-full windows on average (an item of h x w merge units has
    ceil(h / m) x ceil(w / m) windows of m x m)."""
    return pow2(-(-2 * units // max(1, window_units)))


def vision_chunk_spec(cfg: Config, sizes: VisionChunkSizes | None = None) -> ChunkSpec | None:
    """The run's vision chunks (``models/vl/vision_chunks.py``) with shape buckets: from the config's
    settings (resolved from the training set by the runner) or ``sizes`` (the planner's, from its lengths), one
    part per batch shard; None without buckets, with ``--vision_chunk_units=-1`` or while unresolved (the vision
    tower inside the prefix programs)."""
    d = cfg.data
    if cfg.programs.buckets is None or d.vision_chunk_units < 0:
        return None
    s = sizes or VisionChunkSizes(d.vision_chunk_units, d.vision_frame_units, d.vision_batch_units)
    if s.chunk_units <= 0:
        return None
    return ChunkSpec.for_run(s.chunk_units, s.batch_units, cfg.model.vision.merger_window**2, s.frame_units,
                             cfg.mesh.batch_shards)
