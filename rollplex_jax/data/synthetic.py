"""Synthetic visual tasks for the tiny demo, drawn with PIL (nothing downloaded).

Three tasks, each a 56x56 RGB picture of flat squares on a dark grey background, a prompt
that is the same for every example of the task, and a one-token answer (in
``TinyTokenizer``'s vocabulary), so the answer can only be read from the image:

- ``colour``: one square (side 24-36 px) of red / green / blue / yellow, anywhere.
- ``quadrant``: one white square (side 8-14 px) wholly inside one quadrant; the answer is
  top-left / top-right / bottom-left / bottom-right.
- ``count``: 1-4 white squares (side 8-12 px) that neither overlap nor touch (>= 2 px apart).

Answers are drawn uniformly, so a constant answer scores 1/4. Sizes scale with
``image_size`` (defaults for 56 px: 4x4 patches of 14 px, 2x2 merged vision tokens; the
quadrant boundaries fall on patch boundaries). Everything is a function of the numpy
``Generator`` passed in, so a seed fixes the dataset.

``write_dataset`` records what decided the files (``dataset_key``: task, count, seed, sizes) in ``synthetic.json``
beside ``data.jsonl``, so that a run reuses a split only when its flags would write the same files
(``run/setup.py``).
"""

from __future__ import annotations

import json
import os

import numpy as np
from PIL import Image, ImageDraw

from rollplex_jax.data import synthetic_video

TASKS = ("colour", "quadrant", "count", "video_count")  # video_count: synthetic_video.py (mp4 clips)
IMAGE_TASKS = TASKS[:3]
PROMPTS = {"colour": "what colour?", "quadrant": "which quadrant?", "count": "how many squares?",
           "video_count": synthetic_video.PROMPT}
ANSWERS = {
    "colour": ("red", "green", "blue", "yellow"),
    "quadrant": ("top-left", "top-right", "bottom-left", "bottom-right"),
    "count": ("1", "2", "3", "4"),
    "video_count": synthetic_video.ANSWERS,
}
KEY_FILE = "synthetic.json"  # beside data.jsonl: the dataset_key it was written from
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (50, 80, 230), "yellow": (235, 215, 40)}
BACKGROUND = (40, 40, 40)
WHITE = (240, 240, 240)
GAP = 2  # min distance between count squares, in px at 56


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown: one of {', '.join(TASKS)}")


def _square(draw: ImageDraw.ImageDraw, x: int, y: int, side: int, fill) -> None:
    draw.rectangle([x, y, x + side - 1, y + side - 1], fill=fill)


def _sizes(image_size: int, lo: int, hi: int) -> tuple[int, int]:
    s = image_size / 56
    return max(1, round(lo * s)), max(1, round(hi * s))


def _colour(draw, rng, size):
    answer = ANSWERS["colour"][int(rng.integers(4))]
    lo, hi = _sizes(size, 24, 36)
    side = int(rng.integers(lo, hi + 1))
    x, y = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    _square(draw, x, y, side, COLOURS[answer])
    return answer


