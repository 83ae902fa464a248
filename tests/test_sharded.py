"""Sharded training on fake CPU devices (the test env has 4): the same run as on one device.

Each run: the tiny flagfile, B 4 x G 4, two mini-batches of two micro-batches (so several updates per
step and gradient accumulation cross the mesh), 2 RL steps, rollout by the transformers engine from the
sharded params (its sharing binder gathers what a mesh splits). Stated tolerance: every metric and every
parameter within rtol 1e-5 (atol 1e-6 for parameters, 1e-7 for metrics) of the single-device run: XLA
sums partial products in another order across devices, everything else is identical (the rollouts are
the same tokens, so rewards match exactly). Adam eps 1e-6 as in test_rollplex_equivalence (with 1e-8 a
gradient component near 0 flips the sign of an update of size lr).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from rollplex_jax import mesh as mesh_lib
from rollplex_jax.config import MeshConfig, ModelConfig
from rollplex_jax.runner import Runner

STEPS = 2
SKIP = ("time/", "memory/")


def _run(tmp_path_factory, schedule: str, fsdp: int, tp: int):
    wd = tmp_path_factory.mktemp(f"{schedule}_{fsdp}x{tp}")
    r = Runner.from_flagfile("configs/tiny_cpu.flags", steps=STEPS, workdir=str(wd), train_fsdp=fsdp, train_tp=tp,
                             schedule=schedule, batch_prompts=4, group_size=4, micro_batch=4, mini_batches=2,
                             eval_n=0, progress=False, reward="launch.bench_reward:varied_reward",
                             checkpoint_every=0, eps=1e-6, measure_memory=False, log=lambda m: None)
    metrics = list(r.run())
    params = {k: np.asarray(v) for k, v in r.state.params.items()}
    shardings = {k: v.sharding for k, v in r.state.params.items()}
    report = r.engine.sharing_report()
    r.close()
    return metrics, params, shardings, report


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return {s: _run(tmp_path_factory, s, 1, 1) for s in ("serial", "rollplex")}


@pytest.mark.parametrize("schedule,fsdp,tp", [("serial", 4, 1), ("serial", 1, 4), ("serial", 2, 2),
                                              ("rollplex", 2, 2), ("rollplex", 1, 4)])
def test_sharded_run_equals_single_device(single, tmp_path_factory, schedule, fsdp, tp):
    metrics, params, shardings, report = _run(tmp_path_factory, schedule, fsdp, tp)
    ref_metrics, ref_params, _, ref_report = single[schedule]
    assert len(metrics) == len(ref_metrics) == STEPS
    for step, (m, r) in enumerate(zip(metrics, ref_metrics, strict=True)):
        keys = {k for k in r if not k.startswith(SKIP)}
        assert keys == {k for k in m if not k.startswith(SKIP)}
        for k in keys:
            np.testing.assert_allclose(m[k], r[k], rtol=1e-5, atol=1e-7, err_msg=f"step {step + 1} {k}")
    for k, ref in ref_params.items():
        np.testing.assert_allclose(params[k], ref, rtol=1e-5, atol=1e-6, err_msg=k)
    # really sharded as configured, and not by accident replicated
    sharded = [k for k, s in shardings.items() if any(a is not None for a in s.spec)]
    assert len(sharded) > len(shardings) // 2
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=fsdp, train_tp=tp))
    configured = mesh_lib.param_shardings(ModelConfig.from_json_file("configs/models/demo.json"), mesh)
    for k, s in shardings.items():  # after 2 steps of updates, still the rules' layout
        assert s.mesh.shape == mesh.shape and s.is_equivalent_to(configured[k], params[k].ndim), (k, s.spec)
    # one device: every engine tensor a view of the actor's buffer; sharded: the split ones are rebuilt
    assert ref_report.bytes["rebuilt"] == 0
    assert report.bytes["rebuilt"] > 0


def test_startup_check_names_a_mis_sharded_parameter():
    cfg = ModelConfig.from_json_file("configs/models/demo.json")
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=2, train_tp=2))
    sh = mesh_lib.param_shardings(cfg, mesh)
    from rollplex_jax.models.qwen2_5_vl.params import init_params

    params = mesh_lib.place(init_params(cfg, jax.random.key(0)), sh)
    mesh_lib.check_sharded(params, sh)
    name = "model.layers.0.mlp.up_proj.weight"
    params[name] = jax.device_put(params[name], jax.devices()[0])
    with pytest.raises(mesh_lib.ShardingError, match=name.replace(".", r"\.")):
        mesh_lib.check_sharded(params, sh)


def test_rules_shard_megatron_style_and_replicate_what_does_not_divide():
    cfg = ModelConfig.from_json_file("configs/models/demo.json")
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=1, train_tp=4))
    sh = mesh_lib.param_shardings(cfg, mesh)
    P = mesh_lib.PartitionSpec
    assert sh["model.layers.0.self_attn.q_proj.weight"].spec == P("tp", None)  # column-parallel
    assert sh["model.layers.0.self_attn.o_proj.weight"].spec == P(None, "tp")  # row-parallel
    assert sh["model.layers.0.mlp.down_proj.weight"].spec == P(None, "tp")
    assert sh["model.norm.weight"].spec == P(None)
    table = mesh_lib.sharding_table(cfg, mesh)
    assert table["mesh"] == {"fsdp": 1, "tp": 4}
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=64"):
        mesh_lib.train_mesh(MeshConfig(train_fsdp=8, train_tp=8))
