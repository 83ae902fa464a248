"""Qwen2-VL / Qwen2.5-VL image and video preprocessing in numpy + PIL (no torch, no torchvision).

What: turns PIL images (or video frames) into the ``pixel_values`` / ``grid_thw`` pair
the Qwen2.5-VL vision tower eats, and tells the prompt builder how many image-pad
tokens each image needs. ``probe_image`` reads an image's upright size from its header
alone, so a dataset can be checked and planned at load time without decoding pixels.

Why: transformers' ``Qwen2_5_VLProcessor`` and the Qwen2-VL video processor import
torchvision, which has no usable CPU build here (see ENVIRONMENT.md). This module
reproduces ``transformers.Qwen2VLImageProcessorPil`` (transformers 5.x) step for step,
so its outputs are bit-for-bit equal to it (tests/data/test_image_processing.py):

1. ``convert_to_rgb``: images with an alpha band or a ``transparency`` entry are
   alpha-composited onto white; everything else goes through ``Image.convert("RGB")``.
2. ``smart_resize`` to multiples of ``patch_size * merge_size`` (28) within
   [min_pixels, max_pixels], then a PIL BICUBIC resize (done even when the size is
   unchanged, which PIL treats as a copy).
3. Rescale in float64 by 1/255, cast to float32, then ``(x - mean) / std`` in float32
   with the OpenAI CLIP mean/std.
4. Patchify (C, H, W) into rows of (C, T, P, P) ordered so that each 2x2 merge group's
   four patches are consecutive; an image is repeated ``temporal_patch_size`` times
   along time, i.e. it is a one-step video.
"""

from __future__ import annotations

import io
import math
import os

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from rollplex_jax.config import VisionConfig

OPENAI_CLIP_MEAN = VisionConfig.image_mean  # Qwen2.5-VL's normalization (VisionConfig's defaults)
OPENAI_CLIP_STD = VisionConfig.image_std
RESCALE_FACTOR = 1 / 255
MAX_ASPECT_RATIO = 200
RESAMPLE = Image.Resampling.BICUBIC


