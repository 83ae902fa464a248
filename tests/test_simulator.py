"""Step-time simulator: pure functions, the CLI, its per-phase FLOPs and bytes against XLA's counts of the same
programs, and the bench calibration report (the wall-time comparison itself is launch.bench --bench_simulate)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from absl import flags

from rollplex_jax import sim as simulator
from rollplex_jax.memory import planner
from rollplex_jax.programs.costs import ZERO, ProgramCost, program_costs
from rollplex_jax.sim import costs, hardware, phases, schedules
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
    # one process per device (launch.plan's default, --process_devices 0): each engine reads an all-gathered copy
    # inside the bind, before the rollout, on the critical path as serial's full copy is
    for name in ("rollplex", "sharing_only", "serial"):
        sc = sim.schedules[name]
        assert {p: a for _, p, a, _ in sc.spans}["prefill"] == pytest.approx(
            sc.phases["host"] + sc.phases["input_prep"] + sc.phases["weight_sync"])
    # one process driving all 8: the refill runs after the update, beside the next step's host work; the rollout
    # waits for the later of the two (serial's full copy stays on the critical path)
    one = _config("configs/qwen2_5_vl_7b_8dev.flags", "--train_fsdp=1", "--train_tp=2", "--rollout_tp=1",
                  "--process_devices=8")
    sim = simulator.simulate(one, hw, planner.Lengths.from_config(one))
    for name in ("rollplex", "sharing_only"):
        sc = sim.schedules[name]
        starts = {p: a for _, p, a, _ in sc.spans}
        host = sc.phases["host"] + sc.phases["input_prep"]
        assert starts["weight_sync"] == 0 and starts["prefill"] == pytest.approx(max(host, expect))
    # one device, the transformers engine: every tensor aligned (a view of the actor's), nothing to refill
    one = _config("configs/bench_cpu.flags")
    assert (one.rollout.engine, one.mesh.train_devices, one.mesh.rollout_tp) == ("hf", 1, 1)
    sim = simulator.simulate(one, hw, planner.Lengths.from_config(one))
    assert all(sim.schedules[n].phases["weight_sync"] == 0 for n in ("rollplex", "overlap_only", "sharing_only"))


def _dp_by_hand(cfg, dp: int, shards: int, bw: float) -> float:
    """One step's gradient sums over dp, by hand: mini-batches x 2 (dp-1)/dp x P_t / (fsdp tp) x 2 B (bf16) / link."""
    return cfg.rl.mini_batches * 2 * (dp - 1) / dp * planner.param_counts(cfg).trainable / shards * 2 / bw


