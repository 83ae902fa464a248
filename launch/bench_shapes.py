"""Issue 30's benchmark: does data with images of mixed sizes train as fast as the same rows at one size?

  python -m launch.bench_shapes [--steps=30] [--out=runs/bench_shapes] [--fixed_size=250]
                                [--run_flags="--shape_buckets=off"]

Why a benchmark of its own: every new batch shape is a new XLA program, and real data (geometry3k: one image per
prompt, 80-420 px a side, questions of varied length) brings new shapes nearly every step, so a run compiles
every step. ``launch.bench`` times one synthetic task; this one times three fresh ``launch.main`` processes, as a
user runs them, with ``configs/bench_shapes_cpu.flags``:

- (a) ``mixed``: ``launch.make_dataset --task=mixed_count`` (each image 80-420 px wide and high), with an empty
  persistent compilation cache under ``--out``;
- (b) ``fixed``: the same rows with every image ``--fixed_size`` px square, with another empty cache;
- (c) ``rerun``: (a) again in a new process on (a)'s cache (what a restarted job or the next run pays).

The data and a tiny model with a small Qwen-like BPE tokenizer (``launch.make_tiny_checkpoint
--with_tokenizer``) are written under ``--out`` when missing. Prints one JSON line (also ``OUT/bench_shapes.json``):
the steady-state (steps 6 on) median seconds per step of (a) and (b) and their ratio (and of (c): what the cache
alone saves, as tracing and lowering each new shape remain), the compilations over steps 6 on of (a)
(``perf/compiles``), its mean ``perf/padding_frac``, the first step's seconds of (a) and (c) and their ratio,
each against its target. A key a run's metrics.jsonl lacks is reported as null and named under
``missing_keys``. ``log_compiles`` counts, per run, the XLA programs JAX logged as compiled or loaded from the
cache (``JAX_LOG_COMPILES``), whichever metrics the run writes.

The cache goes to each run as ``--compilation_cache_dir`` where ``launch.flags`` defines that flag, and always
as ``JAX_COMPILATION_CACHE_DIR`` (with every entry kept: the tiny model's programs compile in under JAX's 1 s
default threshold).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from absl import app, flags

from launch.flags import REPO_ROOT

FLAGFILE = "configs/bench_shapes_cpu.flags"
MODEL_CONFIG = "configs/models/tiny.json"
STEADY_FROM = 6  # steps 1-5 compile what any run must; the steady state is what follows
# metric -> largest value that passes (issue 30)
TARGETS = {"ratio_mixed_fixed": 1.3, "compiles_after_5": 6, "padding_frac": 0.25, "rerun_over_cold_first": 0.3}
RUN_KEYS = ("timing_s/step", "perf/padding_frac", "perf/compiles", "timing_s/compile")
_COMPILE_LINE = re.compile(r"Finished XLA compilation of .*? in ([0-9.eE+-]+) sec")



def define_flags() -> None:
    """This entry point's flags, defined when it runs (not at import: the test imports ``summarise``)."""
    flags.DEFINE_integer("steps", 30, "Training steps of each run.", lower_bound=1)
    flags.DEFINE_string("out", "runs/bench_shapes", "Directory of the data, model, caches, runs and JSON.")
    flags.DEFINE_integer("fixed_size", 250, "Side in px of every image of the fixed-size twin.", lower_bound=28)
    flags.DEFINE_integer("n", 256, "Rows of each dataset.", lower_bound=4)
    flags.DEFINE_integer("data_seed", 0, "Seed of the datasets.", lower_bound=0)
    flags.DEFINE_string("run_flags", "", "Extra launch.main flags for every run (shell words), for A/B figures, "
                        "e.g. --run_flags='--shape_buckets=off'.")


def ensure_data(out: str, n: int, seed: int, fixed_size: int) -> tuple[str, str]:
    """The mixed and fixed-size parquet files under ``out/data`` (named by what decides them), written if missing."""
    from rollplex_jax.data import synthetic_mixed

    paths = []
    for size in (0, fixed_size):
        name = f"mixed_n{n}_s{seed}" if not size else f"fixed{size}_n{n}_s{seed}"
        path = os.path.join(out, "data", name, "train.parquet")
        if not os.path.exists(path):
            synthetic_mixed.write_parquet(path, n, seed, size)
        paths.append(path)
    return paths[0], paths[1]


def ensure_model(out: str) -> str:
    """``out/model``: the tiny model with a BPE tokenizer (``make_tiny_checkpoint.write_model_dir``), written if its
    weights are missing (they are written last)."""
    path = os.path.join(out, "model")
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        from launch.make_tiny_checkpoint import write_model_dir
        from rollplex_jax.config import ModelConfig

        write_model_dir(path, ModelConfig.from_json_file(REPO_ROOT / MODEL_CONFIG), with_tokenizer=True)
    return path


def cache_flag_defined() -> bool:
    """Whether ``launch.main`` has ``--compilation_cache_dir`` (issue 30's persistent cache flag)."""
    from launch import flags as launch_flags

    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    return "compilation_cache_dir" in fv


