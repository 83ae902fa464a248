"""Packed rows (segment ids) compute what the padded batch computes: logits, hidden states, the prefix's boundary
KV and last logits, and gradients, fp32, within 1e-5 of each tensor's largest entry (float summation order:
the blockwise kernel's blocks fall elsewhere in a packed row), at real (unpadded) positions, with images and a
video, the default programs and 4-long blocks; on a mesh the rows pack per data-parallel group."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import MeshConfig, ProgramConfig, tiny_model_config
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import packing as P
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.parallel import mesh as mesh_lib
from tests.hf_reference import mm_inputs

TOL = 1e-5
PROGS = {"default": ProgramConfig(), "blocks4": ProgramConfig(attention_block=4),
         "dense": ProgramConfig(attention="dense")}
ROWS = [
    [5, 6, ("image", (1, 8, 8)), 7, ("image", (1, 4, 6)), 8, 9],  # the longest row: 28 tokens
    [10, 11],
    [12, ("video", (2, 4, 4)), 13],
    [14, 15, 16],
    [17, ("image", (1, 4, 4)), 18, 19, 20],
    [21],
]


def _close(a, b, tol=TOL):
    a, b = np.asarray(a), np.asarray(b)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_model_config()
    return cfg, init_params(cfg, jax.random.key(0), std=0.1), mm_inputs(cfg, ROWS, np.random.default_rng(1))


def test_next_fit_keeps_order_and_packs_only_when_it_saves_a_row():
    assert P.next_fit(np.array([3, 4, 2, 6, 1]), 7).tolist() == [0, 0, 1, 2, 2]
    mask = np.zeros((4, 6), int)
    for r, n in enumerate([6, 2, 3, 1]):
        mask[r, 6 - n:] = 1
    slot, seg, p = P.pack_layout(mask)
    assert p == 2 and seg.tolist() == [[0] * 6, [1, 1, 2, 2, 2, 3]]
    assert slot[1, 4:].tolist() == [6, 7] and (slot[mask == 0] == -1).all()
    assert P.padding_fraction(mask) == pytest.approx(0.5) and P.padding_fraction(mask, p) == 0.0
    # per group of 2 rows: [6 | 2] and [3, 1]: 2 packed rows per group, nothing saved
    assert P.pack_layout(mask, groups=2) is None
    assert P.pack_layout(np.ones((3, 5), int)) is None


@pytest.mark.parametrize("prog", list(PROGS))
def test_packed_full_forward_equals_padded(model, prog):
    cfg, params, inp = model
    padded, packed = M.prepare_inputs(cfg, **inp), M.prepare_inputs(cfg, **inp, opts=M.InputOptions(pack=True))
    assert packed.packing is not None and packed.packing.input_ids.shape[0] < len(ROWS)
    fwd = jax.jit(functools.partial(M.full_forward, return_hidden=True, prog=PROGS[prog]), static_argnums=1)
    (want, want_h), (got, got_h) = fwd(params, cfg, padded), fwd(params, cfg, packed)
    real = inp["attention_mask"] > 0
    _close(np.asarray(got)[real], np.asarray(want)[real])
    for x, y in zip(got_h, want_h, strict=True):
        _close(np.asarray(x)[real], np.asarray(y)[real])
    window = jax.jit(lambda p, i, s: M.full_forward(p, cfg, i, prog=PROGS[prog], logits_window=(s, 5)))
    _close(np.asarray(window(params, packed, 20))[real[:, 20:25]], np.asarray(want)[:, 20:25][real[:, 20:25]])


@pytest.mark.parametrize("prog", ["blocks4"])  # the one-block (dense) path: test_attention.py, with segments
def test_packed_prefix_state_and_gradients_equal_padded(model, prog):
    cfg, params, inp = model
    padded, packed = M.prepare_inputs(cfg, **inp), M.prepare_inputs(cfg, **inp, opts=M.InputOptions(pack=True))
    real = jnp.asarray(inp["attention_mask"] > 0)
    ct = jax.random.normal(jax.random.key(2), (len(ROWS), inp["input_ids"].shape[1], cfg.text.vocab_size))
    ct_last = jax.random.normal(jax.random.key(3), (len(ROWS), cfg.text.vocab_size))

    def loss(params, inputs):  # gradients through every real position's logits and the prefix's last logits
        logits = M.full_forward(params, cfg, inputs, prog=PROGS[prog])
        state, last = M.prefix_forward(params, cfg, inputs, prog=PROGS[prog])
        kv = jnp.where(real[None, :, :, None, None], state.k, 0).sum() + jnp.where(
            real[None, :, :, None, None], state.v, 0).sum()
        return jnp.sum(jnp.where(real[..., None], logits * ct, 0)) + jnp.sum(last * ct_last) + 0.1 * kv

    run = jax.jit(jax.value_and_grad(loss))
    (lw, gw), (lg, gg) = run(params, padded), run(params, packed)
    _close(lg, lw)
    for name in gw:
        _close(gg[name], gw[name])
    prefix = jax.jit(functools.partial(M.prefix_forward, prog=PROGS[prog]), static_argnums=1)
    (sw, lastw), (sg, lastg) = prefix(params, cfg, padded), prefix(params, cfg, packed)
    _close(lastg, lastw)
    _close(np.asarray(sg.k)[:, np.asarray(real)], np.asarray(sw.k)[:, np.asarray(real)])
    _close(np.asarray(sg.v)[:, np.asarray(real)], np.asarray(sw.v)[:, np.asarray(real)])
    assert (np.asarray(sg.mask) == np.asarray(sw.mask)).all()


def test_rows_pack_within_their_data_parallel_group(model):
    """groups=2: each half of the rows packs into its own packed rows; on a 2-device fsdp mesh (params and
    activations sharded as in training) the packed forward equals the padded one on one device."""
    cfg, params, inp = model
    packed = M.prepare_inputs(cfg, **inp, opts=M.InputOptions(pack=True, groups=2)).packing
    seg = np.asarray(packed.segments)
    half = seg.shape[0] // 2
    assert seg.shape[0] % 2 == 0 and seg.shape[0] < len(ROWS)
    assert set(seg[:half].ravel()) - {-1} <= {0, 1, 2} and set(seg[half:].ravel()) - {-1} <= {3, 4, 5}
    want = M.full_forward(params, cfg, M.prepare_inputs(cfg, **inp))
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=2, train_tp=1), jax.devices()[:2])
    with jax.set_mesh(mesh):
        placed = mesh_lib.place(params, mesh_lib.param_shardings(cfg, mesh))
        got = jax.jit(M.full_forward, static_argnums=1)(placed, cfg, M.prepare_inputs(
            cfg, **inp, opts=M.InputOptions(pack=True, groups=2)))
    real = inp["attention_mask"] > 0
    _close(np.asarray(got)[real], np.asarray(want)[real])
