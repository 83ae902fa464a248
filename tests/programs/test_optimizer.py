"""The chunked, optionally offloaded optimizer step: same params whatever the chunking and placement."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rollplex_jax.config import OptimConfig, tiny_model_config
from rollplex_jax.memory import meter as meter_lib
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.parallel import memory_kinds
from rollplex_jax.programs.optimizer import ChunkedOptimizer, chunk_names

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=0.5, lr_schedule="cosine")  # as the optax oracle


def _grads(params, i):
    keys = jax.random.split(jax.random.key(100 + i), len(params))
    return {k: jax.random.normal(kk, v.shape, jnp.float32).astype(v.dtype)
            for kk, (k, v) in zip(keys, sorted(params.items()), strict=True)}


def _run(params, opt: ChunkedOptimizer, steps=3):
    params = {k: jnp.array(v, copy=True) for k, v in params.items()}
    state = opt.init(params)
    for i in range(steps):
        params, state, m = opt.update(params, state, _grads(params, i))
        assert bool(m["update_ok"])
    return {k: np.asarray(v) for k, v in params.items()}, state


@pytest.fixture(scope="module")
def params():
    return init_params(tiny_model_config(), jax.random.key(0))


def test_chunks_cover_every_param_once_in_balanced_groups(params):
    groups = chunk_names(params, 4)
    flat = [n for g in groups for n in g]
    assert sorted(flat) == sorted(params) and len(flat) == len(set(flat))
    assert len(groups) == 4
    sizes = [sum(params[n].size for n in g) for g in groups]
    assert max(sizes) <= 0.5 * sum(sizes)


def test_chunked_and_offloaded_updates_equal_the_unchunked_one(params):
    ref, _ = _run(params, ChunkedOptimizer(OPTIM, 10, n_chunks=1))
    chunked, _ = _run(params, ChunkedOptimizer(OPTIM, 10, n_chunks=4))
    offloaded, state = _run(params, ChunkedOptimizer(OPTIM, 10, n_chunks=4, offload=True))
    for k in ref:
        np.testing.assert_array_equal(chunked[k], ref[k], err_msg=k)
        np.testing.assert_array_equal(offloaded[k], ref[k], err_msg=k)
    # Between updates the offloaded state is in host memory: no device bytes at all.
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(state)}
    assert kinds == {"pinned_host"}
    assert meter_lib.live_buffer_bytes(state) == 0


def test_matches_optax_adamw_with_global_clipping(params):
    """The chunked step is exactly optax's chain(clip_by_global_norm, adamw) on the whole tree."""
    ours, _ = _run(params, ChunkedOptimizer(OPTIM, 10, n_chunks=3))
    sched = optax.cosine_decay_schedule(OPTIM.lr, 10, alpha=OPTIM.final_lr_frac)
    tx = optax.chain(optax.clip_by_global_norm(OPTIM.grad_clip),
                     optax.adamw(sched, b1=OPTIM.b1, b2=OPTIM.b2, eps=OPTIM.eps, weight_decay=OPTIM.weight_decay))
    p = dict(params)
    s = tx.init(p)
    for i in range(3):
        u, s = tx.update(_grads(p, i), s, p)
        p = optax.apply_updates(p, u)
    for k in p:
        np.testing.assert_allclose(ours[k], np.asarray(p[k]), rtol=1e-6, atol=1e-7, err_msg=k)


def test_bf16_compute_weights_are_cast_from_fp32_master_weights(params):
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in params.items()}
    opt = ChunkedOptimizer(OPTIM, 10, n_chunks=2, offload=True)
    out, state = _run(bf16, opt)
    master = {k: v for m in state.master for k, v in m.items()}
    assert sorted(master) == sorted(params)
    for k, v in master.items():
        assert v.dtype == jnp.float32 and out[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(jnp.asarray(memory_kinds.to_device(v)).astype(jnp.bfloat16)), out[k])
    # The master weights moved by more than bf16 rounding: updates accumulate in fp32.
    moved = max(float(jnp.max(jnp.abs(memory_kinds.to_device(master[k]) - params[k]))) for k in master)
    assert moved > 1e-3


def test_frozen_vision_params_do_not_move(params):
    frozen = OptimConfig(lr=1e-2, weight_decay=0.01, freeze_vision=True)
    out, _ = _run(params, ChunkedOptimizer(frozen, 10, n_chunks=3))
    for k, v in params.items():
        same = np.array_equal(out[k], np.asarray(v))
        assert same == k.startswith("visual."), k


def test_nonfinite_gradient_leaves_params_and_state_unchanged(params):
    opt = ChunkedOptimizer(OPTIM, 10, n_chunks=2, offload=True)
    p = {k: jnp.array(v, copy=True) for k, v in params.items()}
    state = opt.init(p)
    nan = {k: jnp.full_like(v, jnp.nan) for k, v in p.items()}
    new, new_state, m = opt.update(p, state, nan)
    assert not bool(m["update_ok"])
    for k, v in params.items():
        np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(v))
    counts = [int(memory_kinds.to_device(c[0].count)) for c in new_state.chunks]
    assert counts == [0, 0]


@pytest.mark.parametrize("offload", [False, True])
def test_zero1_over_dp_equals_the_replicated_update(params, offload):
    """ZeRO-1 (``--optimizer_shard=dp``) on a dp 2 x fsdp 2 mesh: the master weights and moments are sharded over dp
    (a quarter of each fp32 tensor on a device where dp and fsdp divide it) and stay so after updates, the params
    keep their layout (replicated over dp), and the params equal the replicated-state update's bitwise (AdamW is
    element-wise; each device computes its part). Chunked, and offloaded between updates."""
    from rollplex_jax.config import MeshConfig
    from rollplex_jax.parallel import mesh as mesh_lib

    cfg = tiny_model_config(dtype="bfloat16")
    mesh = mesh_lib.train_mesh(MeshConfig(train_dp=2, train_fsdp=2))
    shardings = mesh_lib.param_shardings(cfg, mesh)
    p16 = mesh_lib.place({k: v.astype(jnp.bfloat16) for k, v in params.items()}, shardings)
    out = []
    with jax.set_mesh(mesh):
        for zero in (False, True):
            opt = ChunkedOptimizer(OPTIM, 10, n_chunks=2, offload=offload, zero=zero)
            got, state = _run(p16, opt)
            out.append(got)
    zs = mesh_lib.zero_shardings(shardings, cfg)
    leaves = mesh_lib.per_param_leaves(state, shardings)
    axes = {a for k in leaves for e in zs[k.split("#")[0]].spec for a in (e if isinstance(e, tuple) else (e,))}
    assert leaves and "dp" in axes
    mesh_lib.check_sharded(leaves, zs, "ZeRO-1 optimizer state")
    for k in out[0]:
        np.testing.assert_array_equal(out[1][k], out[0][k], err_msg=k)