def run_main(out: str, name: str, args: list[str], cache_dir: str, cache_flag: bool) -> dict:
    """Runs ``launch.main`` with ``FLAGFILE`` and ``args`` into ``out/name`` (cleared first) on the cache
    ``cache_dir``, logging to ``out/name.log``; returns its wall seconds, metrics rows and log-counted compiles."""
    workdir, log = os.path.join(out, name), os.path.join(out, f"{name}.log")
    shutil.rmtree(workdir, ignore_errors=True)
    cmd = [sys.executable, "-m", "launch.main", f"--flagfile={FLAGFILE}", f"--workdir={workdir}", *args]
    if cache_flag:
        cmd.append(f"--compilation_cache_dir={cache_dir}")
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1", JAX_LOG_COMPILES="1")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    with open(log) as f:
        text = f.read()
    if rc != 0:
        raise RuntimeError(f"run {name!r} failed (exit {rc}); the end of {log}:\n{text[-3000:]}")
    seconds = [float(s) for s in _COMPILE_LINE.findall(text)]
    return {"wall_s": wall, "rows": read_rows(os.path.join(workdir, "metrics.jsonl")),
            "log_compiles": {"count": len(seconds), "seconds": round(sum(seconds), 3)}}


def read_rows(path: str) -> list[dict]:
    """The training rows of a metrics.jsonl (those with ``timing_s/step``; a validation-only row has none)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "timing_s/step" in r]


def _values(rows: list[dict], key: str, first: int = 1) -> list[float] | None:
    """``key`` of the rows from step ``first`` on; None when a row lacks it (or no row is there)."""
    picked = [r for r in rows if r["step"] >= first]
    if not picked or any(r.get(key) is None for r in picked):
        return None
    return [float(r[key]) for r in picked]


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _first_step_s(rows: list[dict]) -> float | None:
    first = [r for r in rows if r["step"] == min((r["step"] for r in rows), default=None)]
    return float(first[0]["timing_s/step"]) if first else None


def summarise(mixed: list[dict], fixed: list[dict], rerun: list[dict], steady_from: int = STEADY_FROM) -> dict:
    """The benchmark's figures from the training rows of the three runs (module docstring); None where a run's
    rows lack the key or the run is too short, with the lacking keys listed per run under ``missing_keys``."""
    steady = {name: _values(rows, "timing_s/step", steady_from)
              for name, rows in (("mixed", mixed), ("fixed", fixed), ("rerun", rerun))}
    median = {name: statistics.median(v) if v else None for name, v in steady.items()}
    compiles = _values(mixed, "perf/compiles", steady_from)
    compile_s = _values(mixed, "timing_s/compile", steady_from)
    padding = _values(mixed, "perf/padding_frac")
    cold, warm = _first_step_s(mixed), _first_step_s(rerun)
    out = {"steps": max((r["step"] for r in mixed), default=0), "steady_from_step": steady_from,
           "mixed_s_per_step": median["mixed"], "fixed_s_per_step": median["fixed"],
           "ratio_mixed_fixed": _ratio(median["mixed"], median["fixed"]), "rerun_s_per_step": median["rerun"],
           "compiles_after_5": sum(compiles) if compiles is not None else None,
           "compile_s_after_5": sum(compile_s) if compile_s is not None else None,
           "padding_frac": statistics.fmean(padding) if padding else None,
           "cold_first_step_s": cold, "rerun_first_step_s": warm, "rerun_over_cold_first": _ratio(warm, cold)}
    out = {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
    out["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()}
    out["pass"] = {k: None if out[k] is None else out[k] <= v for k, v in TARGETS.items()}
    out["missing_keys"] = {name: [k for k in RUN_KEYS if not rows or any(k not in r for r in rows)]
                           for name, rows in (("mixed", mixed), ("fixed", fixed), ("rerun", rerun))}
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    fv = flags.FLAGS
    out = os.path.abspath(fv.out)
    os.makedirs(out, exist_ok=True)
    mixed_data, fixed_data = ensure_data(out, fv.n, fv.data_seed, fv.fixed_size)
    model = ensure_model(out)
    cache_flag = cache_flag_defined()
    common = [f"--model_dir={model}", f"--steps={fv.steps}", *shlex.split(fv.run_flags)]
    caches = {name: os.path.join(out, "cache", name) for name in ("mixed", "fixed")}
    for path in caches.values():
        shutil.rmtree(path, ignore_errors=True)  # cold: an empty cache
    plan = (("mixed", mixed_data, caches["mixed"]), ("fixed", fixed_data, caches["fixed"]),
            ("rerun", mixed_data, caches["mixed"]))
    runs = {}
    for name, data, cache in plan:
        runs[name] = run_main(out, name, [*common, f"--dataset={data}"], cache, cache_flag)
        print(f"bench_shapes: run {name} done in {runs[name]['wall_s']:.1f} s", file=sys.stderr)
    result = summarise(runs["mixed"]["rows"], runs["fixed"]["rows"], runs["rerun"]["rows"])
    result["runs"] = {name: {"wall_s": round(r["wall_s"], 1), "log_compiles": r["log_compiles"]}
                      for name, r in runs.items()}
    result["run_flags"] = fv.run_flags
    result["compilation_cache_dir_flag"] = cache_flag
    line = json.dumps(result)
    with open(os.path.join(out, "bench_shapes.json"), "w") as f:
        f.write(line + "\n")
    print(line)


if __name__ == "__main__":
    define_flags()
    app.run(main)
