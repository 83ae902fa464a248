"""Prompt datasets: rows of a dataset file -> checked row metadata -> examples preprocessed per batch -> ``Prompts``.

A dataset is a .jsonl / .json / .parquet file or a directory of parquet files (``sources.py``), whose rows are read
through EasyR1's column flags (``rows.py``: ``--prompt_key``, ``--answer_key`` (dotted), ``--image_key``,
``--video_key``, ``--image_dir``, ``--format_prompt``; ``<image>`` / ``<video>`` placeholders or chat messages).
This project's original JSONL rows ``{"images": [paths], "prompt": str, "answer": str}`` are that format with its
default keys. Loading reads every row and every image's header and every video's container header, never a pixel,
so a bad file fails (or is reported) at start and not in the middle of a run, and a 100k-row dataset loads in
seconds holding a few dozen bytes per row:

- a malformed row (bad JSON, not an object, a missing prompt or answer column, a placeholder count that does not
  match the media) raises ``DataError`` naming ``file:row`` and what is wrong;
- a missing, empty, unidentifiable or oversized image (a path or bytes inside a parquet row), or a PNG that is
  truncated or fails its CRCs (``image_processing.probe_image``), skips its row with a warning naming the row
  and the image (``DataReport.bad_image``); an unreadable video, one with no frame or fewer than 2, the same
  (``bad_video``); an empty answer the same (``empty_answer``);
- an image over ``max_pixels`` is downscaled by ``smart_resize``, as Qwen's processor does (counted in
  ``resized``), never dropped; videos are sampled and sized by Qwen's video rules (``video_sampling.py``);
- a rendered prompt longer than ``max_prompt_len`` tokens skips its row with a warning (``too_long``); prompts
  are never truncated, which could cut a run of image tokens.

What a ``Dataset`` keeps per kept row: its index in the source, the prompt's token count, the merged vision
tokens and each image's and video's grid (and a video's seconds per temporal step). ``dataset[i]`` re-reads row
i and renders its prompt ids; an example's pixels are decoded and patchified when a batch reads them
(``collate``), through a byte-bounded ``PatchCache`` keyed by the media + preprocessing parameters. Pixels the
header check cannot vouch for (a truncated JPEG: its header is intact) fail there with ``DataError`` naming the
row and the file, rather than being skipped: a skip mid-run would change a batch that the sampler, every
process and a resumed run agree on. A row or image that changed since loading fails the same way.

``PromptSampler`` (sampler.py, re-exported here) picks each step's prompts by index.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from rollplex_contract.batch import Prompts
from rollplex_jax.config import VisionConfig
from rollplex_jax.data import rows as rows_lib
from rollplex_jax.data.image_cache import PatchCache
from rollplex_jax.data.image_processing import ImageLoadError, load_image, num_merged_tokens, preprocess_images
from rollplex_jax.data.row_check import DataReport, LoadOptions, RowChecker
from rollplex_jax.data.sampler import PromptSampler
from rollplex_jax.data.sources import DataError, open_source
from rollplex_jax.data.tokenizer import Tokenizer, render_messages

__all__ = ["DataError", "DataReport", "Dataset", "Example", "LoadOptions", "PromptSampler", "collate", "load_dataset"]

@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Example:
    """One prompt, as a batch sees it.

    prompt_ids: int32 [T] (rendered chat prompt, image and video pads expanded); image_grid_thw: int64
    [n_images, 3]; video_grid_thw: int64 [n_videos, 3]; second_per_grid_ts: float32 [n_videos]; images / videos:
    their names (paths); extra: the row's other columns (``data_source``, ``extra_info``, ...: reward functions
    get them). ``image_pixel_values`` / ``video_pixel_values``: float32 [N, patch_dim] patches of the row's images
    / videos in order, decoded when read (through the dataset's cache, read-only); ``pixel_values`` both.
    """

    prompt_ids: np.ndarray
    image_grid_thw: np.ndarray
    answer: str
    prompt: str
    images: tuple[str, ...]
    source: str
    load_pixels: Callable[[str], np.ndarray] = dataclasses.field(repr=False)
    video_grid_thw: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 3), np.int64))
    second_per_grid_ts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.float32))
    videos: tuple[str, ...] = ()
    extra: dict = dataclasses.field(default_factory=dict)

    @property
    def image_pixel_values(self) -> np.ndarray:
        return self.load_pixels("image")

    @property
    def video_pixel_values(self) -> np.ndarray:
        return self.load_pixels("video")

    @property
    def pixel_values(self) -> np.ndarray:
        parts = [p for p in (self.image_pixel_values, self.video_pixel_values) if len(p)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else self.image_pixel_values


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Rows:
    """What loading keeps of the kept rows (arrays in source order), and how an example is rebuilt from it."""

    source: object  # sources.JsonlSource | JsonSource | ParquetSource
    base: str  # where relative media paths start
    src: np.ndarray  # int64: the row's index in the source
    prompt_len: np.ndarray  # int32: rendered prompt tokens
    vision_tokens: np.ndarray  # int32: merged vision tokens of the row's images and videos
    image_start: np.ndarray  # int64 [rows + 1]: row r's images are image_hw[image_start[r]:image_start[r + 1]]
    image_hw: np.ndarray  # int32 [images, 2]: grid (h, w) in patches
    video_start: np.ndarray  # int64 [rows + 1]
    video_thw: np.ndarray  # int32 [videos, 3]: grid (t, h, w)
    video_spgt: np.ndarray  # float32 [videos]: seconds per temporal grid step
    video_times: np.ndarray  # float64 [sum of the videos' t]: each temporal step's time (step_timestamps)
    tok: Tokenizer
    vision: VisionConfig
    opts: LoadOptions
    cache: PatchCache

    def grids(self, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        hw = self.image_hw[self.image_start[r]:self.image_start[r + 1]].astype(np.int64)
        images = np.concatenate([np.ones((len(hw), 1), np.int64), hw], axis=1)
        v = slice(self.video_start[r], self.video_start[r + 1])
        return images, self.video_thw[v].astype(np.int64).reshape(-1, 3), self.video_spgt[v].astype(np.float32)

    def timestamps(self, r: int) -> list[tuple[float, ...]] | None:
        """Row ``r``'s videos' step times where prompts write them (``VisionConfig.video_timestamps``), else None."""
        if not self.vision.video_timestamps:
            return None
        steps = np.concatenate([[0], np.cumsum(self.video_thw[:, 0])]).astype(np.int64)
        first, last = self.video_start[r], self.video_start[r + 1]
        return [tuple(self.video_times[steps[v]:steps[v + 1]].tolist()) for v in range(first, last)]

    def example(self, r: int) -> Example:
        """Row ``r``'s example: its row re-read and its prompt rendered again (checked against load time)."""
        i = int(self.src[r])
        where = self.source.where(i)
        parsed = rows_lib.parse_row(self.source.row(i), self.opts.fmt, where)
        images, videos, spgt = self.grids(r)
        m = self.vision.spatial_merge_size
        ids = np.asarray(render_messages(self.tok, parsed.messages, [num_merged_tokens(g, m) for g in images],
                                         [num_merged_tokens(g, m) for g in videos],
                                         video_timestamps=self.timestamps(r)), np.int32)
        if len(ids) != self.prompt_len[r]:
            raise DataError(f"{where}: the prompt renders to {len(ids)} tokens now, {self.prompt_len[r]} at load "
                            "time: the dataset changed since it was loaded; restart the run on it as it is now")
        img = [rows_lib.image_source(item, self.base, where, k) for k, item in enumerate(parsed.images)]
        vid = [_video_spec(item, self.base, where) for item in parsed.videos]
        load = functools.partial(self.pixels, tuple(img), tuple(vid), images, videos, where)
        return Example(prompt_ids=ids, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=spgt,
                       answer=parsed.answer, prompt=parsed.prompt, images=tuple(n for n, _ in img),
                       videos=tuple(v.name for v in vid), extra=parsed.extra, source=where, load_pixels=load)

    def pixels(self, images, videos, image_grids, video_grids, where: str, kind: str) -> np.ndarray:
        """float32 [N, patch_dim]: the row's images' (or videos') patches in order, from the cache or decoded now."""
        v = self.vision
        items, grids = (images, image_grids) if kind == "image" else (videos, video_grids)
        if not len(items):
            return np.zeros((0, v.patch_dim), np.float32)
        params = (self.opts.min_pixels, self.opts.max_pixels, v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
        parts = []
        for k, (item, g) in enumerate(zip(items, grids, strict=True)):
            if kind == "image":
                name, data = item
                key = ("image", data if isinstance(data, str) else (where, k), *params)
                make = functools.partial(self._image_patches, name, data, g, where)
            else:
                key = ("video", item, self.opts.video_rule, *params)
                make = functools.partial(self._video_patches, item, g, where)
            parts.append(self.cache.get(key, make))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _image_patches(self, name: str, data: str | bytes, grid: np.ndarray, where: str) -> np.ndarray:
        try:
            image = load_image(data, name)
        except ImageLoadError as e:
            raise DataError(f"{where}: {e}. Its header passed the checks at load time but its pixels cannot be "
                            "decoded: replace the file and resume (dropping the row changes the dataset, which a "
                            "resumed run refuses)") from None
        patches, got = preprocess_images([image], self.vision, self.opts.min_pixels, self.opts.max_pixels)
        if got[0].tolist() != grid.tolist():
            raise DataError(f"{where}: image {name!r} decodes to a {got[0][1]}x{got[0][2]}-patch grid but its header "
                            f"gave {grid[1]}x{grid[2]} at load time: the file changed since the dataset was loaded "
                            "(or its EXIF orientation is stored after the pixel data, where the header check does "
                            "not look); restart the run")
        return patches

    def _video_patches(self, spec, grid: np.ndarray, where: str) -> np.ndarray:
        from rollplex_jax.data import video_io

        try:
            v = self.vision
            plan = video_io.probe_video(spec, self.opts.video_rule, v.patch_size * v.spatial_merge_size,
                                        patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size)
            if list(plan.grid_thw) != grid.tolist():
                raise DataError(f"{where}: video {spec.name!r} now gives grid {list(plan.grid_thw)}, "
                                f"{grid.tolist()} at load time: the file changed since loading; restart the run")
            return video_io.load_video(spec, plan, self.vision)
        except video_io.VideoError as e:
            raise DataError(f"{where}: {e}. Its header passed the checks at load time but its frames cannot be "
                            "decoded: replace the file and resume") from None


def _video_spec(item, base: str, where: str):
    from rollplex_jax.data import video_io

    try:
        return video_io.video_spec(item, base)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


class Dataset(Sequence):
    """The kept rows of a dataset file; each example is built when indexed (see the module docstring).

    ``dataset[i]`` is an ``Example``; ``dataset[a:b]`` and ``dataset[int_array]`` are ``Dataset`` views of the
    same rows and cache. ``prompt_lengths`` and ``vision_tokens`` come from the load-time metadata, no pixel
    or line is read for them.
    """

    def __init__(self, rows: _Rows, index: np.ndarray | None = None):
        self._rows = rows
        self._index = np.arange(len(rows.src), dtype=np.int64) if index is None else index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return Dataset(self._rows, self._index[key])
        if isinstance(key, (int, np.integer)):
            return self._rows.example(int(self._index[key]))  # numpy: negative indices, IndexError past the end
        idx = np.asarray(key)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise TypeError(f"a Dataset is indexed by an int, a slice or a 1-d integer array, not {key!r}")
        return Dataset(self._rows, self._index[idx])

    def __iter__(self) -> Iterator[Example]:
        for r in self._index:
            yield self._rows.example(int(r))

    @property
    def prompt_lengths(self) -> np.ndarray:
        """int32 [len]: each example's prompt length in tokens (image pads included)."""
        return self._rows.prompt_len[self._index]

    @property
    def vision_tokens(self) -> np.ndarray:
        """int32 [len]: each example's merged vision tokens (image- and video-pad tokens)."""
        return self._rows.vision_tokens[self._index]

    @property
    def largest_frame_tokens(self) -> int:
        """Merged vision tokens of the largest image or video frame among the loaded rows (0 without any)."""
        r = self._rows
        hw = [r.image_hw.reshape(-1, 2), r.video_thw.reshape(-1, 3)[:, 1:]]
        sizes = np.concatenate([np.prod(a.astype(np.int64), axis=1) for a in hw])
        return int(sizes.max()) // r.vision.spatial_merge_size**2 if len(sizes) else 0

    @property
    def video_count(self) -> int:
        """Videos among the loaded rows."""
        return len(self._rows.video_thw.reshape(-1, 3))

    @property
    def cache(self) -> PatchCache:
        return self._rows.cache

    def __repr__(self) -> str:
        return f"Dataset({self._rows.source.path!r}, {len(self)} examples)"


def load_dataset(path: str | os.PathLike, tok: Tokenizer, vision: VisionConfig, opts: LoadOptions, *,
                 log: Callable[[str], None] = print) -> tuple[Dataset, DataReport]:
    """Reads and checks every row of a dataset and its media's headers; decodes no pixels.

    Args:
        path: A .jsonl / .json (``path@key``) / .parquet file or a directory of parquet files (``sources.py``).
        tok: Renders prompts (``render_messages``) and must know every prompt/answer word.
        vision: Patch, merge and temporal sizes for the patches.
        opts: Image pixel bounds (larger images are downscaled), the longest prompt in tokens (longer rows are
            skipped), columns and template, video rule, cache bound (``LoadOptions``; from the flags:
            ``LoadOptions.from_config``).
        log: Receives a warning line for each of the first ``row_check.MAX_ROW_WARNINGS`` skipped rows, one for
            the rest, and a one-line summary.

    Returns:
        The kept rows in source order (a ``Dataset``: examples built on access), and the counts.

    Raises:
        DataError: a malformed row, a prompt/answer the tokenizer cannot encode, or no row kept.
    """
    path = os.fspath(path)
    rows_lib.check_format_prompt(opts.fmt.format_prompt)
    source = open_source(path)
    base = rows_lib.media_base(path, opts.fmt)
    checker = RowChecker(tok, vision, opts, base, log)
    cols = {k: array.array("q") for k in ("src", "prompt_len", "vision_tokens", "n_images", "n_videos")}
    image_hw, video_thw, spgt, times = array.array("i"), array.array("i"), array.array("f"), array.array("d")
    for i, row in enumerate(_progress(source)):
        kept = checker.check(source.where(i), row)
        if kept is None:
            continue
        n, hw, thw, secs, vision_tokens, steps = kept
        for key, value in (("src", i), ("prompt_len", n), ("vision_tokens", vision_tokens), ("n_images", len(hw)),
                           ("n_videos", len(thw))):
            cols[key].append(value)
        for g in hw:
            image_hw.extend(g)
        for g in thw:
            video_thw.extend(g)
        spgt.extend(secs)
        for t in steps:
            times.extend(t)
    rep = checker.report
    rep.kept = len(cols["src"])
    skipped = rep.skipped_text(opts.max_prompt_len)
    if checker.unshown:
        log(checker.unshown_text())
    log(f"data: {path}: kept {rep.kept} of {rep.rows} rows; skipped {skipped}; downscaled {rep.resized} images over "
        f"max_pixels={opts.max_pixels}")
    if not rep.kept:
        if rep.rows == 0:
            raise DataError(f"dataset file {path!r} has no rows")
        raise DataError(f"no usable rows in {path!r}: all {rep.rows} rows were skipped ({skipped}); "
                        "see the warnings above")
    a = {k: np.frombuffer(v, np.int64).copy() for k, v in cols.items()}
    starts = lambda n: np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    rows = _Rows(source=source, base=base, src=a["src"], prompt_len=a["prompt_len"].astype(np.int32),
                 vision_tokens=a["vision_tokens"].astype(np.int32), image_start=starts(a["n_images"]),
                 image_hw=np.frombuffer(image_hw, np.int32).reshape(-1, 2).copy(), video_start=starts(a["n_videos"]),
                 video_thw=np.frombuffer(video_thw, np.int32).reshape(-1, 3).copy(),
                 video_spgt=np.frombuffer(spgt, np.float32).copy(), video_times=np.frombuffer(times, np.float64).copy(),
                 tok=tok, vision=vision, opts=opts,
                 cache=PatchCache(opts.cache_bytes))
    return Dataset(rows), rep


def _progress(source) -> Iterator[dict]:
    """The source's rows, with a progress bar when there are many (their media headers are read one by one)."""
    from tqdm.auto import tqdm

    yield from tqdm(source.rows(), total=len(source), desc="checking dataset rows", unit="row",
                    disable=len(source) < 20_000, leave=False)


def collate(examples: Iterable[Example], pad_id: int) -> Prompts:
    """Left-pads a batch of examples into ``Prompts`` (the rollout and actor input); their media are decoded
    and patchified here (through the dataset's cache).

    Returns:
        ``Prompts`` with int32 ``input_ids``/``attention_mask`` [B, T_max] (pads on the left, mask 0 there),
        ``pixel_values`` every image's patches in batch order then every video's, their grids
        ``image_grid_thw`` / ``video_grid_thw`` and the videos' ``second_per_grid_ts`` (None without any).
    """
    examples = list(examples)  # a Dataset builds its examples on access: build each once
    if not examples:
        raise ValueError("collate got no examples")
    t = max(len(e.prompt_ids) for e in examples)
    input_ids = np.full((len(examples), t), pad_id, np.int32)
    mask = np.zeros((len(examples), t), np.int32)
    for i, e in enumerate(examples):
        n = len(e.prompt_ids)
        input_ids[i, t - n:] = e.prompt_ids
        mask[i, t - n:] = 1
    images = [e for e in examples if len(e.image_grid_thw)]
    videos = [e for e in examples if len(e.video_grid_thw)]
    pix = [e.image_pixel_values for e in images] + [e.video_pixel_values for e in videos]
    cat = lambda xs, dtype: np.concatenate(xs).astype(dtype) if xs else None
    return Prompts(input_ids=input_ids, attention_mask=mask, pixel_values=cat(pix, np.float32),
                   image_grid_thw=cat([e.image_grid_thw for e in images], np.int64),
                   video_grid_thw=cat([e.video_grid_thw for e in videos], np.int64),
                   second_per_grid_ts=cat([e.second_per_grid_ts for e in videos], np.float32))
