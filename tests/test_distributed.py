"""rollplex_jax.parallel.distributed: detection of multi-process settings (flags, SLURM environment, host
lists) and a real
2-process jax.distributed run (2 processes x 2 fake CPU devices, gloo collectives) over one global mesh."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from rollplex_jax.parallel.distributed import DistributedError, DistributedSpec, default_port, detect, expand_hostlist
from tests.paths import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "slurm", "psum_check.py")


@pytest.mark.parametrize("text, hosts", [
    ("vm", ["vm"]),
    ("a,b", ["a", "b"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("node[8-10]", ["node8", "node9", "node10"]),
    ("node[098-100]", ["node098", "node099", "node100"]),
    ("gpu-a[1-2]x,cpu1", ["gpu-a1x", "gpu-a2x", "cpu1"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node]1", "node[a-b]", "node[3-1]", ""])
def test_expand_hostlist_errors(text):
    with pytest.raises(DistributedError):
        expand_hostlist(text)


def test_detect_single_process():
    assert detect(env={}) is None
    assert detect(num_processes=1, env={}) is None
    assert detect(env={"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                       "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "vm"}) is None


def test_detect_explicit_wins_over_slurm():
    env = _slurm_env(procid=1)
    spec = detect("10.0.0.1:1234", 4, 3, env=env)
    assert spec == DistributedSpec("10.0.0.1:1234", 4, 3, None, source="flags")


@pytest.mark.parametrize("kwargs, missing", [
    ({"coordinator_address": "h:1"}, "--num_processes, --process_id"),
    ({"num_processes": 2}, "--coordinator_address, --process_id"),
    ({"num_processes": 2, "process_id": 0}, "--coordinator_address"),
])
def test_detect_partial_flags(kwargs, missing):
    with pytest.raises(DistributedError, match=f"without {missing}"):
        detect(env={}, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, "--process_id must be in"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": -1}, "--process_id must be in"),
    ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, "--coordinator_address must be HOST:PORT"),
    ({"coordinator_address": "h:99999", "num_processes": 2, "process_id": 0}, "HOST:PORT"),
    ({"coordinator_address": "h:1", "num_processes": 0, "process_id": 0}, "--num_processes must be >= 1"),
])
def test_detect_invalid_flags(kwargs, match):
    with pytest.raises(DistributedError, match=match):
        detect(env={}, **kwargs)


def _slurm_env(procid=0, ntasks=2, nodelist="node[07-08]", step=True, **extra):
    env = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": str(ntasks), "SLURM_PROCID": str(procid),
           "SLURM_JOB_NODELIST": nodelist, "SLURM_NODELIST": nodelist, "SLURM_LOCALID": "0"}
    if step:  # what srun adds (the batch script has none of these)
        env.update({"SLURM_STEP_ID": "3", "SLURM_STEPID": "3", "SLURM_STEP_NUM_TASKS": str(ntasks),
                    "SLURM_STEP_NODELIST": nodelist})
    env.update(extra)
    return env


def test_detect_slurm_step():
    spec = detect(env=_slurm_env(procid=1))
    assert spec.source == "slurm"
    assert (spec.num_processes, spec.process_id) == (2, 1)
    assert spec.coordinator_address == f"node07:{default_port(_slurm_env())}"
    port = default_port(_slurm_env())
    assert 20000 <= port < 30000 and port == 20000 + (4242 * 31 + 3) % 10000
    # every task of a step derives the same address
    assert detect(env=_slurm_env(procid=0)).coordinator_address == spec.coordinator_address


def test_detect_slurm_overrides():
    env = _slurm_env(ROLLPLEX_COORDINATOR_PORT="31337", ROLLPLEX_COORDINATOR_HOST="ib-node07")
    assert detect(env=env).coordinator_address == "ib-node07:31337"
    assert detect(env=_slurm_env(JAX_COORDINATOR_PORT="1234")).coordinator_address == "node07:1234"
    with pytest.raises(DistributedError, match="ROLLPLEX_COORDINATOR_PORT"):
        detect(env=_slurm_env(ROLLPLEX_COORDINATOR_PORT="http"))


@pytest.mark.parametrize("extra, ids", [
    ({}, None),  # CPU job: no GPUs, every process drives its own (fake) devices
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_GPUS_ON_NODE": "8"}, None),  # one task per node drives 8 GPUs
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_GPUS_ON_NODE": "8", "SLURM_LOCALID": "5"}, (5,)),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_LOCALID": "3"}, (3,)),
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "CUDA_VISIBLE_DEVICES": "6", "SLURM_LOCALID": "6"}, None),  # bound
    ({"SLURM_STEP_TASKS_PER_NODE": "4,8", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8", "SLURM_LOCALID": "7"},
     (7,)),
])
def test_detect_slurm_one_task_per_gpu(extra, ids):
    """Several tasks on a node that see all its GPUs: task SLURM_LOCALID drives GPU SLURM_LOCALID (issue 33)."""
    assert detect(env=_slurm_env(**extra)).local_device_ids == ids


def test_detect_slurm_more_tasks_than_gpus():
    with pytest.raises(DistributedError, match="--ntasks-per-node=4"):
        detect(env=_slurm_env(SLURM_STEP_TASKS_PER_NODE="8", SLURM_GPUS_ON_NODE="4"))


def test_detect_slurm_batch_script_is_single_process():
    """In the sbatch script itself SLURM_NTASKS=2 and SLURM_PROCID=0 but only one process runs: not distributed."""
    assert detect(env=_slurm_env(step=False)) is None


def test_detect_slurm_errors():
    env = _slurm_env()
    del env["SLURM_PROCID"]
    with pytest.raises(DistributedError, match="SLURM_PROCID"):
        detect(env=env)
    with pytest.raises(DistributedError, match="SLURM_PROCID=5"):
        detect(env=_slurm_env(procid=5))
    with pytest.raises(DistributedError, match="SLURM_STEP_NUM_TASKS"):
        detect(env=_slurm_env(SLURM_STEP_NUM_TASKS="two"))
    env = _slurm_env()
    for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        del env[k]
    with pytest.raises(DistributedError, match="--coordinator_address"):
        detect(env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_global_mesh():
    """2 real processes x 2 fake CPU devices: jax.distributed over gloo, one 4-device mesh, psum across processes."""
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": xla_flags(2), "JAX_PLATFORMS": "cpu"}
    for k in [k for k in env if k.startswith("SLURM_")]:
        del env[k]
    procs = [subprocess.Popen([sys.executable, WORKER, f"--coordinator_address=127.0.0.1:{port}",
                               "--num_processes=2", f"--process_id={i}", "--timeout_s=45"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for i in range(2)]
    deadline = time.monotonic() + 60
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"process exited {p.returncode}:\n{err[-3000:]}"
    rows = [json.loads(next(line for line in out.splitlines() if line.startswith("{"))) for out, _ in outs]
    assert [r["process_index"] for r in rows] == [0, 1]
    for r in rows:
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 4, 2)
        assert r["global_shape"] == [8, 3]
        assert r["sum"] == r["psum"] == r["expected"] == 84.0
