"""A synthetic video task for the tiny demo family, written as mp4 files (PyAV, h264) plus a JSONL index.

``video_count``: "how many squares?" over a short clip. The clip has ``frames`` frames at ``fps`` (default 8
frames at 2 fps: 4 s, which Qwen's sampling at 2 fps keeps whole: 4 temporal steps of 2 frames). In k of its
temporal steps (k uniform in 1-4) one white square shows on both frames of the step, in a random quadrant (side
60-93% of the quadrant's, at a random place inside it: at 56 px one quadrant is one merged vision token); the other
steps are empty. Every frame holds at most one square, so no single frame answers the question: the count is only
in the sequence. (Squares of 8-14 px anywhere, straddling tokens, were not learned in 300 steps: the reward stayed
at 0.25, one class, with the demo's recipe; measured in the issue-18 note.) Answers are drawn uniformly (a
constant answer scores 1/4) and are one ``TinyTokenizer`` word.

The video is encoded as h264 in yuv420p (what users' mp4s are); white on dark grey survives the chroma
subsampling and the quantisation (``crf`` 0-ish quality, checked by the tests: a decoded frame's square is where
it was drawn). Everything is a function of the numpy ``Generator``, so a seed fixes the dataset.
"""

from __future__ import annotations

import json
import os

import numpy as np

BACKGROUND = 40
WHITE = 240
PROMPT = "how many squares?"
ANSWERS = ("1", "2", "3", "4")


def make_clip(rng: np.random.Generator, size: int = 56, frames: int = 8) -> tuple[np.ndarray, str]:
    """``(frames uint8 [F, size, size, 3], answer)`` of one ``video_count`` example (module docstring)."""
    steps = frames // 2
    if frames % 2 or steps < 4:
        raise ValueError(f"video_count needs an even frame count >= 8 (4 temporal steps of 2 frames), got {frames}")
    k = int(rng.integers(1, 5))
    shown = np.sort(rng.choice(steps, size=k, replace=False))
    clip = np.full((frames, size, size, 3), BACKGROUND, np.uint8)
    cell = size // 2  # the square fills most of one quadrant: at 56 px, one merged vision token
    lo, hi = round(cell * 0.6), cell - 2
    for step in shown:
        side = int(rng.integers(lo, hi + 1))
        q = int(rng.integers(4))
        x = (q % 2) * cell + int(rng.integers(0, cell - side + 1))
        y = (q // 2) * cell + int(rng.integers(0, cell - side + 1))
        clip[2 * step:2 * step + 2, y:y + side, x:x + side] = WHITE
    return clip, ANSWERS[k - 1]


def write_mp4(path: str, clip: np.ndarray, fps: int = 2) -> None:
    """Encodes ``clip`` (uint8 [F, H, W, 3], even H and W) as an h264 mp4 at ``fps``."""
    import av

    with av.open(path, mode="w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = clip.shape[2], clip.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "1", "preset": "ultrafast"}
        for frame in clip:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())


def write_video_dataset(n: int, out_dir: str | os.PathLike, seed: int, size: int = 56, frames: int = 8,
                        fps: int = 2) -> str:
    """Writes ``n`` clips as ``out_dir/videos/000000.mp4, ...`` and ``out_dir/data.jsonl`` rows
    ``{"videos": ["videos/000000.mp4"], "prompt": "how many squares?", "answer": "3"}`` (paths relative to the
    JSONL file; no placeholder, so the video goes before the text). Same arguments -> same files. Returns the
    JSONL's path."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if size % 2:
        raise ValueError(f"size={size} must be even (h264 in yuv420p)")
    out_dir = os.fspath(out_dir)
    os.makedirs(os.path.join(out_dir, "videos"), exist_ok=True)
    rng = np.random.default_rng(seed)
    width = max(6, len(str(n - 1)))
    rows = []
    for i in range(n):
        clip, answer = make_clip(rng, size, frames)
        rel = f"videos/{i:0{width}d}.mp4"
        write_mp4(os.path.join(out_dir, rel), clip, fps)
        rows.append({"videos": [rel], "prompt": PROMPT, "answer": answer})
    return write_jsonl(os.path.join(out_dir, "data.jsonl"), rows)


def write_jsonl(path: str, rows: list[dict]) -> str:
    """Writes ``rows`` as a JSONL file atomically (a temporary file renamed), so a reader never sees half of it."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    os.replace(tmp, path)
    return path
