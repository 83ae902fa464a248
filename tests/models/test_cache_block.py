"""On the CPU the blockwise kernel cuts its block until one fp32 score block fits ``CPU_BLOCK_BYTES``
(``attention.cache_block``), and the result still equals the dense oracle: values and gradients, fp32,
1e-5 of each tensor's largest entry (or absolute where that is below 1), the rule of test_attention.py.
Also: ``programs.costs.program_costs`` gives XLA's FLOPs of a compiled program (a matmul: exactly 2 m n k).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.models import attention as A
from rollplex_jax.programs.costs import program_costs

TOL = 1e-5


def test_the_rule_on_the_shapes_of_the_vlm448_bench():
    if jax.default_backend() != "cpu":
        pytest.skip("the cap applies on the CPU only")
    assert A.cache_block(512, 32 * 4, 277, 277) == 64  # text: 32 rows x 4 heads, 277 tokens
    assert A.cache_block(512, 32 * 2, 1024, 1024) == 128  # vision: 32 frames of 1024 patches, 2 heads
    assert A.cache_block(512, 2048 * 2, 16, 16) == 512  # vision windows of 16 patches: one dense block
    assert A.cache_block(8, 10**6, 4096, 4096) == 8  # never above the configured block
    assert A.cache_block(512, 10**6, 4096, 4096) == 16  # nor below 16


def _close(a, b, tol=TOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert np.isfinite(x).all()
        np.testing.assert_allclose(x, y, atol=tol * max(1.0, float(np.abs(y).max())), rtol=0)


def test_a_capped_block_equals_the_dense_oracle():
    """16 rows x 4 heads, T = S = 160, causal, left padding: block 512 is cut to 128 (two blocks a side,
    padded), values and gradients as dense."""
    b, t, h, kh, d = 16, 160, 4, 2, 8
    if jax.default_backend() == "cpu":
        assert A.cache_block(512, b * h, t, t) == 128
    rng = np.random.default_rng(0)
    q, k, v, ct = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                   for s in ((b, 1, t, h, d), (b, 1, t, kh, d), (b, 1, t, kh, d), (b, 1, t, h * d)))
    valid = jnp.asarray(np.arange(t)[None, None] >= rng.integers(0, 60, (b, 1, 1)))

    def run(impl):
        f = lambda q, k, v: A.attention(q, [A.KVSource(k, v, valid, causal=True)], impl=impl, block=512)  # noqa: E731
        return jax.jit(lambda q, k, v: (f(q, k, v), jax.vjp(f, q, k, v)[1](ct)))(q, k, v)

    _close(run("blockwise"), run("dense"))


def test_program_costs_counts_a_matmuls_flops():
    m, k, n = 64, 32, 16
    cost = program_costs(jax.jit(jnp.matmul), jax.ShapeDtypeStruct((m, k), jnp.float32),
                         jax.ShapeDtypeStruct((k, n), jnp.float32))
    assert cost.flops == 2 * m * k * n
    assert cost.bytes_accessed >= 4 * (m * k + k * n + m * n)
