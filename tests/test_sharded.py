"""Sharded training on fake CPU devices (the test env has 4): the same run as on one device.

Each run: the tiny flagfile with its defaults (memory measured, the planner asked about the mesh), B 4 x G 4,
two mini-batches of two micro-batches (so several updates per step and gradient accumulation cross the
mesh), 2 RL steps, rollout by the transformers engine from the sharded params (its sharing binder gathers
what a mesh splits), then ``finish()`` (run_summary.json with planned vs measured memory per device).

Stated tolerances (tests/equivalence.py says why): metrics (loss, KL, grad_norm, ...) within rtol 1e-5 (atol
1e-7); final params within 2% of the update scale (lr x updates) per element; the gradients at the first
step, before Adam, within 1e-5 of each tensor's largest entry. XLA sums partial products in another order
across devices, everything else is identical (the rollouts are the same tokens, so rewards match exactly).
Adam eps 1e-6 (the flagfile has 1e-8): eps bounds how much Adam amplifies a near-zero component's rounding
noise (at most lr x noise / eps); the update tolerance is derived for 1e-6 (tests/equivalence.py).
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from launch.api import runner_from_flagfile
from rollplex_jax.config import MeshConfig, ModelConfig
from rollplex_jax.data.dataset import collate
from rollplex_jax.models.vl.fused import to_hf
from rollplex_jax.parallel import mesh as mesh_lib
from rollplex_jax.programs.actor import Answers
from rollplex_jax.programs.sequences import micro_batches
from rollplex_jax.rl import losses
from rollplex_jax.step import rl_step
from tests.equivalence import assert_same_gradients, assert_same_updates

STEPS, LR = 2, 5e-4
SKIP = ("time/", "memory/", "timing_s/", "perf/time_per_step", "perf/throughput",  # wall clock, live memory,
        "perf/compile",  # and compilations: what the process had compiled (or cached) before
        "perf/padding_frac")  # and the packed slots: each fsdp group packs its rows into its own power of two
# |engine - trainer log-prob|: fp32 noise itself (~1e-7 per token), which another reduction order moves by ulps of a
# log-prob (2.4e-7 at |logp| < 4): compared absolutely, within 1e-6 (a real mismatch is >= 1e-4)
NOISE = ("rollout/logprob_abs_diff_",)
FLAGS = dict(steps=STEPS, batch_prompts=4, group_size=4, micro_batch=4, mini_batches=2, eval_n=0, progress=False,
             reward="launch.bench_reward:varied_reward", checkpoint_every=0, lr=LR, eps=1e-6, log=lambda m: None)


def _runner(tmp_path_factory, schedule: str, fsdp: int, tp: int, temperature: float = 1.0, dp: int = 1,
            placement: str = "across", flagfile: str = "configs/tiny_cpu.flags"):
    wd = tmp_path_factory.mktemp(f"{schedule}_{dp}x{fsdp}x{tp}_t{temperature}")
    return runner_from_flagfile(flagfile, workdir=str(wd), train_dp=dp, train_fsdp=fsdp, train_tp=tp,
                                schedule=schedule, temperature=temperature, dp_placement=placement, **FLAGS)


def _run(tmp_path_factory, schedule: str, fsdp: int, tp: int, temperature: float = 1.0, dp: int = 1,
         placement: str = "across"):
    r = _runner(tmp_path_factory, schedule, fsdp, tp, temperature, dp, placement)
    metrics = list(r.run())
    # compared in the checkpoint's layout: the actor's rows are grouped per training TP rank (fused.py)
    params = to_hf({k: np.asarray(v) for k, v in r.state.params.items()}, r.cfg.model)
    shardings = {k: (v.sharding, v.ndim, r.cfg.model) for k, v in r.state.params.items()}
    report = r.engine.sharing_report()
    summary = r.finish()
    with open(f"{r.workdir}/run_summary.json") as f:
        assert json.load(f)["steps_done"] == STEPS
    return metrics, params, shardings, report, summary


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(schedule, temperature) -> the one-device run, run once when first asked for."""
    runs = {}

    def get(schedule: str, temperature: float):
        if (schedule, temperature) not in runs:
            runs[schedule, temperature] = _run(tmp_path_factory, schedule, 1, 1, temperature)
        return runs[schedule, temperature]

    return get


# One case at --temperature=0.7: every log-prob of the sharded programs at softmax(logits / T) too.
@pytest.mark.parametrize("schedule,fsdp,tp,temperature", [("serial", 4, 1, 1.0), ("serial", 1, 4, 1.0),
                                                          ("serial", 2, 2, 1.0), ("rollplex", 2, 2, 1.0),
                                                          ("rollplex", 1, 4, 0.7)])
