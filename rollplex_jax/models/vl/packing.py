"""Padding-free rows: the real tokens of a padded batch packed into fewer rows of the same length.

What: ``pack_layout(attention_mask, groups)`` places each row's real tokens (in order) one after another in
rows of the batch's length T (next-fit, in row order, so the vision tokens keep their batch order), and
returns the ``Packing`` a forward pass runs on: packed token ids, token types and M-RoPE positions [P, T],
segment ids [P, T] (the source row, -1 at the tail padding) and ``unpack`` [B, T], the flat packed slot of
each padded position. Attention inside a packed row is masked by segment (``KVSource.segments``), so every
token attends to exactly the keys it attends to in the padded batch, at the positions it has there: the
outputs are the padded computation's, up to float summation order (tested, fp32, 1e-5).

Why: prompts of different lengths are left-padded to the longest, and the serial schedule's rows (prompt ++
answer) repeat each prompt's padding G times. The decoder's cost is linear (matmuls) and quadratic
(attention) in the padded length; packing computes P rows instead of B.

How: packing happens on the host (``prepare_inputs(..., opts=InputOptions(pack=True))``) and only where it saves a row
(P < B); outputs go back to the padded layout inside the program by one gather (``unpack_rows``), so
every consumer (losses, the prefix state, the suffix) sees the padded shapes as before. On a mesh the rows
are packed per data-parallel group (``groups`` contiguous row blocks, each into the same number of packed
rows), so a packed row never mixes two devices' rows.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rollplex_jax.config.shapes import pow2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
    """A batch's real tokens packed into P rows of length T.

    input_ids, token_types, segments: [P, T] (segments: the padded row each token came from, -1 = padding);
    positions: [3, P, T]; unpack: [B, T] flat index into P * T of each padded position (0 where padded);
    vision_index: [P, T] the vision embedding of each placeholder (-1 elsewhere), as in the padded batch.
    """

    input_ids: jax.Array
    token_types: jax.Array
    positions: jax.Array
    segments: jax.Array
    unpack: jax.Array
    vision_index: jax.Array


def to_device(x, dtype=None) -> jax.Array:
    """A host array on the default device, as ``jnp.asarray(x, dtype)`` gives it, without compiling: jax 0.10's
    ``jnp.asarray`` of a NumPy array compiles a small XLA program per new shape and dtype (measured: 3 per new
    shape for an int64 -> int32, a float64 -> float32 and a plain copy), so under shape buckets every new bucket
    compiled a dozen of them beside the step's real programs. ``jax.device_put`` of the converted array does not."""
    x = np.asarray(x)
    return jax.device_put(x.astype(jax.dtypes.canonicalize_dtype(x.dtype if dtype is None else dtype), copy=False))


