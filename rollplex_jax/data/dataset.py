"""Prompt datasets: JSONL rows -> validated, preprocessed ``Example``s -> left-padded batches.

A dataset is a JSONL file of rows ``{"images": [paths relative to the file], "prompt": str,
"answer": str}``. Loading checks every row up front, so a bad file fails (or is reported)
at start and not in the middle of a run:

- a malformed line (bad JSON, not an object, a missing or ill-typed field) raises
  ``DataError`` naming ``file:line`` and what is wrong;
- a missing, empty or corrupt image skips its row with a warning naming ``file:line`` and
  the image (counted in ``DataReport.bad_image``);
- an image over ``max_pixels`` is downscaled by ``smart_resize``, as Qwen's processor does
  (counted in ``resized``), never dropped;
- a rendered prompt longer than ``max_prompt_len`` tokens skips its row with a warning
  (``too_long``); prompts are never truncated, which could cut a run of image tokens.

``PromptSampler`` picks each step's prompts: a fresh seeded permutation per epoch, with a
JSON-able ``state()`` so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from rollplex_contract.batch import Prompts
from rollplex_jax.config import VisionConfig
from rollplex_jax.data.image_processing import (
    ImageLoadError,
    load_image,
    num_merged_tokens,
    preprocess_images,
    smart_resize,
)
from rollplex_jax.data.tokenizer import Tokenizer, render_prompt


class DataError(ValueError):
    """A dataset file or row is unusable; the message names the file (and line) and the fix."""


def _iter_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """Yields ``(line_number, row)`` for each non-blank line, validating the row's fields."""
    try:
        f = open(path, encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"dataset file {path!r} does not exist") from None
    except OSError as e:
        raise DataError(f"dataset file {path!r} cannot be read: {e}") from None
    with f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a JSON object "
                                f'{{"images": [...], "prompt": ..., "answer": ...}}, got {type(row).__name__}')
            for key in ("prompt", "answer"):
                if key not in row:
                    raise DataError(f"{where}: missing field {key!r} (a string)")
                if not isinstance(row[key], str):
                    raise DataError(f"{where}: field {key!r} must be a string, got "
                                    f"{type(row[key]).__name__} {row[key]!r}")
            if "images" not in row:
                raise DataError(f"{where}: missing field 'images' (a list of image paths, relative to the file)")
            images = row["images"]
            if not isinstance(images, list) or not all(isinstance(p, str) and p for p in images):
                raise DataError(f"{where}: field 'images' must be a list of non-empty path strings, got {images!r}")
            yield lineno, row


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """Reads and validates a dataset JSONL file (blank lines are skipped).

    Raises:
        DataError: the file is missing, or a line is not a JSON object with a string
            "prompt", a string "answer" and a list-of-strings "images"; the message has
            ``file:line``.
    """
    return [row for _, row in _iter_jsonl(os.fspath(path))]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Example:
    """One preprocessed prompt.

    prompt_ids: int32 [T] (rendered chat prompt, image pads expanded); pixel_values: float32
    [N, patch_dim] patches of the row's images in order; image_grid_thw: int64 [n_images, 3].
    """

    prompt_ids: np.ndarray
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    answer: str
    prompt: str
    images: tuple[str, ...]
    source: str


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


