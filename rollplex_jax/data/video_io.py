"""Video inputs end to end: a dataset's video item -> a plan from metadata -> Qwen2.5-VL patches.

Three steps, so a dataset can count every video's tokens at load time and decode pixels only per batch:

- ``video_spec(item, base_dir)``: one dataset video item (a path, ``file://`` path, a verl-style dict
  ``{"video": path or [frame paths], "fps", "nframes", ...}``, or a list of frame paths) -> ``VideoSpec``.
- ``probe_video(spec, rule)``: metadata only (``video_decode.container_info``: packets counted, nothing
  decoded; a frame list: image headers) -> ``VideoPlan``: frame indices, per-frame size, grid, token count,
  sampled fps and ``second_per_grid_t``, by Qwen's rules (``video_sampling``).
- ``load_video(spec, plan, vision)``: decodes the planned frames only -> float32 ``[t*h*w, patch_dim]``.

As qwen-vl-utils 0.0.14 (``fetch_video``) does it, and where we differ:

- A file: frames ``linspace(first, last, n).round()`` over the whole video or the ``video_start`` /
  ``video_end`` clip, ``n`` from the fps rule (``video_sampling.frame_count``), each frame resized to
  ``frame_size`` (the per-frame share of ``total_pixels``, within [min_pixels, max_pixels]).
  ``sampled fps = n / frames in the clip x video fps``, ``second_per_grid_t = temporal_patch_size / sampled fps``.
- A frame list: every frame is used (no fps resampling: qwen-vl-utils has none for lists), padded with the
  last to an even count. Its fps is the row's ``fps`` if given, else the rule's (2.0, as qwen-vl-utils'
  default ``sample_fps``; qwen-vl-utils 0.0.14 reads that key as ``sample_fps`` and older versions as
  ``fps``); ``second_per_grid_t = temporal_patch_size / fps`` (1.0 at the defaults). qwen-vl-utils first
  resizes each frame as an *image* (``fetch_image``: smart_resize within the row's min/max pixels, else
  4 x 28^2 .. 16384 x 28^2, PIL BICUBIC), then resizes that to the video size computed from the image
  size: so do we (``VideoPlan.list_size``), which gives the same token count (sizing the original directly
  would not: a 64x48 list is 336x336 there, 392x280 directly). Frames must all have one size (Qwen stacks
  them). ``nframes``/``min_frames``/``max_frames``/``video_start``/``video_end`` do not apply to a list
  (qwen-vl-utils ignores them; we reject them).
- Resizing: qwen-vl-utils resizes the decoded uint8 frames with torchvision ``resize(BICUBIC,
  antialias=True)``; we resize the RGB frames with PIL BICUBIC, the same pipeline as images
  (``image_processing``: rescale 1/255, CLIP mean/std, patchify). torchvision's antialiased bicubic follows
  PIL's filter (a = -0.5, support widened by the downscale factor) but rounds differently: pixel values may
  differ by a few uint8 levels. Not measured here (torchvision cannot be installed); the token counts,
  grids and ``second_per_grid_t`` are the same by construction.
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
from PIL import Image

from rollplex_jax.config import VisionConfig
from rollplex_jax.data import video_sampling as vs
from rollplex_jax.data.image_processing import (
    RESAMPLE,
    check_vision,
    load_image,
    preprocess_video_at,
    probe_image,
    smart_resize,
)
from rollplex_jax.data.video_decode import VideoError, container_info, decode_frames

__all__ = ["VideoError", "VideoPlan", "VideoSpec", "load_video", "probe_video", "video_spec"]

# qwen-vl-utils' image limits, used for a frame list's per-frame image resize when the row sets none.
IMAGE_MIN_PIXELS = 4 * 28 * 28
IMAGE_MAX_PIXELS = 16384 * 28 * 28

_FLOAT_KEYS = ("fps", "video_start", "video_end")
_INT_KEYS = ("nframes", "min_frames", "max_frames", "min_pixels", "max_pixels", "total_pixels")
_FILE_ONLY = ("nframes", "min_frames", "max_frames", "video_start", "video_end")
ACCEPTED = ('a video path string ("clip.mp4" or "file:///data/clip.mp4"), a list of frame image paths, or a '
            'dict {"video": path or [frame paths]} with optional "fps", "nframes", "min_frames", "max_frames", '
            '"video_start", "video_end" (seconds), "min_pixels", "max_pixels", "total_pixels"')


@dataclasses.dataclass(frozen=True)
class VideoSpec:
    """One video of a row: a container file (``path``) or a frame list (``frames``, image paths in time order),
    with the row's own settings (verl's video dict keys; None: the run's ``VideoRule``)."""

    path: str | None = None
    frames: tuple[str, ...] | None = None
    fps: float | None = None
    nframes: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    video_start: float | None = None
    video_end: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    total_pixels: int | None = None

    def __post_init__(self):
        if (self.path is None) == (self.frames is None):
            raise ValueError("a VideoSpec has a path (a video file) or frames (a list of image paths), exactly one")
        if self.frames is not None:
            if not self.frames:
                raise ValueError("a frame-list video needs at least one frame path")
            if given := [k for k in _FILE_ONLY if getattr(self, k) is not None]:
                raise ValueError(f"{', '.join(given)} apply to a video file, not a frame list (every frame of a "
                                 "list is used); remove them or give the video as a file")
        if self.fps is not None and self.nframes is not None:
            raise ValueError("a video gives fps or nframes, not both (Qwen's rule)")
        for key in _FLOAT_KEYS + _INT_KEYS:
            v = getattr(self, key)
            if v is not None and not v > 0 and not (key == "video_start" and v == 0):
                raise ValueError(f"video {key}={v!r} must be > 0")
        if None not in (self.video_start, self.video_end) and self.video_start >= self.video_end:
            raise ValueError(f"video clip [{self.video_start}, {self.video_end}] s is empty: start must be < end")

    @property
    def name(self) -> str:
        """The file, or the frame list by its first frame and count (for messages)."""
        return self.path if self.path is not None else f"frame list [{self.frames[0]!r}, ... {len(self.frames)} frames]"


