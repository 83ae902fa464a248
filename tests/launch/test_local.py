"""launch.local: one process per device on one machine (issue 33), started as a user would, on fake CPU devices."""

import json
import subprocess
import sys

from launch.local import child_env, visible_gpus
from tests.paths import REPO

FLAGS = ["--flagfile=configs/tiny_cpu.flags", "--steps=1", "--batch_prompts=4", "--group_size=4", "--micro_batch=8",
         "--synthetic_n=16", "--eval_n=0", "--checkpoint_every=0", "--noprogress",
         "--reward=tests.reward_fns:varied_parts"]


def test_the_environment_hands_one_device_to_each_process():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}) == ["2", "5"]
    assert child_env(1, ["2", "5"], False, {})["CUDA_VISIBLE_DEVICES"] == "5"
    env = child_env(0, [], True, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_dump_to=x"})
    assert env["XLA_FLAGS"] == "--xla_dump_to=x --xla_force_host_platform_device_count=1"
    assert env["JAX_PLATFORMS"] == "cpu"


def test_two_processes_of_one_device_train_one_mesh(tmp_path):
    run = subprocess.run([sys.executable, "-m", "launch.local", "--nproc=2", "--cpu", "--", *FLAGS, "--train_dp=2",
                          f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 2 and lines[0]["params_sha256"] == lines[1]["params_sha256"], run.stdout[-2000:]
    assert "[process 1]" in run.stderr  # both ran, each decoding its share


def test_a_failing_process_fails_the_launch(tmp_path):
    """A mesh of 3 devices over 2 one-device processes: every process refuses it; the launcher exits non-zero."""
    run = subprocess.run([sys.executable, "-m", "launch.local", "--nproc=2", "--cpu", "--", *FLAGS, "--train_dp=3",
                          f"--workdir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "devices" in run.stderr
