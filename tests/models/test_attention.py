"""The blockwise attention kernel equals the dense oracle (values and gradients, fp32, 1e-5 of each
tensor's largest entry, or absolute where that is below 1), and the remat policies do not change
gradients (1e-6, same rule).

Cases: left padding under a causal mask (fully masked query rows included), G answers over one shared
prefix (the prefix KV has no N axis), GQA ratios 2 and 4, a causal query offset, blocks that do not
divide the lengths, gradients through the prefix KV into the prefix's own inputs, and the vision tower's
windows and per-frame full attention (a video of several frames). Every blockwise call here uses small
blocks so that it really runs several blocks (the default 512 would send these tiny shapes to dense).
"""

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import ProgramConfig, tiny_model_config
from rollplex_jax.models import attention as A
from rollplex_jax.models import blockwise as B
from rollplex_jax.models.qwen2_5_vl.vision import vision_forward
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.params import init_params
from tests.hf_reference import mm_inputs

TOL = 1e-5
D = 8  # head dim


def _normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _close(a, b, tol=TOL):
    """Every leaf within ``tol`` absolute, scaled by the leaf's largest entry where that exceeds 1 (gradients
    summed over many rows reach O(100): fp32 rounding then is ~1e-7 of that, not of 1)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert np.isfinite(x).all()
        np.testing.assert_allclose(x, y, atol=tol * max(1.0, float(np.abs(y).max())), rtol=0)


def _both(fn, args, rng, block):
    """(value, grads w.r.t. every arg) of fn(impl, *args) for dense and blockwise, with one random cotangent."""
    cts = jax.tree.map(lambda o: _normal(rng, *o.shape), jax.eval_shape(lambda *a: fn("dense", block, *a), *args))
    results = []
    for impl in ("dense", "blockwise"):
        f = lambda *a, impl=impl: fn(impl, block, *a)  # noqa: E731
        results.append(jax.jit(lambda a, c, f=f: (f(*a), jax.vjp(f, *a)[1](c)))(args, cts))
    return results


def _attend(impl, block, q, sources):
    return A.attention(q, sources, impl=impl, block=block)


def _left_padded(rng, b, t, lengths):
    return jnp.asarray(np.arange(t)[None] >= (t - np.asarray(lengths))[:, None])


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2)])
@pytest.mark.parametrize("block", [4, 5])
def test_causal_left_padding(heads, kv_heads, block):
    """Full/prefix pass: causal over left-padded rows; the rows before a row's first token see nothing."""
    rng = np.random.default_rng(0)
    b, t = 3, 11
    valid = _left_padded(rng, b, t, [11, 6, 1])[:, None]  # [B, 1, T]
    q, k, v = _normal(rng, b, 1, t, heads, D), _normal(rng, b, 1, t, kv_heads, D), _normal(rng, b, 1, t, kv_heads, D)

    def fn(impl, block, q, k, v):
        return _attend(impl, block, q, [A.KVSource(k, v, valid, causal=True)])

    (dense, g_dense), (blk, g_blk) = _both(fn, (q, k, v), rng, block)
    _close(blk, dense)
    _close(g_blk, g_dense)
    masked = ~np.asarray(valid[:, 0])  # left padding: no key at or before them is valid
    assert np.all(np.asarray(blk)[:, 0][masked] == 0) and np.all(np.asarray(dense)[:, 0][masked] == 0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (8, 2)])
def test_answers_over_a_shared_prefix(heads, kv_heads):
    """Suffix pass: N answers (right-padded, causal) and the prompt's KV (left-padded, no N axis), one softmax."""
    rng = np.random.default_rng(1)
    b, n, tr, tp = 2, 3, 7, 9
    prefix_valid = _left_padded(rng, b, tp, [9, 4])
    lengths = np.array([[7, 3, 1], [5, 7, 2]])
    own_valid = jnp.asarray(np.arange(tr)[None, None] < lengths[..., None])
    args = (_normal(rng, b, n, tr, heads, D), _normal(rng, b, n, tr, kv_heads, D), _normal(rng, b, n, tr, kv_heads, D),
            _normal(rng, b, tp, kv_heads, D), _normal(rng, b, tp, kv_heads, D))

    def fn(impl, block, q, k, v, pk, pv):
        return _attend(impl, block, q, [A.KVSource(pk, pv, prefix_valid), A.KVSource(k, v, own_valid, causal=True)])

    (dense, g_dense), (blk, g_blk) = _both(fn, args, rng, 4)
    _close(blk, dense)
    _close(g_blk, g_dense)  # q, own k/v, and the shared prefix k/v (summed over the N answers)


