"""Prompt datasets: JSONL rows -> checked row metadata -> examples preprocessed per batch -> ``Prompts``.

A dataset is a JSONL file of rows ``{"images": [paths relative to the file], "prompt": str,
"answer": str}``. Loading reads every line and every image's header, never its pixels, so a bad
file fails (or is reported) at start and not in the middle of a run, and a 100k-row dataset loads
in seconds holding a few dozen bytes per row:

- a malformed line (bad JSON, not an object, a missing or ill-typed field) raises
  ``DataError`` naming ``file:line`` and what is wrong;
- a missing, empty, unidentifiable or oversized image, or a PNG that is truncated or fails its
  CRCs (``image_processing.probe_image``: header + ``PIL verify``), skips its row with a warning
  naming ``file:line`` and the image (counted in ``DataReport.bad_image``);
- an image over ``max_pixels`` is downscaled by ``smart_resize``, as Qwen's processor does
  (counted in ``resized``), never dropped; its size, hence its grid and the prompt's token count,
  comes from the header;
- a rendered prompt longer than ``max_prompt_len`` tokens skips its row with a warning
  (``too_long``); prompts are never truncated, which could cut a run of image tokens.

What a ``Dataset`` keeps per kept row: the line's byte offset and CRC, the prompt's token count, the
merged vision tokens and each image's grid. ``dataset[i]`` re-reads line i and renders its prompt ids;
an example's ``pixel_values`` are decoded and patchified when a batch reads them (``collate``), through
a byte-bounded ``PatchCache`` keyed by image path + preprocessing parameters. Pixels the header check
cannot vouch for (a truncated JPEG: its header is intact) fail there with ``DataError`` naming
``file:line`` and the image, rather than being skipped: a skip mid-run would change a batch that the
sampler, every process and a resumed run agree on. A line or image that changed since loading fails
the same way (the line's CRC; the decoded grid against the header's).

``PromptSampler`` (sampler.py, re-exported here) picks each step's prompts by index.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from rollplex_contract.batch import Prompts
from rollplex_jax.config import VisionConfig
from rollplex_jax.data.image_cache import DEFAULT_CACHE_BYTES, PatchCache
from rollplex_jax.data.image_processing import (
    ImageLoadError,
    check_vision,
    load_image,
    num_merged_tokens,
    preprocess_images,
    probe_image,
    smart_resize,
)
from rollplex_jax.data.sampler import PromptSampler
from rollplex_jax.data.tokenizer import Tokenizer, render_prompt

__all__ = ["DataError", "DataReport", "Dataset", "Example", "PromptSampler", "collate", "load_dataset", "load_jsonl"]


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file (and line) and the fix."""