def _path(p, base_dir) -> str:
    if not isinstance(p, (str, os.PathLike)):
        raise ValueError(f"a video path must be a string, got {type(p).__name__} {p!r}")
    p = os.fspath(p)
    if p.startswith(("http://", "https://", "data:")):
        raise ValueError(f"video {p[:80]!r} is a URL or inline data; download it and give the local path")
    p = p.removeprefix("file://")
    if not p:
        raise ValueError("a video path is empty")
    return p if os.path.isabs(p) else os.path.normpath(os.path.join(os.fspath(base_dir), p))


def _value(key: str, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} must be a number, got {type(v).__name__} {v!r}")
    if key in _INT_KEYS:
        if v != int(v):
            raise ValueError(f"{key} must be a whole number, got {v!r}")
        return int(v)
    return float(v)


def video_spec(item, base_dir: str | os.PathLike = ".") -> VideoSpec:
    """Parses one dataset video item (module docstring); relative paths are joined to ``base_dir``.

    Raises:
        ValueError: naming the item and the accepted forms.
    """
    try:
        if isinstance(item, (str, os.PathLike)):
            return VideoSpec(path=_path(item, base_dir))
        if isinstance(item, (list, tuple)):
            return VideoSpec(frames=tuple(_path(p, base_dir) for p in item))
        if not isinstance(item, dict):
            raise ValueError(f"a video item cannot be a {type(item).__name__}")
        if "video" not in item:
            raise ValueError('a video dict needs a "video" key')
        unknown = sorted(set(item) - {"video", "type", *_FLOAT_KEYS, *_INT_KEYS})
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}")
        opts = {k: _value(k, v) for k, v in item.items() if k not in ("video", "type") and v is not None}
        video = item["video"]
        if isinstance(video, (list, tuple)):
            return VideoSpec(frames=tuple(_path(p, base_dir) for p in video), **opts)
        return VideoSpec(path=_path(video, base_dir), **opts)
    except ValueError as e:
        raise ValueError(f"video item {str(item)[:200]}: {e}. Accepted: {ACCEPTED}") from None


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    """What ``load_video`` will decode and produce, from metadata only.

    indices: frames to decode (container frame numbers, or positions in the frame list, the last repeated to
    pad); total_frames: frames of the container (packets) or of the list; video_fps: the container's frame rate
    (a frame list: its fps); src_size (h, w) as decoded; list_size: a frame list's per-frame image size (None for
    files); size: (h, w) each frame is resized to; grid_thw: (t, h / patch, w / patch); tokens: merged tokens
    (video pads) ``t * h * w / merge^2`` in grid units; fps: fps of the sampled frames; second_per_grid_t:
    seconds per temporal grid step (M-RoPE ``second_per_grid_ts``); timestamps: each temporal grid step's time in
    seconds (``video_sampling.step_timestamps``: what Qwen3-VL writes into the prompt).
    """

    indices: tuple[int, ...]
    total_frames: int
    video_fps: float
    src_size: tuple[int, int]
    list_size: tuple[int, int] | None
    size: tuple[int, int]
    grid_thw: tuple[int, int, int]
    tokens: int
    fps: float
    second_per_grid_t: float
    timestamps: tuple[float, ...] = ()

    @property
    def patches(self) -> int:
        """Rows of ``load_video``'s output."""
        return int(np.prod(self.grid_thw))