@pytest.mark.parametrize("block", [3, 4])
def test_packed_segments_equal_separate_rows(block):
    """Several sequences packed in one row with segment ids (padding at the tail): blockwise = dense, and each
    segment's output and gradients equal those of the same sequence alone in a left-padded row."""
    rng = np.random.default_rng(7)
    lens, t, heads, kv = [4, 2, 3], 11, 4, 2
    seg = np.full(t, -1)
    seg[:sum(lens)] = np.repeat(np.arange(len(lens)), lens)
    segs = jnp.asarray(seg)[None, None]  # [1, 1, T]
    valid = segs >= 0
    q, k, v = _normal(rng, 1, 1, t, heads, D), _normal(rng, 1, 1, t, kv, D), _normal(rng, 1, 1, t, kv, D)

    def fn(impl, block, q, k, v):
        return _attend(impl, block, q, [A.KVSource(k, v, valid, causal=True, segments=segs, q_segments=segs)])

    (dense, g_dense), (blk, g_blk) = _both(fn, (q, k, v), rng, block)
    _close(blk, dense)
    _close(g_blk, g_dense)
    assert np.all(np.asarray(blk)[0, 0, sum(lens):] == 0) and np.all(np.asarray(dense)[0, 0, sum(lens):] == 0)
    start = 0
    for n in lens:  # the segment alone, left-padded to T (as the padded batch holds it)
        rows = slice(start, start + n)
        alone = [jnp.zeros_like(x).at[:, :, t - n:].set(x[:, :, rows]) for x in (q, k, v)]
        one = _attend("dense", block, alone[0], [A.KVSource(alone[1], alone[2], _left_padded(rng, 1, t, [n])[:, None],
                                                             causal=True)])
        _close(np.asarray(blk)[:, :, rows], np.asarray(one)[:, :, t - n:])
        start += n


def test_causal_query_offset():
    """Queries that are the last T of S keys (bottom-right causal alignment), non-dividing blocks."""
    rng = np.random.default_rng(2)
    t, s = 5, 9
    valid = jnp.ones((2, 1, s), bool)
    args = (_normal(rng, 2, 1, t, 4, D), _normal(rng, 2, 1, s, 2, D), _normal(rng, 2, 1, s, 2, D))

    def fn(impl, block, q, k, v):
        return _attend(impl, block, q, [A.KVSource(k, v, valid, causal=True, q_offset=s - t)])

    (dense, g_dense), (blk, g_blk) = _both(fn, args, rng, 2)
    _close(blk, dense)
    _close(g_blk, g_dense)


def test_gradient_through_the_prefix_kv_into_its_inputs():
    """Prefix pass -> its KV -> suffix pass: the gradient reaches the prefix's inputs and projections."""
    rng = np.random.default_rng(3)
    b, n, tp, tr, width, heads, kv_heads = 2, 3, 10, 6, 16, 4, 2
    prefix_valid = _left_padded(rng, b, tp, [10, 3])
    own_valid = jnp.asarray(np.arange(tr)[None, None] < np.array([[6, 2, 4], [1, 6, 5]])[..., None])
    wq, wk, wv = (_normal(rng, width, h * D) * width**-0.5 for h in (heads, kv_heads, kv_heads))
    x_prefix, x_answers = _normal(rng, b, tp, width), _normal(rng, b, n, tr, width)

    def fn(impl, block, x_prefix, x_answers, wq, wk, wv):
        def proj(x, w, h):
            return jnp.einsum("...i,io->...o", x, w).reshape(*x.shape[:-1], h, D)

        pk, pv = proj(x_prefix, wk, kv_heads), proj(x_prefix, wv, kv_heads)  # [B, Tp, K, d]
        prefix_out = _attend(impl, block, proj(x_prefix, wq, heads)[:, None],
                             [A.KVSource(pk[:, None], pv[:, None], prefix_valid[:, None], causal=True)])
        suffix_out = _attend(impl, block, proj(x_answers, wq, heads),
                             [A.KVSource(pk, pv, prefix_valid),
                              A.KVSource(proj(x_answers, wk, kv_heads), proj(x_answers, wv, kv_heads), own_valid,
                                         causal=True)])
        return prefix_out, suffix_out

    (dense, g_dense), (blk, g_blk) = _both(fn, (x_prefix, x_answers, wq, wk, wv), rng, 4)
    _close(blk, dense)
    _close(g_blk, g_dense)
    assert float(jnp.abs(g_blk[0]).max()) > 0.1  # the prefix inputs do get a gradient


