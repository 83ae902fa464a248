"""Phase-aware memory at run time: measurement by class, offload of the optimizer state, lifetimes."""

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.api import runner_from_flagfile
from rollplex_jax.config import (
    Config,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    RlConfig,
    RolloutConfig,
    RunConfig,
)
from rollplex_jax.memory import meter as meter_lib
from rollplex_jax.memory.classes import CLASSES, PHASES
from rollplex_jax.models.vl.params import params_sha256
from rollplex_jax.parallel import memory_kinds
from rollplex_jax.run.runner import Runner
from rollplex_jax.step import ops as step_ops
from rollplex_jax.step import rollplex_ops
from tests.paths import REPO


def test_live_buffer_bytes_counts_each_buffer_once_and_skips_host_memory():
    a = jnp.ones((256,), jnp.float32)
    assert meter_lib.live_buffer_bytes({"x": a, "y": a, "z": [a]}) == 1024
    host = memory_kinds.to_host(a)
    assert host.sharding.memory_kind == "pinned_host" and meter_lib.live_buffer_bytes(host) == 0
    back = memory_kinds.to_device(host)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(a))
    assert meter_lib.live_buffer_bytes(back) == 1024


def test_live_by_class_attributes_named_arrays_and_counts_the_rest_as_other():
    w = jnp.ones((1000,), jnp.float32)
    g = jnp.zeros((500,), jnp.float32)
    stray = jnp.arange(300, dtype=jnp.float32)
    out, rest = meter_lib.live_by_class({"compute_weights": {"w": w}, "gradients": (g,)})
    assert out["compute_weights"] == 4000 and out["gradients"] == 2000
    assert rest >= stray.nbytes  # every other live array, reported apart
    with pytest.raises(KeyError, match="unknown buffer class"):
        meter_lib.live_by_class({"weights": w})


def test_meter_peak_is_the_largest_snapshot_plus_program_temps():
    meter = meter_lib.MemoryMeter()
    f = meter.track(jax.jit(lambda x: jnp.sort(jnp.tanh(x) * 2.0)[::-1] + x.sum()), "train", "f")
    x = jnp.ones((4096,), jnp.float32)
    y = f(x)
    meter.mark("train", compute_weights=x, gradients=y)
    m = meter.step_metrics()
    assert m["memory/train/compute_weights_bytes"] == x.nbytes and m["memory/train/gradients_bytes"] == y.nbytes
    assert m["memory/train_peak_bytes"] == sum(v for k, v in m.items() if k.startswith("memory/train/"))
    assert meter.step_metrics() == {}  # next step starts empty
    with pytest.raises(KeyError, match="unknown phase"):
        meter.mark("warmup", compute_weights=x)


class _Program:
    """A jitted program whose compiled memory analysis is replaced (``analysis``: a value, or an exception to raise)."""

    def __init__(self, analysis):
        self.fn, self.analysis = jax.jit(lambda x: x * 2.0), analysis

    def __call__(self, *args):
        return self.fn(*args)

    def lower(self, *args):
        prog = self

        class Compiled:
            def memory_analysis(self):
                if isinstance(prog.analysis, Exception):
                    raise prog.analysis
                return prog.analysis

        class Lowered:
            def compile(self):
                prog.fn.lower(*args).compile()
                return Compiled()

        return Lowered()


@pytest.mark.parametrize("analysis", [NotImplementedError("no memory stats on this backend"), None])
def test_a_backend_without_memory_analysis_counts_0_and_warns_once_naming_the_program(analysis):
    meter = meter_lib.MemoryMeter()
    f = meter.track(_Program(analysis), "train", "my_program")
    with pytest.warns(RuntimeWarning, match=r"'my_program'.*(no memory stats|returned None)") as seen:
        for n in (8, 16):  # two shapes: two compiles, one warning
            f(jnp.ones((n,), jnp.float32))
    assert len([w for w in seen if "my_program" in str(w.message)]) == 1
    assert meter.step_metrics()["memory/train/activations_bytes"] == 0


def test_a_program_that_fails_to_compile_raises_instead_of_counting_0():
    meter = meter_lib.MemoryMeter()
    f = meter.track(_Program(RuntimeError("XLA ran out of something")), "train", "broken")
    with pytest.raises(RuntimeError, match="ran out of something"):
        f(jnp.ones((8,), jnp.float32))
    bad_args = meter.track(jax.jit(lambda x: x @ x), "train", "matmul")
    with pytest.raises(TypeError):
        bad_args(jnp.ones((2, 3), jnp.float32))


