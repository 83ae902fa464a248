"""Positions for Qwen2.5-VL: the text model's 3-D M-RoPE index and the vision tower's layout.

Both depend on the data (where image tokens sit, each image's grid), not on
parameters, so they are computed on the host with numpy and passed to the jit
programs as integer arrays: a program is then specialised on shapes only.

``get_rope_index`` follows transformers' ``Qwen2_5_VLModel.get_rope_index``
(transformers 5.x): text tokens advance all three axes together; an image or
video block takes (t, h, w) positions offset by the running position, and the
running position then advances by ``max(h, w) // merge``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from rollplex_jax.config import ModelConfig, TextConfig, VisionConfig

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(input_ids: np.ndarray, cfg: ModelConfig, vision_region: np.ndarray | None = None) -> np.ndarray:
    """0 for text, 1 for image-pad, 2 for video-pad tokens (HF's ``mm_token_type_ids``).

    Pad ids outside ``vision_region`` (e.g. inside a sampled answer) are text: only the prompt
    carries images, and a policy may well sample the image-pad id.
    """
    types = np.zeros_like(input_ids, dtype=np.int32)
    types[input_ids == cfg.image_token_id] = IMAGE
    types[input_ids == cfg.video_token_id] = VIDEO
    if vision_region is not None:
        types[~np.asarray(vision_region, bool)] = TEXT
    return types


def _runs(types: np.ndarray):
    """Yields (type, start, end) for each maximal run of equal token types."""
    start = 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            yield int(types[start]), start, i
            start = i


def get_rope_index(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    cfg: ModelConfig,
    image_grid_thw: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | None = None,
    types: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """3-D positions of every token.

    Args:
      input_ids: [B, T] token ids (any padding side; pads have attention_mask 0).
      attention_mask: [B, T] 1 for real tokens.
      cfg: the model config (special ids, merge size, tokens_per_second).
      image_grid_thw, video_grid_thw: [n, 3] grids, in the order the image/video blocks
        appear across the batch (row-major over batch then sequence).
      second_per_grid_ts: [n_videos] seconds per temporal grid step (default 1); the temporal offsets are
        ``temporal_positions`` (float32 arithmetic, as transformers).
      types: [B, T] token types (``token_types``); default: from the ids everywhere.

    Returns:
      positions [3, B, T] int32 (0 at padding) and next_position [B] int32: the text
      position the token after the last real token would take.
    """
    merge = cfg.vision.spatial_merge_size
    if cfg.vision.video_timestamps:  # Qwen3-VL: every frame is its own block (its time as text before it)
        video_grid_thw = frame_grids(video_grid_thw)
        second_per_grid_ts = None
    B, T = input_ids.shape
    positions = np.zeros((3, B, T), np.int32)
    next_pos = np.zeros((B,), np.int32)
    grids = {IMAGE: iter(image_grid_thw if image_grid_thw is not None else []),
             VIDEO: iter(video_grid_thw if video_grid_thw is not None else [])}
    secs = iter(second_per_grid_ts if second_per_grid_ts is not None else [])
    all_types = token_types(input_ids, cfg) if types is None else types
    for b in range(B):
        keep = attention_mask[b].astype(bool)
        types = all_types[b][keep]
        cur, chunks = 0, []
        for kind, s, e in _runs(types):
            if kind == TEXT:
                chunks.append(np.broadcast_to(np.arange(e - s) + cur, (3, e - s)))
                cur += e - s
                continue
            grid = next(grids[kind], None)
            if grid is None:
                raise ValueError(f"row {b}: more {'image' if kind == IMAGE else 'video'} blocks than grids")
            t, h, w = (int(x) for x in grid)
            h, w = h // merge, w // merge
            n = t * h * w
            if e - s != n:
                raise ValueError(f"row {b}: a block of {e - s} vision tokens does not match grid {tuple(grid)} "
                                 f"which needs {n} tokens")
            tt = temporal_positions(t, cfg.vision.tokens_per_second, next(secs, 1.0) if kind == VIDEO else None)
            tg, hg, wg = np.meshgrid(tt, np.arange(h), np.arange(w), indexing="ij")
            chunks.append(np.stack([tg.ravel(), hg.ravel(), wg.ravel()]) + cur)
            cur += max(h, w)
        pos = np.concatenate(chunks, axis=1) if chunks else np.zeros((3, 0), np.int64)
        positions[:, b, keep] = pos
        next_pos[b] = cur
    return positions, next_pos


def frame_grids(grids: np.ndarray | None) -> np.ndarray | None:
    """[n, 3] (t, h, w) grids -> one (1, h, w) grid per temporal step, in order (Qwen3-VL's videos:
    transformers' ``get_rope_index`` repeats each video's grid t times with t = 1)."""
    if grids is None or not len(grids):
        return grids
    g = np.asarray(grids, np.int64)
    out = np.repeat(g, g[:, 0], axis=0)
    out[:, 0] = 1
    return out


def temporal_positions(t: int, tokens_per_second: float, second_per_grid_t: float | None) -> np.ndarray:
    """Temporal M-RoPE offsets of a block's ``t`` grid steps: ``trunc(i x tokens_per_second x second_per_grid_t)``
    in float32, as transformers computes it (``second_per_grid_ts`` is a float32 tensor: ``tokens_per_second x s``
    and ``arange(t) x interval`` are float32 products, then ``.long()``). The float32 rounding matters: with
    s = 0.45, tokens_per_second 2, step 10 is 9 in float32 and 8 in float64 (vLLM computes in float64).
    Images (``second_per_grid_t`` None) take 0, 1, ... (interval 1)."""
    if second_per_grid_t is None:
        return np.arange(t, dtype=np.int64)
    interval = np.float32(tokens_per_second) * np.float32(second_per_grid_t)
    return np.trunc(np.arange(t, dtype=np.float32) * interval).astype(np.int64)


def mrope_cos_sin(positions: jnp.ndarray, cfg: TextConfig, dtype) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables [..., T, head_dim] for M-RoPE from positions [3, ..., T].

    Frequency band i (of head_dim/2) takes its angle from axis (t, h, w) given by
    which ``mrope_section`` chunk it falls in; the table is then duplicated for the
    rotate-half layout.
    """
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [3, ..., T, hd/2]
    band = _select_axis(freqs, axis_of_band(cfg))
    emb = jnp.concatenate([band, band], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def axis_of_band(cfg: TextConfig) -> np.ndarray:
    """The position axis (0 t, 1 h, 2 w) of each of the head_dim / 2 frequency bands: Qwen2.5-VL's
    ``mrope_section`` chunks in order (chunk i from axis i % 3); Qwen3-VL's interleaved layout
    (``mrope_interleaved``, transformers' ``recomposition_frequencies``): band j is h where j % 3 == 1 and
    j < 3 x section[1], w where j % 3 == 2 and j < 3 x section[2], t otherwise."""
    if not cfg.mrope_interleaved:
        return np.concatenate([np.full(n, i % 3) for i, n in enumerate(cfg.mrope_section)])
    j, s = np.arange(cfg.head_dim // 2), cfg.mrope_section
    return np.where((j % 3 == 1) & (j < 3 * s[1]), 1, np.where((j % 3 == 2) & (j < 3 * s[2]), 2, 0))


def _select_axis(freqs: jnp.ndarray, axis_of_band: np.ndarray) -> jnp.ndarray:
    """freqs [3, ..., hd/2] -> [..., hd/2] taking band j from axis axis_of_band[j]."""
    onehot = np.eye(3, dtype=np.float32)[axis_of_band].T  # [3, hd/2]
    onehot = onehot.reshape((3,) + (1,) * (freqs.ndim - 2) + (freqs.shape[-1],))
    return jnp.sum(freqs * onehot, axis=0)


def text_positions(start: jnp.ndarray, length: int) -> jnp.ndarray:
    """[3, B, length] positions of text tokens that follow a prefix ending before ``start`` [B]."""
    pos = start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.broadcast_to(pos[None], (3,) + pos.shape)


# ---------------------------------------------------------------------------------------------
# Vision tower layout: window reordering, attention segments, 2-D rotary positions.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Host-computed index arrays for one vision forward over concatenated images/videos.

    All arrays are in *merge-unit* granularity (one row per 2x2 group of patches) except
    ``rot_pos`` which is per patch. ``window_index`` orders merge units window by window
    (as transformers does); ``reverse_index`` undoes it after the merger.
    """

    window_index: np.ndarray  # [U] int32
    reverse_index: np.ndarray  # [U] int32
    full_segment: np.ndarray  # [U] int32, frame id of each (reordered) unit
    window_segment: np.ndarray  # [U] int32, window id of each (reordered) unit
    rot_pos: np.ndarray  # [N, 2] int32 (h, w) of each patch, in reordered patch order
    window_gather: np.ndarray  # [n_windows, S_w] int32 reordered unit indices of each window, padded with U
    frame_gather: np.ndarray  # [n_frames, S_f] int32 reordered unit indices of each frame, padded with U
    # Qwen3-VL's learned position table: 4 bilinear taps per patch into it and their weights (``position_taps``),
    # in reordered patch order as ``rot_pos``; None without a table
    pos_taps: np.ndarray | None = None  # [N, 4] int32
    pos_weights: np.ndarray | None = None  # [N, 4] float32

    def per_patch(self) -> dict[str, np.ndarray]:
        """The per-patch arrays ``vision_forward`` takes as they are (rotary positions, the table's taps)."""
        out = {"rot_pos": self.rot_pos}
        if self.pos_taps is not None:
            out.update(pos_taps=self.pos_taps, pos_weights=self.pos_weights)
        return out

    def arrays(self, groups: int = 1) -> dict[str, np.ndarray]:
        """What ``vision.vision_forward`` takes: the units split into ``groups`` equal, self-contained groups
        (``group_layout``; one group when they cannot be)."""
        return group_layout(self, groups) or group_layout(self, 1)


def group_layout(layout: VisionLayout, groups: int) -> dict[str, np.ndarray] | None:
    """The layout as ``groups`` equal groups of consecutive merge units whose windows, frames and
    reorderings stay inside the group, with group-local indices: ``window_index`` and ``reverse_index``
    [groups, U / groups], ``window_gather`` and ``frame_gather`` [groups, segments per group (padded with
    empty segments), longest] padded with U / groups, and ``rot_pos`` [N, 2] as is. On a mesh the groups
    are the devices' shares of the patches (``fsdp``): every gather is then within a device. None when
    the units cannot be split so (U not divisible, or an image or video crossing a group boundary)."""
    units = len(layout.window_index)
    if groups < 1 or units % groups:
        return None
    size = units // groups
    own = np.arange(units) // size
    if np.any(layout.window_index // size != own):  # a reordering leaves its group: an item crosses a boundary
        return None
    out = {"window_index": (layout.window_index - own * size).reshape(groups, size).astype(np.int32),
           "reverse_index": (layout.reverse_index - own * size).reshape(groups, size).astype(np.int32),
           **layout.per_patch()}
    for key in ("window_gather", "frame_gather"):
        g = _group_segments(getattr(layout, key), units, size, groups)
        if g is None:
            return None
        out[key] = g
    return out


def _group_segments(gather: np.ndarray, units: int, size: int, groups: int) -> np.ndarray | None:
    """[S, L] segment indices (padded with ``units``) -> [groups, C, L] group-local (padded with ``size``)."""
    valid = gather < units
    first = gather[:, 0] // size
    if np.any(valid & (gather // size != first[:, None])):
        return None
    count = np.bincount(first, minlength=groups)
    out = np.full((groups, max(int(count.max()), 1), gather.shape[1]), size, np.int32)
    for k in range(groups):
        seg = gather[first == k]
        out[k, :len(seg)] = np.where(seg < units, seg - k * size, size)
    return out


def vision_layout(grid_thw: np.ndarray, cfg: VisionConfig) -> VisionLayout:
    """Window/segment/rotary layout of ``grid_thw`` [n, 3] (patch grids of each image/video)."""
    m = cfg.spatial_merge_size
    win = cfg.merger_window
    window_index, frame_seg, window_seg, rot, sizes = [], [], [], [], []
    offset = n_frames = n_windows = 0
    for t, h, w in np.asarray(grid_thw, dtype=np.int64).tolist():
        if h % m or w % m:
            raise ValueError(f"grid {(t, h, w)}: h and w must be multiples of spatial_merge_size={m}")
        gh, gw = h // m, w // m
        # 2-D rotary positions of patches, block-major over m x m merge blocks (as the patches are laid out).
        hp, wp = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        hp = hp.reshape(gh, m, gw, m).transpose(0, 2, 1, 3).reshape(-1)
        wp = wp.reshape(gh, m, gw, m).transpose(0, 2, 1, 3).reshape(-1)
        unit_pos = np.stack([hp, wp], -1).reshape(gh * gw, m * m, 2)
        nwh, nww = -(-gh // win), -(-gw // win)
        for f in range(t):
            idx = np.arange(gh * gw).reshape(gh, gw)
            for wi in range(nwh):
                for wj in range(nww):
                    block = idx[wi * win:(wi + 1) * win, wj * win:(wj + 1) * win].reshape(-1)
                    window_index.append(block + offset + f * gh * gw)
                    window_seg.append(np.full(block.size, n_windows))
                    frame_seg.append(np.full(block.size, n_frames + f))
                    rot.append(unit_pos[block].reshape(-1, 2))
                    sizes.append(np.broadcast_to([h, w], (block.size * m * m, 2)))
                    n_windows += 1
        offset += t * gh * gw
        n_frames += t
    window_index = np.concatenate(window_index).astype(np.int32)
    full_segment = np.concatenate(frame_seg).astype(np.int32)
    window_segment = np.concatenate(window_seg).astype(np.int32)
    rot_pos = np.concatenate(rot).astype(np.int32)
    taps = position_taps(rot_pos, np.concatenate(sizes), cfg.num_position_embeddings) \
        if cfg.num_position_embeddings else (None, None)
    return VisionLayout(
        window_index=window_index,
        reverse_index=np.argsort(window_index).astype(np.int32),
        full_segment=full_segment,
        window_segment=window_segment,
        rot_pos=rot_pos,
        window_gather=segment_gather(window_segment),
        frame_gather=segment_gather(full_segment),
        pos_taps=taps[0],
        pos_weights=taps[1],
    )


def position_taps(pos: np.ndarray, size: np.ndarray, table: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3-VL's learned position table (``table`` entries, a square of side s) bilinearly resampled to each
    patch's frame, as transformers' ``get_vision_interpolation_indices_and_weights`` (bilinear, align_corners,
    border): per patch at (row, col) [N, 2] of a frame of size (h, w) [N, 2], the 4 table rows h_tap x s + w_tap
    and their weights, the per-axis source ``index x (s - 1) / max(size - 1, 1)`` and weights ``max(1 - |src -
    tap|, 0)`` in float32. Returns (taps [N, 4] int32, weights [N, 4] float32)."""
    side = int(round(table**0.5))
    axes = []
    for a in (0, 1):
        src = pos[:, a].astype(np.float32) * np.float32(side - 1) / np.maximum(size[:, a] - 1, 1).astype(np.float32)
        floor = np.floor(src)
        raw = floor[:, None] + np.arange(2, dtype=np.float32)
        weight = np.maximum(np.float32(1) - np.abs(src[:, None] - raw), np.float32(0))
        axes.append((np.clip(raw, 0, side - 1).astype(np.int64), weight.astype(np.float32)))
    (ht, hw), (wt, ww) = axes
    taps = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    return taps.astype(np.int32), (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)


def segment_gather(segment: np.ndarray) -> np.ndarray:
    """[n_segments, longest] indices of each run of equal ids in ``segment`` (runs are contiguous in the
    window-reordered order), padded with ``len(segment)``: attention runs per segment, not over one dense
    [N, N] mask, so its cost is sum of squared segment sizes (padded to the longest) instead of N^2."""
    seg = np.asarray(segment)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    lens = np.diff(np.r_[starts, len(seg)])
    if len(np.unique(seg)) != len(starts):
        raise ValueError("segment ids must form contiguous runs")
    out = np.full((len(starts), int(lens.max())), len(seg), np.int32)
    for i, (a, n) in enumerate(zip(starts, lens, strict=True)):
        out[i, :n] = np.arange(a, a + n)
    return out


def vision_cos_sin(rot_pos: jnp.ndarray, cfg: VisionConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Axial 2-D rotary tables [N, head_dim] (fp32) from per-patch (h, w) positions [N, 2]."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, half, 2, dtype=np.float32) / half))
    freqs = rot_pos.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, hd/4]
    hw = freqs.reshape(freqs.shape[0], -1)  # [N, hd/2] = (h bands, w bands)
    emb = jnp.concatenate([hw, hw], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def pad_layout(layout: VisionLayout, units: int, windows: int, window_len: int, frames: int,
               frame_len: int, unit: int) -> VisionLayout:
    """The layout of the same items followed by ``units - U`` padding merge units (``unit`` patches each), with
    ``windows`` x ``window_len`` and ``frames`` x ``frame_len`` segment gathers (shape buckets,
    ``config/shapes.py``). Padding units stay in place (identity in both reorderings), sit in no segment (so no
    real patch attends to them and they attend to nothing that reaches a real output) and have rotary position
    (0, 0); their merged tokens follow the real ones and are never scattered into the text (``text.embed`` takes
    the first n_image + n_video). Segments gain empty rows and masked columns: index ``units``, out of range."""
    n = len(layout.window_index)
    if units < n or windows < len(layout.window_gather) or frames < len(layout.frame_gather) \
            or window_len < layout.window_gather.shape[1] or frame_len < layout.frame_gather.shape[1]:
        raise ValueError(f"pad_layout: buckets ({units} units, {windows} x {window_len} windows, {frames} x "
                         f"{frame_len} frames) smaller than the layout's")
    extra = np.arange(n, units, dtype=np.int32)
    taps = {} if layout.pos_taps is None else dict(
        pos_taps=np.concatenate([layout.pos_taps, np.zeros(((units - n) * unit, 4), np.int32)]),
        pos_weights=np.concatenate([layout.pos_weights, np.zeros(((units - n) * unit, 4), np.float32)]))

    def gather(g: np.ndarray, rows: int, cols: int) -> np.ndarray:
        out = np.full((rows, cols), units, np.int32)
        out[:g.shape[0], :g.shape[1]] = np.where(g < n, g, units)
        return out

    return VisionLayout(
        window_index=np.concatenate([layout.window_index, extra]),
        reverse_index=np.concatenate([layout.reverse_index, extra]),
        full_segment=np.concatenate([layout.full_segment, np.full(units - n, -1, np.int32)]),
        window_segment=np.concatenate([layout.window_segment, np.full(units - n, -1, np.int32)]),
        rot_pos=np.concatenate([layout.rot_pos, np.zeros(((units - n) * unit, 2), np.int32)]),
        window_gather=gather(layout.window_gather, windows, window_len),
        frame_gather=gather(layout.frame_gather, frames, frame_len),
        **taps,
    )


def single_group(layout: VisionLayout) -> dict[str, np.ndarray]:
    """``group_layout(layout, 1)`` that keeps empty (padding) segments: what ``vision_forward`` takes."""
    return {"window_index": layout.window_index[None], "reverse_index": layout.reverse_index[None],
            **layout.per_patch(), "window_gather": layout.window_gather[None],
            "frame_gather": layout.frame_gather[None]}