def test_sharded_run_equals_single_device(single, tmp_path_factory, schedule, fsdp, tp, temperature):
    _check_mesh_run(single, tmp_path_factory, schedule, 1, fsdp, tp, temperature)


# HSDP (issue 32): weights over fsdp x tp, replicated over dp, the batch over dp x fsdp, gradients summed over dp;
# --dp_placement=within puts a dp group on consecutive devices (the other placement, same results)
@pytest.mark.parametrize("schedule,dp,fsdp,tp,placement", [("serial", 2, 2, 1, "across"),
                                                           ("rollplex", 2, 1, 2, "across"),
                                                           ("rollplex", 2, 1, 2, "within")])
def test_data_parallel_run_equals_single_device(single, tmp_path_factory, schedule, dp, fsdp, tp, placement):
    _check_mesh_run(single, tmp_path_factory, schedule, dp, fsdp, tp, 1.0, placement)


def test_dp_placement_puts_a_dp_group_apart_or_together():
    across = mesh_lib.train_mesh(MeshConfig(train_dp=2, train_fsdp=1, train_tp=2))
    within = mesh_lib.train_mesh(MeshConfig(train_dp=2, train_fsdp=1, train_tp=2, dp_placement="within"))
    ids = lambda m: [d.id for d in m.devices[:, 0, 0]]  # noqa: E731 -- a dp group: tp rank 0 of each replica
    assert ids(across) == [0, 2] and ids(within) == [0, 1]
    assert [d.id for d in within.devices[0, 0, :]] == [0, 2]  # a tp group: every other device


def _check_mesh_run(single, tmp_path_factory, schedule, dp, fsdp, tp, temperature, placement="across"):
    metrics, params, shardings, report, summary = _run(tmp_path_factory, schedule, fsdp, tp, temperature, dp,
                                                       placement)
    ref_metrics, ref_params, _, ref_report, _ = single(schedule, temperature)
    assert len(metrics) == len(ref_metrics) == STEPS
    for step, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        keys = {k for k in r if not k.startswith(SKIP)}
        assert keys == {k for k in m if not k.startswith(SKIP)}
        for k in keys:
            rtol, atol = (0.0, 1e-6) if k.startswith(NOISE) else (1e-5, 1e-7)
            np.testing.assert_allclose(m[k], r[k], rtol=rtol, atol=atol, err_msg=f"step {step + 1} {k}")
    worst = assert_same_updates(params, ref_params, lr=LR, updates=STEPS * 2)
    print(f"{schedule} dp {dp} x fsdp {fsdp} x tp {tp}: worst param difference {worst:.3g} of the tolerance")
    # really sharded as configured, and not by accident replicated
    sharded = [k for k, (s, _, _) in shardings.items() if any(a is not None for a in s.spec)]
    assert len(sharded) > len(shardings) // 2
    axes = {a for s, _, _ in shardings.values() for e in s.spec for a in (e if isinstance(e, tuple) else (e,))}
    assert "dp" not in axes  # weights replicated over dp
    mesh = mesh_lib.train_mesh(MeshConfig(train_dp=dp, train_fsdp=fsdp, train_tp=tp, dp_placement=placement))
    model = next(iter(shardings.values()))[2]
    assert model.text.fuse_groups == tp  # the engine's layout for this training TP (fused.param_layout)
    configured = mesh_lib.param_shardings(model, mesh)
    for k, (s, ndim, _) in shardings.items():  # after 2 steps of updates, still the rules' layout
        assert s.mesh.shape == mesh.shape and s.is_equivalent_to(configured[k], ndim), (k, s.spec)
    # one device: every engine tensor a view of the actor's buffer; sharded: the split ones are rebuilt
    assert ref_report.bytes["rebuilt"] == 0
    assert report.bytes["rebuilt"] > 0
    # memory measured on the mesh (the busiest device) beside the planner's per-device figure: within 15% per
    # phase, as on one device (tests/test_memory.py)
    mem = summary["memory"]
    assert mem["devices"] == dp * fsdp * tp and mem["measured_peak_bytes"]["train"] > 0
    if schedule == "rollplex":
        rows = mem["planned_vs_measured"]
        print(f"planned / measured per device ({dp}x{fsdp}x{tp}): "
              f"{ {p: v['planned_over_measured'] for p, v in rows.items()} }")
        assert set(rows) == {"rollout", "score", "train", "update"}
        for phase, row in rows.items():
            assert 0.85 <= row["planned_over_measured"] <= 1.15, (phase, row)


@pytest.mark.parametrize("dp,fsdp,tp,temperature,flagfile", [
    (1, 2, 2, 1.0, "configs/tiny_cpu.flags"), (1, 1, 4, 0.7, "configs/tiny_cpu.flags"),
    (2, 2, 1, 1.0, "configs/tiny_cpu.flags"), (2, 1, 2, 1.0, "configs/tiny_cpu.flags"),
    (1, 2, 2, 1.0, "configs/tiny_qwen3_vl_cpu.flags")])  # Qwen3-VL: q/k norms, position table, DeepStack mergers
