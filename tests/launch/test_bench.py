"""launch.bench end to end on a tiny setting: the JSON line's contract and the equivalence check."""

import json
import os
import subprocess
import sys

from tests.paths import REPO


def test_bench_prints_the_contract(tmp_path):
    args = ["--flagfile=configs/bench_cpu.flags", f"--workdir={tmp_path}", "--bench_steps=1", "--bench_warmup=1",
            "--synthetic_n=8", "--batch_prompts=2", "--group_size=4", "--synthetic_image_size=56",
            "--min_pixels=3136", "--max_pixels=3136", "--peer_report"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.bench", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    *_, full, last = r.stdout.strip().splitlines()
    out, peer = json.loads(full), json.loads(last)
    assert out == json.loads((tmp_path / "bench.json").read_text())
    assert set(out["modes"]) == {"serial", "rollplex", "overlap_only", "sharing_only"}
    assert set(out["speedup"]) == {"rollplex", "overlap_only", "sharing_only"}
    assert all(m["step_s"] > 0 for m in out["modes"].values())
    rates = out["modes"]["serial"]["phase_flops"]  # bench_cpu uses the reference (KL in the loss)
    assert set(rates) == {"reference", "actor"}
    assert rates["actor"]["gflop"] > 2 * rates["reference"]["gflop"] > 0  # fwd + bwd vs fwd
    assert rates["actor"]["gflop_per_s"] == rates["actor"]["gflop"] / rates["actor"]["s"]
    assert out["equivalent"] is True and isinstance(out["max_param_rel_diff"], float)
    assert all(d["p999"] <= 0.02 for d in out["update_diff"].values())  # of lr x updates (equivalence.py)
    assert (tmp_path / "plots" / "timeline_compare.png").stat().st_size > 5000
    trace = json.loads((tmp_path / "rollplex" / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"torch decode", "JAX prefix", "JAX suffix", "update"} <= lanes
    # Overlap accounting: against serial's rollout of the same step; none for serial (no prefix programs).
    assert out["modes"]["serial"]["overlap"] == {}
    keys = {"decode_slowdown_s", "hidden_prefix_s", "exposed_prefix_s", "critical_path_saving_s"}
    assert all(set(out["modes"][m]["overlap"]) == keys for m in ("rollplex", "overlap_only", "sharing_only"))
    assert out["modes"]["sharing_only"]["overlap"]["hidden_prefix_s"] == 0.0  # --nooverlap: after the decode
    overlap = [e for e in trace["traceEvents"] if e.get("cat") == "overlap"]
    assert {e["name"] for e in overlap} >= {"hidden prefix"} and all(keys <= set(e["args"]) for e in overlap)
    # --peer_report: one short line after the full one.
    assert set(peer) == {"peer_report", "speedup"} and set(peer["speedup"]) == set(out["speedup"])
    for name, row in peer["peer_report"].items():
        assert set(row) == {"step_s", "tokens_per_s_per_device", "rollout_frac"}
        assert row["step_s"] == out["modes"][name]["step_s"] and row["tokens_per_s_per_device"] > 0
        assert 0 < row["rollout_frac"] < 1
