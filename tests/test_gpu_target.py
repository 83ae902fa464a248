"""Compiling for a GPU without one (issue 31; rollplex_jax/memory/targets.py, models/platform.py): the backend
choices follow the compile target, a missing plugin is named with its install, and XLA's GPU compiler compiles a
small program and one step's real programs of the tiny config for an H100 (in a subprocess: the CUDA plugin must
register before JAX starts; ``make setup`` installs it into <venv>/gpu-aot)."""

import json
import os
import subprocess
import sys

import pytest

from launch.api import config_from_flagfile
from rollplex_jax.memory import aot, targets
from rollplex_jax.memory.classes import PHASES
from rollplex_jax.models import attention
from rollplex_jax.models.platform import compiling_for, platform
from rollplex_jax.models.vl.layers import compiler_options
from tests.paths import REPO

HAVE_PLUGIN = targets.plugin_version() is not None or os.path.isdir(targets.SIDE_DIR)
needs_plugin = pytest.mark.skipif(not HAVE_PLUGIN, reason=f"no CUDA plugin: {targets.INSTALL_HINT}")


def test_backend_choices_follow_the_compile_target():
    """The CPU's attention block cut, its remat pass switch and its bf16 stand-in apply when compiling for the CPU
    only; for a GPU the programs are built as a GPU runs them, whatever machine traces them."""
    cfg = config_from_flagfile("configs/tiny_cpu.flags", dtype="bfloat16")
    big = (4096, 2048, 2048)  # score rows x queries x keys far over the CPU's cache block
    with compiling_for("cpu"):
        assert platform() == "cpu"
        assert attention.cache_block(512, *big) < 512
        assert compiler_options("layer") is not None
        stand_in, options, _ = aot.compile_setup(cfg)
        assert stand_in.model.dtype == "float16" and options
    with compiling_for("gpu"):
        assert platform() == "gpu"
        assert attention.cache_block(512, *big) == 512
        assert compiler_options("layer") is None
        same, options, note = aot.compile_setup(cfg)
        assert same.model.dtype == "bfloat16" and options is None and "for gpu" in note


def test_unknown_target_and_missing_plugin_name_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="h100"):
        targets.target("b300")
    monkeypatch.setattr(targets, "plugin_version", lambda: None)
    with pytest.raises(RuntimeError, match="make gpu-aot"):
        targets.devices(targets.TARGETS["h100"], 1)
    monkeypatch.setattr(targets, "plugin_version", lambda: "0.0.1")
    with pytest.raises(RuntimeError, match="does not match jax"):
        targets.devices(targets.TARGETS["h100"], 1)


def test_target_protos_carry_the_card():
    for t in targets.TARGETS.values():
        proto = t.config_proto()
        assert f"device_memory_size: {t.memory_bytes}" in proto and f'"{t.name}"' in proto
        assert f"major: {t.capability[0]} minor: {t.capability[1]}" in proto