def _lines(path: str) -> Iterator[tuple[int, int, bytes]]:
    """Yields ``(line_number, byte_offset, line)`` for each non-blank line."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"dataset file {path!r} does not exist") from None
    except OSError as e:
        raise DataError(f"dataset file {path!r} cannot be read: {e}") from None
    with f:
        offset = 0
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, offset, line
            offset += len(line)


def _parse_row(where: str, line: bytes) -> dict:
    """The row of one line, its fields checked; ``DataError`` naming ``where`` otherwise."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object "
                        f'{{"images": [...], "prompt": ..., "answer": ...}}, got {type(row).__name__}')
    for key in ("prompt", "answer"):
        if key not in row:
            raise DataError(f"{where}: missing field {key!r} (a string)")
        if not isinstance(row[key], str):
            raise DataError(f"{where}: field {key!r} must be a string, got {type(row[key]).__name__} {row[key]!r}")
    if "images" not in row:
        raise DataError(f"{where}: missing field 'images' (a list of image paths, relative to the file)")
    images = row["images"]
    if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
        raise DataError(f"{where}: field 'images' must be a list of non-empty path strings, got {images!r}")
    return row


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads and validates a dataset JSONL file (blank lines are skipped).

    Raises:
        DataError: the file is missing, or a line is not a JSON object with a string
            "prompt", a string "answer" and a list-of-strings "images"; the message has
            ``file:line``.
    """
    path = os.fspath(path)
    return [_parse_row(f"{path}:{lineno}", line) for lineno, _, line in _lines(path)]


def _image_paths(base: str, row: dict) -> tuple[str, ...]:
    return tuple(os.path.normpath(os.path.join(base, p)) for p in row["images"])


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Example:
    """One prompt, as a batch sees it.

    prompt_ids: int32 [T] (rendered chat prompt, image pads expanded); image_grid_thw: int64 [n_images, 3];
    ``pixel_values``: float32 [N, patch_dim] patches of the row's images in order, decoded and patchified
    when read (``load_pixels``: through the dataset's cache, read-only).
    """

    prompt_ids: np.ndarray
    image_grid_thw: np.ndarray
    answer: str
    prompt: str
    images: tuple[str, ...]
    source: str
    load_pixels: Callable[[], np.ndarray] = dataclasses.field(repr=False)

    @property
    def pixel_values(self) -> np.ndarray:
        return self.load_pixels()


@dataclasses.dataclass(kw_only=True)
class DataReport:
    """What loading did: rows read, kept, and skipped or changed per reason.

    ``bad_image`` and ``too_long`` count skipped rows; ``resized`` counts images (not rows)
    downscaled because they exceeded ``max_pixels``.
    """

    rows: int = 0
    kept: int = 0
    bad_image: int = 0
    resized: int = 0
    too_long: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class _Rows:
    """What loading keeps of the kept rows (arrays in file order), and how an example is rebuilt from it."""

    path: str
    offset: np.ndarray  # int64: byte offset of the row's line
    lineno: np.ndarray  # int64
    crc: np.ndarray  # int64: zlib.crc32 of the line's bytes
    prompt_len: np.ndarray  # int32: rendered prompt tokens
    vision_tokens: np.ndarray  # int32: merged vision tokens of the row's images
    image_start: np.ndarray  # int64 [rows + 1]: row r's images are image_hw[image_start[r]:image_start[r + 1]]
    image_hw: np.ndarray  # int32 [images, 2]: grid (h, w) in patches
    tok: Tokenizer
    vision: VisionConfig
    min_pixels: int
    max_pixels: int
    cache: PatchCache

    def grids(self, r: int) -> np.ndarray:
        hw = self.image_hw[self.image_start[r]:self.image_start[r + 1]].astype(np.int64)
        return np.concatenate([np.ones((len(hw), 1), np.int64), hw], axis=1)

    def example(self, r: int) -> Example:
        """Row ``r``'s example: its line re-read (checked against its CRC) and its prompt rendered again."""
        where = f"{self.path}:{int(self.lineno[r])}"
        try:
            with open(self.path, "rb") as f:
                f.seek(int(self.offset[r]))
                line = f.readline()
        except OSError as e:
            raise DataError(f"{where}: the dataset file cannot be read any more: {e}") from None
        if zlib.crc32(line) != int(self.crc[r]):
            raise DataError(f"{where}: the dataset file changed since it was loaded (this line is not the one that "
                            "was checked); restart the run on the file as it is now")
        row = json.loads(line)
        grids = self.grids(r)
        n_tokens = [num_merged_tokens(g, self.vision.spatial_merge_size) for g in grids]
        ids = np.asarray(render_prompt(self.tok, row["prompt"], n_tokens), np.int32)
        if len(ids) != self.prompt_len[r]:  # same line (CRC), same tokenizer: cannot differ
            raise RuntimeError(f"{where}: prompt of {len(ids)} tokens now, {self.prompt_len[r]} at load time")
        images = _image_paths(os.path.dirname(os.path.abspath(self.path)), row)
        return Example(prompt_ids=ids, image_grid_thw=grids, answer=row["answer"], prompt=row["prompt"],
                       images=images, source=where, load_pixels=functools.partial(self.pixels, images, grids, where))

    def pixels(self, images: tuple[str, ...], grids: np.ndarray, where: str) -> np.ndarray:
        """float32 [N, patch_dim]: the images' patches in order, from the cache or decoded now."""
        v = self.vision
        if not images:
            return np.zeros((0, v.patch_dim), np.float32)
        params = (self.min_pixels, self.max_pixels, v.patch_size, v.spatial_merge_size, v.temporal_patch_size)
        parts = [self.cache.get((p, *params), functools.partial(self._patches, p, g, where))
                 for p, g in zip(images, grids, strict=True)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _patches(self, path: str, grid: np.ndarray, where: str) -> np.ndarray:
        try:
            image = load_image(path)
        except ImageLoadError as e:
            raise DataError(f"{where}: {e}. Its header passed the checks at load time but its pixels cannot be "
                            "decoded: replace the file and resume (dropping the row changes the dataset, which a "
                            "resumed run refuses)") from None
        patches, got = preprocess_images([image], self.vision, self.min_pixels, self.max_pixels)
        if got[0].tolist() != grid.tolist():
            raise DataError(f"{where}: image {path!r} decodes to a {got[0][1]}x{got[0][2]}-patch grid but its header "
                            f"gave {grid[1]}x{grid[2]} at load time: the file changed since the dataset was loaded "
                            "(or its EXIF orientation is stored after the pixel data, where the header check does "
                            "not look); restart the run")
        return patches


class Dataset(Sequence):
    """The kept rows of a dataset file; each example is built when indexed (see the module docstring).

    ``dataset[i]`` is an ``Example``; ``dataset[a:b]`` and ``dataset[int_array]`` are ``Dataset`` views of the
    same rows and cache. ``prompt_lengths`` and ``vision_tokens`` come from the load-time metadata, no pixel
    or line is read for them.
    """

    def __init__(self, rows: _Rows, index: np.ndarray | None = None):
        self._rows = rows
        self._index = np.arange(len(rows.offset), dtype=np.int64) if index is None else index

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
        """int32 [len]: each example's merged vision tokens (image-pad tokens)."""
        return self._rows.vision_tokens[self._index]

    @property
    def cache(self) -> PatchCache:
        return self._rows.cache

    def __repr__(self) -> str:
        return f"Dataset({self._rows.path!r}, {len(self)} examples)"


class _RowChecker:
    """Checks rows at load time, from the line and the images' headers; counts and logs the skipped ones."""

    def __init__(self, path: str, tok: Tokenizer, vision: VisionConfig, min_pixels: int, max_pixels: int,
                 max_prompt_len: int, log: Callable[[str], None]):
        self.path, self.base = path, os.path.dirname(os.path.abspath(path))
        self.tok, self.vision, self.log = tok, vision, log
        self.min_pixels, self.max_pixels, self.max_prompt_len = min_pixels, max_pixels, max_prompt_len
        self.report = DataReport()
        self._probes: dict[str, tuple | str] = {}  # image path -> (size, resized size), or the error
        self._lengths: dict[tuple, int] = {}  # (prompt, image tokens) -> rendered length
        self._answers: set[str] = set()

    def _probe(self, path: str) -> tuple | str:
        if path not in self._probes:
            factor = check_vision(self.vision)  # RGB input, or a ValueError that stops loading
            try:
                h, w = probe_image(path)
                self._probes[path] = ((h, w), smart_resize(h, w, factor, self.min_pixels, self.max_pixels))
            except ImageLoadError as e:
                self._probes[path] = str(e)
            except ValueError as e:  # smart_resize: extreme aspect ratio
                self._probes[path] = f"image file {path!r}: {e}"
        return self._probes[path]

    def _prompt_len(self, where: str, row: dict, n_tokens: list[int]) -> int:
        key = (row["prompt"], tuple(n_tokens))
        try:
            if key not in self._lengths:
                self._lengths[key] = len(render_prompt(self.tok, row["prompt"], n_tokens))
            if row["answer"] not in self._answers:
                self.tok.encode(row["answer"])
                self._answers.add(row["answer"])
        except ValueError as e:
            raise DataError(f"{where}: cannot tokenize this row: {e}") from None
        return self._lengths[key]

    def check(self, lineno: int, line: bytes) -> tuple[int, list[tuple[int, int]]] | None:
        """``(prompt length, image grids (h, w))`` of a kept row; None (logged, counted) for a skipped one."""
        rep = self.report
        rep.rows += 1
        where = f"{self.path}:{lineno}"
        row = _parse_row(where, line)
        probes = [self._probe(p) for p in _image_paths(self.base, row)]
        error = next((p for p in probes if isinstance(p, str)), None)
        if error:
            rep.bad_image += 1
            self.log(f"warning: {where}: row skipped, bad image: {error}")
            return None
        rep.resized += sum(h * w > self.max_pixels for (h, w), _ in probes)
        grids = [(h // self.vision.patch_size, w // self.vision.patch_size) for _, (h, w) in probes]
        n_tokens = [num_merged_tokens((1, *g), self.vision.spatial_merge_size) for g in grids]
        n = self._prompt_len(where, row, n_tokens)
        if n > self.max_prompt_len:
            rep.too_long += 1
            self.log(f"warning: {where}: row skipped, prompt is {n} tokens (with {sum(n_tokens)} image tokens), "
                     f"over max_prompt_len={self.max_prompt_len}; raise --max_prompt_len or lower --max_pixels")
            return None
        return n, grids


def load_dataset(path: str | os.PathLike, tok: Tokenizer, vision: VisionConfig, *, min_pixels: int,
                 max_pixels: int, max_prompt_len: int, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 log: Callable[[str], None] = print) -> tuple[Dataset, DataReport]:
    """Reads and checks every row of a dataset JSONL file and its images' headers; decodes no pixels.

    Args:
        path: The JSONL file; image paths are relative to its directory (absolute ones too).
        tok: Renders prompts (``render_prompt``) and must know every prompt/answer word.
        vision: Patch, merge and temporal sizes for the image patches.
        min_pixels: ``smart_resize`` lower bound (``DataConfig.min_pixels``).
        max_pixels: ``smart_resize`` upper bound; larger images are downscaled.
        max_prompt_len: Longest rendered prompt in tokens; longer rows are skipped.
        cache_bytes: Bound of the dataset's ``PatchCache`` of preprocessed images (``--image_cache_mb``).
        log: Receives one warning line per skipped row and a one-line summary.

    Returns:
        The kept rows in file order (a ``Dataset``: examples built on access), and the counts.

    Raises:
        DataError: a malformed line, a prompt/answer the tokenizer cannot encode, or no row kept.
    """
    path = os.fspath(path)
    checker = _RowChecker(path, tok, vision, min_pixels, max_pixels, max_prompt_len, log)
    cols = {k: array.array("q") for k in ("offset", "lineno", "crc", "prompt_len", "vision_tokens", "n_images")}
    image_hw = array.array("i")
    merge2 = vision.spatial_merge_size ** 2
    for lineno, offset, line in _lines(path):
        kept = checker.check(lineno, line)
        if kept is None:
            continue
        n, grids = kept
        for key, value in (("offset", offset), ("lineno", lineno), ("crc", zlib.crc32(line)), ("prompt_len", n),
                           ("vision_tokens", sum(h * w for h, w in grids) // merge2), ("n_images", len(grids))):
            cols[key].append(value)
        for g in grids:
            image_hw.extend(g)
    rep = checker.report
    rep.kept = len(cols["offset"])
    log(f"data: {path}: kept {rep.kept} of {rep.rows} rows; skipped {rep.bad_image} with bad images, "
        f"{rep.too_long} over max_prompt_len={max_prompt_len}; downscaled {rep.resized} images over "
        f"max_pixels={max_pixels}")
    if not rep.kept:
        if rep.rows == 0:
            raise DataError(f"dataset file {path!r} has no rows")
        raise DataError(f"no usable rows in {path!r}: all {rep.rows} rows were skipped ({rep.bad_image} with "
                        f"bad images, {rep.too_long} over max_prompt_len={max_prompt_len}); see the warnings above")
    a = {k: np.frombuffer(v, np.int64).copy() for k, v in cols.items()}
    rows = _Rows(path=path, offset=a["offset"], lineno=a["lineno"], crc=a["crc"],
                 prompt_len=a["prompt_len"].astype(np.int32), vision_tokens=a["vision_tokens"].astype(np.int32),
                 image_start=np.concatenate([[0], np.cumsum(a["n_images"])]).astype(np.int64),
                 image_hw=np.frombuffer(image_hw, np.int32).reshape(-1, 2).copy(), tok=tok, vision=vision,
                 min_pixels=min_pixels, max_pixels=max_pixels, cache=PatchCache(cache_bytes))
    return Dataset(rows), rep


def collate(examples: Iterable[Example], pad_id: int) -> Prompts:
    """Left-pads a batch of examples into ``Prompts`` (the rollout and actor input); their images are decoded
    and patchified here (``Example.pixel_values``, through the dataset's cache).

    Returns:
        ``Prompts`` with int32 ``input_ids``/``attention_mask`` [B, T_max] (pads on the left,
        mask 0 there), ``pixel_values`` all images' patches in batch order and
        ``image_grid_thw`` their rows (both None when the batch has no image), no videos.
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
    with_images = [e for e in examples if len(e.image_grid_thw)]
    pixel_values = grid = None
    if with_images:
        pixel_values = np.concatenate([e.pixel_values for e in with_images], axis=0)
        grid = np.concatenate([e.image_grid_thw for e in with_images], axis=0).astype(np.int64)
    return Prompts(input_ids=input_ids, attention_mask=mask, pixel_values=pixel_values, image_grid_thw=grid)