def _pixel_rule(rule: vs.VideoRule, spec: VideoSpec) -> vs.VideoRule:
    over = {k: getattr(spec, k) for k in ("min_pixels", "max_pixels", "total_pixels") if getattr(spec, k) is not None}
    return dataclasses.replace(rule, **over) if over else rule


@dataclasses.dataclass(frozen=True)
class _Sizing:
    """How a probe sizes frames: the run's (or the row's) pixel rule and the vision tower's patch geometry
    (``factor`` = patch_size x spatial_merge_size)."""

    rule: vs.VideoRule
    factor: int
    patch_size: int
    temporal: int


def _plan(indices, total, video_fps, src, list_size, n_for_size, fps, sz: _Sizing) -> VideoPlan:
    h, w = vs.frame_size(*(list_size or src), n_for_size, sz.rule, sz.factor)
    merge = sz.factor // sz.patch_size
    grid = (math.ceil(len(indices) / sz.temporal), h // sz.patch_size, w // sz.patch_size)
    return VideoPlan(indices=tuple(int(i) for i in indices), total_frames=int(total), video_fps=float(video_fps),
                     src_size=tuple(src), list_size=list_size, size=(h, w), grid_thw=grid,
                     tokens=grid[0] * grid[1] * grid[2] // merge**2, fps=float(fps),
                     second_per_grid_t=vs.second_per_grid_t(sz.temporal, fps),
                     timestamps=vs.step_timestamps(indices, video_fps, sz.temporal))


def probe_video(spec: VideoSpec, rule: vs.VideoRule, factor: int = 28, *, patch_size: int = 14,
                temporal_patch_size: int = 2) -> VideoPlan:
    """The plan of ``spec`` from metadata only (module docstring). ``factor`` = patch_size x spatial_merge_size.

    Raises:
        VideoError: the file (or a frame) is missing, empty or unreadable, has no video stream, no frames, fewer
            than 2 frames, an empty clip range, frames of different sizes (a list), or settings Qwen rejects.
    """
    if factor % patch_size:
        raise ValueError(f"factor {factor} is not a multiple of patch_size {patch_size}")
    try:
        rule = _pixel_rule(rule, spec)
    except ValueError as e:
        raise VideoError(f"video {spec.name}: its pixel settings conflict with the run's: {e}") from None
    sz = _Sizing(rule, factor, patch_size, temporal_patch_size)
    if spec.frames is not None:
        return _probe_frames(spec, sz)
    info = container_info(spec.path)
    if info.total_frames < vs.FRAME_FACTOR:
        raise VideoError(f"video file {spec.path!r} has {info.total_frames} frame; Qwen2.5-VL needs at least "
                         f"{vs.FRAME_FACTOR} (one temporal patch): give it as an image instead, or drop it")
    try:
        first, last, count = vs.frame_range(info.total_frames, info.fps, spec.video_start, spec.video_end)
        n = vs.frame_count(count, info.fps, rule, nframes=spec.nframes, fps=spec.fps, min_frames=spec.min_frames,
                           max_frames=spec.max_frames)
        indices = vs.frame_indices(first, last, n)
        return _plan(indices, info.total_frames, info.fps, (info.height, info.width), None, n,
                     vs.sampled_fps(n, count, info.fps), sz)
    except ValueError as e:
        raise VideoError(f"video file {spec.path!r} ({info.total_frames} frames at {info.fps:g} fps, "
                         f"{info.height}x{info.width}): {e}; fix the row's settings or drop the video") from None


def _probe_frames(spec: VideoSpec, sz: _Sizing) -> VideoPlan:
    sizes = []
    for i, p in enumerate(spec.frames):
        try:
            sizes.append(probe_image(p))
        except ValueError as e:
            raise VideoError(f"frame {i} of {spec.name}: {e}") from None
    for i, s in enumerate(sizes):
        if s != sizes[0]:
            raise VideoError(f"{spec.name}: frame {i} ({spec.frames[i]!r}) is {s[0]}x{s[1]} but frame 0 is "
                             f"{sizes[0][0]}x{sizes[0][1]} (height x width); the frames of a video must have one "
                             "size: resize them to one size, or split the list")
    n = len(spec.frames)
    padded = vs.padded_frame_count(n)
    indices = list(range(n)) + [n - 1] * (padded - n)
    fps = sz.rule.fps if spec.fps is None else spec.fps
    try:
        list_size = smart_resize(*sizes[0], sz.factor, spec.min_pixels or IMAGE_MIN_PIXELS,
                                 spec.max_pixels or IMAGE_MAX_PIXELS)
        return _plan(indices, n, fps, sizes[0], list_size, padded, fps, sz)
    except ValueError as e:
        raise VideoError(f"{spec.name}: {e}; fix the row's settings or the frames") from None


def load_video(spec: VideoSpec, plan: VideoPlan, vision: VisionConfig) -> np.ndarray:
    """Decodes the planned frames of ``spec`` and turns them into float32 ``[t*h*w, vision.patch_dim]`` patches
    (``plan.grid_thw``), exactly as images are (``image_processing.preprocess_video_at``).

    Raises:
        VideoError: the file decodes to fewer frames than planned, a frame changed size since the probe, or any
            reading error; ValueError: ``plan`` was made for another patch geometry than ``vision``.
    """
    factor = check_vision(vision)
    h, w = plan.size
    want = (math.ceil(len(plan.indices) / vision.temporal_patch_size), h // vision.patch_size, w // vision.patch_size)
    if h % factor or w % factor or want != tuple(plan.grid_thw):
        raise ValueError(f"video plan of {spec.name} (size {h}x{w}, grid {plan.grid_thw}) was not made for this "
                         f"vision config (patch {vision.patch_size}, merge {vision.spatial_merge_size}, temporal "
                         f"{vision.temporal_patch_size}); probe it with factor={factor}")
    if spec.frames is not None:
        frames = _load_list(spec, plan)
    else:
        frames = decode_frames(spec.path, plan.indices, plan.total_frames)
        for i, f in zip(plan.indices, frames, strict=True):
            if (f.height, f.width) != tuple(plan.src_size):
                raise VideoError(f"video file {spec.path!r}: frame {i} decodes at {f.height}x{f.width}, the stream "
                                 f"said {plan.src_size[0]}x{plan.src_size[1]}; videos that change size mid-stream "
                                 "are not supported: re-encode at one size")
    patches, _ = preprocess_video_at(frames, vision, h, w)
    return patches


def _load_list(spec: VideoSpec, plan: VideoPlan) -> list[Image.Image]:
    """The frame list's planned frames, each resized as an image first (``plan.list_size``), as qwen-vl-utils."""
    lh, lw = plan.list_size
    loaded: dict[int, Image.Image] = {}
    for i in sorted(set(plan.indices)):
        try:
            img = load_image(spec.frames[i])
        except ValueError as e:
            raise VideoError(f"frame {i} of {spec.name}: {e}") from None
        if (img.height, img.width) != tuple(plan.src_size):
            raise VideoError(f"frame {i} of {spec.name} ({spec.frames[i]!r}) is {img.height}x{img.width}, the plan "
                             f"said {plan.src_size[0]}x{plan.src_size[1]}: the file changed since it was probed")
        loaded[i] = img.resize((lw, lh), resample=RESAMPLE)
    return [loaded[i] for i in plan.indices]
