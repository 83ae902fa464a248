"""The load-time check of one dataset row: its media's headers, its prompt's length; counted skips.

Why apart from ``dataset.py``: this is where every skip rule lives, with its counter and its warning, so the
rules read in one place (``dataset.py``'s docstring lists them): a bad image or video and an empty answer skip
the row, a prompt over ``max_prompt_len`` skips it, an oversized image is downscaled (counted). What is wrong
with the row itself (a missing column, a placeholder count) is a ``DataError`` from ``rows.parse_row``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rollplex_jax.config import VisionConfig
from rollplex_jax.data import rows as rows_lib
from rollplex_jax.data.image_processing import ImageLoadError, check_vision, probe_image, smart_resize
from rollplex_jax.data.sources import DataError
from rollplex_jax.data.tokenizer import Tokenizer, render_messages
from rollplex_jax.data.video_sampling import VideoRule


@dataclasses.dataclass(kw_only=True)
class DataReport:
    """What loading did: rows read, kept, and skipped or changed per reason.

    ``bad_image``, ``bad_video``, ``empty_answer`` and ``too_long`` count skipped rows; ``resized`` counts
    images (not rows) downscaled because they exceeded ``max_pixels``.
    """

    rows: int = 0
    kept: int = 0
    bad_image: int = 0
    bad_video: int = 0
    empty_answer: int = 0
    resized: int = 0
    too_long: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def skipped_text(self, max_prompt_len: int) -> str:
        """The skips in words (video and empty-answer counts only when there are some)."""
        parts = [f"{self.bad_image} with bad images"]
        parts += [f"{self.bad_video} with bad videos"] if self.bad_video else []
        parts += [f"{self.empty_answer} with an empty answer"] if self.empty_answer else []
        return ", ".join(parts + [f"{self.too_long} over max_prompt_len={max_prompt_len}"])


class RowChecker:
    """Checks rows at load time, from the row and its media's headers; counts and logs the skipped ones."""

    def __init__(self, tok: Tokenizer, vision: VisionConfig, min_pixels: int, max_pixels: int, max_prompt_len: int,
                 fmt: rows_lib.RowFormat, base: str, video_rule: VideoRule, log: Callable[[str], None]):
        self.tok, self.vision, self.log = tok, vision, log
        self.min_pixels, self.max_pixels, self.max_prompt_len = min_pixels, max_pixels, max_prompt_len
        self.fmt, self.base, self.video_rule = fmt, base, video_rule
        self.factor = check_vision(vision)  # RGB input, or a ValueError that stops loading
        self.report = DataReport()
        self._probes: dict[str, tuple | str] = {}  # image path -> (size, resized size), or the error
        self._answers: set[str] = set()

    def _probe(self, name: str, data: str | bytes) -> tuple | str:
        cached = isinstance(data, str)
        if cached and data in self._probes:
            return self._probes[data]
        try:
            h, w = probe_image(data, name)
            out = ((h, w), smart_resize(h, w, self.factor, self.min_pixels, self.max_pixels))
        except ImageLoadError as e:
            out = str(e)
        except ValueError as e:  # smart_resize: extreme aspect ratio
            out = f"image {name!r}: {e}"
        if cached:
            self._probes[data] = out
        return out

    def _videos(self, parsed: rows_lib.ParsedRow, where: str) -> list | str:
        """Each video's plan (grid, seconds per step), or the error of the first bad one."""
        if not parsed.videos:
            return []
        from rollplex_jax.data import video_io

        plans = []
        for item in parsed.videos:
            try:
                spec = video_io.video_spec(item, self.base)
            except ValueError as e:
                raise DataError(f"{where}: {e}") from None
            try:
                plans.append(video_io.probe_video(spec, self.video_rule, self.factor, patch_size=self.vision.patch_size,
                                                   temporal_patch_size=self.vision.temporal_patch_size))
            except ValueError as e:  # VideoError, or a rule that cannot sample it (too few frames)
                return str(e)
        return plans

    def _skip(self, counter: str, where: str, why: str) -> None:
        setattr(self.report, counter, getattr(self.report, counter) + 1)
        self.log(f"warning: {where}: row skipped, {why}")

    def _prompt_len(self, where: str, parsed: rows_lib.ParsedRow, n_img: list[int], n_vid: list[int]) -> int:
        try:
            n = len(render_messages(self.tok, parsed.messages, n_img, n_vid))
            if parsed.answer not in self._answers:
                self.tok.encode(parsed.answer)
                self._answers.add(parsed.answer)
        except ValueError as e:
            raise DataError(f"{where}: cannot tokenize this row: {e}") from None
        return n

    def check(self, where: str, row: dict) -> tuple | None:
        """``(prompt length, image grids (h, w), video grids (t, h, w), seconds per step, vision tokens)`` of a
        kept row; None (logged, counted) for a skipped one."""
        self.report.rows += 1
        parsed = rows_lib.parse_row(row, self.fmt, where)
        if not parsed.answer.strip():
            self._skip("empty_answer", where, f"its answer (column {self.fmt.answer_key!r}) is empty")
            return None
        probes = [self._probe(*rows_lib.image_source(item, self.base, where, k))
                  for k, item in enumerate(parsed.images)]
        error = next((p for p in probes if isinstance(p, str)), None)
        if error:
            self._skip("bad_image", where, f"bad image: {error}")
            return None
        plans = self._videos(parsed, where)
        if isinstance(plans, str):
            self._skip("bad_video", where, f"bad video: {plans}")
            return None
        self.report.resized += sum(h * w > self.max_pixels for (h, w), _ in probes)
        p, m2 = self.vision.patch_size, self.vision.spatial_merge_size ** 2
        hw = [(h // p, w // p) for _, (h, w) in probes]
        thw = [tuple(int(x) for x in plan.grid_thw) for plan in plans]
        n_img, n_vid = [h * w // m2 for h, w in hw], [t * h * w // m2 for t, h, w in thw]
        n = self._prompt_len(where, parsed, n_img, n_vid)
        if n > self.max_prompt_len:
            media, lower = f"{sum(n_img)} image", "--max_pixels"
            if n_vid:
                media, lower = f"{media} and {sum(n_vid)} video", f"{lower} / --video_max_pixels / --video_max_frames"
            self._skip("too_long", where, f"prompt is {n} tokens (with {media} tokens), over max_prompt_len="
                       f"{self.max_prompt_len}; raise --max_prompt_len or lower {lower}")
            return None
        return n, hw, thw, [float(plan.second_per_grid_t) for plan in plans], sum(n_img) + sum(n_vid)
