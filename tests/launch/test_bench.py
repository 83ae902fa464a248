"""launch.bench end to end on a tiny setting: the JSON line's contract and the equivalence check."""

import json
import os
import subprocess
import sys

from tests.paths import REPO


def test_bench_prints_the_contract(tmp_path):
    args = ["--flagfile=configs/bench_cpu.flags", f"--workdir={tmp_path}", "--bench_steps=1", "--bench_warmup=1",
            "--synthetic_n=8", "--batch_prompts=2", "--group_size=4", "--synthetic_image_size=56",
            "--min_pixels=3136", "--max_pixels=3136"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.bench", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out["modes"]) == {"serial", "rollplex", "overlap_only", "sharing_only"}
    assert set(out["speedup"]) == {"rollplex", "overlap_only", "sharing_only"}
    assert all(m["step_s"] > 0 for m in out["modes"].values())
    assert out["equivalent"] is True and isinstance(out["max_param_rel_diff"], float)
    assert all(d["p999"] <= 0.02 for d in out["update_diff"].values())  # of lr x updates (equivalence.py)
    assert (tmp_path / "plots" / "timeline_compare.png").stat().st_size > 5000
    trace = json.loads((tmp_path / "rollplex" / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"torch decode", "JAX prefix", "JAX suffix", "update"} <= lanes
