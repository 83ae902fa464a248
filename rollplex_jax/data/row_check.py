"""The load-time check of one dataset row: its media's headers, its prompt's length; counted skips.

Why apart from ``dataset.py``: this is where every skip rule lives, with its counter and its warning, so the
rules read in one place (``dataset.py``'s docstring lists them): a bad image or video and an empty answer skip
the row, a prompt over ``max_prompt_len`` skips it, an oversized image is downscaled (counted). What is wrong
with the row itself (a missing column, a placeholder count) is a ``DataError`` from ``rows.parse_row``.

A dataset with many bad rows would bury the log in warnings: the first ``MAX_ROW_WARNINGS`` skipped rows get a
line each, the rest are counted per cause (``RowChecker.unshown``) and summed up in one line after loading.
``LoadOptions`` gathers what loading needs from the data flags (``LoadOptions.from_config``), once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rollplex_jax.config import DataConfig, VisionConfig
from rollplex_jax.data import rows as rows_lib
from rollplex_jax.data.image_cache import DEFAULT_CACHE_BYTES
from rollplex_jax.data.image_processing import ImageLoadError, check_vision, probe_image, smart_resize
from rollplex_jax.data.sources import DataError
from rollplex_jax.data.tokenizer import Tokenizer, render_messages
from rollplex_jax.data.video_sampling import VideoRule

MAX_ROW_WARNINGS = 10  # skipped rows logged one by one; the others are counted per cause
_CAUSES = {"bad_image": "with bad images", "bad_video": "with bad videos", "empty_answer": "with an empty answer",
           "too_long": "over max_prompt_len"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How a dataset's rows are read and checked at load time.

    ``min_pixels`` / ``max_pixels``: ``smart_resize`` bounds of images (larger ones are downscaled);
    ``max_prompt_len``: the longest rendered prompt in tokens (longer rows are skipped); ``fmt``: column names,
    media directory and prompt template (``rows.RowFormat``); ``video_rule``: how videos are sampled and sized;
    ``cache_bytes``: bound of each dataset's cache of preprocessed media (``image_cache.PatchCache``).
    """

    min_pixels: int
    max_pixels: int
    max_prompt_len: int
    fmt: rows_lib.RowFormat = rows_lib.RowFormat()
    video_rule: VideoRule = VideoRule()
    cache_bytes: int = DEFAULT_CACHE_BYTES

    @classmethod
    def from_config(cls, d: DataConfig) -> LoadOptions:
        """The options the data flags give (``--prompt_key``, ``--video_fps``, ``--image_cache_mb``, ...)."""
        fmt = rows_lib.RowFormat(prompt_key=d.prompt_key, answer_key=d.answer_key, image_key=d.image_key,
                                 video_key=d.video_key, image_dir=d.image_dir, format_prompt=d.format_prompt)
        rule = VideoRule(fps=d.video_fps, min_frames=d.video_min_frames, max_frames=d.video_max_frames,
                         min_pixels=d.video_min_pixels, max_pixels=d.video_max_pixels,
                         total_pixels=d.video_total_pixels)
        return cls(min_pixels=d.min_pixels, max_pixels=d.max_pixels, max_prompt_len=d.max_prompt_len, fmt=fmt,
                   video_rule=rule, cache_bytes=d.image_cache_mb << 20)


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
    """Checks rows at load time, from the row and its media's headers; counts the skipped ones and logs the first
    ``MAX_ROW_WARNINGS`` (``unshown``: the others, per cause).

    Args:
      tok: renders the prompts; must know every prompt and answer word.
      vision: patch, merge and temporal sizes.
      opts: the limits, columns and video rule (``LoadOptions``).
      base: where relative media paths start.
      log: receives the warnings.
    """

    def __init__(self, tok: Tokenizer, vision: VisionConfig, opts: LoadOptions, base: str,
                 log: Callable[[str], None]):
        self.tok, self.vision, self.log = tok, vision, log
        self.min_pixels, self.max_pixels, self.max_prompt_len = opts.min_pixels, opts.max_pixels, opts.max_prompt_len
        self.fmt, self.base, self.video_rule = opts.fmt, base, opts.video_rule
        self.factor = check_vision(vision)  # RGB input, or a ValueError that stops loading
        self.report = DataReport()
        self.unshown: dict[str, int] = {}  # skipped rows past the first MAX_ROW_WARNINGS, per cause
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
        shown = sum(getattr(self.report, c) for c in _CAUSES) - sum(self.unshown.values()) - 1
        if shown < MAX_ROW_WARNINGS:
            self.log(f"warning: {where}: row skipped, {why}")
        else:
            self.unshown[counter] = self.unshown.get(counter, 0) + 1

    def unshown_text(self) -> str:
        """One line on the skipped rows that got no warning of their own ('' when every one got one)."""
        if not self.unshown:
            return ""
        causes = ", ".join(f"{self.unshown[c]} {text}" + (f"={self.max_prompt_len}" if c == "too_long" else "")
                           for c, text in _CAUSES.items() if c in self.unshown)  # in the summary's order
        return (f"warning: {sum(self.unshown.values())} more rows skipped without a line each ({causes}); the first "
                f"{MAX_ROW_WARNINGS} are above, the summary below counts every cause")

    def _prompt_len(self, where: str, parsed: rows_lib.ParsedRow, n_img: list[int], n_vid: list[int],
                    times: list | None) -> int:
        try:
            n = len(render_messages(self.tok, parsed.messages, n_img, n_vid, video_timestamps=times))
            if parsed.answer not in self._answers:
                self.tok.encode(parsed.answer)
                self._answers.add(parsed.answer)
        except ValueError as e:
            raise DataError(f"{where}: cannot tokenize this row: {e}") from None
        return n

    def check(self, where: str, row: dict) -> tuple | None:
        """``(prompt length, image grids (h, w), video grids (t, h, w), seconds per step, vision tokens, each video's
        step times)`` of a kept row; None (logged, counted) for a skipped one."""
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
        times = [plan.timestamps for plan in plans] if self.vision.video_timestamps else None
        n = self._prompt_len(where, parsed, n_img, n_vid, times)
        if n > self.max_prompt_len:
            media, lower = f"{sum(n_img)} image", "--max_pixels"
            if n_vid:
                media, lower = f"{media} and {sum(n_vid)} video", f"{lower} / --video_max_pixels / --video_max_frames"
            self._skip("too_long", where, f"prompt is {n} tokens (with {media} tokens), over max_prompt_len="
                       f"{self.max_prompt_len}; raise --max_prompt_len or lower {lower}")
            return None
        return (n, hw, thw, [float(plan.second_per_grid_t) for plan in plans], sum(n_img) + sum(n_vid),
                [plan.timestamps for plan in plans])