def load_dataset(path: str | os.PathLike, tok: Tokenizer, vision: VisionConfig, *, min_pixels: int,
                 max_pixels: int, max_prompt_len: int,
                 log: Callable[[str], None] = print) -> tuple[list[Example], DataReport]:
    """Loads, validates and preprocesses every row of a dataset JSONL file.

    Args:
        path: The JSONL file; image paths are relative to its directory (absolute ones too).
        tok: Renders prompts (``render_prompt``) and must know every prompt/answer word.
        vision: Patch, merge and temporal sizes for the image patches.
        min_pixels: ``smart_resize`` lower bound (``DataConfig.min_pixels``).
        max_pixels: ``smart_resize`` upper bound; larger images are downscaled.
        max_prompt_len: Longest rendered prompt in tokens; longer rows are skipped.
        log: Receives one warning line per skipped row and a one-line summary.

    Returns:
        The kept examples in file order, and the counts.

    Raises:
        DataError: a malformed line, a prompt/answer the tokenizer cannot encode, or no row kept.
    """
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    factor = vision.patch_size * vision.spatial_merge_size
    examples: list[Example] = []
    rep = DataReport()
    for lineno, row in _iter_jsonl(path):
        rep.rows += 1
        where = f"{path}:{lineno}"
        images = tuple(os.path.normpath(os.path.join(base, p)) for p in row["images"])
        pil, sizes, error = [], [], None
        for p in images:
            try:
                im = load_image(p)
                sizes.append(smart_resize(im.height, im.width, factor, min_pixels, max_pixels))
                pil.append(im)
            except ImageLoadError as e:
                error = str(e)
            except ValueError as e:  # smart_resize: extreme aspect ratio
                error = f"image file {p!r}: {e}"
            if error:
                break
        if error:
            rep.bad_image += 1
            log(f"warning: {where}: row skipped, bad image: {error}")
            continue
        rep.resized += sum(im.height * im.width > max_pixels for im in pil)
        grids = [(1, h // vision.patch_size, w // vision.patch_size) for h, w in sizes]
        n_tokens = [num_merged_tokens(g, vision.spatial_merge_size) for g in grids]
        try:
            ids = render_prompt(tok, row["prompt"], n_tokens)
            tok.encode(row["answer"])
        except ValueError as e:
            raise DataError(f"{where}: cannot tokenize this row: {e}") from None
        if len(ids) > max_prompt_len:
            rep.too_long += 1
            log(f"warning: {where}: row skipped, prompt is {len(ids)} tokens (with {sum(n_tokens)} image "
                f"tokens), over max_prompt_len={max_prompt_len}; raise --max_prompt_len or lower --max_pixels")
            continue
        if pil:
            pixel_values, grid_thw = preprocess_images(pil, vision, min_pixels, max_pixels)
        else:
            pixel_values = np.zeros((0, vision.patch_dim), np.float32)
            grid_thw = np.zeros((0, 3), np.int64)
        assert [tuple(g) for g in grid_thw.tolist()] == grids, (grid_thw, grids)
        examples.append(Example(prompt_ids=np.asarray(ids, np.int32), pixel_values=pixel_values,
                                image_grid_thw=grid_thw, answer=row["answer"], prompt=row["prompt"],
                                images=images, source=where))
    rep.kept = len(examples)
    log(f"data: {path}: kept {rep.kept} of {rep.rows} rows; skipped {rep.bad_image} with bad images, "
        f"{rep.too_long} over max_prompt_len={max_prompt_len}; downscaled {rep.resized} images over "
        f"max_pixels={max_pixels}")
    if not examples:
        if rep.rows == 0:
            raise DataError(f"dataset file {path!r} has no rows")
        raise DataError(f"no usable rows in {path!r}: all {rep.rows} rows were skipped ({rep.bad_image} with "
                        f"bad images, {rep.too_long} over max_prompt_len={max_prompt_len}); see the warnings above")
    return examples, rep


def collate(examples: Sequence[Example], pad_id: int) -> Prompts:
    """Left-pads a batch of examples into ``Prompts`` (the rollout and actor input).

    Returns:
        ``Prompts`` with int32 ``input_ids``/``attention_mask`` [B, T_max] (pads on the left,
        mask 0 there), ``pixel_values`` all images' patches in batch order and
        ``image_grid_thw`` their rows (both None when the batch has no image), no videos.
    """
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


class PromptSampler:
    """Deterministic prompt order: a permutation per epoch from ``default_rng((seed, epoch))``.

    ``next_indices()`` returns the next ``batch_size`` indices; a batch that reaches the end
    of an epoch continues into the next epoch's permutation, so every example is used once
    per epoch (a batch larger than the dataset holds repeats). ``state()`` / ``from_state``
    round-trip (epoch, position), so a resumed run draws exactly the batches an
    uninterrupted one would have.
    """

    def __init__(self, n_examples: int, batch_size: int, seed: int, *, epoch: int = 0, position: int = 0):
        if n_examples < 1:
            raise ValueError(f"n_examples={n_examples} must be >= 1")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if epoch < 0 or not 0 <= position < n_examples:
            raise ValueError(f"epoch={epoch} must be >= 0 and position={position} in [0, {n_examples})")
        self.n_examples, self.batch_size, self.seed = n_examples, batch_size, seed
        self.epoch, self.position = epoch, position
        self._perm = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(self.n_examples)

    def next_indices(self) -> np.ndarray:
        """The next ``batch_size`` example indices (int64)."""
        out = []
        need = self.batch_size
        while need:
            take = min(need, self.n_examples - self.position)
            out.append(self._perm[self.position:self.position + take])
            self.position += take
            need -= take
            if self.position == self.n_examples:
                self.epoch, self.position = self.epoch + 1, 0
                self._perm = self._permutation(self.epoch)
        return np.concatenate(out).astype(np.int64)

    def state(self) -> dict[str, int]:
        """JSON-able position: pass it to ``from_state`` to continue from here."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n_examples": self.n_examples, "batch_size": self.batch_size}

    @classmethod
    def from_state(cls, state: dict, *, n_examples: int | None = None) -> PromptSampler:
        """Rebuilds a sampler at a saved position.

        Args:
            state: A dict from ``state()``.
            n_examples: If given, the current dataset size; a mismatch with the saved one
                raises ValueError (the saved order would index a different dataset).
        """
        if n_examples is not None and n_examples != state["n_examples"]:
            raise ValueError(f"the sampler state was saved for {state['n_examples']} examples but the dataset "
                             f"now has {n_examples}; resume with the same dataset")
        return cls(int(state["n_examples"]), int(state["batch_size"]), int(state["seed"]),
                   epoch=int(state["epoch"]), position=int(state["position"]))
