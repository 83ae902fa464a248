"""Video frame sampling and sizing (rollplex_jax/data/video_sampling.py) against hand-computed cases of the
qwen-vl-utils rules, and the frame indices against torch's own float32 linspace."""

import numpy as np
import pytest
import torch

from rollplex_jax.data import video_sampling as vs


@pytest.mark.parametrize("total,video_fps,kw,want", [
    (300, 30.0, {}, 20),  # 10 s at 30 fps, sampled at 2 fps
    (30, 30.0, {}, 4),  # 1 s: 2 frames at 2 fps, raised to the minimum of 4
    (3, 30.0, {}, 2),  # 3 frames: min(4, floor2(3)) = 2
    (15000, 25.0, {}, 768),  # 10 min at 25 fps: 1200 capped at 768
    (180, 24.0, {}, 14),  # 7.5 s at 24 fps: 15 -> floor to a multiple of 2
    (300, 30.0, {"fps": 1.0}, 10),
    (300, 30.0, {"max_frames": 9}, 8),  # floor2(9)
    (300, 30.0, {"min_frames": 31}, 32),  # ceil2(31)
    (300, 30.0, {"nframes": 7}, 8),  # round(3.5) = 4 pairs
    (300, 30.0, {"nframes": 5}, 4),  # round(2.5) = 2 pairs (banker's rounding, as Python's round)
])
def test_frame_count(total, video_fps, kw, want):
    assert vs.frame_count(total, video_fps, **kw) == want


def test_frame_count_rule_and_errors():
    assert vs.frame_count(300, 30.0, vs.VideoRule(fps=4.0, max_frames=16)) == 16
    with pytest.raises(ValueError, match="at least 2"):
        vs.frame_count(1, 30.0)
    with pytest.raises(ValueError, match="not both"):
        vs.frame_count(300, 30.0, nframes=4, fps=1.0)
    with pytest.raises(ValueError, match="fps must be > 0"):
        vs.VideoRule(fps=0)


def test_frame_range():
    assert vs.frame_range(300, 30.0) == (0, 299, 300)
    assert vs.frame_range(300, 30.0, 1.01, 5.0) == (31, 150, 120)  # ceil(30.3), floor(150)
    assert vs.frame_range(300, 30.0, None, 100.0) == (0, 299, 300)  # clamped to the duration
    with pytest.raises(ValueError, match="empty"):
        vs.frame_range(300, 30.0, 6.0, 5.0)


@pytest.mark.parametrize("first,last", [(0, 299), (0, 1), (31, 150), (0, 14999), (7, 7 + 766), (0, 9)])
def test_frame_indices_equal_torch_linspace(first, last):
    for n in sorted({1, 2, 3, 4, 5, 8, 20, 31, 64, 767, 768} | {last - first + 1}):
        want = torch.linspace(first, last, n).round().long().numpy()
        np.testing.assert_array_equal(vs.frame_indices(first, last, n), want, err_msg=f"{first}..{last}, n={n}")


def test_frame_indices_hand_cases():
    np.testing.assert_array_equal(vs.frame_indices(0, 299, 4), [0, 100, 199, 299])  # 99.67 -> 100, 199.33 -> 199
    np.testing.assert_array_equal(vs.frame_indices(0, 9, 4), [0, 3, 6, 9])
    np.testing.assert_array_equal(vs.frame_indices(0, 1, 3), [0, 0, 1])  # 0.5 rounds to even


def test_pixel_budget_and_size():
    # the total budget (128000 x 28^2 x 0.9 = 90,316,800) over 20 frames is above the per-frame cap of 768 x 28^2
    assert vs.frame_pixel_budget(20) == 768 * 28 * 28
    assert vs.frame_pixel_budget(768) == 90316800 // 768 * 2 == 235200
    assert vs.frame_pixel_budget(768, vs.VideoRule(total_pixels=10**6)) == int(128 * 28 * 28 * 1.05)  # floor
    assert vs.frame_pixel_budget(4, vs.VideoRule(max_pixels=200704)) == 200704  # --video_max_pixels caps it
    # 1280 x 720 at 20 frames: 728 x 1288 is over 602,112 -> beta 1.2372 -> 560 x 1008 (40 x 72 patches)
    assert vs.frame_size(720, 1280, 20) == (560, 1008)
    # at 768 frames the budget is 235,200: beta = sqrt(921600 / 235200) = 1.9795 -> floor(12.99) x 28 by
    # floor(23.09) x 28
    assert vs.frame_size(720, 1280, 768) == (336, 644)


def test_padding_and_time_step():
    assert [vs.padded_frame_count(n) for n in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert vs.sampled_fps(20, 300, 30.0) == 2.0
    assert vs.second_per_grid_t(2, 2.0) == 1.0