def test_buffer_class_lifetimes():
    kv = CLASSES["boundary_kv"]
    assert [kv.live_in(p) for p in PHASES] == [True, True, True, False]
    opt = CLASSES["optimizer_state"]
    assert all(opt.live_in(p, "resident") for p in PHASES)
    assert [opt.live_in(p, "offload") for p in PHASES] == [False, False, False, True]
    assert not CLASSES["prefix_residuals"].live_in("train", "recompute")


def _config(tmp_path, name, **memory_kw) -> Config:
    model = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    return Config(
        model=model,
        data=DataConfig(synthetic_n=16, eval_n=0, min_pixels=3136, max_pixels=3136, max_prompt_len=64),
        rollout=RolloutConfig(group_size=4, max_new_tokens=3, max_batch=64),
        rl=RlConfig(batch_prompts=4, micro_batch=16, reward="launch.bench_reward:varied_reward"),
        optim=OptimConfig(lr=1e-3),
        memory=MemoryConfig(**memory_kw),
        run=RunConfig(workdir=str(tmp_path / name), steps=2, progress=False, schedule="rollplex"),
    )


@pytest.mark.parametrize("measure", [False, True])
@pytest.mark.parametrize("schedule", ["rollplex", "serial"])
def test_a_steps_ops_is_freed_when_the_step_returns(tmp_path, monkeypatch, schedule, measure):
    """No reference cycle through a step's ops (e.g. ops -> memory hook -> ops): with the cyclic GC off, no
    ops outlives its step. A cycle kept every step's inputs, boundary and params allocated across the next
    step's decode until the GC ran (bench_cpu overlap_only +20-35%)."""
    cls = rollplex_ops.RollplexOps if schedule == "rollplex" else step_ops.SerialOps
    made, init = [], cls.__init__

    def tracked(self, *args, **kwargs):
        made.append(weakref.ref(self))
        init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", tracked)
    cfg = _config(tmp_path, "gc", measure_memory=measure)
    r = Runner(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, schedule=schedule)))
    gc.disable()
    try:
        list(r.run())
        alive = sum(ref() is not None for ref in made)
    finally:
        gc.enable()
        r.close()
    assert len(made) == 2 and alive == 0


def test_offloaded_optimizer_state_lives_on_the_device_only_during_the_update(tmp_path):
    """Same params as the resident run; optimizer bytes on the device only in `update`, one chunk at a time;
    boundary KV and residuals freed after their last consumer (the gradient)."""
    runs = {}
    for policy in ("resident", "offload"):
        r = Runner(_config(tmp_path, policy, optimizer_policy=policy, optimizer_chunks=4))
        runs[policy] = (list(r.run()), params_sha256(r.state.params), r)
    (res, res_sha, r_res), (off, off_sha, r_off) = runs["resident"], runs["offload"]
    assert off_sha == res_sha
    opt_bytes = meter_lib.live_buffer_bytes(r_res.state.opt_state)
    assert opt_bytes > 0 and meter_lib.live_buffer_bytes(r_off.state.opt_state) == 0
    for m_res, m_off in zip(res, off, strict=True):
        assert m_res["memory/rollout/optimizer_state_bytes"] == opt_bytes
        for phase in ("rollout", "score", "train"):
            assert m_off[f"memory/{phase}/optimizer_state_bytes"] == 0
            assert m_off[f"memory/{phase}_peak_bytes"] < m_res[f"memory/{phase}_peak_bytes"]
        # during the update only about one chunk of the state (of 4) is on the device
        assert 0 < m_off["memory/update/optimizer_state_bytes"] < 0.5 * opt_bytes
        for m in (m_res, m_off):
            assert m["memory/rollout/prefix_residuals_bytes"] > 0 and m["memory/rollout/boundary_kv_bytes"] > 0
            assert m.get("memory/update/prefix_residuals_bytes", 0) == 0
            assert m.get("memory/update/boundary_kv_bytes", 0) == 0
    for _, _, r in runs.values():
        r.close()


def test_offloaded_run_checkpoints_and_resumes_to_the_same_params(tmp_path):
    cfg = _config(tmp_path, "a", optimizer_policy="offload", optimizer_chunks=3)
    whole = Runner(cfg)
    list(whole.run())
    want = params_sha256(whole.state.params)
    whole.close()
    cut = _config(tmp_path, "b", optimizer_policy="offload", optimizer_chunks=3)
    first = Runner(dataclasses.replace(cut, run=dataclasses.replace(cut.run, steps=1)))
    list(first.run())
    first.save()
    first.checkpointer.wait()
    first.close()
    again = Runner(dataclasses.replace(cut, run=dataclasses.replace(cut.run, resume=True)))
    assert again.step == 1 and meter_lib.live_buffer_bytes(again.state.opt_state) == 0
    list(again.run())
    assert params_sha256(again.state.params) == want
    again.close()