_SMALL = """
import json
from rollplex_jax.memory import targets
targets.use_plugin()
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
devs = targets.devices(targets.TARGETS["h100"], 2)
mesh = Mesh(devs, ("fsdp",))
x = jax.ShapeDtypeStruct((1024, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp")))
w = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
c = jax.jit(lambda x, w: jnp.tanh(x @ w)).lower(x, w).compile()
m = c.memory_analysis()
print(json.dumps({"kind": devs[0].device_kind, "platform": devs[0].platform, "backend": jax.default_backend(),
                  "argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
                  "gpu_gemm": any(k in c.as_text() for k in ("gemm_fusion", "cublas"))}))
"""


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@needs_plugin
def test_small_program_compiles_for_h100_without_a_gpu():
    """A bf16 matmul on 2 fake H100s: the GPU compiler's program (the dot as a GPU GEMM), each device's half
    of x as its argument, on a machine whose only backend is the CPU (no JAX_PLATFORMS given: use_plugin sets it)."""
    r = _run(["-c", _SMALL], 120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kind"] == "NVIDIA H100 80GB HBM3" and out["platform"] == "gpu" and out["backend"] == "cpu"
    assert out["argument"] == (512 * 512 + 512 * 512) * 2 and out["output"] == 512 * 512 * 2
    assert out["gpu_gemm"]  # a GPU GEMM (Triton gemm fusion or cuBLAS call), which XLA's CPU compiler never emits


@needs_plugin
def test_a_tiny_step_compiles_for_h100(tmp_path):
    """``launch.plan --compile --target=h100`` on the tiny flagfile (fsdp 2): every program of one step compiled by
    XLA's GPU compiler, per phase beside the plan, the compiled peak with the torch side, target and versions."""
    flagfile = tmp_path / "tiny_2dev.flags"
    flagfile.write_text(f"--flagfile={REPO / 'configs' / 'tiny_cpu.flags'}\n--train_fsdp=2\n")
    r = _run(["-m", "launch.plan", f"--flagfile={flagfile}", "--compile", "--target=h100", "--format=json"], 300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiled_target"]["device"] == "NVIDIA H100 80GB HBM3"
    assert out["compiled_target"]["compute_capability"] == "9.0"
    assert out["compiled_versions"][targets.PLUGIN] == out["compiled_versions"]["jax"]
    assert set(out["planned_vs_compiled"]) == set(PHASES) and "H100" in out["compiled_note"]
    assert {"actor_prefix", "suffix_grads", "prefix_vjp", "update_chunk"} <= set(out["compiled"])
    assert all(v["total_bytes"] > 0 for v in out["compiled"].values())
    worst = max(v["bytes"] for v in out["compiled_phases"].values())
    assert out["compiled_peak_bytes"] >= worst


_CUDNN = """
import json
from rollplex_jax.memory import targets
targets.use_plugin()
import jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rollplex_jax.models.attention import KVSource, attention
from rollplex_jax.models.platform import compiling_for
from rollplex_jax.programs.hlo_cost import program_cost
t = targets.TARGETS["h100"]
mesh = Mesh(targets.devices(t, 1), ("x",))
s = NamedSharding(mesh, P())
q = jax.ShapeDtypeStruct((2, 1, 256, 4, 64), jnp.bfloat16, sharding=s)
kv = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16, sharding=s)
n = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=s)

def loss(q, k, v, n):
    valid = jnp.arange(256)[None, :] < n[:, None]  # right-padded keys: cuDNN takes their lengths
    out = attention(q, [KVSource(k, v, valid, right_padded=True)], impl="cudnn")
    return out.astype(jnp.float32).sum()

def fmha(checks):
    with compiling_for("gpu"), (targets.cudnn_checks(t) if checks else __import__("contextlib").nullcontext()):
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, n).compile()
    return c.as_text().count('custom_call_target="__cudnn$fmha'), program_cost(c.as_text()).flops

(calls, flops), (without, _) = fmha(True), fmha(False)
print(json.dumps({"with_checks": calls, "without": without, "flops": flops}))
"""


@needs_plugin
def test_cudnn_attention_compiles_for_h100_without_a_gpu():
    """``--attention=cudnn`` for a GPU target: jax's cuDNN checks answer for the target's sm_90 and cuDNN
    (``targets.cudnn_checks``), so XLA's GPU compiler gets the fused-attention calls (forward and backward),
    whose FLOPs the HLO cost reader counts; without the substitution jax finds no local GPU and the call falls
    back to blockwise (no cuDNN call)."""
    r = _run(["-c", _CUDNN], 120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["with_checks"] >= 2 and out["without"] == 0, out
    assert out["flops"] == (4 + 10) * 2 * 4 * 256 * 256 * 64  # forward + backward of B H T S d (hlo_cost.py)


@needs_plugin
def test_the_simulator_takes_the_h100_compile_of_both_schedules(tmp_path):
    """``launch.plan --simulate --compile --target=h100`` on the tiny flagfile: the Rollplex and serial programs
    compiled for an H100, their FLOPs (every loop trip counted) near the cost model's dot FLOPs, and the phases
    they run timed on them. The model counts the FLOPs of the matmuls of each program as written; the compiled
    programs add what the model leaves out (the attention's whole diagonal blocks, where the model takes the
    causal half: measured 1.01-1.10 here), so 0.95-1.3. A loop counted once, or a program's runs per step
    miscounted, is off by the layer or micro-batch count."""
    r = _run(["-m", "launch.plan", "--flagfile=configs/tiny_cpu.flags", "--simulate", "--compile", "--target=h100",
              "--sim_hardware=H100", f"--plot_out={tmp_path}/t.png"], 300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cmp = out["details"]["compiled_vs_model"]
    assert set(cmp) == {"rollplex", "serial"} and {"vision", "actor_prefix", "actor"} <= set(cmp["rollplex"])
    for key, phases in cmp.items():
        for phase, c in phases.items():
            assert 0.95 <= c["flops_ratio"] <= 1.3, (key, phase, c)
    src = out["sources"]
    assert src["rollplex"]["actor_bwd"] == src["serial"]["actor_bwd"] == "compiled"
    assert src["rollplex"]["decode"] == src["disaggregated"]["decode"] == "model"
    assert src["disaggregated"]["actor_bwd"] == "scaled"  # the serial programs on another pool: scaled by serial's
    hw, c = out["hardware"], cmp["rollplex"]["vision"]
    link = hw["intra_bw"]  # the tiny mesh fits a node
    ew = hw["elementwise_bw"] or hw["hbm_bw"] * 0.8
    expect = (c["compiled_flops"] / (hw["peak_flops"]["float32"] * hw["mfu_forward"]) + c["compiled_bytes"] / ew
              + c["compiled_kernels"] * hw["op_overhead_s"] + c["compiled_comm_bytes"] / link)
    assert out["schedules"]["rollplex"]["phases_s"]["vision"] == pytest.approx(expect, rel=1e-9)
