"""Tiny video files and frame lists written with PyAV / PIL for tests (no download, no torchvision).

Frames are one solid colour each (``colour(i)``: distinct for i < 37, so a lossy codec is near-exact and the
decoded order can be read back), or, with ``noise``, a fixed random picture shifted one column per frame.
"""

from __future__ import annotations

import av
import numpy as np
from PIL import Image

H, W, FPS = 48, 64, 8


def colour(i: int) -> tuple[int, int, int]:
    return (7 * i, 255 - 7 * i, 30 + 6 * i)


def frame(i: int, noise: bool = False, size=(H, W)) -> np.ndarray:
    """[h, w, 3] uint8 picture of frame ``i``."""
    if noise:
        base = np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)
        return np.roll(base, i, axis=1)
    img = np.empty((*size, 3), np.uint8)
    img[:] = colour(i)
    return img


def write_video(path, n: int, codec: str = "libx264", fps: int = FPS, noise: bool = False) -> str:
    """An ``n``-frame W x H video at ``fps`` (h264 mp4 by default; "libvpx" for webm)."""
    with av.open(str(path), "w") as c:
        # vp8 at its default bitrate is off by up to 9 levels on these frames; at crf 4 within 3, as h264
        s = c.add_stream(codec, rate=fps, options={"crf": "4", "b:v": "2M"} if codec == "libvpx" else {})
        s.width, s.height, s.pix_fmt = W, H, "yuv420p"
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(frame(i, noise), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


def write_frames(d, n: int, size=(W, H)) -> list[str]:
    """``n`` PNG frames (PIL size = (width, height)) in directory ``d``."""
    out = []
    for i in range(n):
        p = d / f"f{i:02d}.png"
        Image.new("RGB", size, colour(i)).save(p)
        out.append(str(p))
    return out
