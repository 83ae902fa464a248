"""Video files and frame lists -> plans -> patches (rollplex_jax/data/video_io.py, video_decode.py).

Tiny videos are written with PyAV (tests/video_files.py: h264 mp4, vp8 webm, 64x48, 8 fps). Frame counts,
indices, sizes, grids, token counts and second_per_grid_t are compared with values computed by hand in the
comments (Qwen's rules, ../shared/DATA.md), not recomputed with the functions under test. Pixels: every frame is
one solid colour, so the lossy codec is near-exact and the decoded order can be read back from the patches.
Every error names the file.
"""

from __future__ import annotations

import dataclasses

import av
import numpy as np
import pytest
from PIL import Image

from rollplex_jax.config import tiny_model_config
from rollplex_jax.data.image_processing import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from rollplex_jax.data.video_io import VideoError, VideoSpec, load_video, probe_video, video_spec
from rollplex_jax.data.video_sampling import VideoRule
from tests.video_files import colour, write_frames, write_video

SMALL = VideoRule(min_pixels=28 * 28, max_pixels=56 * 56)  # every frame 56x56: grid 4x4 per step


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    with av.open(str(d / "audio.m4a"), "w") as c:  # a container with an audio stream only
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for p in [*s.encode(frame), *s.encode()]:
            c.mux(p)
    (d / "empty.mp4").write_bytes(b"")
    (d / "garbage.mp4").write_bytes(b"this is not a video" * 20)
    return dict(mp4=write_video(d / "a.mp4", 32), webm=write_video(d / "b.webm", 33, "libvpx"),
                one=write_video(d / "one.mp4", 1), audio=str(d / "audio.m4a"), empty=str(d / "empty.mp4"),
                garbage=str(d / "garbage.mp4"), missing=str(d / "missing.mp4"), dir=d)


def test_video_spec_forms(tmp_path):
    assert video_spec("clips/a.mp4", tmp_path) == VideoSpec(path=str(tmp_path / "clips" / "a.mp4"))
    assert video_spec("file:///data/a.mp4", tmp_path).path == "/data/a.mp4"
    s = video_spec({"type": "video", "video": "a.webm", "fps": 1, "max_pixels": 3136, "video_end": 2}, tmp_path)
    assert (s.path, s.fps, s.max_pixels, s.video_end) == (str(tmp_path / "a.webm"), 1.0, 3136, 2.0)
    s = video_spec({"video": ["f0.png", "file:///x/f1.png"], "fps": 4.0}, tmp_path)
    assert s.frames == (str(tmp_path / "f0.png"), "/x/f1.png") and s.fps == 4.0
    assert video_spec(["f0.png"], tmp_path).frames == (str(tmp_path / "f0.png"),)


@pytest.mark.parametrize("item,match", [
    (3, "cannot be a int"),
    ({"fps": 2}, '"video" key'),
    ({"video": "a.mp4", "resized_height": 56}, r"unknown key\(s\) \['resized_height'\]"),
    ({"video": "a.mp4", "fps": True}, "fps must be a number"),
    ({"video": "a.mp4", "nframes": 4.5}, "whole number"),
    ({"video": "a.mp4", "fps": 1, "nframes": 4}, "not both"),
    ({"video": "a.mp4", "video_start": 3, "video_end": 2}, "empty"),
    ({"video": ["f.png"], "nframes": 4}, "apply to a video file, not a frame list"),
    ("https://example.com/a.mp4", "download it"),
    ([], "at least one frame"),
])
def test_video_spec_errors_name_the_item_and_the_forms(item, match):
    with pytest.raises(ValueError, match=match) as e:
        video_spec(item, "/data")
    assert "Accepted: a video path string" in str(e.value)