def next_fit(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Packed row of each sequence: in order, a sequence starts a new row when it does not fit the current one."""
    rows, used, row = np.zeros(len(lengths), np.int64), 0, 0
    for i, n in enumerate(lengths):
        if used + n > capacity and used:
            row, used = row + 1, 0
        rows[i], used = row, used + int(n)
    return rows


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Packed row of each sequence: longest first, each into the first row with room (fewer rows than
    ``next_fit``, in any order: ``Packing.vision_index`` keeps the vision tokens' batch order)."""
    rows, used = np.zeros(len(lengths), np.int64), []
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        n = int(lengths[i])
        r = next((j for j, u in enumerate(used) if u + n <= capacity), len(used))
        if r == len(used):
            used.append(0)
        rows[i] = r
        used[r] += n
    return rows


def _stable_rows(lengths: np.ndarray, groups: int, row_lengths) -> tuple[list[np.ndarray], int, int]:
    """(packed row of each sequence per group, rows per group, row length): of the candidate ``row_lengths``
    the one with the fewest slots (a power of two rows per group x the length; the shorter on a tie)."""
    per = len(lengths) // groups
    best = None
    for length in sorted(set(int(c) for c in row_lengths)):
        rows = [first_fit_decreasing(lengths[g * per:(g + 1) * per], length) for g in range(groups)]
        p_group = pow2(max(int(r.max()) + 1 for r in rows), cap=per)
        if best is None or p_group * length < best[1] * best[2]:
            best = (rows, p_group, length)
    return best


def pack_layout(attention_mask: np.ndarray, groups: int = 1, stable: bool = False,
                row_lengths=()) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(flat packed slot [B, T] of each real token, -1 elsewhere; segment ids [P, L]; P), or None when packing
    saves no row. Rows are packed per group of B / groups consecutive rows (each group into the same count).
    Without ``stable``: in row order (``next_fit``) into rows of the batch's length (L = T). ``stable`` (shape
    buckets): always packed, each group into a power of two rows (at most its B / groups; the rows beyond what
    the tokens need empty, segment -1), longest first (``first_fit_decreasing``), into rows of length T or of
    one of ``row_lengths`` (> T: longer rows hold more sequences), whichever runs the fewest slots: measured
    on ``launch.bench_shapes``'s prompts (4 per batch, 49-254 tokens), 37% of the slots padding with rows of T,
    17% with a choice of rows up to ``--max_prompt_len`` (WORKSPACE.md, "Shape-stable batches")."""
    mask = np.asarray(attention_mask) > 0
    b, t = mask.shape
    groups = groups if groups > 1 and b % groups == 0 else 1
    per = b // groups
    lengths = mask.sum(1)
    if stable:
        rows, p_group, length = _stable_rows(lengths, groups, [t, *(c for c in row_lengths if c > t)])
    else:
        rows, length = [next_fit(lengths[g * per:(g + 1) * per], t) for g in range(groups)], t
        p_group = max(int(r.max()) + 1 for r in rows)  # every group holds b / groups >= 1 rows
        if p_group * groups >= b:
            return None
    slot = np.full((b, t), -1, np.int64)
    segments = np.full((p_group * groups, length), -1, np.int32)
    for g, r in enumerate(rows):
        fill = np.zeros(p_group, np.int64)
        for i, pr in enumerate(r):
            row, packed_row, n = g * per + i, g * p_group + int(pr), int(lengths[g * per + i])
            start = fill[pr]
            slot[row, mask[row]] = packed_row * length + start + np.arange(n)
            segments[packed_row, start:start + n] = row
            fill[pr] += n
    return slot, segments, p_group * groups


def pack(input_ids: np.ndarray, token_types: np.ndarray, positions: np.ndarray, layout) -> Packing:
    """The ``Packing`` of padded host arrays [B, T] (positions [3, B, T]) under ``pack_layout``'s result."""
    slot, segments, p = layout
    length = segments.shape[1]
    real = slot >= 0
    ids = np.zeros(p * length, np.int32)
    types = np.zeros(p * length, np.int32)
    pos = np.zeros((3, p * length), positions.dtype)
    vision = np.full(p * length, -1, np.int32)
    ids[slot[real]] = input_ids[real]
    types[slot[real]] = token_types[real]
    pos[:, slot[real]] = positions[:, real]
    vision[slot[real]] = vision_order(token_types)[real]
    return Packing(input_ids=to_device(ids.reshape(p, length)), token_types=to_device(types.reshape(p, length)),
                   positions=to_device(pos.reshape(3, p, length)), segments=to_device(segments),
                   unpack=to_device(np.where(real, slot, 0).astype(np.int32)),
                   vision_index=to_device(vision.reshape(p, length)))


def vision_order(token_types: np.ndarray) -> np.ndarray:
    """[B, T] index of each placeholder's vision embedding (images row-major first, then videos; -1 for text):
    the order ``text.embed`` assigns them in the padded batch."""
    types = np.asarray(token_types)
    img, vid = (types == 1), (types == 2)
    flat_img, flat_vid = img.reshape(-1), vid.reshape(-1)
    idx = np.where(flat_img, np.cumsum(flat_img) - 1,
                   np.where(flat_vid, flat_img.sum() + np.cumsum(flat_vid) - 1, -1))
    return idx.reshape(types.shape).astype(np.int32)


def unpack_rows(x: jax.Array, packing: Packing, window=None) -> jax.Array:
    """Packed x [P, T, ...] -> padded [B, T, ...] (or [B, length, ...] for ``window=(start, length)``, start
    may be traced); padded positions get whatever slot 0 holds (callers mask them, as they mask padding)."""
    idx = packing.unpack
    if window is not None:
        idx = jax.lax.dynamic_slice_in_dim(idx, window[0], window[1], axis=1)
    flat = x.reshape(-1, *x.shape[2:])
    return flat[idx]


def padding_fraction(attention_mask: np.ndarray, packed_rows: int | None = None) -> float:
    """Share of the token slots that are padding: in the padded batch, or in ``packed_rows`` rows of length T."""
    mask = np.asarray(attention_mask)
    rows = mask.shape[0] if packed_rows is None else packed_rows
    return 1.0 - float((mask > 0).sum()) / float(rows * mask.shape[1])
