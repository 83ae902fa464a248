"""A compiled program's costs read from its optimized HLO (rollplex_jax/programs/hlo_cost.py): every loop counted
as often as it runs (XLA's own cost analysis counts a while body once), slices and in-place updates by the bytes
they touch, collectives by what they produce. Expectations are exact counts known without XLA."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollplex_jax.programs.hlo_cost import arrays, nbytes, parse, program_cost

L, M, K = 6, 128, 256  # a scan of L layers of [M, K] x [K, K] matmuls


def _scan(w, x):
    def body(c, wi):
        return jnp.tanh(c @ wi), None

    return jax.lax.scan(body, x, w)[0].sum()


def test_loops_count_every_trip_where_xla_counts_one():
    """Forward and backward of the scan: 3 matmuls of 2 M K K per layer (forward; the gradients of input and
    weight), L layers: exactly, where XLA's cost analysis of the same program counts one trip of each loop."""
    w, x = jnp.ones((L, K, K)), jnp.ones((M, K))
    compiled = jax.jit(jax.grad(_scan)).lower(w, x).compile()
    c = program_cost(compiled.as_text())
    assert c.flops == 3 * L * 2 * M * K * K and c.unknown_loops == 0
    assert compiled.cost_analysis()["flops"] < c.flops / 2  # one trip of each loop (and the elementwise work)


def test_a_fusion_moves_its_operands_and_output_once():
    x = jnp.ones((1024, 1024))
    c = program_cost(jax.jit(lambda x: jnp.tanh(x) * 2 + 1).lower(x).compile().as_text())
    assert (c.flops, c.bytes, c.kernels) == (0, 2 * x.nbytes, 1)  # one kernel: read x, write the result
    assert list(c.by_kind.values()) == [2 * x.nbytes]  # one kind of kernel (the fusion)


def test_a_slice_of_a_stacked_buffer_counts_the_slice():
    """Each layer reads its [K, K] slice of the stacked weights, not the whole [L, K, K] buffer: the bytes are
    bounded by a few passes over each layer's operands, far below L reads of the stack."""
    n = 24  # layers: reading the whole stack each layer would count n / 4 times the bound below
    w, x = jnp.ones((n, K, K)), jnp.ones((M, K))
    c = program_cost(jax.jit(lambda w, x: jax.lax.scan(lambda c, wi: (c @ wi, None), x, w)[0])
                     .lower(w, x).compile().as_text())
    per_layer = w.nbytes / n + 2 * x.nbytes  # the slice, the carry in and out
    assert c.flops == n * 2 * M * K * K
    assert n * per_layer <= c.bytes <= 4 * n * per_layer < n * w.nbytes


def test_collectives_count_what_they_produce():
    """Replicating a [256, 512] fp32 array sharded over 2 devices: each device's all-gather produces the whole."""
    mesh = Mesh(jax.devices()[:2], ("d",))
    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("d")))
    whole = NamedSharding(mesh, PartitionSpec())
    text = jax.jit(lambda x: jax.lax.with_sharding_constraint(x, whole) * 2).lower(x).compile().as_text()
    assert program_cost(text).comm_bytes == 256 * 512 * 4


def test_shapes_and_tuples_parse():
    assert arrays("(bf16[2,3]{1,0}, /*index=1*/f32[4]{0}, s32[])") == [("bf16", (2, 3)), ("f32", (4,)), ("s32", ())]
    assert nbytes("(bf16[2,3]{1,0}, f32[4]{0})") == 2 * 6 + 4 * 4
    comps, entry = parse("HloModule m\n\nENTRY %main (p: f32[2]) -> f32[2] {\n"
                         "  %p = f32[2]{0} parameter(0)\n  ROOT %t = f32[2]{0} tanh(%p)\n}\n")
    assert entry == "main" and [i.op for i in comps["main"]] == ["parameter", "tanh"]
    assert comps["main"][1].operands == ("p",) and comps["main"][0].args == "0"
