"""Exact resume, preemption by SIGTERM, kill -9 during a save, restore onto another mesh.

Real subprocesses and real signals where the behaviour involves them.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rollplex_jax.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RlConfig,
    RolloutConfig,
    RunConfig,
)
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.run.checkpoint import Checkpointer
from rollplex_jax.run.runner import Runner
from tests.paths import REPO

KEYS = ("reward/mean", "loss", "kl", "grad_norm", "skipped_steps/no_signal")


def _config(workdir, schedule="serial", steps=4, every=2, resume=False) -> Config:
    return Config(
        model=ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json"),
        data=DataConfig(synthetic_n=16, eval_n=0, min_pixels=3136, max_pixels=3136, max_prompt_len=64),
        rollout=RolloutConfig(group_size=4, max_new_tokens=3, max_batch=64),
        rl=RlConfig(batch_prompts=2, micro_batch=8, kl_coef=0.1, reward="tests.reward_fns:length_parity"),
        optim=OptimConfig(lr=3e-3, lr_schedule="cosine", weight_decay=0.0),  # tiny_cpu.flags' (_launch's) own
        checkpoint=CheckpointConfig(every=every, keep=3),
        run=RunConfig(workdir=str(workdir), steps=steps, progress=False, schedule=schedule, resume=resume),
    )


def _metrics(rows):
    return [{k: r.get(k) for k in KEYS} for r in rows]


@pytest.mark.parametrize("schedule", ["serial", "rollplex"])
def test_resume_equals_uninterrupted(tmp_path, schedule):
    a = Runner(_config(tmp_path / "a", schedule))
    full = list(a.run())
    full_sha = a.finish()["params_sha256"]

    b = Runner(_config(tmp_path / "b", schedule))
    list(b.run(2))  # checkpoint of step 2 written (every=2); then the process "dies"
    b.close()
    with pytest.raises(ConfigError, match="--resume"):
        Runner(_config(tmp_path / "b", schedule))  # refuses to overwrite a run that has checkpoints
    c = Runner(_config(tmp_path / "b", schedule, resume=True))
    assert c.step == 2
    rest = list(c.run())
    sha = c.finish()["params_sha256"]
    assert sha == full_sha
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _metrics(rows) == _metrics([{"step": i + 1, **m} for i, m in enumerate(full)])
    assert _metrics(rest) == _metrics(full[2:])


def test_resume_refuses_another_parameter_layout(tmp_path):
    """A checkpoint's fused rows are grouped for the engine's TP (fused.py): under another grouping the same shapes
    hold other rows, so a resume with flags that change the layout must refuse, naming the fix."""
    import dataclasses

    a = Runner(_config(tmp_path / "a", steps=2))
    list(a.run())
    a.close()
    cfg = _config(tmp_path / "a", steps=4, resume=True)
    other = dataclasses.replace(cfg, model=cfg.model.with_param_layout(fuse_groups=2))
    with pytest.raises(ConfigError, match="layout .*resume with the flags it was saved with"):
        Runner(other)
    b = Runner(cfg)  # the layout it was saved with resumes
    assert b.step == 2
    b.close()


def _launch(workdir, *extra, module=("launch.main",)):
    args = ["--flagfile=configs/tiny_cpu.flags", "--schedule=serial", f"--workdir={workdir}", "--batch_prompts=2",
            "--group_size=4",
            "--synthetic_n=16", "--eval_n=0", "--reward=tests.reward_fns:length_parity", "--noprogress", *extra]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", *module, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(workdir):
    path = workdir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_sigterm_checkpoints_and_exits_0_then_resumes(tmp_path):
    wd = tmp_path / "run"
    p = _launch(wd, "--steps=500", "--checkpoint_every=0")
    deadline = time.time() + 300
    while len(_rows(wd)) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.2)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    record = json.loads(out.strip().splitlines()[-1])
    assert record["preempted"] is True and record["checkpoint"] == record["steps_done"] >= 2
    assert "rerun with --resume" in err
    done = record["steps_done"]
    q = _launch(wd, f"--steps={done + 1}", "--resume")
    out, err = q.communicate(timeout=300)
    assert q.returncode == 0, err[-2000:]
    assert [r["step"] for r in _rows(wd)] == list(range(1, done + 2))


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_usable(tmp_path):
    ref = Runner(_config(tmp_path / "ref", steps=4, every=1))
    list(ref.run())
    ref_sha = ref.finish()["params_sha256"]

    wd = tmp_path / "run"
    common = ("--steps=4", "--checkpoint_every=1", "--micro_batch=8", "--kl_coef=0.1", "--lr=3e-3",
              "--max_new_tokens=3", "--synthetic_n=16", "--decay_steps=0", "--checkpoint_keep=3")
    p = _launch(wd, *common, module=("tests.reliability.kill_during_save", "3"))  # SIGKILL once save 3 started
    p.communicate(timeout=300)
    assert p.returncode == -signal.SIGKILL
    assert sorted(int(d) for d in os.listdir(wd / "checkpoints") if d.isdigit())[-1] == 2  # 3 never completed
    q = _launch(wd, *common, "--resume")
    out, err = q.communicate(timeout=300)
    assert q.returncode == 0, err[-2000:]
    assert "continuing from the checkpoint of step 2" in err
    assert json.loads(out.strip().splitlines()[-1])["params_sha256"] == ref_sha


@pytest.mark.parametrize("n_restore", [2, 1])
def test_restore_onto_another_mesh(tmp_path, n_restore):
    cfg = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    params = init_params(cfg, jax.random.key(0))
    devices = jax.devices()
    assert len(devices) >= 4, "needs XLA_FLAGS=--xla_force_host_platform_device_count=4"
    mesh4 = Mesh(np.array(devices[:4]), ("fsdp",))

    def shard(x, mesh):
        n = mesh.devices.size
        spec = PartitionSpec("fsdp") if x.shape[0] % n == 0 else PartitionSpec()
        return jax.device_put(x, NamedSharding(mesh, spec))

    saved = {k: shard(v, mesh4) for k, v in params.items()}
    assert len(saved["model.embed_tokens.weight"].sharding.device_set) == 4
    ck = Checkpointer(str(tmp_path), keep=1)
    ck.save(1, {"params": saved}, {"step": 1})
    ck.wait()
    mesh_n = Mesh(np.array(devices[:n_restore]), ("fsdp",))
    like = {"params": {k: shard(v, mesh_n) for k, v in params.items()}}
    tree, meta = ck.restore(1, like)
    ck.close()
    assert meta == {"step": 1}
    for k, v in tree["params"].items():
        assert len(v.sharding.device_set) == (n_restore if v.shape[0] % n_restore == 0 else n_restore)
        np.testing.assert_array_equal(np.asarray(v), np.asarray(params[k]))


def test_train_state_saved_on_dp_restores_on_other_meshes(tmp_path):
    """Issue 32: the actor params and the ZeRO-1 optimizer state saved on dp 2 x fsdp 2 (the state sharded over dp
    and fsdp) restore onto fsdp 4 and onto one device, each laid out as that mesh's optimizer keeps it, with the
    same values; the checkpoint does not record the mesh."""
    from rollplex_jax.config import MeshConfig, OptimConfig
    from rollplex_jax.parallel import mesh as mesh_lib
    from rollplex_jax.programs.optimizer import ChunkedOptimizer

    cfg = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    params = {k: v.astype(jax.numpy.bfloat16) for k, v in init_params(cfg, jax.random.key(0)).items()}
    grads = {k: jax.numpy.ones_like(v) for k, v in params.items()}

    def state_on(mesh_cfg: MeshConfig):
        mesh = mesh_lib.train_mesh(mesh_cfg)
        placed = mesh_lib.place(params, mesh_lib.param_shardings(cfg, mesh))
        opt = ChunkedOptimizer(OptimConfig(lr=1e-3), 10, n_chunks=2, zero=mesh_cfg.zero_dp)
        with jax.set_mesh(mesh):
            state = opt.init(placed)
            placed, state, _ = opt.update(placed, state, dict(grads))  # moments and master weights not zero
        return {"params": placed, "opt_state": state}

    saved = state_on(MeshConfig(train_dp=2, train_fsdp=2))
    master = jax.tree.leaves(saved["opt_state"].master)
    assert any("dp" in str(x.sharding.spec).replace("fsdp", "") for x in master)  # ZeRO-1: over dp too
    ck = Checkpointer(str(tmp_path), keep=1)
    ck.save(1, saved, {"step": 1})
    ck.wait()
    want = jax.tree.map(np.asarray, saved)
    for target in (MeshConfig(train_fsdp=4), MeshConfig()):
        like = state_on(target)
        tree, _ = ck.restore(1, like)
        for got, ref, lk in zip(jax.tree.leaves(tree), jax.tree.leaves(want), jax.tree.leaves(like), strict=True):
            assert got.sharding.is_equivalent_to(lk.sharding, got.ndim)
            np.testing.assert_array_equal(np.asarray(got), ref)
    ck.close()