def test_dp_allreduce_by_hand():
    """Issue 32: dp 2 x fsdp 2 x tp 2 (8 devices, one H800 node): every schedule sums the gradients over dp once per
    optimizer step, over NVLink, in a phase of its own between the backward and the update; twice with two
    mini-batches; ZeRO-1 (--optimizer_shard) moves the same bytes and shards the update over dp too. dp 1 has none."""
    hw = hardware.H800
    cfg = _config("configs/qwen2_5_vl_7b_8dev.flags", "--train_dp=2", "--train_fsdp=2", "--train_tp=2")
    expect = _dp_by_hand(cfg, 2, 4, hw.intra_bw)
    sim = simulator.simulate(cfg, hw)
    assert sim.details["dp_allreduce"]["run"]["link"] == "NVLink" and expect > 0
    for name in ("serial", "rollplex", "overlap_only", "sharing_only"):
        sc = sim.schedules[name]
        assert sc.phases["dp_allreduce"] == pytest.approx(expect, rel=1e-12)
        spans = {p: (a, b) for _, p, a, b in sc.spans}
        assert spans["dp_allreduce"][0] == spans["actor_bwd"][1] and spans["update"][0] == spans["dp_allreduce"][1]
    assert any(line.startswith("dp all-reduce: gradients summed over dp 2") for line in sim.assumptions)
    assert "dp_allreduce" in simulator.table(sim)
    two = simulator.simulate(_config("configs/qwen2_5_vl_7b_8dev.flags", "--train_dp=2", "--train_fsdp=2",
                                     "--train_tp=2", "--mini_batches=2"), hw)
    assert two.schedules["serial"].phases["dp_allreduce"] == pytest.approx(2 * expect, rel=1e-12)
    none = _config("configs/qwen2_5_vl_7b_8dev.flags", "--train_dp=2", "--train_fsdp=2", "--train_tp=2",
                   "--optimizer_shard=none")
    assert cfg.mesh.zero_dp and not none.mesh.zero_dp
    s_zero, s_none = (simulator.Setup.of(c, hw, None, None, None, None) for c in (cfg, none))
    assert phases.dp_allreduce(s_none, s_none.mesh).seconds == pytest.approx(expect, rel=1e-12)
    ops = hw.op_overhead_s * 6 * costs.n_tensors(cfg)  # the update's per-tensor kernels; the rest is its bytes
    assert phases.update(s_none, s_none.mesh) - ops == pytest.approx(2 * (phases.update(s_zero, s_zero.mesh) - ops),
                                                                      rel=1e-12)  # state over 4 vs 8 devices
    one = simulator.simulate(_config("configs/qwen2_5_vl_7b_8dev.flags"), hw)  # fsdp 4 x tp 2: dp 1
    assert all(sc.phases["dp_allreduce"] == 0 for sc in one.schedules.values())
    assert "dp_allreduce" not in simulator.table(one)


def test_dp_allreduce_link_follows_the_node():
    """A dp group's members are fsdp x tp devices apart (dp outer): it stays in a node, on NVLink, only while dp x
    fsdp x tp <= devices_per_node, else its sum crosses the network. The 32B mesh (tp 8 x dp 4, 8 GPUs a node) and
    its disaggregated training pool (16 devices: dp 2 x tp 8) sum over the network."""
    cfg = _config("configs/qwen2_5_vl_7b_8dev.flags", "--train_dp=2", "--train_fsdp=2", "--train_tp=2")
    for per_node, link, bw in ((8, "NVLink", hardware.H800.intra_bw), (4, "network", hardware.H800.inter_bw)):
        hw = hardware.H800.replace(devices_per_node=per_node)
        sim = simulator.simulate(cfg, hw)
        assert sim.details["dp_allreduce"]["run"]["link"] == link
        assert sim.schedules["rollplex"].phases["dp_allreduce"] == pytest.approx(_dp_by_hand(cfg, 2, 4, bw),
                                                                                 rel=1e-12)
    big = _config("configs/qwen2_5_vl_32b_h800x32.flags")
    assert (big.mesh.train_dp, big.mesh.train_fsdp, big.mesh.train_tp) == (4, 1, 8)
    sim = simulator.simulate(big, hardware.H800)
    inter = hardware.H800.inter_bw
    assert sim.details["dp_allreduce"]["run"]["link"] == "network"
    assert sim.schedules["serial"].phases["dp_allreduce"] == pytest.approx(_dp_by_hand(big, 4, 8, inter), rel=1e-12)
    assert sim.details["disagg_pools"] == [16, 16] and sim.details["dp_allreduce"]["disaggregated"]["dp"] == 2
    assert sim.schedules["disaggregated"].phases["dp_allreduce"] == pytest.approx(_dp_by_hand(big, 2, 8, inter),
                                                                                  rel=1e-12)
    # --dp_placement=within: a dp group is 4 consecutive devices, in a node: NVLink
    near = _config("configs/qwen2_5_vl_32b_h800x32.flags", "--dp_placement=within")
    sim = simulator.simulate(near, hardware.H800)
    assert sim.details["dp_allreduce"]["run"]["link"] == "NVLink"
    assert sim.schedules["serial"].phases["dp_allreduce"] == pytest.approx(
        _dp_by_hand(near, 4, 8, hardware.H800.intra_bw), rel=1e-12)


