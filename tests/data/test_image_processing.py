"""rollplex_jax.data.image_processing against transformers' Qwen2VLImageProcessorPil.

The reference is the installed transformers' PIL image processor (no torchvision needed),
built with explicit patch/merge/temporal sizes and ``size={"shortest_edge": min_pixels,
"longest_edge": max_pixels}`` (the spelling ``min_pixels=``/``max_pixels=`` is mapped to the
same keys by its ``__init__``). All inputs are made with numpy/PIL; nothing is downloaded.
"""

import io

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from transformers.image_utils import load_image as hf_load_image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from rollplex_jax.config import VisionConfig
from rollplex_jax.data.image_processing import (
    ImageLoadError,
    load_image,
    num_merged_tokens,
    preprocess_images,
    preprocess_video,
    smart_resize,
    to_rgb,
)

VISION = VisionConfig()  # patch 14, merge 2, temporal 2: the Qwen2.5-VL values
DEFAULT_MIN, DEFAULT_MAX = 56 * 56, 28 * 28 * 1280


def _hf(images, min_pixels, max_pixels):
    proc = Qwen2VLImageProcessorPil(patch_size=14, temporal_patch_size=2, merge_size=2,
                                    size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    assert (proc.size.shortest_edge, proc.size.longest_edge) == (min_pixels, max_pixels)
    out = proc(images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def _noise(h, w, seed=0, channels=3):
    shape = (h, w, channels) if channels > 1 else (h, w)
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8))


def _gradient(h, w):
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([255 * y / max(h - 1, 1), 255 * x / max(w - 1, 1), 255 * (x + y) / (h + w)], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8))


# (id, image, min_pixels, max_pixels); sizes are (height, width)
CASES = [
    ("noise_56x56", _noise(56, 56), DEFAULT_MIN, DEFAULT_MAX),
    ("gradient_100x37", _gradient(100, 37), DEFAULT_MIN, DEFAULT_MAX),
    ("noise_333x250", _noise(333, 250, seed=1), DEFAULT_MIN, DEFAULT_MAX),
    ("noise_480x640_downscaled", _noise(480, 640, seed=2), DEFAULT_MIN, 28 * 28 * 64),
    ("noise_5x9_upscaled", _noise(5, 9, seed=3), DEFAULT_MIN, DEFAULT_MAX),
    ("gradient_12x1500_elongated", _gradient(12, 1500), DEFAULT_MIN, DEFAULT_MAX),
    ("noise_70x42_round_half_even", _noise(70, 42, seed=4), 28 * 28, DEFAULT_MAX),
]


def _assert_equal_to_hf(images, min_pixels, max_pixels):
    ref_pv, ref_grid = _hf(images, min_pixels, max_pixels)
    pv, grid = preprocess_images(images, VISION, min_pixels, max_pixels)
    assert pv.dtype == np.float32 and grid.dtype == np.int64
    assert pv.shape == ref_pv.shape and pv.shape[1] == VISION.patch_dim
    np.testing.assert_array_equal(grid, ref_grid)
    assert np.abs(pv - ref_pv).max() <= 1e-5