class ImageLoadError(ValueError):
    """An image file is missing, empty or cannot be decoded; the message names the path."""


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen's target size: sides multiples of ``factor``, area near [min_pixels, max_pixels].

    Same arithmetic as transformers' ``smart_resize`` (Python's banker's ``round``
    included), so the token count matches the reference model exactly. Like Qwen, the
    result can leave [min_pixels, max_pixels] in corner cases (very elongated images
    with tight limits), because a side never drops below ``factor``.

    Args:
        height: Input height in pixels (>= 1).
        width: Input width in pixels (>= 1).
        factor: Side multiple, ``patch_size * spatial_merge_size``.
        min_pixels: Lower bound on ``h * w``; smaller images are upscaled.
        max_pixels: Upper bound on ``h * w``; larger images are downscaled.

    Returns:
        ``(resized_height, resized_width)``, both positive multiples of ``factor``.

    Raises:
        ValueError: a side is < 1 pixel, the aspect ratio exceeds 200, or the limits are invalid.
    """
    if factor < 1 or min_pixels < 1 or max_pixels < min_pixels:
        raise ValueError(f"smart_resize needs factor >= 1 and 1 <= min_pixels <= max_pixels, got "
                         f"factor={factor}, min_pixels={min_pixels}, max_pixels={max_pixels}")
    if height < 1 or width < 1:
        raise ValueError(f"image of {height}x{width} pixels (height x width) is empty: both sides "
                         "must be >= 1 pixel; drop or replace this image")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {height}x{width} pixels (height x width) has aspect ratio "
            f"{max(height, width) / min(height, width):.1f} > {MAX_ASPECT_RATIO}, which Qwen2-VL "
            f"preprocessing rejects; crop or pad it to at most {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(image: Image.Image) -> Image.Image:
    """Converts to RGB exactly as transformers' ``convert_to_rgb`` does for PIL images.

    Args:
        image: A PIL image in any mode (RGB, RGBA, LA, P, L, CMYK, ...).

    Returns:
        An RGB image. Transparency (an alpha band, or a palette/RGB ``transparency``
        entry) is composited onto a white background rather than dropped.
    """
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _opened(source: str | os.PathLike | bytes, name: str | None) -> tuple[str, object]:
    """``(name for messages, what Image.open takes)``: a checked path, or encoded bytes (a parquet image)."""
    if isinstance(source, (bytes, bytearray)):
        name = name or "<image bytes>"
        if not source:
            raise ImageLoadError(f"image {name!r} is empty (0 bytes); re-encode or drop it")
        return name, io.BytesIO(source)
    path = os.fspath(source)
    _check_file(path)
    return path, path


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise ImageLoadError(f"image file {path!r} does not exist; check the dataset's image paths")
    if not os.path.isfile(path):
        raise ImageLoadError(f"image path {path!r} is not a regular file (a directory?)")
    if os.path.getsize(path) == 0:
        raise ImageLoadError(f"image file {path!r} is empty (0 bytes); re-download or drop it")


def _load_error(path: str, e: Exception) -> ImageLoadError:
    """The ``ImageLoadError`` for an exception PIL raised while reading ``path``."""
    if isinstance(e, UnidentifiedImageError):
        return ImageLoadError(f"image file {path!r} is not in an image format PIL can identify "
                              "(corrupt header or not an image)")
    if isinstance(e, Image.DecompressionBombError):
        return ImageLoadError(f"image file {path!r} is too large to decode safely: {e}")
    # PIL raises OSError, SyntaxError, ValueError, EOFError, ... on bad data
    return ImageLoadError(f"image file {path!r} could not be decoded (truncated or corrupt): {type(e).__name__}: {e}")


def load_image(path: str | os.PathLike | bytes, name: str | None = None) -> Image.Image:
    """Reads an image file fully into memory as an upright RGB PIL image.

    The EXIF orientation is applied (as ``transformers.image_utils.load_image`` does)
    and modes are converted with :func:`to_rgb`. The pixels are decoded here, so a
    truncated file fails now. (If some code sets ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES =
    True``, PIL itself fills truncated files with gray instead of failing.)

    Args:
        path: Path of a PNG/JPEG/... file, or the encoded bytes of one (named ``name`` in errors).
        name: What errors call an image given as bytes.

    Returns:
        The decoded RGB image.

    Raises:
        ImageLoadError: the file is missing, not a regular file, empty, not an image,
            truncated/corrupt, or larger than PIL's decompression-bomb limit.
    """
    path, opened = _opened(path, name)
    try:
        with Image.open(opened) as img:
            img.load()
            upright = ImageOps.exif_transpose(img)
            return to_rgb(upright)
    except Exception as e:
        raise _load_error(path, e) from None


_TRANSPOSING = (5, 6, 7, 8)  # EXIF orientations that exif_transpose turns by 90 degrees (sides swap)


def probe_image(path: str | os.PathLike | bytes, name: str | None = None) -> tuple[int, int]:
    """The ``(height, width)`` :func:`load_image` will return, read from the file's header: no pixel is decoded.

    Checks what can be checked without decoding: the file exists, is not empty, PIL identifies its
    format and size (and the decompression-bomb limit), its EXIF orientation (as ``exif_transpose``
    reads it, from the header) and ``Image.verify``: for PNG every chunk's CRC through IEND, so a truncated
    or damaged PNG fails here; for JPEG (and most other formats) verify checks nothing more, so a truncated
    JPEG passes and fails only when :func:`load_image` decodes it.

    Raises:
        ImageLoadError: as :func:`load_image`, for what the header and verify reveal.
    """
    path, opened = _opened(path, name)
    try:
        with Image.open(opened) as img:
            width, height = img.size
            # the base class's getexif reads the header's EXIF/XMP; PngImageFile's own would decode the pixels
            orientation = Image.Image.getexif(img).get(ExifTags.Base.Orientation, 1)
            img.verify()
    except Exception as e:
        raise _load_error(path, e) from None
    return (width, height) if orientation in _TRANSPOSING else (height, width)


def _normalized_frame(image: Image.Image, height: int, width: int, vision: VisionConfig) -> np.ndarray:
    """RGB-converts, BICUBIC-resizes, rescales and normalizes one image (``vision.image_mean`` / ``image_std``:
    CLIP's for Qwen2.5-VL, 0.5 for Qwen3-VL).

    Args:
        image: A PIL image in any mode.
        height: Target height (a multiple of the patch factor).
        width: Target width.
        vision: Supplies the normalization.

    Returns:
        float32 array ``[3, height, width]``; same operations and dtypes as transformers.
    """
    rgb = to_rgb(image).resize((width, height), resample=RESAMPLE)
    x = (np.asarray(rgb).astype(np.float64) * RESCALE_FACTOR).astype(np.float32)
    x = (x - np.asarray(vision.image_mean, np.float32)) / np.asarray(vision.image_std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def _patchify(frames: np.ndarray, patch_size: int, merge_size: int,
              temporal_patch_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Cuts frames into Qwen's flat patch rows, padding time by repeating the last frame.

    Args:
        frames: float32 ``[T, C, H, W]`` with H, W multiples of ``patch_size * merge_size``.
        patch_size: Spatial patch side P.
        merge_size: Spatial merge side M (patches of one MxM group are consecutive rows).
        temporal_patch_size: Frames per temporal patch Tp.

    Returns:
        ``(patches [t*gh*gw, C*Tp*P*P], (t, gh, gw))``; rows ordered (t, gh/M, gw/M, M, M),
        columns (C, Tp, P, P), as in transformers' ``Qwen2VLVideoProcessor.patchify``.
    """
    if pad := -frames.shape[0] % temporal_patch_size:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)], axis=0)
    n, c, h, w = frames.shape
    t, gh, gw = n // temporal_patch_size, h // patch_size, w // patch_size
    x = frames.reshape(t, temporal_patch_size, c, gh // merge_size, merge_size, patch_size,
                       gw // merge_size, merge_size, patch_size)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, c * temporal_patch_size * patch_size**2), (t, gh, gw)


def check_vision(vision: VisionConfig) -> int:
    """Returns the resize factor after checking the config describes RGB input."""
    if vision.in_channels != 3:
        raise ValueError(f"vision.in_channels={vision.in_channels} is not supported: images are RGB (3)")
    return vision.patch_size * vision.spatial_merge_size


def preprocess_images(images: list[Image.Image], vision: VisionConfig, min_pixels: int,
                      max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """Turns images (any sizes and modes) into Qwen2.5-VL ``pixel_values`` and ``image_grid_thw``.

    Args:
        images: PIL images; each is resized on its own with :func:`smart_resize`.
        vision: Supplies patch_size, spatial_merge_size and temporal_patch_size.
        min_pixels: smart_resize lower bound (``DataConfig.min_pixels``).
        max_pixels: smart_resize upper bound (``DataConfig.max_pixels``).

    Returns:
        ``pixel_values``: float32 ``[sum of t*h*w, vision.patch_dim]``, images concatenated
        in order; ``grid_thw``: int64 ``[len(images), 3]`` rows ``(1, h, w)`` in patches.
    """
    if not images:
        raise ValueError("preprocess_images got an empty image list; pass at least one image")
    factor = check_vision(vision)
    rows, grids = [], []
    for image in images:
        height, width = smart_resize(image.height, image.width, factor, min_pixels, max_pixels)
        frame = _normalized_frame(image, height, width, vision)
        patches, grid = _patchify(frame[None], vision.patch_size, vision.spatial_merge_size,
                                  vision.temporal_patch_size)
        rows.append(patches)
        grids.append(grid)
    return np.concatenate(rows, axis=0), np.asarray(grids, dtype=np.int64)


def preprocess_video(frames: list[Image.Image], vision: VisionConfig, min_pixels: int,
                     max_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """Turns video frames into Qwen2.5-VL ``pixel_values_videos`` and ``video_grid_thw``.

    Every frame is resized to the first frame's :func:`smart_resize` size with the same
    PIL pipeline as images; the frame count is padded by repeating the last frame to a
    multiple of ``temporal_patch_size``. Frame sampling (fps) is the caller's job.

    Args:
        frames: PIL frames in time order (at least one).
        vision: Supplies patch_size, spatial_merge_size and temporal_patch_size.
        min_pixels: smart_resize lower bound per frame.
        max_pixels: smart_resize upper bound per frame.

    Returns:
        ``pixel_values``: float32 ``[t*h*w, vision.patch_dim]``; ``grid_thw``: int64 ``[1, 3]``
        with ``t = ceil(len(frames) / temporal_patch_size)``.
    """
    if not frames:
        raise ValueError("preprocess_video got no frames; pass at least one frame")
    factor = check_vision(vision)
    height, width = smart_resize(frames[0].height, frames[0].width, factor, min_pixels, max_pixels)
    return preprocess_video_at(frames, vision, height, width)


def preprocess_video_at(frames: list[Image.Image], vision: VisionConfig, height: int,
                        width: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`preprocess_video` at a size chosen by the caller (``video_io``: Qwen's per-video frame budget).

    Args:
        frames: PIL frames in time order (at least one), any sizes and modes.
        vision: Supplies patch_size, spatial_merge_size and temporal_patch_size.
        height, width: target size of every frame, multiples of ``patch_size * spatial_merge_size``.

    Returns:
        As :func:`preprocess_video`.
    """
    if not frames:
        raise ValueError("preprocess_video_at got no frames; pass at least one frame")
    factor = check_vision(vision)
    if height < factor or width < factor or height % factor or width % factor:
        raise ValueError(f"video frame size {height}x{width} (height x width) is not a positive multiple of "
                         f"{factor} (patch_size x spatial_merge_size); size it with smart_resize")
    stacked = np.stack([_normalized_frame(f, height, width, vision) for f in frames])
    patches, grid = _patchify(stacked, vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size)
    return patches, np.asarray([grid], dtype=np.int64)


def num_merged_tokens(grid_thw_row, spatial_merge_size: int) -> int:
    """Number of image/video-pad tokens the prompt needs for one image or video.

    Args:
        grid_thw_row: ``(t, h, w)`` in patches, one row of ``grid_thw``.
        spatial_merge_size: ``VisionConfig.spatial_merge_size`` (M).

    Returns:
        ``t * h * w // M**2``, the number of merged vision tokens the model emits.
    """
    t, h, w = (int(v) for v in grid_thw_row)
    if h % spatial_merge_size or w % spatial_merge_size:
        raise ValueError(f"grid_thw row {(t, h, w)} has h or w not divisible by "
                         f"spatial_merge_size={spatial_merge_size}; was it built with another merge size?")
    return t * h * w // spatial_merge_size**2
