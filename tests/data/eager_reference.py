"""The eager data path as it was before issue 17, kept as the oracle of the lazy one (tests only).

``eager_load`` decodes and patchifies every image of every row at load time, exactly as
``dataset.load_dataset`` did (same checks, counts and messages); ``eager_collate`` is the collate of
that time over its examples (dicts with the pixels inside).
"""

from __future__ import annotations

import os

import numpy as np

from rollplex_contract.batch import Prompts
from rollplex_jax.data.dataset import DataError, DataReport
from rollplex_jax.data.image_processing import (
    ImageLoadError,
    load_image,
    num_merged_tokens,
    preprocess_images,
    smart_resize,
)
from rollplex_jax.data.sources import jsonl_lines, read_json_row
from rollplex_jax.data.tokenizer import render_prompt


def _parse_row(where: str, line: bytes) -> dict:
    """A row of the original JSONL format ``{"images": [paths], "prompt": str, "answer": str}``, its fields checked
    as that time's strict reader did; ``DataError`` naming ``where``."""
    row = read_json_row(where, line)
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


def _decode_row(images, factor, min_pixels, max_pixels):
    pil, sizes = [], []
    for p in images:
        try:
            im = load_image(p)
            sizes.append(smart_resize(im.height, im.width, factor, min_pixels, max_pixels))
            pil.append(im)
        except ImageLoadError as e:
            return None, None, str(e)
        except ValueError as e:
            return None, None, f"image file {p!r}: {e}"
    return pil, sizes, None


def eager_load(path, tok, vision, *, min_pixels, max_pixels, max_prompt_len, log):
    """(examples as dicts, DataReport), as the eager ``load_dataset`` returned them."""
    path = os.fspath(path)
    base = os.path.dirname(os.path.abspath(path))
    factor = vision.patch_size * vision.spatial_merge_size
    examples, rep = [], DataReport()
    for lineno, _, line in jsonl_lines(path):
        rep.rows += 1
        where = f"{path}:{lineno}"
        row = _parse_row(where, line)
        images = tuple(os.path.normpath(os.path.join(base, p)) for p in row["images"])
        pil, sizes, error = _decode_row(images, factor, min_pixels, max_pixels)
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
            pixel_values, grid_thw = np.zeros((0, vision.patch_dim), np.float32), np.zeros((0, 3), np.int64)
        examples.append(dict(prompt_ids=np.asarray(ids, np.int32), pixel_values=pixel_values,
                             image_grid_thw=grid_thw, answer=row["answer"], prompt=row["prompt"], images=images,
                             source=where))
    rep.kept = len(examples)
    log(f"data: {path}: kept {rep.kept} of {rep.rows} rows; skipped {rep.bad_image} with bad images, "
        f"{rep.too_long} over max_prompt_len={max_prompt_len}; downscaled {rep.resized} images over "
        f"max_pixels={max_pixels}")
    return examples, rep


def eager_collate(examples: list[dict], pad_id: int) -> Prompts:
    t = max(len(e["prompt_ids"]) for e in examples)
    input_ids = np.full((len(examples), t), pad_id, np.int32)
    mask = np.zeros((len(examples), t), np.int32)
    for i, e in enumerate(examples):
        n = len(e["prompt_ids"])
        input_ids[i, t - n:] = e["prompt_ids"]
        mask[i, t - n:] = 1
    with_images = [e for e in examples if len(e["image_grid_thw"])]
    pixel_values = grid = None
    if with_images:
        pixel_values = np.concatenate([e["pixel_values"] for e in with_images], axis=0)
        grid = np.concatenate([e["image_grid_thw"] for e in with_images], axis=0).astype(np.int64)
    return Prompts(input_ids=input_ids, attention_mask=mask, pixel_values=pixel_values, image_grid_thw=grid)
