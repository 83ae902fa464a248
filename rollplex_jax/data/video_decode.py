"""A video file's metadata and chosen frames through PyAV (FFmpeg), without torch or torchvision.

Why its own module: qwen-vl-utils reads videos with torchcodec, decord or torchvision, and transformers' video
processor needs torchvision, which cannot be installed here (../shared/DATA.md). PyAV's wheel carries FFmpeg, so
every container FFmpeg demuxes (mp4, webm, mkv, avi, mov...) is read the same way. ``video_io`` builds the
Qwen-level plan on top of the two functions here:

- ``container_info``: frame count, average frame rate and coded size from the container alone. The frame count
  is the number of (non-empty) video packets, found by demuxing the file without decoding a frame, not the
  header's ``nb_frames``: webm/mkv headers carry none (0) and an edited or truncated mp4's can be wrong, while a
  packet holds exactly one frame for every video codec FFmpeg has. That is also what torchcodec's exact mode
  (qwen-vl-utils' first choice of reader) counts. Cost: one read of the file, no decoding (measured on this
  2-core CPU, whole probe: 0.5 ms for a 32-frame 64x48 mp4, 10 ms for 3000 frames (1.4 MB), 18 ms for 300
  frames of 640x360 (0.8 MB); about 3 us a packet, so ~0.4 s for an hour at 30 fps plus reading the file).
- ``decode_frames``: decodes from the start up to the last chosen frame only (frame-threaded), keeping the
  chosen frames as RGB PIL images (FFmpeg's swscale does the YUV -> RGB conversion, as it does for decord and
  torchcodec); a file that decodes to fewer frames than its packets promised is an error, not a shorter video.
  Rotation metadata (phone videos) is not applied, as decord and torchcodec do not apply it either.

Every failure is a ``VideoError`` naming the file and what to do about it.
"""

from __future__ import annotations

import dataclasses
import os

import av
from av.video.reformatter import VideoReformatter
from PIL import Image


class VideoError(ValueError):
    """A video (file or frame list) is missing, empty, unreadable or unusable; the message names it and the fix."""


@dataclasses.dataclass(frozen=True)
class ContainerInfo:
    """What the container says about its first video stream: frames (video packets), frames per second, coded size."""

    total_frames: int
    fps: float
    height: int
    width: int


def check_file(path: str) -> None:
    """Raises ``VideoError`` unless ``path`` is an existing, non-empty regular file."""
    if not os.path.exists(path):
        raise VideoError(f"video file {path!r} does not exist; check the dataset's video paths (relative paths are "
                         "joined to the dataset file's directory)")
    if not os.path.isfile(path):
        raise VideoError(f"video path {path!r} is not a regular file (a directory? a frame list is given as a list "
                         "of image paths)")
    if os.path.getsize(path) == 0:
        raise VideoError(f"video file {path!r} is empty (0 bytes); re-download or drop it")


def _unreadable(path: str, e: Exception) -> VideoError:
    return VideoError(f"video file {path!r} cannot be read by FFmpeg (not a video container, or corrupt): "
                      f"{type(e).__name__}: {e}; re-encode it (e.g. `ffmpeg -i in -c:v libx264 out.mp4`) or drop it")


def container_info(path: str) -> ContainerInfo:
    """Frame count, fps and size of the first video stream of ``path`` (module docstring: packets, no decoding)."""
    check_file(path)
    try:
        with av.open(path) as container:
            if not container.streams.video:
                kinds = sorted({s.type for s in container.streams}) or ["none"]
                raise VideoError(f"video file {path!r} has no video stream (streams: {', '.join(kinds)}); an "
                                 "audio-only file cannot be a video input: drop it or point the row at the video")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate or stream.base_rate
            height, width = stream.codec_context.height, stream.codec_context.width
            total = sum(1 for packet in container.demux(stream) if packet.size > 0)
    except VideoError:
        raise
    except Exception as e:  # PyAV raises av.error.* (ValueError/OSError subclasses) on bad data
        raise _unreadable(path, e) from None
    if total == 0:
        raise VideoError(f"video file {path!r} has a video stream with no frames; re-encode or drop it")
    if not rate or float(rate) <= 0:
        raise VideoError(f"video file {path!r} states no frame rate, so frames cannot be sampled at an fps; "
                         "re-encode it with one (e.g. `ffmpeg -i in -r 30 out.mp4`)")
    if height < 1 or width < 1:
        raise VideoError(f"video file {path!r} has a video stream of size {height}x{width}; re-encode or drop it")
    return ContainerInfo(total, float(rate), int(height), int(width))


def decode_frames(path: str, indices, header_frames: int) -> list[Image.Image]:
    """The frames ``indices`` (0-based, in presentation order, repeats allowed) of ``path`` as RGB PIL images, in
    the order given; decodes up to the last of them and no further. ``header_frames``: the count ``container_info``
    found, named in the error when the file decodes to fewer frames."""
    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("decode_frames needs at least one frame index")
    want, last = set(indices), max(indices)
    got: dict[int, Image.Image] = {}
    decoded = 0
    check_file(path)
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise VideoError(f"video file {path!r} has no video stream; drop it or point the row at the video")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            rgb = VideoReformatter()  # one swscale context for the clip: frame.to_image() builds one per frame
            for frame in container.decode(stream):
                if decoded in want:
                    got[decoded] = rgb.reformat(frame, format="rgb24").to_image()
                decoded += 1
                if decoded > last:
                    break
    except VideoError:
        raise
    except Exception as e:
        raise VideoError(f"video file {path!r} failed while decoding frame {decoded} (of {last + 1} needed): "
                         f"{type(e).__name__}: {e}; the file is damaged: re-encode or drop it") from None
    if decoded <= last:
        raise VideoError(f"video file {path!r} decodes to {decoded} frames, its container said {header_frames} "
                         f"(frame {last} was planned): the file is truncated or damaged; re-encode or drop it")
    return [got[i] for i in indices]
