"""A suffix micro-batch takes its prefix rows [p0, p0 + size) of the boundary state inside the program
(``programs.split._rows`` / ``_add_cotangent``): on a mesh that splits the rows over ``fsdp`` by a one-hot
contraction, which must equal slicing exactly and must not gather the whole boundary onto every device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rollplex_jax.config import MeshConfig
from rollplex_jax.parallel import mesh as mesh_lib
from rollplex_jax.programs import split

L, B, T, K, D = 2, 4, 3, 2, 4


def _boundary(rng):
    k = rng.standard_normal((L, B, T, K, D)).astype(np.float32)
    last = rng.standard_normal((B, 5)).astype(np.float32)
    return k, last


@pytest.mark.parametrize("fsdp,size", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_rows_and_cotangent_equal_slicing_exactly(fsdp, size):
    rng = np.random.default_rng(0)
    k, last = _boundary(rng)
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=fsdp, train_tp=1))
    with jax.set_mesh(mesh):
        kd = jax.device_put(k, NamedSharding(mesh, PartitionSpec(None, "fsdp")))
        ld = jax.device_put(last, NamedSharding(mesh, PartitionSpec("fsdp")))
        assert split.fsdp_size() == fsdp
        mask = jax.device_put(rng.random((B, T)) > 0.5, NamedSharding(mesh, PartitionSpec("fsdp")))
        pos = jax.device_put(np.arange(B, dtype=np.int32), NamedSharding(mesh, PartitionSpec("fsdp")))
        boundary = split.BoundaryRows(kd, kd, ld, mask, pos)
        rows = jax.jit(split._rows, static_argnums=0)
        add = jax.jit(split._add_cotangent)
        for p0 in range(B - size + 1):
            got = rows(size, p0, boundary)
            got_k, got_last = got.k, got.last
            np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(mask)[p0:p0 + size])
            np.testing.assert_array_equal(np.asarray(got.next_pos), np.arange(p0, p0 + size))
            np.testing.assert_array_equal(np.asarray(got_k), k[:, p0:p0 + size])
            np.testing.assert_array_equal(np.asarray(got_last), last[p0:p0 + size])
            gk = rng.standard_normal((L, size, T, K, D)).astype(np.float32)
            gl = rng.standard_normal((size, 5)).astype(np.float32)
            acc_k, acc_l = add((kd, ld), (gk, gl), p0)
            want_k, want_l = k.copy(), last.copy()
            want_k[:, p0:p0 + size] += gk
            want_l[p0:p0 + size] += gl
            np.testing.assert_array_equal(np.asarray(acc_k), want_k)
            np.testing.assert_array_equal(np.asarray(acc_l), want_l)


def test_rows_on_a_split_mesh_do_not_gather_the_boundary():
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=4, train_tp=1))
    k = jax.ShapeDtypeStruct((L, 8, 64, K, D), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "fsdp")))
    with jax.set_mesh(mesh):
        hlo = jax.jit(lambda a, p0: split._take_rows(a, p0, 1)).lower(k, 0).compile().as_text()
    assert "all-gather" not in hlo  # each device contracts its own rows; the micro-batch's row is summed
    assert "all-reduce" in hlo