def test_disaggregated_pool_mesh_keeps_dp_semantics():
    """The training pool keeps the run's tp and its fsdp (or the largest divisor of pool / tp below it) and puts
    the rest on dp, with ZeRO-1 over it as --optimizer_shard says."""
    cfg = _config("configs/qwen2_5_vl_7b_8dev.flags")  # fsdp 4 x tp 2
    s = simulator.Setup.of(cfg, hardware.H800, None, None, None, None)
    for d_t, fsdp, dp in ((24, 4, 3), (12, 3, 2), (4, 2, 1), (8, 4, 1)):
        m = schedules.pool_mesh(s, d_t)
        assert (m.devices, m.dp, m.fsdp, m.tp) == (d_t, dp, fsdp, 2) and m.dp * m.weight_shards == d_t
        assert m.optimizer_shards == dp and m.zero_dp == (dp > 1)
    none = simulator.Setup.of(_config("configs/qwen2_5_vl_7b_8dev.flags", "--optimizer_shard=none"), hardware.H800,
                              None, None, None, None)
    assert schedules.pool_mesh(none, 24).optimizer_shards == 1

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


SIM_LENGTHS = planner.Lengths(prompt_tokens=77, vision_tokens=64, response_tokens=8)  # bench_cpu's rows


def _xla_phases(cfg, lengths) -> dict[str, ProgramCost]:
    """XLA's counts (``programs.costs.program_costs``) per phase of one step of each schedule, on the real
    programs at ``lengths`` (abstract inputs, every row full length: ``memory.aot.Abstract``), one call per
    program (micro_batch >= B x G). The rollplex prefix programs run the vision tower inside unless it is
    frozen (then ``vision`` runs once and both prefixes take its embeddings)."""
    import jax
    import jax.numpy as jnp

    from rollplex_jax.memory import aot
    from rollplex_jax.programs.actor import Answers, make_programs
    from rollplex_jax.programs.split import BoundaryRows, make_split_programs

    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    A, B, G = aot.Abstract(cfg), cfg.rl.batch_prompts, cfg.rollout.group_size
    P, R, f32 = A.params, B * G, jnp.float32
    assert cfg.rl.micro_batch >= R and cfg.rl.mini_batches == 1 and cfg.rl.uses_reference
    temp = cfg.rollout.temperature
    serial = make_programs(cfg.model, cfg.rl, cfg.optim, 1, prog=cfg.programs, temperature=temp)
    sp = make_split_programs(cfg.model, cfg.rl, cfg.programs, temperature=temp)
    full, ids = A.inputs(R, Tp, Tv, Tr), A.array((R, Tr), jnp.int32)
    answers = Answers(ids=ids, weights=A.array((R, Tr), f32), advantages=A.array((R,), f32), ref=A.array((R, Tr), f32))
    out = {"serial/reference": program_costs(serial.ref_logprobs, P, full, Tp, ids, ids),
           "serial/actor": program_costs(serial.grad, P, full, Tp, answers)}
    prompts, emb, vision = A.inputs(B, Tp, Tv, 0), None, ZERO
    if cfg.optim.freeze_vision:
        vision = program_costs(sp.vision, P, prompts)
        emb = A.array((B * Tv, cfg.model.text.hidden_size), f32)
    out["rollplex/prefix"] = vision + program_costs(sp.actor_prefix.program, P, prompts, emb)
    out["rollplex/ref_prefix"] = program_costs(sp.prefix, P, prompts, emb)
    k, v, last, kept = jax.eval_shape(sp.actor_prefix.program, P, prompts, emb)
    mask, pos, rids = A.array((B, Tp), bool), A.array((B,), jnp.int32), A.array((B, G, Tr), jnp.int32)
    rows = BoundaryRows(k, v, last, mask, pos)
    out["rollplex/reference"] = program_costs(sp.suffix_logp, B, P, rows, 0, rids, A.array((B, G, Tr), bool))
    w = A.array((B, G, Tr), f32)
    out["rollplex/actor"] = program_costs(sp.suffix_grads, B, P, rows, 0,
                                          Answers(ids=rids, weights=w, advantages=A.array((B, G), f32), ref=w)) \
        + program_costs(sp.prefix_vjp, sp.actor_prefix.meta(P, prompts, emb), P, kept, k, v, last)
    return out