def _demo_runner(tmp_path, name, **overrides) -> Runner:
    """The demo's flagfile (tiny_cpu.flags), a few steps of a reward with signal in every group."""
    kw = dict(steps=2, synthetic_n=32, eval_n=0, progress=False, schedule="rollplex",
              reward="launch.bench_reward:varied_reward")
    return runner_from_flagfile("configs/tiny_cpu.flags", workdir=str(tmp_path / name), **{**kw, **overrides})


@pytest.mark.parametrize("policy", ["resident", "offload"])
def test_planner_predicts_the_measured_peak_of_every_phase_within_15_percent(tmp_path, policy):
    r = _demo_runner(tmp_path, policy, optimizer_policy=policy)
    list(r.run())
    report = r.memory_report()
    r.close()
    rows = report["planned_vs_measured"]
    assert set(rows) == set(PHASES)
    for phase, row in rows.items():
        assert 0.85 <= row["planned_over_measured"] <= 1.15, (phase, row)


def test_hbm_budget_forces_offload_or_refuses_naming_the_smallest_budget(tmp_path):
    from rollplex_jax.config import ConfigError
    from rollplex_jax.memory import planner

    probe = _demo_runner(tmp_path, "probe")
    peaks = {p: planner.plan(probe.cfg, probe.lengths, 1,
                             optimizer_policy=p).peak_bytes("rollplex") for p in ("resident", "offload")}
    probe.close()
    assert peaks["offload"] < peaks["resident"]
    budget = (peaks["offload"] + peaks["resident"]) // 2  # fits only with the optimizer state offloaded
    r = _demo_runner(tmp_path, "fit", hbm_budget=str(budget))
    assert r.optimizer_policy == "offload"
    ms = list(r.run())
    r.close()
    for m in ms:
        assert m["memory/rollout/optimizer_state_bytes"] == 0
        assert max(m[f"memory/{p}_peak_bytes"] for p in PHASES) < budget
    with pytest.raises(ConfigError, match=r"smallest budget that fits is [0-9.]+ MiB"):
        _demo_runner(tmp_path, "tiny", hbm_budget="1MiB")
    with pytest.raises(ConfigError, match="--schedule=rollplex"):
        _demo_runner(tmp_path, "serial", hbm_budget="1GiB", schedule="serial")


def test_hbm_budget_on_a_mesh_plans_per_device(tmp_path):
    """On fsdp 2 x tp 2 the budget is per device: the planner is asked about the 4-device mesh (it used to be
    asked about one device and refused the mesh), a budget between its two per-device peaks offloads, the run
    stays under it on its busiest device, and the plan is within 15% of what that device holds per phase (it
    was 0.58-0.77: the plan split every dimension over the mesh, shared the optimizer state over all devices
    and left out the engine's rebuilt weights and the FSDP-gathered ones)."""
    from rollplex_jax.config import MeshConfig
    from rollplex_jax.memory import planner

    mesh = dict(train_fsdp=2, train_tp=2)
    probe = _demo_runner(tmp_path, "probe4", **mesh)
    peaks = {p: planner.plan(probe.cfg, probe.lengths, 4,
                             optimizer_policy=p).peak_bytes("rollplex") for p in ("resident", "offload")}
    one = planner.plan(dataclasses.replace(probe.cfg, mesh=MeshConfig()), probe.lengths, 1,
                       optimizer_policy="offload").peak_bytes("rollplex")
    probe.close()
    assert peaks["offload"] < peaks["resident"] < one  # per device on the mesh: less than on one device
    budget = (peaks["offload"] + peaks["resident"]) // 2
    r = _demo_runner(tmp_path, "fit4", hbm_budget=str(budget), **mesh)
    assert r.optimizer_policy == "offload"
    ms = list(r.run())
    report = r.memory_report()
    r.close()
    assert report["devices"] == 4
    for m in ms:
        assert m["memory/rollout/optimizer_state_bytes"] == 0
        assert max(m[f"memory/{p}_peak_bytes"] for p in PHASES) <= budget
    rows = report["planned_vs_measured"]
    assert set(rows) == set(PHASES)
    for phase, row in rows.items():
        assert 0.85 <= row["planned_over_measured"] <= 1.15, (phase, row)
