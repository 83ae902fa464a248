"""The simulator on compiled costs (rollplex_jax/sim/compiled.py): a phase with the compiled programs' FLOPs,
bytes, kernels and collective bytes takes the time model's seconds of exactly those, the actor's compiled time is
split into forward and backward without changing its sum, each schedule takes only the compile of the programs it
runs, and every phase says where its figure came from."""

import pytest

from rollplex_jax import sim as simulator
from rollplex_jax.sim import compiled as sim_compiled
from rollplex_jax.sim import hardware
from tests.test_simulator import _config

HW = hardware.H100


def _costs(flops: float, nbytes: float, kernels: float = 100, comm: float = 1e6) -> dict:
    return {"flops": flops, "bytes": nbytes, "kernels": kernels, "comm_bytes": comm, "unknown_loops": 0,
            "programs": {"p": 1}}


def test_a_compiled_phase_is_timed_by_the_model_on_its_counts():
    cfg = _config("configs/tiny_cpu.flags")
    s = simulator.Setup.of(cfg, HW, None, None, None, None)
    c = _costs(4e12, 2e10)
    expect = 4e12 / (HW.flops(s.dt) * HW.mfu_forward) + 2e10 / HW.ew_bw + 100 * HW.op_overhead_s + 1e6 / HW.intra_bw
    got = sim_compiled.compiled_phases(s, {"vision": c, "actor": c}, {"actor_fwd": 1.0, "actor_bwd": 3.0})
    assert got["vision"] == pytest.approx(expect, rel=1e-12)
    actor = sim_compiled.seconds(s, c, HW.mfu_backward)
    assert got["actor_fwd"] + got["actor_bwd"] == pytest.approx(actor, rel=1e-12)
    assert got["actor_fwd"] == pytest.approx(actor / 4, rel=1e-12)  # the model's 1 : 3
    assert "reference" not in got and "update" not in got


def test_schedules_take_the_compile_of_the_programs_they_run():
    """The Rollplex compile sets rollplex's and sharing_only's phases; overlap_only (the same family, a prefix per
    answer) takes the model scaled by the Rollplex phases' compiled / model ratios; serial and disaggregated,
    without a serial compile, stay the model's. A serial compile scales disaggregated's phases by its ratios."""
    cfg = _config("configs/tiny_cpu.flags")
    assert cfg.run.prefix_sharing
    base = simulator.simulate(cfg, HW)
    big = _costs(1e15, 1e12)  # far slower than the model: a phase that took it shows
    sim = simulator.simulate(cfg, HW, compiled={"rollplex": {"actor_prefix": big, "actor": big}})
    src = sim.to_dict()["sources"]
    assert src["rollplex"]["actor_prefix"] == src["sharing_only"]["actor_prefix"] == "compiled"
    assert src["overlap_only"]["actor_prefix"] == src["overlap_only"]["actor_bwd"] == "scaled"
    assert src["rollplex"]["decode"] == src["overlap_only"]["decode"] == src["serial"]["actor_fwd"] == "model"
    for name in ("rollplex", "overlap_only"):
        ph, ph0 = sim.schedules[name].phases, base.schedules[name].phases
        assert ph["vision"] == pytest.approx(ph0["vision"], rel=1e-12)  # no compiled vision here
    ratio = sim.schedules["rollplex"].phases["actor_prefix"] / base.schedules["rollplex"].phases["actor_prefix"]
    assert sim.schedules["overlap_only"].phases["actor_prefix"] == pytest.approx(
        base.schedules["overlap_only"].phases["actor_prefix"] * ratio, rel=1e-12)
    for name in ("serial", "disaggregated"):  # no serial compile: unchanged
        assert sim.schedules[name].step_s == pytest.approx(base.schedules[name].step_s, rel=1e-12)
    both = simulator.simulate(cfg, HW, compiled={"serial": {"actor": big, "update": big}})
    assert both.sources["disaggregated"] == {"actor_fwd": "scaled", "actor_bwd": "scaled", "update": "scaled"}
    r = both.schedules["serial"].phases["actor_bwd"] / base.schedules["serial"].phases["actor_bwd"]
    assert both.schedules["disaggregated"].phases["actor_bwd"] == pytest.approx(
        base.schedules["disaggregated"].phases["actor_bwd"] * r, rel=1e-12)
    # another device count than the compiled (and run) mesh is refused (issue 32: no hypothetical dp), and a
    # compile no schedule runs applies nowhere, which the assumptions say
    with pytest.raises(ValueError, match="--train_dp"):
        simulator.simulate(cfg, HW, devices=2 * cfg.mesh.train_devices, compiled={"rollplex": {"actor": big}})
    other = simulator.simulate(cfg, HW, compiled={"other": {"actor": big}})
    assert not other.sources and any("none applied" in a for a in other.assumptions)


def test_a_compiled_actor_holds_the_dp_sum():
    """The compiled gradient programs' collective bytes hold the gradient sums over dp (GSPMD reduces every gradient
    program's output over dp), so a schedule whose actor is compiled drops the modelled dp_allreduce phase (not
    counted twice); one without a compile of its family keeps it."""
    cfg = _config("configs/tiny_cpu.flags", "--train_dp=2")
    base = simulator.simulate(cfg, HW)
    assert base.schedules["rollplex"].phases["dp_allreduce"] > 0
    sim = simulator.simulate(cfg, HW, compiled={"rollplex": {"actor": _costs(1e12, 1e10)}})
    assert sim.schedules["rollplex"].phases["dp_allreduce"] == sim.schedules["overlap_only"].phases["dp_allreduce"] == 0
    assert sim.schedules["serial"].phases["dp_allreduce"] == base.schedules["serial"].phases["dp_allreduce"] > 0