VISION_GRIDS = {
    "windows": np.array([[1, 8, 8], [1, 4, 6]]),  # windows of 2x2 merge units (16 patches); partial ones in 4 x 6
    "video_frames": np.array([[3, 8, 12], [1, 6, 10]]),  # 3 frames (full attention within each frame)
}


@pytest.mark.parametrize("grids", list(VISION_GRIDS))
def test_vision_tower_blockwise_equals_dense(grids):
    """Windows (segments <= 64 patches) and whole frames (full-attention blocks), values and gradients."""
    cfg = tiny_model_config()  # vision: 2 blocks, windows of 16 patches at block 0, whole frames at block 1
    params = {k: v for k, v in init_params(cfg, jax.random.key(0), std=0.2).items() if k.startswith("visual.")}
    grid = VISION_GRIDS[grids]
    layout = rope.vision_layout(grid, cfg.vision).arrays()
    assert layout["window_gather"].shape[1] > len(grid)  # more windows than items: windows are really used
    pix = _normal(np.random.default_rng(4), int(np.prod(grid, -1).sum()), cfg.vision.patch_dim)

    def fn(impl, block, params, pix):
        prog = ProgramConfig(attention=impl, attention_block=block)
        return vision_forward(params, cfg.vision, pix, layout, prog=prog)

    (dense, g_dense), (blk, g_blk) = _both(fn, (params, pix), np.random.default_rng(5), 8)
    _close(blk, dense)
    _close(g_blk, g_dense)


def _tiny_batch(cfg):
    rows = [[5, 6, ("image", (1, 8, 8)), 7], [10, ("video", (2, 4, 4)), 11, 12, 13, 14, 15]]
    return M.prepare_inputs(cfg, **mm_inputs(cfg, rows, np.random.default_rng(0)))


@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_remat_keeps_gradients(remat):
    """Decoder and vision tower: gradients w.r.t. every param with remat equal those without (1e-6)."""
    cfg = tiny_model_config()  # vision: 2 blocks, windows of 16 patches at block 0, whole frames at block 1
    params = init_params(cfg, jax.random.key(1), std=0.1)
    inputs = _tiny_batch(cfg)

    def grads(prog):
        loss = lambda p: jnp.sum(M.full_forward(p, cfg, inputs, prog=prog) ** 2) * 1e-3  # noqa: E731
        return jax.jit(jax.grad(loss))(params)

    ref = grads(ProgramConfig(remat="none", attention_block=8))
    got = grads(ProgramConfig(remat=remat, attention_block=8))
    assert any(float(jnp.abs(g).max()) > 1e-3 for k, g in ref.items() if k.startswith("visual.blocks."))
    _close(got, ref, tol=1e-6)


def test_blockwise_temp_memory_does_not_grow_with_t_times_s():
    """XLA temp bytes of value_and_grad at T = S = 1024: blockwise (block 128) far below dense's [T, S]."""
    b, t, h, kh = 1, 1024, 4, 2
    spec = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((b, 1, t, h, D), (b, 1, t, kh, D), (b, 1, t, kh, D))]
    valid = jnp.ones((b, 1, t), bool)

    def temp(impl):
        def loss(q, k, v):
            return jnp.sum(A.attention(q, [A.KVSource(k, v, valid, causal=True)], impl=impl, block=128))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*spec).compile().memory_analysis().temp_size_in_bytes

    scores = b * h * t * t * 4
    assert temp("dense") >= scores
    assert temp("blockwise") < scores / 4


def test_cudnn_falls_back_on_cpu_with_a_log_line(caplog):
    rng = np.random.default_rng(6)
    q, k, v = _normal(rng, 2, 1, 9, 4, D), _normal(rng, 2, 9, 2, D), _normal(rng, 2, 9, 2, D)
    src = [A.KVSource(k, v, jnp.asarray(np.arange(9)[None] < np.array([[9], [5]])), right_padded=True)]
    A._note.cache_clear()
    with caplog.at_level(logging.WARNING, logger=A.__name__):
        out = A.attention(q, src, impl="cudnn", block=4)
    assert "cuDNN needs a GPU" in caplog.text
    _close(out, A.attention(q, src, impl="dense"))


