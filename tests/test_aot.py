"""AOT-compiled memory of the real programs (rollplex_jax/memory/aot.py, launch.plan --compile) on the tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch.api import config_from_flagfile
from rollplex_jax.memory import aot, planner
from tests.paths import REPO

LENGTHS = planner.Lengths(prompt_tokens=24, vision_tokens=4, response_tokens=3)


@pytest.mark.parametrize("schedule", ["rollplex", "serial"])
def test_every_program_of_a_step_compiles_and_reports_bytes(schedule):
    cfg = config_from_flagfile("configs/tiny_cpu.flags", schedule=schedule, kl_coef=0.1)
    c = aot.compiled_memory(cfg, LENGTHS)
    want = {"rollplex": {"actor_prefix", "ref_prefix", "suffix_logp", "suffix_grads", "prefix_vjp", "clip",
                         "update_chunk"},
            "serial": {"ref_logprobs", "grad", "clip", "update_chunk"}}[schedule]
    assert set(c.programs) == want
    for name, pb in c.programs.items():
        assert pb.argument > 0 and pb.total >= pb.temp, name
    assert set(c.phase_bytes) == {"rollout", "score", "train", "update"}
    params = aot.abstract_shard_bytes(aot.Abstract(cfg).params)
    assert all(b >= params for b in c.phase_bytes.values())  # the weights are on the device in every phase


def test_the_saved_prefix_state_holds_no_weights():
    """The actor prefix's vjp residuals without the parameters: every linear weight the backward reads is
    taken from the params passed to the prefix vjp, not copied into the saved state (issue 17)."""
    import jax
    import numpy as np

    from rollplex_jax.models.qwen2_5_vl import model as M
    from rollplex_jax.models.qwen2_5_vl.params import param_shapes
    from rollplex_jax.programs.split import ResidualPrefix
    from tests.hf_reference import mm_inputs

    cfg = config_from_flagfile("configs/tiny_cpu.flags").model
    inputs = M.prepare_inputs(cfg, **mm_inputs(cfg, [[9] * 6 + [("image", (1, 4, 4))], [9] * 10],
                                              np.random.default_rng(0)))
    rp, params = ResidualPrefix(cfg), param_shapes(cfg)
    out = jax.eval_shape(rp.program, params, inputs, None)
    _, names = rp.meta(params, inputs, None)
    linear = {k for k, v in params.items() if len(v.shape) == 2 and k.endswith(".weight") and "norm" not in k
              and "embed_tokens" not in k}
    assert linear <= set(filter(None, names))  # all of them taken from the params
    kept = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(out[3]))
    assert kept + sum(int(np.prod(params[k].shape)) * params[k].dtype.itemsize for k in linear) \
        <= sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(
            jax.eval_shape(lambda p: jax.vjp(lambda q: M.prefix_forward(q, cfg, inputs)[1], p)[1], params)))


def test_a_mesh_divides_the_per_device_bytes():
    one = aot.compiled_memory(config_from_flagfile("configs/tiny_cpu.flags", schedule="rollplex"), LENGTHS)
    four = aot.compiled_memory(config_from_flagfile("configs/tiny_cpu.flags", schedule="rollplex", train_fsdp=2,
                                                    train_tp=2), LENGTHS)
    assert four.live_bytes["train"]["compute_weights"] < one.live_bytes["train"]["compute_weights"] / 2
    assert four.programs["suffix_grads"].argument < one.programs["suffix_grads"].argument


def test_launch_plan_compile_prints_compiled_and_planned_vs_compiled():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.plan", "--flagfile=configs/tiny_cpu.flags", "--compile",
                        "--format=json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"layouts", "compiled", "planned_vs_compiled"} <= set(out)
    assert set(out["planned_vs_compiled"]) == {"rollout", "score", "train", "update"}
    assert all(v["total_bytes"] > 0 for v in out["compiled"].values())


def test_cpu_compiles_16_bit_matmuls_as_a_gpu_would():
    """On CPU, XLA upcasts bf16 matmuls to fp32 and keeps the converted weights as temporaries; the compile
    stand-in (float16, same bytes, with ``change-op-data-type`` off) does not. A two-matmul gradient whose
    weights are 16 MiB: as-is 44 MiB of temp (fp32 copies), with the stand-in 5 MiB (the [512, 4096]
    hidden activation and its gradient)."""
    import jax
    import jax.numpy as jnp

    cfg, options, note = aot.compile_setup(config_from_flagfile("configs/tiny_cpu.flags", dtype="bfloat16"))
    assert cfg.model.dtype == "float16" and "bfloat16 compiled as float16" in note
    assert {"change-op-data-type", aot.CPU_COMBINER} <= set(options["xla_disable_hlo_passes"].split(","))
    fp32, _, _ = aot.compile_setup(config_from_flagfile("configs/tiny_cpu.flags"))
    assert fp32.model.dtype == "float32"

    def temp(dtype, opts):
        S = jax.ShapeDtypeStruct
        f = jax.jit(jax.grad(lambda w1, w2, x: (jax.nn.relu(x @ w1) @ w2).sum()))
        args = (S((1024, 4096), dtype), S((4096, 1024), dtype), S((512, 1024), dtype))
        return aot.compile_program(f, *args, options=opts)[0].temp

    as_is, stand_in = temp(jnp.bfloat16, None), temp(jnp.float16, options)
    assert stand_in < 0.25 * as_is, (stand_in, as_is)