@pytest.mark.parametrize("image,min_pixels,max_pixels", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_single_image_equals_transformers(image, min_pixels, max_pixels):
    _assert_equal_to_hf([image], min_pixels, max_pixels)


def test_images_of_different_sizes_in_one_call_equal_transformers():
    images = [c[1] for c in CASES]
    _assert_equal_to_hf(images, DEFAULT_MIN, 28 * 28 * 256)
    _, grid = preprocess_images(images, VISION, DEFAULT_MIN, 28 * 28 * 256)
    assert grid.shape == (len(images), 3) and (grid[:, 0] == 1).all()


def _rgba(h, w):
    return Image.fromarray(np.random.default_rng(5).integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")


def _palette_with_transparency(h, w):
    img = _noise(h, w, seed=6).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    img.info["transparency"] = 3
    return img


MODES = {
    "RGBA": lambda: _rgba(40, 60),
    "LA": lambda: _rgba(40, 60).convert("LA"),
    "P_transparency": lambda: _palette_with_transparency(40, 60),
    "P": lambda: _noise(40, 60, seed=7).convert("P"),
    "L": lambda: _noise(40, 60, seed=8, channels=1),
    "CMYK": lambda: Image.fromarray(np.random.default_rng(9).integers(0, 256, (40, 60, 4), dtype=np.uint8), "CMYK"),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_non_rgb_modes_convert_like_transformers(mode):
    # transformers composites transparency onto white (convert_to_rgb), it does not drop alpha.
    _assert_equal_to_hf([MODES[mode]()], DEFAULT_MIN, DEFAULT_MAX)


def test_to_rgb_composites_alpha_onto_white():
    img = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert np.asarray(to_rgb(img)).tolist() == np.full((4, 4, 3), 255).tolist()


# --- smart_resize -------------------------------------------------------------------------

sizes = st.integers(1, 6000)


@settings(max_examples=300, deadline=None)
@given(h=sizes, w=sizes, min_pixels=st.integers(1, 28 * 28 * 64), extra=st.integers(0, 28 * 28 * 2000))
@example(h=70, w=126, min_pixels=784, extra=28 * 28 * 100)  # 2.5 and 4.5 patches: round half to even
@example(h=10, w=37, min_pixels=3136, extra=0)  # upscaled past max_pixels=min_pixels, as Qwen does
@example(h=100, w=5000, min_pixels=3136, extra=0)  # short side clamped to 28, past max_pixels
def test_smart_resize_equals_transformers(h, w, min_pixels, extra):
    assume(max(h, w) / min(h, w) <= 200)
    assert smart_resize(h, w, 28, min_pixels, min_pixels + extra) == hf_smart_resize(
        h, w, 28, min_pixels=min_pixels, max_pixels=min_pixels + extra)


@settings(max_examples=300, deadline=None)
@given(h=sizes, w=sizes, min_tokens=st.integers(1, 16), max_tokens=st.integers(256, 16384))
def test_smart_resize_multiples_of_28_within_limits(h, w, min_tokens, max_tokens):
    # Qwen's bounds hold when the limits are not tight relative to the aspect ratio
    # (here min <= 16*784, max >= 256*784, aspect <= 200); with tighter limits Qwen itself
    # can leave [min, max] because a side never drops below 28 (equality is tested above).
    assume(max(h, w) / min(h, w) <= 200)
    min_pixels, max_pixels = 28 * 28 * min_tokens, 28 * 28 * max_tokens
    rh, rw = smart_resize(h, w, 28, min_pixels, max_pixels)
    assert rh % 28 == 0 and rw % 28 == 0 and rh >= 28 and rw >= 28
    assert min_pixels <= rh * rw <= max_pixels


@pytest.mark.parametrize("h,w,match", [(0, 10, "empty"), (10, 0, "empty"), (1, 201, "aspect ratio 201.0"),
                                       (3000, 14, "aspect ratio 214.3")])
def test_smart_resize_rejects_degenerate_sizes(h, w, match):
    with pytest.raises(ValueError, match=match) as e:
        smart_resize(h, w)
    assert f"{h}x{w}" in str(e.value)


def test_smart_resize_accepts_aspect_200_and_rejects_bad_limits():
    assert smart_resize(1, 200) == hf_smart_resize(1, 200)
    with pytest.raises(ValueError, match="min_pixels"):
        smart_resize(56, 56, 28, min_pixels=0, max_pixels=100)
    with pytest.raises(ValueError, match="max_pixels"):
        smart_resize(56, 56, 28, min_pixels=5000, max_pixels=4000)


# --- video --------------------------------------------------------------------------------

def test_two_identical_frames_equal_the_image():
    img = _noise(100, 37, seed=10)
    pv_img, grid_img = preprocess_images([img], VISION, DEFAULT_MIN, DEFAULT_MAX)
    for frames in ([img, img], [img]):  # one frame is padded to two by repetition
        pv, grid = preprocess_video(frames, VISION, DEFAULT_MIN, DEFAULT_MAX)
        np.testing.assert_array_equal(grid, grid_img)
        np.testing.assert_array_equal(pv, pv_img)


def test_three_frames_pad_to_four_by_repeating_the_last():
    frames = [_noise(60, 90, seed=s) for s in range(3)]
    pv, grid = preprocess_video(frames, VISION, DEFAULT_MIN, DEFAULT_MAX)
    pv4, grid4 = preprocess_video(frames + frames[-1:], VISION, DEFAULT_MIN, DEFAULT_MAX)
    assert grid.tolist() == [[2, 4, 6]] == grid4.tolist()
    np.testing.assert_array_equal(pv, pv4)
    assert pv.shape == (2 * 4 * 6, VISION.patch_dim)


def test_frames_resize_to_first_frame_size():
    frames = [_noise(56, 84, seed=0), _noise(200, 100, seed=1)]
    _, grid = preprocess_video(frames, VISION, DEFAULT_MIN, DEFAULT_MAX)
    assert grid.tolist() == [[1, 4, 6]]


def _hf_video_patchify(video, patch, merge, tps):
    """numpy transcription of transformers' Qwen2VLVideoProcessor.patchify (one video, [T, C, H, W])."""
    if pad := -video.shape[0] % tps:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
    n, c, h, w = video.shape
    gt, gh, gw = n // tps, h // patch, w // patch
    x = video.reshape(1, gt, tps, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(gt * gh * gw, c * tps * patch * patch)


def test_video_layout_matches_transformers_video_patchify():
    # Qwen2VLVideoProcessor imports torchvision at module level, which has no CPU build here,
    # so its patchify is transcribed above; normalization comes from the real image processor.
    frames = [_noise(56, 84, seed=s) for s in range(5)]  # 56x84 needs no resize
    proc = Qwen2VLImageProcessorPil()
    normed = np.stack([proc.normalize(proc.rescale(np.asarray(f).transpose(2, 0, 1), 1 / 255),
                                      proc.image_mean, proc.image_std) for f in frames])
    pv, grid = preprocess_video(frames, VISION, DEFAULT_MIN, DEFAULT_MAX)
    assert grid.tolist() == [[3, 4, 6]]
    assert np.abs(pv - _hf_video_patchify(normed, 14, 2, 2)).max() <= 1e-6


def test_video_equals_transformers_video_processor_when_importable():
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    except ImportError as e:  # needs torchvision: absent on the CPU machines (ENVIRONMENT.md)
        pytest.skip(f"Qwen2VLVideoProcessor not importable here: {e}")
    frames = [_noise(56, 84, seed=s) for s in range(3)]  # no resize: torchvision's resize differs from PIL's
    proc = Qwen2VLVideoProcessor(patch_size=14, temporal_patch_size=2, merge_size=2,
                                 size={"shortest_edge": DEFAULT_MIN, "longest_edge": DEFAULT_MAX})
    out = proc(videos=[np.stack([np.asarray(f) for f in frames])], return_tensors="np", do_sample_frames=False)
    pv, grid = preprocess_video(frames, VISION, DEFAULT_MIN, DEFAULT_MAX)
    np.testing.assert_array_equal(grid, out["video_grid_thw"])
    assert np.abs(pv - out["pixel_values_videos"]).max() <= 1e-5


# --- tokens -------------------------------------------------------------------------------

def test_num_merged_tokens():
    assert num_merged_tokens((1, 4, 6), 2) == 6
    assert num_merged_tokens(np.array([2, 4, 6]), 2) == 12
    pv, grid = preprocess_images([c[1] for c in CASES], VISION, DEFAULT_MIN, DEFAULT_MAX)
    assert sum(num_merged_tokens(row, 2) for row in grid) * 4 == pv.shape[0]
    with pytest.raises(ValueError, match="spatial_merge_size"):
        num_merged_tokens((1, 3, 4), 2)


# --- load_image ---------------------------------------------------------------------------

def _encoded(fmt, **kw):
    buf = io.BytesIO()
    _noise(64, 48, seed=11).save(buf, fmt, **kw)
    return buf.getvalue()


BAD_FILES = {
    "missing.png": None,
    "empty.png": b"",
    "garbage.jpg": b"this is not an image at all" * 10,
    "truncated.png": _encoded("PNG")[: len(_encoded("PNG")) // 2],
    "truncated.jpg": _encoded("JPEG")[: len(_encoded("JPEG")) // 2],
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_load_image_errors_name_the_path(tmp_path, name):
    path = tmp_path / name
    if BAD_FILES[name] is not None:
        path.write_bytes(BAD_FILES[name])
    with pytest.raises(ImageLoadError) as e:
        load_image(path)
    assert str(path) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_load_image_rejects_directory(tmp_path):
    with pytest.raises(ImageLoadError, match="not a regular file"):
        load_image(tmp_path)


def test_load_image_applies_exif_orientation_like_transformers(tmp_path):
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    path = tmp_path / "rotated.jpg"
    path.write_bytes(_encoded("JPEG", exif=exif))
    img = load_image(path)
    assert img.mode == "RGB" and img.size == (64, 48)  # stored as 48 wide x 64 high
    np.testing.assert_array_equal(np.asarray(img), np.asarray(hf_load_image(str(path))))


def test_load_image_rgba_png_then_preprocess_equals_transformers_on_pil(tmp_path):
    path = tmp_path / "rgba.png"
    _rgba(30, 50).save(path)
    img = load_image(path)
    assert img.mode == "RGB"
    ref_pv, _ = _hf([Image.open(path)], DEFAULT_MIN, DEFAULT_MAX)
    pv, _ = preprocess_images([img], VISION, DEFAULT_MIN, DEFAULT_MAX)
    assert np.abs(pv - ref_pv).max() <= 1e-5


def test_qwen3_vl_images_equal_transformers_with_its_processor_config():
    """Qwen3-VL's image processor (transformers' class with its checkpoints' preprocessor_config.json: patch 16,
    mean and std 0.5) on images of different sizes: the same grids, pixel values within 1e-5."""
    from rollplex_jax.config.model import tiny_qwen3_vl_config

    vision = tiny_qwen3_vl_config().vision
    images = [c[1] for c in CASES]
    lo, hi = 32 * 32 * 4, 32 * 32 * 256
    proc = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": lo, "longest_edge": hi})
    ref = proc(images, return_tensors="np")
    pv, grid = preprocess_images(images, vision, lo, hi)
    np.testing.assert_array_equal(grid, ref["image_grid_thw"])
    assert pv.shape == ref["pixel_values"].shape and np.abs(pv - ref["pixel_values"]).max() <= 1e-5
