"""Step-time simulator: pure functions, the CLI, and calibration against launch.bench on this CPU."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags

from rollplex_jax import sim as simulator
from rollplex_jax.memory import planner
from rollplex_jax.sim import hardware
from tests.paths import REPO


def _config(flagfile: str, *extra: str):
    """Config of a flagfile, parsed by a subprocess-free absl FlagValues copy."""
    from launch import flags as launch_flags

    names = set(flags.FLAGS)
    if "flagfile" not in names or "train_tp" not in names:
        launch_flags.define_flags()
    argv = ["x", f"--flagfile={os.path.join(REPO, flagfile)}", *extra]
    fl = flags.FLAGS
    fl.unparse_flags()
    fl(argv, known_only=True)
    return launch_flags.config_from_flags(fl)


def test_overlap_saving_bounded():
    for pre, dec in [(0.1, 1.0), (1.0, 0.1), (1.0, 1.0), (5.0, 2.0)]:
        for util in (0.0, 0.19, 0.5):
            for inter in (0.0, 0.15, 1.0):
                stage, slow = simulator.overlap_stage(pre, dec, util, inter)
                saving = pre + dec - stage
                assert -1e-12 <= saving <= min(pre, dec) + 1e-12
                assert slow >= 0
    # no interference, idle decode: the prefix hides entirely when it fits
    stage, _ = simulator.overlap_stage(0.5, 1.0, 0.0, 0.0)
    assert stage == pytest.approx(1.0)
    # the paper's bound: saving = min(T_prefix - slowdown, T_decode)
    stage, slow = simulator.overlap_stage(0.2, 1.0, 0.0, 0.1)
    assert 1.2 - stage == pytest.approx(min(0.2 - slow, 1.0))


def test_more_decode_never_makes_rollplex_slower_than_serial():
    cfg = _config("configs/qwen2_5_vl_7b_8dev.flags")
    lengths = planner.Lengths.from_config(cfg)
    for floor in (1e-3, 4e-3, 2e-2, 1e-1):
        sim = simulator.simulate(cfg, hardware.H800.replace(decode_step_floor_s=floor), lengths)
        assert sim.schedules["rollplex"].step_s <= sim.schedules["serial"].step_s
        assert sim.schedules["overlap_only"].step_s <= sim.schedules["serial"].step_s + 1e-9


def test_disaggregated_includes_transfer_and_presets():
    cfg = _config("configs/qwen2_5_vl_32b_h800x32.flags")
    sim = simulator.simulate(cfg, hardware.H800, planner.Lengths.from_config(cfg), 32)
    d = sim.schedules["disaggregated"]
    p = planner.param_counts(cfg).total
    assert d.phases["transfer"] == pytest.approx(p * 2 / 4 / hardware.H800.inter_bw)
    assert d.step_s >= sum(v for k, v in d.phases.items() if k != "decode_slowdown") - 1e-6
    slow = simulator.simulate(cfg, hardware.H800.replace(inter_bw=1e9), planner.Lengths.from_config(cfg), 32)
    assert slow.schedules["disaggregated"].step_s > d.step_s
    assert hardware.preset("h200").hbm_bw > hardware.preset("H100").hbm_bw
    rows = simulator.sweep(cfg, hardware.H800, planner.Lengths.from_config(cfg), 32)
    assert rows[0]["range"] >= rows[-1]["range"] and len(rows) >= 5


def test_weight_sync_refills_the_rebuilt_buffers_of_the_classification():
    """Issue 16: rollplex's weight sync is the engine-owned (rebuilt) bytes of the per-tensor classification,
    the local part copied on the device (read + write at HBM bandwidth), the rest over NVLink. The old rule
    max(0, P/rollout_tp - P/(fsdp tp)) gave 0 at equal TPs, though vLLM's fused qkv / gate_up are rebuilt."""
    hw = hardware.H800
    same = _config("configs/qwen2_5_vl_7b_8dev.flags", "--train_fsdp=1", "--train_tp=2", "--rollout_tp=2")
    c = planner.sharing_classification(same)  # issue 20: the actor stores vLLM's fused tensors: nothing rebuilt
    assert c["layout"] == "vllm" and c["extra_bytes_per_device"] == 0
    cfg = _config("configs/qwen2_5_vl_7b_8dev.flags", "--train_fsdp=1", "--train_tp=2", "--rollout_tp=1")
    c = planner.sharing_classification(cfg)  # a rank needs whole tensors, its device holds half of each
    assert c["layout"] == "vllm" and c["extra_bytes_per_device"] > 0
    local = c["extra_bytes_per_device"] - c["remote_bytes_per_device"]
    expect = 2 * local / hw.hbm_bw + c["remote_bytes_per_device"] / hw.intra_bw
    sim = simulator.simulate(cfg, hw, planner.Lengths.from_config(cfg))
    for name in ("rollplex", "overlap_only", "sharing_only"):
        assert sim.schedules[name].phases["weight_sync"] == pytest.approx(expect) and expect > 0
    full = planner.param_counts(cfg).total * 2 / 1  # bf16, rollout tp 1: serial still copies the whole shard
    assert sim.schedules["serial"].phases["weight_sync"] == pytest.approx(full / hw.intra_bw)
    # one process: the refill runs after the update, beside the next step's host work; the rollout waits for the
    # later of the two (serial's full copy stays on the critical path)
    for name in ("rollplex", "sharing_only"):
        sc = sim.schedules[name]
        starts = {p: a for _, p, a, _ in sc.spans}
        host = sc.phases["host"] + sc.phases["input_prep"]
        assert starts["weight_sync"] == 0 and starts["prefill"] == pytest.approx(max(host, expect))
    sc = sim.schedules["serial"]
    assert {p: a for _, p, a, _ in sc.spans}["prefill"] == pytest.approx(
        sc.phases["host"] + sc.phases["input_prep"] + sc.phases["weight_sync"])
    # one device, the transformers engine: every tensor aligned (a view of the actor's), nothing to refill
    one = _config("configs/bench_cpu.flags")
    assert (one.rollout.engine, one.mesh.train_devices, one.mesh.rollout_tp) == ("hf", 1, 1)
    sim = simulator.simulate(one, hw, planner.Lengths.from_config(one))
    assert all(sim.schedules[n].phases["weight_sync"] == 0 for n in ("rollplex", "overlap_only", "sharing_only"))


