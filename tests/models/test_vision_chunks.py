"""Vision chunks (``models/vl/vision_chunks.py``): a batch's frames encoded in fixed-shape chunks, then
gathered back into batch order, equal the whole batch encoded at once (fp32, 1e-5 of the largest entry: the
same per-frame computation, other attention blocks and summation order), and padding contributes nothing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import tiny_model_config
from rollplex_jax.config.shapes import ChunkSpec
from rollplex_jax.models.qwen2_5_vl.vision import vision_forward
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.models.vl.vision_chunks import (
    constrain_buffer,
    gather_slots,
    plan_chunks,
    read_chunk,
    write_chunk,
)

# images of mixed sizes (one larger than a chunk) and a two-frame video, in batch order
GRIDS = np.array([[1, 8, 8], [1, 4, 6], [1, 12, 16], [1, 4, 4], [2, 4, 8]])


def _encode_chunks(params, cfg, chunks):
    """The buffer [slots, groups x units, W] as ``split.vision_into`` fills it."""
    buf = jnp.zeros((*chunks.shape, cfg.vision.out_hidden_size), jnp.float32)
    for inp, off in zip(chunks.inputs, chunks.offsets, strict=True):
        emb = vision_forward(params, cfg.vision, jnp.asarray(inp["pixel_values"]), inp["layout"])
        buf = write_chunk(buf, emb, off, inp["layout"]["window_index"].shape[0])
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
    buf = _encode_chunks(params, cfg, chunks)
    got = gather_slots(buf, jnp.asarray(chunks.slots[:len(want)]))
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
    again = _encode_chunks(params, cfg, dataclasses.replace(chunks, inputs=noisy))
    np.testing.assert_array_equal(np.asarray(gather_slots(again, jnp.asarray(chunks.slots[:len(want)]))),
                                  np.asarray(got))
    # each chunk's rows read back (``split.vision_grads`` reads the cotangent so) are what it wrote
    for inp, off in zip(chunks.inputs, chunks.offsets, strict=True):
        groups, units = inp["layout"]["window_index"].shape
        emb = vision_forward(params, cfg.vision, jnp.asarray(inp["pixel_values"]), inp["layout"])
        np.testing.assert_array_equal(np.asarray(read_chunk(buf, off, units, groups)), np.asarray(emb))


def test_buffer_is_split_over_the_batch_shards():
    """On dp 2 x fsdp 2 (4 groups) the buffer and its cotangent hold a quarter of their rows per device, the chunks'
    embeddings equal the one-device buffer's (1e-6 of the largest entry: the tower runs split over the devices, so
    XLA may tile its matmuls otherwise) and the gather of a sharded buffer adds exact zeros from the shards that do
    not hold a row. The gradient program of a micro-batch's gather holds no whole buffer: its cotangent is a quarter
    of one per device, its temp the gathered rows and their sum over the shards (measured 20.8 KB against a 98.3 KB
    buffer; a replicated cotangent alone would be the whole 98.3)."""

    from rollplex_jax.config import MeshConfig, RlConfig
    from rollplex_jax.models.vl.vision_chunks import VisionInputs
    from rollplex_jax.parallel import mesh as mesh_lib
    from rollplex_jax.programs.split import make_split_programs

    cfg = tiny_model_config()
    params = init_params(cfg, jax.random.key(0))
    n = int(np.prod(GRIDS, -1).sum())
    pix = np.random.default_rng(0).normal(size=(n, cfg.vision.patch_dim)).astype(np.float32)
    chunks = plan_chunks(GRIDS, pix, ChunkSpec.for_run(16, 32, cfg.vision.merger_window**2, 8, groups=4), cfg.vision)
    want = np.asarray(_encode_chunks(params, cfg, chunks))
    mesh = mesh_lib.train_mesh(MeshConfig(train_dp=2, train_fsdp=2, train_tp=1), jax.devices()[:4])
    placed = mesh_lib.place(params, mesh_lib.param_shardings(cfg, mesh))
    slots = jnp.asarray(chunks.slots)
    with jax.set_mesh(mesh):
        sp = make_split_programs(cfg, RlConfig(), temperature=1.0)  # the runtime's programs
        buf = sp.new_buffer((*chunks.shape, want.shape[-1]), jnp.dtype(jnp.float32))
        shard = (chunks.shape[0], chunks.shape[1] // 4, want.shape[-1])
        for inp, off in zip(chunks.inputs, chunks.offsets, strict=True):
            buf = sp.vision_into(placed, VisionInputs(jnp.asarray(inp["pixel_values"]), inp["layout"]), buf, off)
        assert {s.data.shape for s in buf.addressable_shards} == {shard}
        np.testing.assert_allclose(np.asarray(buf), want, rtol=0, atol=1e-6 * np.abs(want).max())
        got = jax.jit(gather_slots)(buf, slots)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(buf).reshape(-1, want.shape[-1])[chunks.slots])
        # the cotangent constrained as ``split.grads_recompute`` returns it (unconstrained, GSPMD replicates it)
        grad = jax.jit(lambda b: constrain_buffer(jax.grad(lambda x: (gather_slots(x, slots) ** 2).sum())(b)))
        d = grad(buf)
        assert {s.data.shape for s in d.addressable_shards} == {shard}
        np.testing.assert_array_equal(np.asarray(d), np.asarray(jax.grad(
            lambda b: (gather_slots(b, slots) ** 2).sum())(jnp.asarray(np.asarray(buf)))))
        few = slots[:40]  # a micro-batch's tokens
        mem = jax.jit(lambda b: constrain_buffer(jax.grad(lambda x: (gather_slots(x, few) ** 2).sum())(b))).lower(
            buf).compile().memory_analysis()
    assert mem.output_size_in_bytes == buf.nbytes // 4
    assert mem.temp_size_in_bytes < buf.nbytes / 2, (mem.temp_size_in_bytes, buf.nbytes)