def _sim_phases(cfg, lengths) -> dict[str, simulator.Cost]:
    """The simulator's per-device costs of the same phases (``phases.training_costs``, one device, the dense
    program model the CPU preset uses)."""
    s = simulator.Setup.of(cfg, hardware.H800, lengths, 1, None, planner.DENSE_PROGRAMS)

    def total(works):
        return sum((w.total for w in works), simulator.Cost())

    ser = {k: total(w) for k, w in simulator.training_costs(s, 1, False, False).items()}
    rp = {k: total(w) for k, w in simulator.training_costs(s, 1, True, True).items()}
    return {"serial/reference": ser["reference"], "serial/actor": ser["actor_fwd"] + ser["actor_bwd"],
            "rollplex/prefix": rp["vision"] + rp["actor_prefix"], "rollplex/ref_prefix": rp["ref_prefix"],
            "rollplex/reference": rp["reference"], "rollplex/actor": rp["actor_fwd"] + rp["actor_bwd"]}


# Bytes: the dense program model's constants (sim/costs.py) were measured on the full-sequence programs and
# hold there within 15% (measured 0.96-1.00 of XLA at bench_cpu's shapes); the model is linear in the shapes,
# while XLA's "bytes accessed" follows its fusion choices, which change with the shape: the vision tower's bytes
# per 256-patch image are 8.2 MB at 1-4 images, 5.5 MB at 8 and 4.9 MB at 32 (2026-12, this machine), a factor
# of 1.7 no shape-linear model follows. The split programs run at those small row counts (B prompts): their bytes
# are held within a factor of 2 (measured 0.56-1.08). The FLOPs are exact, so a phase missing or counted twice
# fails there.
SERIAL_BYTES_TOL, SPLIT_BYTES_FACTOR = 0.15, 2.0


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_phase_flops_and_bytes_match_xla(freeze_vision):
    """Per phase of both schedules (bench_cpu, dense attention, no remat: the CPU preset's programs), the
    simulator's matmul FLOPs are the dot FLOPs of the real programs, exactly (both count 2 x output x contracted
    of every matmul; dense attention computes the masked half of the causal scores too, and the reference's
    prefix runs its own vision tower unless it is frozen: both were missed before); XLA's FLOPs add the
    elementwise work the simulator times by bytes instead (never less than the matmuls); bytes within the
    tolerances above."""
    cfg = _config("configs/bench_cpu.flags", "--attention=dense", "--remat=none",
                  f"--{'' if freeze_vision else 'no'}freeze_vision")
    xla, sim = _xla_phases(cfg, SIM_LENGTHS), _sim_phases(cfg, SIM_LENGTHS)
    assert set(xla) == set(sim)
    for phase, x in xla.items():
        c = sim[phase]
        assert x.while_loops == 0, phase  # dense programs: XLA's counts are complete
        assert c.flops == pytest.approx(x.matmul_flops, rel=1e-9), (phase, c.flops, x.matmul_flops)
        assert x.flops >= x.matmul_flops, phase
        ratio = (c.ew_bytes + c.att_bytes) / x.bytes_accessed
        if phase.startswith("serial"):
            assert abs(ratio - 1) <= SERIAL_BYTES_TOL, (phase, ratio)
        else:
            assert 1 / SPLIT_BYTES_FACTOR <= ratio <= SPLIT_BYTES_FACTOR, (phase, ratio)


