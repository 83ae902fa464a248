"""Which frames of a video Qwen2.5-VL sees, and at what size: the rules of Qwen's own video utilities.

Why our own: qwen-vl-utils (``vision_process.py``) and transformers' video processor both import torchvision,
which cannot be installed here (../shared/DATA.md). These are the documented rules as pure functions, so a
dataset can count a video's tokens without decoding it and the decoder (PyAV) only decodes the chosen frames:

- frames sampled at ``fps`` (default 2.0): ``n = total / video_fps * fps``, clamped to [ceil2(min_frames),
  floor2(min(max_frames, total))] and to ``total``, then rounded down to a multiple of 2 (``FRAME_FACTOR``);
  or exactly ``nframes`` (rounded to a multiple of 2) when a row asks for a count (``frame_count``);
- which frames: ``linspace(start, end, n).round()`` as torch computes it in float32 (``frame_indices``), over
  the whole video or a ``[video_start, video_end]`` second range (``frame_range``);
- a frame list (a video given as image paths) is padded with its last frame to a multiple of 2
  (``padded_frame_count``);
- pixels per frame: at least ``min_pixels`` (128 x 28^2) and at most
  ``max(min(max_pixels, total_pixels / n x 2), 1.05 x min_pixels)`` (``frame_pixel_budget``; the total budget
  defaults to 128000 x 28^2 x 0.9), then ``smart_resize`` to multiples of 28 (``frame_size``);
- the M-RoPE time step: ``second_per_grid_t = temporal_patch_size / sampled_fps`` (``second_per_grid_t``),
  with ``sampled_fps = n / total x video_fps``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from rollplex_jax.data.image_processing import smart_resize

FRAME_FACTOR = 2
FPS = 2.0
MIN_FRAMES = 4
MAX_FRAMES = 768
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)


@dataclasses.dataclass(frozen=True)
class VideoRule:
    """How videos are sampled and sized (Qwen's defaults; no flag sets them yet: issue 18); a row's own ``fps`` /
    ``nframes`` / ``min_frames`` / ``max_frames`` override them (verl's video dict)."""

    fps: float = FPS
    min_frames: int = MIN_FRAMES
    max_frames: int = MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    total_pixels: int = VIDEO_TOTAL_PIXELS

    def __post_init__(self):
        if not self.fps > 0:
            raise ValueError(f"video fps must be > 0, got {self.fps}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"need 1 <= min_frames <= max_frames, got {self.min_frames} and {self.max_frames}")
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 1 <= video min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")
        if self.total_pixels < 1:
            raise ValueError(f"video total_pixels must be >= 1, got {self.total_pixels}")


def _round2(x: float) -> int:
    return round(x / FRAME_FACTOR) * FRAME_FACTOR


def _ceil2(x: float) -> int:
    return math.ceil(x / FRAME_FACTOR) * FRAME_FACTOR


def _floor2(x: float) -> int:
    return math.floor(x / FRAME_FACTOR) * FRAME_FACTOR


def frame_count(total_frames: int, video_fps: float, rule: VideoRule = VideoRule(), *, nframes: int | None = None,
                fps: float | None = None, min_frames: int | None = None, max_frames: int | None = None) -> int:
    """Frames the model sees of a video of ``total_frames`` at ``video_fps`` (module doc); the keywords are a
    row's own settings. Raises ``ValueError`` when the video is too short for 2 frames."""
    if nframes is not None and fps is not None:
        raise ValueError("a video may give fps or nframes, not both")
    if total_frames < 1 or not video_fps > 0:
        raise ValueError(f"video of {total_frames} frames at {video_fps} fps: nothing to sample")
    if nframes is not None:
        n = _round2(nframes)
    else:
        lo = _ceil2(rule.min_frames if min_frames is None else min_frames)
        hi = _floor2(min(rule.max_frames, total_frames) if max_frames is None else max_frames)
        n = total_frames / video_fps * (rule.fps if fps is None else fps)
        n = _floor2(min(min(max(n, lo), hi), total_frames))
    if not FRAME_FACTOR <= n <= total_frames:
        raise ValueError(f"a video of {total_frames} frames gives {n} frames to sample; it needs at least "
                         f"{FRAME_FACTOR} and at most {total_frames} (a video shorter than {FRAME_FACTOR} frames "
                         "cannot be used)")
    return n


def frame_range(total_frames: int, video_fps: float, start_s: float | None = None,
                end_s: float | None = None) -> tuple[int, int, int]:
    """(first frame, last frame, frames in between) of a ``[start_s, end_s]`` clip (seconds; None: the ends)."""
    if total_frames < 1 or not video_fps > 0:
        raise ValueError(f"video of {total_frames} frames at {video_fps} fps: nothing to sample")
    if start_s is None and end_s is None:
        return 0, total_frames - 1, total_frames
    duration = total_frames / video_fps
    first = 0 if start_s is None else math.ceil(max(0.0, min(start_s, duration)) * video_fps)
    last = total_frames - 1 if end_s is None else min(math.floor(max(0.0, min(end_s, duration)) * video_fps),
                                                      total_frames - 1)
    if first >= last:
        raise ValueError(f"video clip [{start_s}, {end_s}] s of a {duration:.2f} s video ({total_frames} frames at "
                         f"{video_fps} fps) is empty: frame {first} >= frame {last}")
    return first, last, last - first + 1


def frame_indices(first: int, last: int, n: int) -> np.ndarray:
    """``n`` frame indices spread over [first, last]: torch's float32 ``linspace(first, last, n).round()`` (the
    first half counted up from ``first``, the second down from ``last``; halves rounded to even)."""
    if n < 1:
        raise ValueError(f"need at least one frame, got n={n}")
    if n == 1:
        return np.asarray([first], np.int64)
    s, e = np.float32(first), np.float32(last)
    step = (e - s) / np.float32(n - 1)
    i = np.arange(n)
    up = s + step * i.astype(np.float32)
    down = e - step * (n - 1 - i).astype(np.float32)
    return np.rint(np.where(i < n // 2, up, down)).astype(np.int64)


def sampled_fps(n: int, total_frames: int, video_fps: float) -> float:
    """Frames per second of the sampled frames."""
    return n / max(total_frames, 1e-6) * video_fps


def padded_frame_count(n: int) -> int:
    """Frames of a frame list after padding with its last frame to a multiple of 2."""
    if n < 1:
        raise ValueError("a frame list needs at least one frame")
    return _ceil2(n)


def frame_pixel_budget(n: int, rule: VideoRule = VideoRule()) -> int:
    """The largest pixel count of one of ``n`` sampled frames."""
    budget = max(min(VIDEO_MAX_PIXELS, rule.total_pixels / n * FRAME_FACTOR), int(rule.min_pixels * 1.05))
    return int(min(rule.max_pixels, budget))


def frame_size(height: int, width: int, n: int, rule: VideoRule = VideoRule(), factor: int = 28) -> tuple[int, int]:
    """(height, width) every one of ``n`` sampled frames of a ``height x width`` video is resized to."""
    return smart_resize(height, width, factor, rule.min_pixels, max(rule.min_pixels, frame_pixel_budget(n, rule)))


def step_timestamps(indices, video_fps: float, temporal_patch_size: int) -> tuple[float, ...]:
    """Qwen3-VL's time of each temporal grid step, written into the prompt (transformers'
    ``Qwen3VLProcessor._calculate_timestamps``): the frames' indices padded with the last to a multiple of
    ``temporal_patch_size``, each ``index / video_fps`` seconds, a step's time the mean of its first and last."""
    idx = list(indices)
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    ts = [i / video_fps for i in idx]
    return tuple((ts[i] + ts[i + temporal_patch_size - 1]) / 2 for i in range(0, len(ts), temporal_patch_size))


def second_per_grid_t(temporal_patch_size: int, fps_sampled: float) -> float:
    """Seconds one temporal patch spans (``second_per_grid_ts`` of the M-RoPE time positions)."""
    return temporal_patch_size / fps_sampled
