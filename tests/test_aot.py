"""AOT-compiled memory of the real programs (rollplex_jax/memory/aot.py, launch.plan --compile) on the tiny config."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from launch.api import config_from_flagfile
from rollplex_jax.memory import aot, planner
from tests.paths import REPO

LENGTHS = planner.Lengths(prompt_tokens=24, vision_tokens=4, response_tokens=3)


def _nbytes(*arrays) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in arrays)


@pytest.mark.parametrize("schedule", ["rollplex", "rollplex_tower_inside", "serial"])
def test_every_program_of_a_step_compiles_and_reports_bytes(schedule):
    """XLA's bytes of each program against figures known without XLA (tiny_cpu on one device, B = 16 prompts
    x G = 8 answers in one micro-batch, rows of 24 prompt tokens (4 image tokens = 16 patches) + 3 answer tokens):
    params P = 151,424 fp32 (planner.param_counts) = 605,696 B; AdamW state 2 P + two int32 step counts; a
    program's arguments are its inputs' bytes (every model input but ``next_position``, the decode's, and
    ``frame_gather``, videos', which the programs do not read; a traced prompt length is 4 B); its outputs the
    arrays it returns (a tuple adds XLA's table of 8 B per element). Rollplex encodes the images in vision chunks
    (the default with shape buckets: ``vision_into`` into an embeddings buffer the prefix programs take,
    ``vision_grads`` from its cotangent) or, with ``--vision_chunk_units=-1``, inside the prefix programs."""
    inside = schedule == "rollplex_tower_inside"
    cfg = config_from_flagfile("configs/tiny_cpu.flags", schedule="serial" if schedule == "serial" else "rollplex",
                               kl_coef=0.1, **({"vision_chunk_units": -1} if inside else {}))
    c = aot.compiled_memory(cfg, LENGTHS)
    split = {"actor_prefix", "ref_prefix", "suffix_logp", "suffix_grads", "prefix_vjp", "clip", "update_chunk"}
    want = {"rollplex": split | {"vision_into", "vision_grads"}, "rollplex_tower_inside": split,
            "serial": {"ref_logprobs", "grad", "clip", "update_chunk"}}[schedule]
    assert set(c.programs) == want
    assert set(c.phase_bytes) == {"rollout", "score", "train", "update"}
    A, pr = aot.Abstract(cfg), c.programs
    P = planner.param_counts(cfg).total * 4
    opt = 2 * P + 2 * 4
    assert P == aot.abstract_shard_bytes(A.params) == 605_696 and c.live_bytes["train"]["optimizer_state"] == opt
    assert all(b >= P for b in c.phase_bytes.values())  # the weights are on the device in every phase
    assert pr["clip"].argument == P  # the gradients
    assert pr["update_chunk"].argument == P + opt + P + 1  # params, Adam state, clipped gradients, all-finite flag
    assert pr["update_chunk"].alias == P + opt  # params and state donated: updated in place

    def reads(inputs):  # the model inputs a program reads
        unread = [inputs.next_position] + ([inputs.layout["frame_gather"]] if inputs.layout else [])
        return _nbytes(*jax.tree.leaves(inputs)) - _nbytes(*unread)

    if schedule == "serial":
        rows, tr = 16 * 8, 3
        x, logp = reads(A.inputs(rows, 24, 4, tr)), rows * tr * 4
        assert pr["ref_logprobs"].argument == P + x + 2 * rows * tr * 4 + 4  # + answer ids and mask, prompt length
        assert pr["ref_logprobs"].output == logp  # fp32 log-probs [128, 3]
        # + answer ids, token weights, advantages [128], reference log-probs, the engine's log-probs (for
        # rollout/logprob_abs_diff_*, summed inside the gradient program)
        assert pr["grad"].argument == P + x + 4 * logp + rows * 4 + 4
        assert P < pr["grad"].output <= P + 1024  # the gradients + the loss and its metric scalars
        # the score phase holds, beside the reference program, the actor's weights and its Adam state
        assert c.phase_bytes["score"] == pr["ref_logprobs"].total + P + opt
    else:
        buffer = tower = 0
        if not inside:
            buffer = pr["vision_into"].output  # the embeddings buffer [rows, out_hidden] fp32
        x = reads(A.inputs(16, 24, 4, 0, slots=0 if inside else buffer // (4 * cfg.model.vision.out_hidden_size)))
        if not inside:
            assert buffer >= 16 * 4 * cfg.model.vision.out_hidden_size * 4  # every prompt's 4 image tokens
            # the tower's params, a chunk (its pixels, at least the 16 patches of one image, and layout), the buffer,
            # the offset: arguments a program does not read are dropped by jit
            tower = _nbytes(*(a for k, a in A.params.items() if k.startswith("visual.")))
            chunk = _nbytes(*jax.tree.leaves(A.chunk(planner.vision_chunks(cfg, LENGTHS), 24, 4)))
            low = tower + buffer + 16 * cfg.model.vision.patch_dim * 4
            assert low <= pr["vision_into"].argument <= tower + chunk + buffer + 4
            assert pr["vision_into"].alias == buffer  # the buffer donated: written in place
            assert P + low <= pr["vision_grads"].argument <= P + tower + chunk + buffer + 4  # + the accumulator
            assert pr["vision_grads"].alias == P  # the accumulator, donated: added to in place
            assert P <= pr["vision_grads"].output <= P + 8 * len(A.params)
            assert c.live_bytes["train"]["emb_ct"] == buffer
        kv = 2 * 2 * 16 * 24 * 2 * 16 * 4  # (k, v) x 2 layers x 16 prompts x 24 tokens x 2 kv heads x 16 x fp32
        last = 16 * 32 * 4  # the last prompt token's logits over the 32-token vocabulary
        text = P - (tower if not inside else 0)  # chunked: the prefix programs read no tower params
        for name in ("actor_prefix", "ref_prefix"):
            assert pr[name].argument == text + x + buffer, name
        assert kv + last <= pr["ref_prefix"].output <= kv + last + 3 * 8
        residuals = c.live_bytes["rollout"]["prefix_residuals"]  # the kept vjp residuals' shapes (JAX's)
        assert kv + last + residuals <= pr["actor_prefix"].output <= kv + last + residuals + 1024
        assert pr["suffix_logp"].output == 16 * 8 * 3 * 4  # fp32 log-probs [16, 8, 3]
        # the prefix's parameter gradients (+ chunked: the buffer's cotangent, for ``vision_grads``)
        assert P + buffer <= pr["prefix_vjp"].output <= P + buffer + 8 * (len(A.params) + 1)


def test_the_saved_prefix_state_holds_no_weights():
    """The actor prefix's vjp residuals without the parameters: every linear weight the backward reads is
    taken from the params passed to the prefix vjp, not copied into the saved state (issue 17)."""
    from rollplex_jax.models.vl import model as M
    from rollplex_jax.models.vl.params import param_shapes
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
    kept = jax.tree.leaves(out[3])
    shapes = {(tuple(v.shape), v.dtype) for v in params.values()}
    assert not [x.shape for x in kept if (tuple(x.shape), x.dtype) in shapes]  # no residual is a weight
    # jax.vjp's own residuals are exactly the kept ones plus the parameters the backward reads
    plain = jax.tree.leaves(jax.eval_shape(lambda p: jax.vjp(lambda q: M.prefix_forward(q, cfg, inputs)[1], p)[1],
                                           params))
    assert _nbytes(*plain) == _nbytes(*kept) + _nbytes(*(params[k] for k in dict.fromkeys(filter(None, names))))


def test_a_mesh_divides_the_per_device_bytes():
    one = aot.compiled_memory(config_from_flagfile("configs/tiny_cpu.flags", schedule="rollplex"), LENGTHS)
    four = aot.compiled_memory(config_from_flagfile("configs/tiny_cpu.flags", schedule="rollplex", train_fsdp=2,
                                                    train_tp=2), LENGTHS)
    assert four.live_bytes["train"]["compute_weights"] < one.live_bytes["train"]["compute_weights"] / 2
    assert four.programs["suffix_grads"].argument < one.programs["suffix_grads"].argument
    # XLA's argument bytes of the clip (the gradients) are the shards JAX's param shardings give each device
    assert one.programs["clip"].argument == one.live_bytes["train"]["compute_weights"] == 605_696
    assert four.programs["clip"].argument == four.live_bytes["train"]["compute_weights"]


def test_launch_plan_compile_prints_compiled_and_planned_vs_compiled():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.plan", "--flagfile=configs/tiny_cpu.flags", "--compile",
                        "--target=cpu", "--format=json"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"layouts", "compiled", "planned_vs_compiled"} <= set(out)
    assert set(out["planned_vs_compiled"]) == {"rollout", "score", "train", "update"}
    for name, v in out["compiled"].items():
        assert v["total_bytes"] == v["temp_bytes"] + v["argument_bytes"] + v["output_bytes"] - v["alias_bytes"], name
    assert out["compiled"]["clip"]["argument_bytes"] == 605_696  # the gradients: 151,424 fp32 parameters


def test_cpu_compiles_16_bit_matmuls_as_a_gpu_would():
    """On CPU, XLA upcasts bf16 matmuls to fp32 and keeps the converted inputs as temporaries; the compile
    stand-in (float16, same bytes, with ``change-op-data-type`` off) does not. A two-matmul gradient (w1
    [1024, 4096], w2 [4096, 1024], x [512, 1024]): the stand-in's temporaries are the fp32 program's at half the
    bytes (5 MiB = 10 / 2), bfloat16 as-is holds the fp32 program's plus fp32 copies of its three inputs
    (10 + 16 + 16 + 2 = 44 MiB)."""
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

    as_is, stand_in, f32 = temp(jnp.bfloat16, None), temp(jnp.float16, options), temp(jnp.float32, None)
    assert stand_in == f32 // 2, (stand_in, f32)
    assert as_is == f32 + 4 * (1024 * 4096 + 4096 * 1024 + 512 * 1024), (as_is, f32)
