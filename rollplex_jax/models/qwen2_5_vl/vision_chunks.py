"""Fixed-shape vision micro-batches ("vision chunks"): a batch's images and video frames encoded by one program
shape, however many there are and whatever their sizes.

Why: with the vision tower inside the prefix programs, every batch of images of other sizes is a new program
(patch count, windows, frame lengths), and combined with the text's shapes a real dataset kept compiling new
prefix programs for the whole run (``launch.bench_shapes``: 26 compiles over steps 6-30, WORKSPACE.md
"Shape-stable batches"). The vision tower never mixes two frames (windows and full attention stay inside a
frame), so the frames of a batch can be encoded in any grouping: here they are packed into chunks of a fixed
number of merge units (``ChunkSpec.units``), each chunk one call of one program, and the number of chunks
varies instead of the shapes.

How: ``plan_chunks`` splits every image and every video frame (a temporal grid step) into an *item*, packs the
items first-fit decreasing into full-attention rows of ``spec.frame`` units and the rows into *parts* of
``spec.units`` merge units and ``spec.windows`` attention windows (an item larger than that gets a part of its
own, a power of two above: a second shape, as rare as such items), and lays each part out as ``vision_forward``
takes it: the items' patches then zero patches, the window gathers padded to ``spec.windows``, and the
full-attention rows with the frames told apart by segment ids (``frame_ids``: each frame attends to itself
only). A chunk is ``spec.groups`` parts (one per batch shard: ``--train_dp x --train_fsdp``), stacked as
``vision_forward``'s groups, which the mesh splits over its devices: every device encodes one part per call. Each
chunk's merged tokens land in one buffer of ``spec.buffer`` rows at the chunk's offset (``Chunks.offsets``);
``Chunks.slots`` is the buffer row of every vision token in batch order (images then videos, as ``text.embed``
takes them), which the text programs gather (``ModelInputs.vision_slots``). Outputs equal the whole-batch
encoding up to float summation order (tested).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rollplex_jax.config import VisionConfig
from rollplex_jax.config.shapes import ChunkSpec, pow2, windows_for
from rollplex_jax.models.qwen2_5_vl import rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionInputs:
    """One chunk as ``vision.vision_forward`` takes it: pixel_values [units x merge^2, patch_dim] and its layout
    (``window_index``, ``reverse_index`` [1, units], ``rot_pos`` [units x merge^2, 2], ``window_gather``
    [1, windows, window units], ``frame_gather`` and ``frame_ids`` [1, units / frame, frame])."""

    pixel_values: jax.Array
    layout: dict


@dataclasses.dataclass(frozen=True)
class Chunks:
    """A batch's vision chunks: their inputs (host arrays), each chunk's first row in the buffer, and the
    buffer row of every vision token in batch order (``slots``, padded to the buffer's rows with 0)."""

    inputs: list[dict]
    offsets: list[int]
    slots: np.ndarray
    buffer: int


def _items(grids: np.ndarray, merge: int) -> list[tuple[int, int, int, int]]:
    """(h, w, first token, first patch) of every frame of every item in ``grids`` [n, 3] (batch order)."""
    out, tok, patch = [], 0, 0
    for t, h, w in np.asarray(grids, np.int64).tolist():
        for _ in range(t):
            out.append((h, w, tok, patch))
            tok, patch = tok + h * w // merge, patch + h * w
    return out


def _windows(h: int, w: int, cfg: VisionConfig) -> int:
    m, win = cfg.spatial_merge_size, cfg.merger_window
    return -(-(h // m) // win) * -(-(w // m) // win)


def _pack(items, spec: ChunkSpec, cfg: VisionConfig) -> tuple[list, list]:
    """(regular parts, oversized ones), each part (units, windows, full-attention rows of item indices, row
    length): the items first-fit decreasing into rows of ``spec.frame`` units (and at most ``spec.windows``
    windows), the rows first-fit into parts of ``spec.units / spec.frame`` rows and ``spec.windows`` windows; an
    item over a limit alone in a part of the next power of two (and its windows), one row of it."""
    merge = cfg.spatial_merge_size**2
    need = [(h * w // merge, _windows(h, w, cfg)) for h, w, _, _ in items]
    alone, rows = [], []  # rows: [units, windows, items]
    for i in sorted(range(len(items)), key=lambda j: -need[j][0]):
        u, wn = need[i]
        if u > spec.frame or wn > spec.windows:
            units = pow2(u)
            alone.append((units, max(windows_for(units, cfg.merger_window**2), pow2(wn)), [[i]], units))
            continue
        r = next((r for r in rows if r[0] + u <= spec.frame and r[1] + wn <= spec.windows), None)
        if r is None:
            rows.append(r := [0, 0, []])
        r[0], r[1] = r[0] + u, r[1] + wn
        r[2].append(i)
    chunks: list[list] = []  # [windows, rows]
    for r in rows:
        c = next((c for c in chunks if len(c[1]) < spec.units // spec.frame and c[0] + r[1] <= spec.windows), None)
        if c is None:
            chunks.append(c := [0, []])
        c[0] += r[1]
        c[1].append(r[2])
    return [(spec.units, spec.windows, c[1], spec.frame) for c in chunks], alone


def _runs(regular: list, alone: list, groups: int) -> list[list[tuple[tuple, bool]]]:
    """The parts as chunks of ``groups`` parts of one shape each, (part, real): the regular parts in runs of
    ``groups``, an oversized one per chunk; a run short of ``groups`` is filled with copies of its last part
    (``real`` False: encoded into buffer rows no token reads, so the buffer's cotangent there is zero and so is
    their gradient; an oversized item on a mesh costs ``groups`` times its encoding)."""
    runs = [regular[i:i + groups] for i in range(0, len(regular), groups)] + [[p] for p in alone]
    return [[(p, True) for p in run] + [(run[-1], False)] * (groups - len(run)) for run in runs]


def plan_chunks(grids: np.ndarray, pixel_values: np.ndarray, spec: ChunkSpec, cfg: VisionConfig) -> Chunks:
    """The vision chunks of a batch's items (``grids`` [n, 3]: images then videos, ``pixel_values`` their patches
    in that order), see the module docstring."""
    merge = cfg.spatial_merge_size**2
    items = _items(grids, merge)
    n_tokens = items[-1][2] + items[-1][0] * items[-1][1] // merge if items else 0
    slots = np.zeros(n_tokens, np.int32)
    inputs, offsets, base = [], [], 0
    for run in _runs(*_pack(items, spec, cfg), spec.groups):
        parts = []
        for j, ((units, windows, rows, frame), real) in enumerate(run):
            members = [i for r in rows for i in r]
            layout = rope.vision_layout(np.array([[1, items[i][0], items[i][1]] for i in members]), cfg)
            patches = [pixel_values[items[i][3]:items[i][3] + items[i][0] * items[i][1]] for i in members]
            local = base + j * units
            for i in members if real else ():
                n = items[i][0] * items[i][1] // merge
                slots[items[i][2]:items[i][2] + n] = local + np.arange(n)
                local += n
            parts.append(_chunk_arrays(layout, np.concatenate(patches), (units, windows),
                                       [len(r) for r in rows], frame, cfg))
        inputs.append(_stack(parts))
        offsets.append(base)
        base += units * len(run)  # every part of a run has the same units
    whole = spec.chunk_units
    buffer = max(spec.buffer, -(-base // whole) * whole)
    return Chunks(inputs, offsets, np.pad(slots, (0, buffer - n_tokens)), buffer)


def _stack(parts: list[dict]) -> dict:
    """One chunk's arrays from its parts' (each one group): the groups ``vision_forward`` splits over the mesh
    (``rope.group_layout``'s form: group-local indices [groups, ...], patches and rotary positions in part order)."""
    return {"pixel_values": np.concatenate([p["pixel_values"] for p in parts]),
            "layout": {k: np.concatenate([p["layout"][k] for p in parts]) for k in parts[0]["layout"]}}


def _chunk_arrays(layout: rope.VisionLayout, patches: np.ndarray, size: tuple[int, int], row_items: list[int],
                  frame: int, cfg: VisionConfig) -> dict:
    """A chunk's pixel_values and layout: ``rope.pad_layout`` to ``size`` = (units, windows), and the full
    attention in units / ``frame`` rows of ``frame`` units, row r holding the next ``row_items[r]`` frames (the
    layout's frames in order), told apart by frame ids (padding: index ``units``, outside the gather, and id -1)."""
    merge = cfg.spatial_merge_size**2
    units, windows = size
    n = len(layout.window_index)
    padded = rope.pad_layout(layout, units, windows, cfg.merger_window**2, len(layout.frame_gather),
                             layout.frame_gather.shape[1], merge)
    arrays = rope.single_group(padded)
    gather, ids = np.full((units // frame, frame), units, np.int32), np.full((units // frame, frame), -1, np.int32)
    row_of = np.repeat(np.arange(len(row_items)), row_items)  # the layout's frames in order, row by row
    fill = np.zeros(len(row_items), np.int64)
    for f, row in enumerate(row_of):
        members = layout.frame_gather[f][layout.frame_gather[f] < n]
        gather[row, fill[row]:fill[row] + len(members)], ids[row, fill[row]:fill[row] + len(members)] = members, f
        fill[row] += len(members)
    arrays["frame_gather"], arrays["frame_ids"] = gather[None], ids[None]
    pad = np.zeros((units * merge - len(patches), patches.shape[1]), np.float32)
    return {"pixel_values": np.concatenate([patches.astype(np.float32), pad]), "layout": arrays}