def test_the_cpu_probe_finds_the_demo_model():
    """The CPU preset's probes run the demo model of configs/models/demo.json (found from rollplex_jax/sim/, two
    levels below the repo root since the layout move): vision width 32, text width 64."""
    mcfg, ids, per_row, grids = hardware._demo_rows(np.random.default_rng(0), 2, side=4)
    assert (mcfg.vision.hidden_size, mcfg.text.hidden_size) == (32, 64)
    assert ids.shape == (2, 4 * 4 // 4 + 21) and len(per_row) == 2 and grids.tolist() == [[1, 4, 4]] * 2


def test_calibration_report_by_hand():
    """launch.bench --bench_simulate's report: predicted / measured per mode and the speedup, on literal figures
    (serial predicted 0.3 s, rollplex 0.1 s; measured median 0.4 and 0.125 s, fastest 0.25 and 0.1 s)."""
    sim = simulator.simulate(_config("configs/bench_cpu.flags"), hardware.H800, SIM_LENGTHS)
    sim.schedules["serial"].step_s, sim.schedules["rollplex"].step_s = 0.3, 0.1
    rep = simulator.calibration(sim, {"serial": {"step_s": 0.4, "step_s_min": 0.25},
                                      "rollplex": {"step_s": 0.125, "step_s_min": 0.1}})
    assert rep["hardware"] == "H800"
    assert rep["modes"]["serial"] == pytest.approx({"predicted_s": 0.3, "measured_median_s": 0.4,
                                                    "measured_min_s": 0.25, "predicted_over_median": 0.75,
                                                    "predicted_over_min": 1.2})
    assert rep["modes"]["rollplex"]["predicted_over_median"] == pytest.approx(0.8)  # 0.1 / 0.125
    assert rep["modes"]["rollplex"]["predicted_over_min"] == pytest.approx(1.0)
    assert rep["speedup"] == pytest.approx({"predicted": 3.0, "measured_median": 3.2, "measured_min": 2.5})
    one = simulator.calibration(sim, {"serial": {"step_s": 0.4, "step_s_min": 0.25}})
    assert "speedup" not in one and set(one["modes"]) == {"serial"}
    # bench_calibration simulates at the lengths the bench measured (bench_cpu: 77-token prompts with 64 image
    # tokens, answers of at most 8, 7.5 on average)
    lengths = {"prompt_length/max": 77.0, "prompt_length/vision_mean": 64.0, "response_length/max": 8.0,
               "response_length/mean": 7.5}
    cfg = _config("configs/bench_cpu.flags")
    rep = simulator.bench_calibration(cfg, hardware.H800, {"serial": {"step_s": 1.0, "step_s_min": 1.0,
                                                                      "lengths": lengths}})
    want = simulator.simulate(cfg, hardware.H800, SIM_LENGTHS, response_mean=7.5).schedules["serial"].step_s
    assert rep["modes"]["serial"]["predicted_s"] == want
    assert want != simulator.simulate(cfg, hardware.H800).schedules["serial"].step_s  # not the config's maxima


def test_one_process_driving_several_devices_decodes_on_one_engine():
    """At rollout TP 1 each process runs one engine on its first device: one process per device (launch.plan's
    default) decodes on all 8, one process driving all 8 (``--process_devices=8``) on one, with every answer."""
    hw = hardware.H800
    sims = {}
    for pd in (0, 8):
        cfg = _config("configs/qwen2_5_vl_7b_8dev.flags", "--rollout_tp=1", f"--process_devices={pd}")
        sims[pd] = simulator.simulate(cfg, hw, planner.Lengths.from_config(cfg))
    rows = cfg.rl.batch_prompts * cfg.rollout.group_size
    assert sims[0].details["rollout_rows_per_replica"] == -(-rows // 8)
    assert sims[8].details["rollout_rows_per_replica"] == rows
    assert sims[8].schedules["rollplex"].phases["decode"] > 3 * sims[0].schedules["rollplex"].phases["decode"]