def test_mp4_plan_default_rule(files):
    plan = probe_video(video_spec(files["mp4"]), VideoRule())
    # 32 frames at 8 fps = 4 s; at 2 fps: 8 frames; linspace(0, 31, 8) = 0, 4.43, 8.86, 13.29, 17.71, 22.14, 26.57, 31
    assert plan.indices == (0, 4, 9, 13, 18, 22, 27, 31)
    assert (plan.total_frames, plan.video_fps, plan.src_size) == (32, 8.0, (48, 64))
    # 48x64 rounds to 56x56 = 3136 < 128 x 28^2 = 100352: beta = sqrt(100352 / 3072) = 5.7155,
    # h = ceil(48 x 5.7155 / 28) x 28 = 10 x 28 = 280, w = ceil(64 x 5.7155 / 28) x 28 = 14 x 28 = 392
    assert plan.size == (280, 392) and plan.grid_thw == (4, 20, 28)
    assert plan.tokens == 4 * 10 * 14 == 560 and plan.patches == 4 * 20 * 28
    assert plan.fps == 2.0 and plan.second_per_grid_t == 1.0  # 8 / 32 x 8 fps; 2 / 2.0


def test_webm_odd_count_counts_packets(files):
    with av.open(files["webm"]) as c:
        assert c.streams.video[0].frames == 0  # the header has no frame count: packets are counted
    plan = probe_video(video_spec(files["webm"]), SMALL)
    # 33 frames: 33 / 8 x 2 = 8.25 -> 8; linspace(0, 32, 8) = 0, 4.57, 9.14, 13.71, 18.29, 22.86, 27.43, 32
    assert plan.total_frames == 33 and plan.indices == (0, 5, 9, 14, 18, 23, 27, 32)
    assert plan.size == (56, 56) and plan.grid_thw == (4, 4, 4) and plan.tokens == 16
    assert plan.fps == pytest.approx(64 / 33) and plan.second_per_grid_t == pytest.approx(1.03125)  # 2 x 33 / 64


def test_clip_and_nframes(files):
    plan = probe_video(video_spec({"video": files["mp4"], "video_start": 1.0, "video_end": 3.0, "nframes": 6}), SMALL)
    # frames ceil(1 x 8) = 8 .. floor(3 x 8) = 24 (17 frames); linspace(8, 24, 6) = 8, 11.2, 14.4, 17.6, 20.8, 24
    assert plan.indices == (8, 11, 14, 18, 21, 24) and plan.grid_thw == (3, 4, 4) and plan.tokens == 12
    assert plan.fps == pytest.approx(48 / 17) and plan.second_per_grid_t == pytest.approx(34 / 48)  # 6 / 17 x 8


def test_row_fps_and_pixels_override_the_rule(files):
    plan = probe_video(video_spec({"video": files["mp4"], "fps": 4.0, "min_pixels": 784, "max_pixels": 3136}),
                       VideoRule())
    # 4 s at 4 fps = 16 frames; linspace(0, 31, 16), step 31 / 15 = 2.0667: the first half counted up from 0,
    # the second down from 31 (torch's float32 linspace)
    assert plan.indices == (0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29, 31)
    assert plan.size == (56, 56) and plan.fps == 4.0 and plan.second_per_grid_t == 0.5  # 16 / 32 x 8; 2 / 4
    with pytest.raises(VideoError, match=r"a.mp4.*pixel settings conflict.*min_pixels <= max_pixels"):
        probe_video(video_spec({"video": files["mp4"], "max_pixels": 3136}), VideoRule())  # < the rule's min


def _frame_means(patches: np.ndarray, grid, vision) -> np.ndarray:
    """[frames, 3] mean RGB (0-255) of each frame from Qwen's patch rows (t, ..., columns C x Tp x P x P)."""
    t, gh, gw = grid
    tp, p = vision.temporal_patch_size, vision.patch_size
    x = patches.reshape(t, gh * gw, 3, tp, p * p).mean(axis=(1, 4))  # [t, C, Tp]
    x = x.transpose(0, 2, 1).reshape(t * tp, 3)
    return (x * np.asarray(OPENAI_CLIP_STD) + np.asarray(OPENAI_CLIP_MEAN)) * 255


@pytest.mark.parametrize("kind", ["mp4", "webm"])
def test_decoded_pixels_are_the_planned_frames_in_order(files, kind):
    vision = tiny_model_config().vision
    spec = video_spec(files[kind])
    plan = probe_video(spec, SMALL)
    patches = load_video(spec, plan, vision)
    assert patches.dtype == np.float32 and patches.shape == (4 * 4 * 4, vision.patch_dim)
    means = _frame_means(patches, plan.grid_thw, vision)
    palette = np.asarray([colour(i) for i in range(plan.total_frames)], np.float64)  # neighbours 6-7 levels apart
    nearest = np.abs(means[:, None] - palette[None]).sum(-1).argmin(1)
    assert tuple(nearest) == plan.indices
    np.testing.assert_allclose(means, palette[list(plan.indices)], atol=3)  # lossy codecs, near-exact on solid frames