def _quadrant(draw, rng, size):
    q = int(rng.integers(4))
    half = size // 2
    lo, hi = _sizes(size, 8, 14)
    side = int(rng.integers(lo, min(hi, half) + 1))
    x0, y0 = (q % 2) * half, (q // 2) * half
    x, y = (int(v) for v in rng.integers(0, half - side + 1, size=2))
    _square(draw, x0 + x, y0 + y, side, WHITE)
    return ANSWERS["quadrant"][q]


def _count(draw, rng, size):
    k = int(rng.integers(1, 5))
    lo, hi = _sizes(size, 8, 12)
    gap = max(1, round(GAP * size / 56))
    boxes: list[tuple[int, int, int]] = []
    tries = 0
    while len(boxes) < k:  # rejection sampling; 4 squares of <= 12 px fit in 56x56 easily
        tries += 1
        if tries > 10_000:
            raise RuntimeError(f"could not place {k} separate squares in a {size}px image; use image_size >= 56")
        side = int(rng.integers(lo, hi + 1))
        x, y = (int(v) for v in rng.integers(0, size - side + 1, size=2))
        if all(x + side + gap <= bx or bx + bs + gap <= x or y + side + gap <= by or by + bs + gap <= y
               for bx, by, bs in boxes):
            boxes.append((x, y, side))
    for x, y, side in boxes:
        _square(draw, x, y, side, WHITE)
    return str(k)


_DRAW = {"colour": _colour, "quadrant": _quadrant, "count": _count}


def make_example(task: str, rng: np.random.Generator, image_size: int = 56) -> tuple[Image.Image, str, str]:
    """Draws one example of ``task``.

    Args:
        task: "colour", "quadrant" or "count".
        rng: The only source of randomness (same generator state -> same example).
        image_size: Side of the square image in px (>= 56 recommended; sizes scale with it).

    Returns:
        ``(image, prompt, answer)``: an RGB PIL image, the task's fixed prompt text, the answer.
    """
    if task not in IMAGE_TASKS:
        raise ValueError(f"task={task!r} is not an image task ({', '.join(IMAGE_TASKS)}); video_count clips come "
                         "from synthetic_video.make_clip")
    if image_size < 28:
        raise ValueError(f"image_size={image_size} is too small: use >= 28 (56 is the demo's size)")
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    answer = _DRAW[task](ImageDraw.Draw(image), rng, image_size)
    return image, PROMPTS[task], answer


def write_dataset(task: str, n: int, out_dir: str | os.PathLike, seed: int, image_size: int = 56,
                  video_frames: int = 8, image_sizes: tuple[int, ...] = ()) -> str:
    """Writes ``n`` examples as PNGs (or, for ``video_count``, mp4 clips of ``video_frames`` frames:
    ``synthetic_video.write_video_dataset``) plus a JSONL index that ``dataset.load_dataset`` reads.

    Layout: ``out_dir/images/000000.png, ...`` and ``out_dir/data.jsonl`` with rows
    ``{"images": ["images/000000.png"], "prompt": ..., "answer": ...}`` (paths relative to
    the JSONL file). Same (task, n, seed, image_size) -> same files. ``image_sizes``: each example's side drawn
    from these (by a generator of its own, so the same seed and sizes give the same files), for prompts of
    mixed lengths.

    Returns:
        The path of ``data.jsonl``.
    """
    _check_task(task)
    key = dataset_key(task, n, seed, image_size, video_frames, image_sizes)
    if task == "video_count":
        path = synthetic_video.write_video_dataset(n, out_dir, seed, size=image_size, frames=video_frames)
    else:
        path = _write_images(task, n, out_dir, seed, image_size, image_sizes)
    with open(os.path.join(os.path.dirname(path), KEY_FILE), "w") as f:  # last: a cut write leaves no key
        json.dump(key, f)
    return path


def dataset_key(task: str, n: int, seed: int, image_size: int = 56, video_frames: int = 8,
                image_sizes: tuple[int, ...] = ()) -> dict:
    """What decides ``write_dataset``'s files (the same arguments: equal keys, equal files); the sizes that do not
    apply to the task are left out, so changing them does not count as a change."""
    key = {"task": task, "n": int(n), "seed": int(seed)}
    if task == "video_count":
        return {**key, "image_size": int(image_size), "video_frames": int(video_frames)}
    if image_sizes:
        return {**key, "image_sizes": [int(x) for x in image_sizes]}
    return {**key, "image_size": int(image_size)}


def written_key(out_dir: str | os.PathLike) -> dict | None:
    """The ``dataset_key`` that ``out_dir`` was written from; None without a record (written before keys were
    recorded, cut short, or not written by ``write_dataset``)."""
    try:
        with open(os.path.join(os.fspath(out_dir), KEY_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_images(task: str, n: int, out_dir, seed: int, image_size: int, image_sizes: tuple[int, ...]) -> str:
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    out_dir = os.fspath(out_dir)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rng = np.random.default_rng(seed)
    width = max(6, len(str(n - 1)))
    rows = []
    sides = np.random.default_rng([seed, 1]).choice(image_sizes, size=n) if image_sizes else np.full(n, image_size)
    for i in range(n):
        image, prompt, answer = make_example(task, rng, int(sides[i]))
        rel = f"images/{i:0{width}d}.png"
        image.save(os.path.join(out_dir, rel))
        rows.append({"images": [rel], "prompt": prompt, "answer": answer})
    return synthetic_video.write_jsonl(os.path.join(out_dir, "data.jsonl"), rows)