def test_simulate_cli_32b(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.plan", "--simulate", "--simulate_sweep",
                        "--flagfile=configs/qwen2_5_vl_32b_h800x32.flags", f"--plot_out={tmp_path}/t.png"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["schedules"]) == set(simulator.SCHEDULES)
    assert out["speedup"]["rollplex_over_serial"] > 1 and out["speedup"]["rollplex_over_disaggregated"] > 1
    assert "sweep" in out and (tmp_path / "t.png").stat().st_size > 5000


def test_dense_counts_match_xla_cost_analysis():
    """The dense program model's FLOPs and bytes are XLA's cost_analysis() of the real programs (within 20%;
    measured 0.91-1.01 on 12 rows of 20 x 20-patch images)."""
    import jax
    import numpy as np

    from rollplex_jax.config import ProgramConfig
    from rollplex_jax.models.qwen2_5_vl.model import full_forward, prepare_inputs
    from rollplex_jax.models.qwen2_5_vl.params import init_params

    cfg = _config("configs/bench_cpu.flags")
    mcfg, ids, per_row, grids = hardware._demo_rows(np.random.default_rng(0), 12, side=20)
    inputs = prepare_inputs(mcfg, ids, np.ones_like(ids), np.concatenate(per_row), grids)
    params = init_params(mcfg, jax.random.key(0))

    pm = planner.DENSE_PROGRAMS
    # The programs that model describes: dense attention, no remat (not the model functions' defaults).
    prog = ProgramConfig(attention=pm.attention, remat=pm.remat)

    def loss(p, i):
        return full_forward(p, mcfg, i, prog=prog).sum()

    rows, t, n = ids.shape[0], ids.shape[1], 20 * 20
    fwd = simulator.text_forward(cfg, rows, t, 0, t, pm) + simulator.vision_forward(cfg, rows, n, pm)
    both = fwd + simulator.backward_of(fwd, pm, cfg)
    for fn, c in ((jax.jit(loss), fwd), (jax.jit(jax.grad(loss)), both)):
        xla = hardware._xla_cost(fn, params, inputs)
        assert 0.8 <= c.flops / xla["flops"] <= 1.2, (c.flops, xla["flops"])
        assert 0.8 <= (c.ew_bytes + c.att_bytes) / xla["bytes accessed"] <= 1.2, (c, xla["bytes accessed"])


