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
``vision_forward``'s groups, which the mesh splits over its devices: every device encodes one part per call.

The buffer: [slots, groups x units, width] (``Chunks.shape``), its second axis split over the batch shards as the
chunks' parts are, so a device holds 1 / groups of it and writes only its own parts' tokens (``write_chunk``: a
chunk fills slot ``Chunks.offsets[c]``; an oversized part of k x units fills k slots). Without that split the
buffer and its cotangent were whole on every device: 16.25 GiB each at Qwen3-VL-32B (DeepStack makes a row 4 x
5120 wide), which put the GPU-compiled train phase at 110.78 GiB. ``Chunks.slots`` is the flat row of every vision
token in batch order (images then videos, as ``text.embed`` takes them), which the text programs gather
(``ModelInputs.vision_slots``, ``gather_slots``: each device gathers the tokens it holds, a sum over the batch
shards adds the rest, exactly, as every other shard adds zeros). Outputs equal the whole-batch encoding up to float
summation order (tested).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from rollplex_jax.config import VisionConfig
from rollplex_jax.config.shapes import ChunkSpec, pow2, windows_for
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.layers import constrain_rows


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
    """A batch's vision chunks: their inputs (host arrays), each chunk's first slot in the buffer, the flat
    buffer row of every vision token in batch order (``slots``, padded to the buffer's rows with 0), the buffer's
    rows and the rows of one of its slots (``row``: groups x units)."""

    inputs: list[dict]
    offsets: list[int]
    slots: np.ndarray
    buffer: int
    row: int

    @property
    def shape(self) -> tuple[int, int]:
        """The buffer's [slots, groups x units] (times the embedding width)."""
        return self.buffer // self.row, self.row


def buffer_row(slot: int, part: int, u: np.ndarray, spec: ChunkSpec) -> np.ndarray:
    """Flat buffer rows of tokens ``u`` of part ``part`` of the chunk at ``slot``: part j's unit u in slot
    slot + u // units, row j x units + u % units (a regular chunk: slot x groups x units + j x units + u)."""
    return ((slot + u // spec.units) * spec.groups + part) * spec.units + u % spec.units


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
    inputs, offsets, slot = [], [], 0
    for run in _runs(*_pack(items, spec, cfg), spec.groups):
        parts = []
        for j, ((units, windows, rows, frame), real) in enumerate(run):
            members = [i for r in rows for i in r]
            layout = rope.vision_layout(np.array([[1, items[i][0], items[i][1]] for i in members]), cfg)
            patches = [pixel_values[items[i][3]:items[i][3] + items[i][0] * items[i][1]] for i in members]
            local = 0
            for i in members if real else ():
                n = items[i][0] * items[i][1] // merge
                slots[items[i][2]:items[i][2] + n] = buffer_row(slot, j, local + np.arange(n), spec)
                local += n
            parts.append(_chunk_arrays(layout, np.concatenate(patches), (units, windows),
                                       [len(r) for r in rows], frame, cfg))
        inputs.append(_stack(parts))
        offsets.append(slot)
        slot += max(1, run[0][0][0] // spec.units)  # every part of a run has the same units
    buffer = max(spec.buffer, slot * spec.chunk_units)
    return Chunks(inputs, offsets, np.pad(slots, (0, buffer - n_tokens)), buffer, spec.chunk_units)


def slot_count(buffer: int, rows: int, length: int) -> int:
    """The length of the vision slots of ``rows`` prompt rows of ``length`` tokens (``ModelInputs.vision_slots``):
    as many as they can hold, at most the buffer's rows. A fixed shape per (rows, length), so no new programs, and
    a micro-batch's programs gather their own rows' tokens, not a whole buffer's worth (at Qwen3-VL-32B that copy
    was 16.25 GiB)."""
    return min(buffer, rows * length)


def write_chunk(buffer: jax.Array, emb: jax.Array, slot, groups: int) -> jax.Array:
    """``buffer`` [slots, groups x units, W] with a chunk's embeddings ``emb`` [groups x part units, W] (part j's
    tokens in the j-th row block, as ``vision_forward`` gives them) written from ``slot``: each part's tokens into
    the row block its batch shard holds (a part larger than a slot's row block spans several slots)."""
    gu, w = buffer.shape[1:]
    units, per = emb.shape[0] // groups, gu // groups
    x = emb.reshape(groups, units, w)
    if units < per:
        x = jnp.pad(x, ((0, 0), (0, per - units), (0, 0)))
    k = max(1, units // per)
    x = constrain_buffer(x.reshape(groups, k, per, w).transpose(1, 0, 2, 3).reshape(k, gu, w))
    return constrain_buffer(jax.lax.dynamic_update_slice_in_dim(buffer, x.astype(buffer.dtype), slot, axis=0))


def read_chunk(buffer: jax.Array, slot, units: int, groups: int) -> jax.Array:
    """The rows ``write_chunk`` wrote for a chunk of parts of ``units``: [groups x units, W]."""
    gu, w = buffer.shape[1:]
    per = gu // groups
    k = max(1, units // per)
    x = jax.lax.dynamic_slice_in_dim(buffer, slot, k, axis=0).reshape(k, groups, per, w).transpose(1, 0, 2, 3)
    return x.reshape(groups, k * per, w)[:, :units].reshape(groups * units, w)


def constrain_buffer(x: jax.Array | None) -> jax.Array | None:
    """A buffer-shaped array [slots, groups x units, W] (the buffer, its cotangent) split as the buffer is; any
    other (None, a frozen tower's [tokens, W] embeddings) unchanged."""
    return constrain_rows(x, (1,)) if x is not None and x.ndim == 3 else x


def gather_slots(buffer: jax.Array, slots: jax.Array) -> jax.Array:
    """The embeddings of flat buffer rows ``slots`` [S]: [S, W] (on a mesh each device gathers the rows it holds
    and the batch shards' results are summed)."""
    gu = buffer.shape[1]
    return buffer[slots // gu, slots % gu]


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
