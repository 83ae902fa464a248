"""--compilation_cache_dir: its default (per user, under XDG_CACHE_HOME), '' for none, and two runs of launch.main
with one cache directory: every program the first run compiled, the second loads (its steps compile nothing)."""

import json
import os
import subprocess
import sys

from absl import flags

from launch import flags as launch_flags
from rollplex_jax.config import default_compilation_cache_dir
from tests.paths import REPO

TINY = ["--flagfile=configs/tiny_cpu.flags", "--steps=2", "--batch_prompts=2", "--group_size=2", "--synthetic_n=8",
        "--eval_n=0", "--checkpoint_every=0", "--noprogress"]


def _config(*args):
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", f"--flagfile={REPO / 'configs' / 'tiny_cpu.flags'}", *args])
    return launch_flags.config_from_flags(fv)


def test_the_default_is_per_user_and_empty_means_none(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _config().run.compilation_cache_dir == str(tmp_path / "rollplex_jax" / "xla")  # as the summary shows it
    assert _config("--compilation_cache_dir=").run.compilation_cache_dir == ""
    monkeypatch.chdir(tmp_path)
    assert _config("--compilation_cache_dir=mine").run.compilation_cache_dir == str(tmp_path / "mine")
    assert default_compilation_cache_dir({"XDG_CACHE_HOME": "relative"}) == \
        os.path.join(os.path.expanduser("~"), ".cache", "rollplex_jax", "xla")  # the XDG spec ignores relative paths


def _run(workdir, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.main", *TINY, f"--workdir={workdir}", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return rows, json.loads((workdir / "run_summary.json").read_text())


def test_a_second_run_loads_every_program_the_first_compiled(tmp_path):
    """Exact: no program of these steps is left out of the cache (JAX skips only programs with host callbacks, and
    these have none; every program is kept however small or quick to compile), and the second run's programs are
    the same (same flags, same jax, same devices), so each one the first run compiled is a load in the second."""
    cache = tmp_path / "cache"
    cold, summary = _run(tmp_path / "cold", f"--compilation_cache_dir={cache}")
    warm, _ = _run(tmp_path / "warm", f"--compilation_cache_dir={cache}")
    assert cold[0]["perf/compiles"] > 10 and cold[0]["timing_s/compile"] > 0
    assert [r["perf/compiles"] for r in warm] == [0, 0] and [r["timing_s/compile"] for r in warm] == [0, 0]
    assert [r["perf/compile_cache_hits"] for r in warm] == [r["perf/compiles"] for r in cold]
    assert os.listdir(cache)
    assert summary["config"]["run"]["compilation_cache_dir"] == str(cache) == summary["compilation"]["cache_dir"]