def test_sharded_gradient_equals_single_device(tmp_path_factory, dp, fsdp, tp, temperature, flagfile):
    """The gradient of one micro-batch of real rollouts at theta_0, before Adam: within 1e-5 of each tensor's
    largest entry on the mesh and on one device (at --temperature=0.7 too; on dp meshes the sum over dp too)."""
    one = _runner(tmp_path_factory, "serial", 1, 1, temperature, flagfile=flagfile)
    many = _runner(tmp_path_factory, "serial", fsdp, tp, temperature, dp, flagfile=flagfile)
    prompts = collate(one.train_set[:2], 0)
    ro = rl_step.sample(one.ctx, one.state.params, prompts, rl_step.Draw(n=4, seed=3))
    b, g, tr = ro.response_ids.shape
    w = losses.token_weights(jax.numpy.asarray(ro.mask.reshape(b * g, tr)), "token-mean")
    adv = jax.numpy.asarray(np.random.default_rng(0).standard_normal(b * g), jax.numpy.float32)
    (mb,) = micro_batches(one.cfg.model, prompts, ro, b * g)
    grads = []
    for r in (one, many):
        with r.mesh_scope():
            (_, _), gr = r.programs.grad(r.state.params, mb.inputs, mb.prompt_len,
                                         Answers(ids=mb.response_ids, weights=w, advantages=adv))
        grads.append(to_hf({k: np.asarray(v) for k, v in gr.items()}, r.cfg.model))  # one layout for both
        r.close()
    worst = assert_same_gradients(grads[1], grads[0])
    print(f"dp {dp} x fsdp {fsdp} x tp {tp}: worst gradient difference {worst:.3g} of the largest entry")


def test_startup_check_names_a_mis_sharded_parameter():
    cfg = ModelConfig.from_json_file("configs/models/demo.json")
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=2, train_tp=2))
    sh = mesh_lib.param_shardings(cfg, mesh)
    from rollplex_jax.models.vl.params import init_params

    params = mesh_lib.place(init_params(cfg, jax.random.key(0)), sh)
    mesh_lib.check_sharded(params, sh)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    params[name] = jax.device_put(params[name], jax.devices()[0])
    with pytest.raises(mesh_lib.ShardingError, match=name.replace(".", r"\.")):
        mesh_lib.check_sharded(params, sh)


def test_rules_shard_megatron_style_and_replicate_what_does_not_divide():
    cfg = ModelConfig.from_json_file("configs/models/demo.json")
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=1, train_tp=4))
    sh = mesh_lib.param_shardings(cfg, mesh)
    P = mesh_lib.PartitionSpec
    assert sh["model.layers.0.self_attn.qkv_proj.weight"].spec == P("tp", None)  # column-parallel
    assert sh["model.layers.0.self_attn.o_proj.weight"].spec == P(None, "tp")  # row-parallel
    assert sh["model.layers.0.mlp.down_proj.weight"].spec == P(None, "tp")
    assert sh["model.norm.weight"].spec == P(None)
    table = mesh_lib.sharding_table(cfg, mesh)
    assert table["mesh"] == {"dp": 1, "fsdp": 1, "tp": 4}
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        mesh_lib.train_mesh(MeshConfig(train_fsdp=8, train_tp=8))


def test_rows_split_over_dp_and_fsdp():
    """On a dp 2 x fsdp 2 mesh the residual rows and the boundary KV rows are split over both batch axes (each
    device computes a quarter of the rows), heads over tp; with dp 1 the spec is fsdp's alone, as before."""
    from rollplex_jax.models.vl.layers import constrain_kv, constrain_rows, fsdp_size

    for dp, fsdp, tp, rows_spec in ((2, 2, 1, ("dp", "fsdp")), (1, 2, 2, "fsdp"), (2, 1, 2, "dp")):
        mesh = mesh_lib.train_mesh(MeshConfig(train_dp=dp, train_fsdp=fsdp, train_tp=tp))
        with jax.set_mesh(mesh):
            x = jax.jit(constrain_rows)(jax.numpy.ones((8, 16)))
            kv = jax.jit(constrain_kv)(jax.numpy.ones((8, 4, 2, 8)))
            assert fsdp_size() == dp * fsdp
        assert x.sharding.spec[0] == rows_spec and x.addressable_shards[0].data.shape == (8 // (dp * fsdp), 16)
        spec = tuple(kv.sharding.spec) + (None,) * 4
        assert spec[0] == rows_spec and spec[2] == ("tp" if tp > 1 else None)