def test_frame_list_odd_count(files, tmp_path):
    frames = write_frames(tmp_path, 5)
    plan = probe_video(video_spec(frames), VideoRule())
    # 5 frames padded with the last to 6; no fps resampling; fps 2.0 (the rule's) -> 2 / 2.0 = 1.0 s per step
    assert plan.indices == (0, 1, 2, 3, 4, 4) and plan.total_frames == 5
    assert plan.fps == 2.0 and plan.second_per_grid_t == 1.0
    # each frame first resized as an image: 48x64 -> 56x56 (3136 >= 4 x 28^2); then 56x56 < 100352:
    # beta = sqrt(100352 / 3136) = 5.657, ceil(56 x 5.657 / 28) = 12 -> 336x336 (sizing 48x64 directly: 280x392)
    assert plan.list_size == (56, 56) and plan.size == (336, 336) and plan.grid_thw == (3, 24, 24)
    assert plan.tokens == 3 * 12 * 12 == 432
    vision = tiny_model_config().vision
    small = probe_video(video_spec({"video": frames, "fps": 4.0}), SMALL)
    assert small.grid_thw == (3, 4, 4) and small.second_per_grid_t == 0.5  # 2 / 4.0
    means = _frame_means(load_video(video_spec(frames), small, vision), small.grid_thw, vision)
    np.testing.assert_allclose(means, [colour(i) for i in (0, 1, 2, 3, 4, 4)], atol=1e-3)  # PNG: lossless


def test_one_frame_list_is_padded_to_two(tmp_path):
    plan = probe_video(video_spec(write_frames(tmp_path, 1)), SMALL)
    assert plan.indices == (0, 0) and plan.grid_thw == (1, 4, 4) and plan.tokens == 4


@pytest.mark.parametrize("key,item,match", [
    ("missing", None, "does not exist"),
    ("empty", None, r"is empty \(0 bytes\)"),
    ("garbage", None, "cannot be read by FFmpeg"),
    ("audio", None, "has no video stream"),
    ("one", None, "has 1 frame; Qwen2.5-VL needs at least 2"),
    ("mp4", {"video_start": 3.5, "video_end": 3.6}, r"clip \[3.5, 3.6\] s .* is empty"),
    ("mp4", {"nframes": 40}, "gives 40 frames"),
    ("dir", None, "not a regular file"),
])
def test_probe_errors_name_the_file(files, key, item, match):
    path = str(files[key])
    spec = video_spec({"video": path, **item} if item else path)
    with pytest.raises(VideoError, match=match) as e:
        probe_video(spec, SMALL)
    assert path in str(e.value)


def test_frame_list_errors_name_the_frame(tmp_path):
    frames = write_frames(tmp_path, 3)
    Image.new("RGB", (32, 48)).save(frames[2])
    with pytest.raises(VideoError, match=r"frame 2 .*f02.png.* is 48x32 but frame 0 is 48x64"):
        probe_video(video_spec(frames), SMALL)
    with pytest.raises(VideoError, match=r"frame 1 of frame list.*nope.png.*does not exist"):
        probe_video(video_spec([frames[0], str(tmp_path / "nope.png")]), SMALL)


def test_decoding_fewer_frames_than_planned_is_an_error(files):
    spec = video_spec(files["mp4"])
    plan = probe_video(spec, SMALL)
    late = dataclasses.replace(plan, indices=plan.indices[:-1] + (40,))  # as if the container promised 41+
    with pytest.raises(VideoError, match=r"a.mp4.* decodes to 32 frames, its container said 32 \(frame 40"):
        load_video(spec, late, tiny_model_config().vision)


def test_plan_for_another_geometry_is_refused(files):
    spec = video_spec(files["mp4"])
    plan = probe_video(spec, SMALL, factor=16, patch_size=8)  # 8 px patches, merge 2
    with pytest.raises(ValueError, match="not made for this vision config"):
        load_video(spec, plan, tiny_model_config().vision)
