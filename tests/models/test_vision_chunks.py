"""Vision chunks (``models/qwen2_5_vl/vision_chunks.py``): a batch's frames encoded in fixed-shape chunks, then
gathered back into batch order, equal the whole batch encoded at once (fp32, 1e-5 of the largest entry: the
same per-frame computation, other attention blocks and summation order), and padding contributes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import tiny_model_config
from rollplex_jax.config.shapes import ChunkSpec
from rollplex_jax.models.qwen2_5_vl import rope
from rollplex_jax.models.qwen2_5_vl.params import init_params
from rollplex_jax.models.qwen2_5_vl.vision import vision_forward
from rollplex_jax.models.qwen2_5_vl.vision_chunks import plan_chunks

# images of mixed sizes (one larger than a chunk) and a two-frame video, in batch order
GRIDS = np.array([[1, 8, 8], [1, 4, 6], [1, 12, 16], [1, 4, 4], [2, 4, 8]])


def _encode_chunks(params, cfg, chunks):
    buf = jnp.zeros((chunks.buffer, cfg.vision.out_hidden_size), jnp.float32)
    for inp, off in zip(chunks.inputs, chunks.offsets, strict=True):
        emb = vision_forward(params, cfg.vision, jnp.asarray(inp["pixel_values"]), inp["layout"])
        buf = jax.lax.dynamic_update_slice_in_dim(buf, emb, off, 0)
    return buf


@pytest.mark.parametrize("chunk, frame, shapes, groups", [(16, 8, {(16, 1), (16, 2), (64, 1)}, 1),
                                                           (64, 16, {(64, 1), (64, 4)}, 1),
                                                           (16, 8, {(16, 1), (16, 2), (64, 1)}, 2)])
def test_chunks_equal_the_whole_batch(chunk, frame, shapes, groups):
    """Parts of 16 units in full-attention rows of 8, and of 64 units in rows of 16, each row holding whole frames;
    an item larger than a row gets a part of its own, a power of two up, in one row. With 2 groups (fsdp 2) a
    chunk is two parts, a short run filled with a copy of its last part (encoded into rows no token reads)."""
    cfg = tiny_model_config()
    params = init_params(cfg, jax.random.key(0))
    n = int(np.prod(GRIDS, -1).sum())
    pix = np.random.default_rng(0).normal(size=(n, cfg.vision.patch_dim)).astype(np.float32)
    want = vision_forward(params, cfg.vision, jnp.asarray(pix), rope.vision_layout(GRIDS, cfg.vision).arrays())
    spec = ChunkSpec.for_run(chunk, 32, cfg.vision.merger_window**2, frame_units=frame, groups=groups)
    chunks = plan_chunks(GRIDS, pix, spec, cfg.vision)
    # (units, full-attention rows) of the parts: items over a row alone in a part of their own, one row
    assert {(c["layout"]["window_index"].shape[1], c["layout"]["frame_gather"].shape[1])
            for c in chunks.inputs} == shapes
    assert {c["layout"]["window_index"].shape[0] for c in chunks.inputs} == {groups}
    got = _encode_chunks(params, cfg, chunks)[chunks.slots[:len(want)]]
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * scale, rtol=0)
    # padding patches contribute nothing: random contents there, bitwise the same real embeddings
    rng, noisy = np.random.default_rng(1), []
    for c in chunks.inputs:
        pix_c = c["pixel_values"].copy()
        size = len(pix_c) // groups  # each part's patches: its items' then padding
        for k in range(groups):
            real = k * size + int((c["layout"]["frame_ids"][k] >= 0).sum()) * cfg.vision.spatial_merge_size**2
            pix_c[real:(k + 1) * size] = rng.normal(size=pix_c[real:(k + 1) * size].shape)
        noisy.append(dict(c, pixel_values=pix_c))
    again = _encode_chunks(params, cfg, chunks.__class__(noisy, chunks.offsets, chunks.slots, chunks.buffer))
    np.testing.assert_array_equal(np.asarray(again[chunks.slots[:len(want)]]), np.asarray(got))
