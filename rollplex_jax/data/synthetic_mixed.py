"""A geometry3k-shaped parquet of a counting task whose images all differ in size (issue 30's benchmark data).

Why: the synthetic tasks of ``synthetic.py`` draw every image at one size (or one of a few), so a run on them
meets few batch shapes; real data (geometry3k: one image per prompt, 80-420 px a side, questions of varied
length) brings a new longest prompt, patch count and packed-row count nearly every step. This module writes
such data without a download, in the layout verl's ``examples/data_preprocess/geo3k.py`` writes
(``/work/shared/DATA.md``): ``data_source``, ``prompt`` (one user message starting with ``<image>``),
``images`` ([{bytes, path}]), ``ability``, ``reward_model`` ({style, ground_truth}), ``extra_info``.

The task: "how many squares?" over 1-4 coloured squares on a coloured background; the answer is one digit.
The squares sit in distinct cells of a 3x3 grid, so they never overlap at any aspect ratio, and each square's
place and size are fractions of its cell: the same layout renders at any width and height. Each row's width
and height are drawn independently in [80, 420] px; ``fixed_size`` renders every row's layout at that square
size instead (the fixed-size twin: the same rows, questions and answers, one image shape). Question texts
come from templates of different lengths. Everything follows from ``seed``.
"""

from __future__ import annotations

import dataclasses
import io
import os

import numpy as np
from PIL import Image, ImageDraw

MIN_SIDE, MAX_SIDE = 80, 420  # px, each of width and height (geometry3k's spread)
GRID = 3  # squares sit in distinct cells of a GRID x GRID grid
DATA_SOURCE = "rollplex/mixed_count"
ANSWERS = ("1", "2", "3", "4")
QUESTIONS = (
    "How many squares are in the image?",
    "Count the squares in the picture. How many are there?",
    "The image shows a few coloured squares on a plain background. How many squares can you see?",
    "Look carefully at the figure, which contains several coloured squares of different sizes drawn on a plain "
    "background. How many squares are there in total? Answer with a single number.",
    "In the picture above, some squares have been drawn in different colours and at different places. Count "
    "every square, whatever its colour or size, and give the number of squares as a digit.",
)
PALETTE = ((220, 40, 40), (40, 180, 60), (50, 80, 230), (235, 215, 40), (240, 240, 240), (200, 90, 220))
BACKGROUNDS = ((40, 40, 40), (20, 30, 60), (60, 30, 30), (30, 55, 35))


@dataclasses.dataclass(frozen=True)
class Square:
    """One square: its grid cell, its side as a fraction of the cell's shorter side, its offset inside the cell
    as fractions of the room left there, and its colour."""

    cell: int
    side: float
    fx: float
    fy: float
    colour: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What an image shows, independent of its size."""

    background: tuple[int, int, int]
    squares: tuple[Square, ...]


def draw_layout(rng: np.random.Generator) -> Layout:
    """1-4 squares (uniform) in distinct cells, sides 45-80% of a cell's shorter side, colours from ``PALETTE``."""
    k = int(rng.integers(1, 5))
    cells = rng.choice(GRID * GRID, size=k, replace=False)
    squares = tuple(Square(int(c), float(rng.uniform(0.45, 0.8)), float(rng.uniform()), float(rng.uniform()),
                           PALETTE[int(rng.integers(len(PALETTE)))]) for c in cells)
    return Layout(BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))], squares)


def render(layout: Layout, width: int, height: int) -> Image.Image:
    """The layout as a ``width`` x ``height`` RGB image (squares stay square: sides scale with the cell's shorter
    side)."""
    image = Image.new("RGB", (width, height), layout.background)
    draw = ImageDraw.Draw(image)
    cw, ch = width / GRID, height / GRID
    for s in layout.squares:
        side = max(2, round(s.side * min(cw, ch)))
        x = round((s.cell % GRID) * cw + s.fx * (cw - side))
        y = round((s.cell // GRID) * ch + s.fy * (ch - side))
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=s.colour)
    return image


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def make_rows(n: int, seed: int, fixed_size: int = 0) -> list[dict]:
    """``n`` rows in verl's geometry3k layout (module docstring). ``fixed_size`` > 0: every image that size
    square, the rest (layouts, questions, answers, row order) as with 0."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    if fixed_size and fixed_size < 28:
        raise ValueError(f"fixed_size={fixed_size} is too small: use >= 28 px (or 0 for mixed sizes)")
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        layout = draw_layout(rng)
        w, h = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
        q = int(rng.integers(len(QUESTIONS)))
        if fixed_size:
            w = h = fixed_size
        answer = str(len(layout.squares))
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": "<image>" + QUESTIONS[q]}],
            "images": [{"bytes": _png(render(layout, w, h)), "path": None}],
            "ability": "counting",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "question": q, "width": w, "height": h},
        })
    return rows


def write_parquet(path: str | os.PathLike, n: int, seed: int, fixed_size: int = 0, row_group_size: int = 64) -> str:
    """Writes ``make_rows(n, seed, fixed_size)`` to the parquet file ``path`` (its directory created); returns
    the path. The rows load with ``--dataset=PATH --answer_key=reward_model.ground_truth``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.fspath(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    pq.write_table(pa.Table.from_pylist(make_rows(n, seed, fixed_size)), tmp, row_group_size=row_group_size)
    os.replace(tmp, path)  # a cut write leaves no train.parquet for a later run to trust
    return path