def test_program_config_is_validated():
    with pytest.raises(ValueError, match="programs.attention"):
        ProgramConfig(attention="flash")
    with pytest.raises(ValueError, match="programs.attention_block"):
        ProgramConfig(attention_block=0)
    with pytest.raises(ValueError, match="programs.remat"):
        ProgramConfig(remat="all")
    assert dataclasses.asdict(ProgramConfig()) == dict(attention="blockwise", attention_block=512, remat="layer",
                                                    packing=True, shape_buckets="64:512:1.25")
    with pytest.raises(ValueError, match="STEP:LINEAR_UNTIL:RATIO"):
        ProgramConfig(shape_buckets="64")


def _frame_rows(rows, t):
    """Segment ids [B, T] of frames packed in rows (ids 0.. in order, -1 after the last frame) and validity."""
    seg = np.full((len(rows), t), -1, np.int32)
    for r, frames in enumerate(rows):
        seg[r, :sum(frames)] = np.repeat(np.arange(len(frames)), frames)
    return jnp.asarray(seg), jnp.asarray(seg >= 0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("row_groups", [1, 2])
def test_rows_one_at_a_time_equal_the_batched_kernel(causal, row_groups):
    """``row_groups`` (rows visited one at a time over the blocks their own segment ids see: the vision tower's
    packed frames) = the batched kernel = dense, value and gradients (fp32: the same sums over fewer blocks, a
    block skipped is fully masked; only the order XLA reduces one row's dot vs a batch's differs)."""
    rng = np.random.default_rng(3)
    rows, t, heads = [[10, 6, 2], [], [3, 3], [7, 5, 4]], 20, 2
    seg, valid = _frame_rows(rows, t)
    q, k, v = _normal(rng, 4, 1, t, heads, D), _normal(rng, 4, t, heads, D), _normal(rng, 4, t, heads, D)

    def fn(groups, impl, block, q, k, v):
        src = A.KVSource(k, v, valid, causal=causal, segments=seg, q_segments=seg[:, None])
        return A.attention(q, [src], impl=impl, block=block, row_groups=groups)

    # the same cotangents for both (a fresh generator of one seed each)
    (dense, g_dense), (batched, g_batched) = _both(functools.partial(fn, 0), (q, k, v), np.random.default_rng(5), 4)
    _, (rows_out, g_rows) = _both(functools.partial(fn, row_groups), (q, k, v), np.random.default_rng(5), 4)
    _close(batched, dense)
    _close(g_batched, g_dense)
    _close(rows_out, batched)
    _close(g_rows, g_batched)
    assert np.all(np.asarray(rows_out)[1] == 0)  # a row of no frame: 0, as in the batched kernel


def test_row_bounds_are_the_blocks_that_see_each_other():
    """Each row's loop bounds (``blockwise._seg_bounds``) are exactly the first and last block pairs with a query
    and a valid key of one id (frames are contiguous, so nothing between them is skipped wrongly)."""
    rows, t, b = [[10, 6, 2], [3, 3], [], [20]], 20, 4
    seg, valid = _frame_rows(rows, t)
    spec = B._Spec(bq=b, bk=(b,), causal=(False,), q_offset=(0,), shared=(True,), scale=1.0, row_groups=1)
    klo, khi, qlo, qhi = (np.asarray(a) for a in B._seg_bounds(spec, 0, t, valid, (seg[:, None], seg)))
    s, m = np.asarray(seg), np.asarray(valid)
    for r in range(len(rows)):
        see = (s[r][:, None] == s[r][None, :]) & m[r][None, :]  # [T queries, T keys]
        vis = see.reshape(t // b, b, t // b, b).any(axis=(1, 3))  # [query blocks, key blocks]
        for i in range(t // b):
            js = np.flatnonzero(vis[i])
            assert (klo[r, i], khi[r, i]) == ((js[0], js[-1] + 1) if js.size else (t // b, 0)), (r, i)
        for j in range(t // b):
            iz = np.flatnonzero(vis[:, j])
            assert (qlo[r, j], qhi[r, j]) == ((iz[0], iz[-1] + 1) if iz.size else (t // b, 0)), (r, j)