def _bench_min_steps(workdir) -> dict:
    """Fastest timed step per mode from launch.bench's metrics.jsonl (warm-up steps excluded)."""
    out = {}
    for mode in ("serial", "rollplex"):
        with open(os.path.join(workdir, mode, "metrics.jsonl")) as f:
            steps = [json.loads(line)["time/step_s"] for line in f if line.strip()]
        out[mode] = min(steps[1:])
    return out


CALIBRATION_FACTOR = 1.6  # predicted / measured within [1/1.6, 1.6] (test_calibration_against_bench)


def _within(ratio: float) -> bool:
    return 1 / CALIBRATION_FACTOR <= ratio <= CALIBRATION_FACTOR


def _calibration_attempt(tmp_path, env) -> dict:
    """One probe (recalibrated) + one launch.bench run, back to back; the ratios and what they came from."""
    sim_cmd = [sys.executable, "-m", "launch.plan", "--simulate", "--sim_hardware=cpu", "--format=json",
               "--flagfile=configs/bench_cpu.flags", f"--workdir={tmp_path}/sim", "--plan_prompt_tokens=77",
               "--sim_recalibrate"]
    r = subprocess.run(sim_cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    pred = json.loads(r.stdout.strip().splitlines()[-1])
    assert (tmp_path / "sim" / "cpu_calibration.json").exists()
    b = subprocess.run([sys.executable, "-m", "launch.bench", "--flagfile=configs/bench_cpu.flags",
                        f"--workdir={tmp_path}/bench", "--bench_steps=10", "--bench_warmup=1",
                        "--bench_modes=serial,rollplex"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert b.returncode == 0, b.stderr[-3000:]
    meas = json.loads(b.stdout.strip().splitlines()[-1])
    fastest = _bench_min_steps(tmp_path / "bench")
    ratios = {mode: pred["schedules"][mode]["step_s"] / fastest[mode] for mode in ("serial", "rollplex")}
    sp_pred, sp_meas = pred["speedup"]["rollplex_over_serial"], fastest["serial"] / fastest["rollplex"]
    ok = all(_within(x) for x in ratios.values()) and _within(sp_pred / sp_meas)
    return {"ok": ok, "ratios": ratios, "speedup_pred": sp_pred, "speedup_meas": sp_meas,
            "measured_fastest": fastest, "measured_median": {k: v["step_s"] for k, v in meas["modes"].items()},
            "speedup_meas_median": meas["speedup"]["rollplex"],
            "predicted": {k: v["step_s"] for k, v in pred["schedules"].items()},
            "calibration": pred["hardware"]["calibration"]}


@pytest.mark.timing
def test_calibration_against_bench(tmp_path):
    """Predict bench_cpu on the measured CPU preset (probes only: nothing fitted to the bench), then run the
    real bench and compare: the step time of serial and of rollplex and the speedup, each predicted / measured
    within a factor of 1.6; an attempt is a probe plus a bench, up to three, and every attempt is printed.

    Both sides are uncontended estimates: the probes keep the fastest of their repeats, the bench side is
    the fastest of 10 timed steps per mode, after one warm-up step (other processes on a shared machine only
    ever slow a step down).

    The tolerance is this machine's noise, not the model's error (2026-12-03, the same code and flags on the
    2-core CI machine within one hour): bench_cpu's fastest serial step 0.28-0.52 s and the measured speedup
    3.07-6.54 over four benches; the same jitted forward, fastest of 9, 0.033-0.093 s. Four attempts
    gave predicted / measured serial 0.42, 1.14, 1.15, 0.80, rollplex 0.69, 0.81, 0.81, 0.83, speedup 0.61,
    1.41, 1.42, 0.96: one attempt in four fails on noise alone, so up to three are made. On a quiet machine
    the fit is tighter (five runs on 2026-11-30: every ratio within 0.73-0.92, speedup within 25%); what
    the check still catches is a model off by a phase or a factor (a missing pass, bytes counted twice)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    attempts = []
    for i in range(3):
        attempts.append(_calibration_attempt(tmp_path / f"attempt{i}", env))
        print(json.dumps(attempts[-1]))
        if attempts[-1]["ok"]:
            break
    last = attempts[-1]
    for mode, ratio in last["ratios"].items():
        assert _within(ratio), (mode, ratio, attempts)
    assert _within(last["speedup_pred"] / last["speedup_meas"]), attempts
