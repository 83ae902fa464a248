"""The Python API notebooks use: launch.api.runner_from_flagfile, samples, metrics_frame, timeline; no global state."""

import os

import numpy as np
import pytest
from absl import app, flags  # noqa: F401  (absl.app defines its own flags on flags.FLAGS when imported)

from launch import flags as launch_flags  # noqa: F401  (imported before the snapshot of flags.FLAGS below)
from launch.api import config_from_flagfile, runner_from_flagfile
from rollplex_jax.config import ConfigError
from rollplex_jax.models.vl.params import params_sha256
from rollplex_jax.run.outputs import read_metrics
from tests.paths import REPO
from tests.reward_fns import length_parity

# configs/tiny_cpu.flags shrunk to seconds; a reward with variance inside groups, so every step updates.
TINY = dict(steps=2, synthetic_n=16, eval_n=0, batch_prompts=2, group_size=4, micro_batch=8, checkpoint_every=0,
            reward="tests.reward_fns:length_parity", progress=False)


def _quiet(msg):
    pass


def test_from_flagfile_parses_on_fresh_flag_values(tmp_path, monkeypatch):
    names = set(flags.FLAGS)
    monkeypatch.chdir(tmp_path)  # the relative flagfile (and its model config) resolve against the repo root
    a = config_from_flagfile("configs/tiny_cpu.flags", steps=5, workdir=tmp_path / "a", schedule="rollplex",
                             prefix_sharing=False, progress=False)
    b = config_from_flagfile("configs/tiny_cpu.flags", steps=7, schedule="serial")  # a second parse, same process
    assert (a.run.steps, a.run.workdir, a.run.schedule) == (5, str(tmp_path / "a"), "rollplex")
    assert (a.run.prefix_sharing, a.run.progress) == (False, False)
    assert (b.run.steps, b.run.workdir, b.run.schedule, b.run.prefix_sharing) == (7, "runs/tiny_cpu", "serial", True)
    assert a.rl.batch_prompts == b.rl.batch_prompts == 16  # the flagfile's values
    assert set(flags.FLAGS) == names  # absl's global flags untouched
    same = config_from_flagfile(REPO / "configs" / "tiny_cpu.flags", steps=7, schedule="serial")
    assert same == b


def test_from_flagfile_errors_name_the_problem():
    with pytest.raises(ConfigError, match="not found"):
        config_from_flagfile("configs/no_such.flags")
    with pytest.raises(ConfigError, match="stepz"):
        config_from_flagfile("configs/tiny_cpu.flags", stepz=3)
    with pytest.raises(ConfigError, match="--group_size=1"):
        config_from_flagfile("configs/tiny_cpu.flags", group_size=1)


def test_a_real_checkpoint_gets_easyr1_defaults_and_the_demos_state_theirs(tmp_path):
    """--model_dir alone fine-tunes with EasyR1's optimizer defaults (examples/config.yaml, worker.actor.optim:
    lr 1e-6, weight decay 1e-2, constant schedule, no warm-up; betas 0.9/0.999, clip 1.0); the demo flagfiles, which
    train a random model from scratch, state their own lr, schedule and weight decay."""
    import json

    from rollplex_jax.config import ModelConfig

    ckpt = tmp_path / "ckpt"  # parsing reads only config.json
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(ModelConfig.from_json_file(REPO / "configs/models/demo.json")
                                                 .to_hf_dict()))
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["rollplex", f"--model_dir={ckpt}"])
    o = launch_flags.config_from_flags(fv).optim
    assert (o.lr, o.weight_decay, o.lr_schedule, o.warmup_steps) == (1e-6, 1e-2, "constant", 0)
    assert (o.b1, o.b2, o.grad_clip) == (0.9, 0.999, 1.0)
    for name in ("tiny_cpu", "video_cpu"):
        text = (REPO / "configs" / f"{name}.flags").read_text()
        assert all(f"\n--{flag}=" in text for flag in ("lr", "lr_schedule", "weight_decay")), name
        o = config_from_flagfile(f"configs/{name}.flags").optim
        assert (o.lr, o.weight_decay, o.lr_schedule) == (5e-4, 0.0, "cosine"), name


def _comparable(rows):
    # time/*, timing_s/* and perf/ rates are wall clock; memory/* is live device memory of the process, which two
    # runners share, and so are the compilations (perf/compiles, perf/compile_cache_hits): the second runner's
    # programs may be in the first's caches.
    skip = ("time/", "timing_s/", "perf/time_per_step", "perf/throughput", "memory/", "perf/compile")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


def test_two_runners_interleave_and_match_their_solo_runs(tmp_path):
    solo = {}
    for schedule in ("serial", "rollplex"):
        r = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path / f"solo_{schedule}", schedule=schedule,
                                 log=_quiet, **TINY)
        solo[schedule] = (_comparable(list(r.run())), params_sha256(r.state.params))
        r.close()

    a = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path / "a", schedule="serial", log=_quiet, **TINY)
    initial = params_sha256(a.state.params)
    b = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path / "b", schedule="rollplex", log=_quiet, **TINY)
    ma, mb = [], []
    for _ in range(2):  # step by step, alternating
        ma += a.run(1)
        mb += b.run(1)
    assert (a.step, b.step) == (2, 2)
    assert _comparable(ma) == solo["serial"][0]
    assert _comparable(mb) == solo["rollplex"][0]
    assert params_sha256(a.state.params) == solo["serial"][1]
    assert params_sha256(b.state.params) == solo["rollplex"][1]
    assert solo["serial"][1] != initial  # the steps did update

    for r in (a, b):
        s = r.samples(load_images=True)
        assert len(s) == 2 and len(r.samples(1)) == 1
        for row in s:
            assert row["step"] == 2 and row["prompt"] and row["answer"]
            assert len(row["responses"]) == len(row["rewards"]) == 4
            assert row["rewards"] == [length_parity(t, row["answer"]) for t in row["responses"]]
            assert row["reward_mean"] == pytest.approx(np.mean(row["rewards"]))
            assert row["images"] and all(os.path.isfile(p) for p in row["images"])
            assert [im.size for im in row["pil"]] == [(56, 56)] * len(row["images"])
        assert np.mean([row["rewards"] for row in s]) == pytest.approx(r.history[-1]["reward/mean"])

        frame = r.metrics_frame()
        assert frame["step"].tolist() == [1, 2]
        assert frame["reward/mean"].tolist() == [h["reward/mean"] for h in r.history]
        spans = r.timeline()
        assert {s.step for s in spans} == {0, 1} and {"rollout", "reward"} <= {s.name for s in spans}
        assert {s.step for s in r.timeline(last_steps=1)} == {1}
        r.close()
    assert a.workdir != b.workdir and os.path.exists(os.path.join(b.workdir, "metrics.jsonl"))


def test_fork_continues_the_same_state_in_another_workdir(tmp_path):
    a = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path / "a", schedule="serial", log=_quiet,
                             **{**TINY, "steps": 3})
    list(a.run(1))
    with pytest.raises(ValueError, match="another workdir"):
        a.fork(tmp_path / "a")
    b = a.fork(tmp_path / "b")  # same flags: must then take exactly the steps a takes
    assert (b.step, b.workdir, b.cfg.run.resume) == (1, str(tmp_path / "b"), True)
    assert params_sha256(b.state.params) == params_sha256(a.state.params)
    assert b.history == a.history
    ma, mb = list(a.run()), list(b.run())
    assert len(ma) == 2 and _comparable(mb) == _comparable(ma)
    assert params_sha256(b.state.params) == params_sha256(a.state.params)
    assert [r["step"] for r in read_metrics(str(tmp_path / "b"))] == [1, 2, 3]
    a.close()
    b.close()


def test_plot_helpers_and_readme_figures(tmp_path):
    from matplotlib.figure import Figure

    from launch.readme_figures import spans_from_chrome_trace
    from rollplex_jax.run import outputs
    from rollplex_jax.trace import Tracer, write_chrome_trace

    rows = [{"step": i + 1, "reward/mean": min(1.0, i / 10), "skipped_steps/no_signal": float(i == 0)}
            for i in range(12)]
    assert os.path.getsize(outputs.plot_reward(rows, str(tmp_path / "r.png"), eval_accuracy=0.9)) > 1000
    cols = outputs.metrics_columns([{"step": 1, "a": 1}, {"step": 2, "a": "nan", "b": 2.0}])
    assert cols["step"].tolist() == [1, 2] and np.isnan(cols["a"][1]) and np.isnan(cols["b"][0])

    mem = [{"step": 1, "memory/train_peak_bytes": 3 * 2**20, "memory/train/activations_bytes": 2 * 2**20,
            "memory/rollout/compute_weights_bytes": 2**20, "memory/rollout_peak_bytes": 2**20}]
    assert list(outputs.memory_by_phase(mem)) == ["rollout", "train"]  # step order
    assert outputs.memory_by_phase(mem)["train"] == {"peak_bytes": 3 * 2**20, "classes": {"activations": 2 * 2**20}}
    ax = Figure().subplots()
    assert outputs.draw_memory(ax, mem) and ax.get_ylabel() == "device memory (MiB)"
    assert not outputs.draw_memory(Figure().subplots(), rows)

    tracer = Tracer()
    tracer.add("torch decode", "rollout", 0, 0.0, 0.5)
    tracer.add("update", "update", 1, 0.6, 0.7, note="x")
    write_chrome_trace(tracer.spans, tmp_path / "trace.json")
    assert spans_from_chrome_trace(str(tmp_path / "trace.json")) == tracer.spans


@pytest.mark.parametrize("engine, flags, procs, env, match", [
    ("hf", {}, 1, {}, "has no tensor parallelism; tensor-parallel decoding needs --engine=vllm"),
    ("vllm", {}, 1, {}, "one vLLM rank per process, one process per device: this job has 1 process"),
    ("vllm", {"train_tp": 2}, 2, {"SLURM_STEP_TASKS_PER_NODE": "3(x2)"}, "must not span nodes, but 3 tasks"),
    ("vllm", {"train_dp": 2}, 1, {}, "one vLLM rank per process, one process per device: this job has 1"),
])
def test_rollout_tp_refusals_name_the_flag(engine, flags, procs, env, match):
    """Issue 33 item 4: the transformers engine refuses --rollout_tp > 1 naming vLLM; vLLM's TP ranks need one
    process per device, groups inside a node, and each rank's own device's shards (before any model is built)."""
    from rollplex_jax.parallel.multihost import Processes
    from rollplex_jax.run.setup import _check_rollout_tp

    cfg = config_from_flagfile("configs/tiny_cpu.flags", rollout_tp=2, engine=engine, **flags)
    with pytest.raises(ConfigError, match=match):
        _check_rollout_tp(cfg, Processes(0, procs), env)


def test_vllm_engine_refuses_a_family_without_its_binding(monkeypatch):
    """--engine=vllm starts for both families; for a family whose vLLM module the runtime does not bind
    (``Family.vllm_engine`` False: a family added with its planner layout only) it stops at start naming
    --engine=hf, not deep in the first bind."""
    import dataclasses

    from rollplex_jax.models import family
    from rollplex_jax.parallel.multihost import Processes
    from rollplex_jax.run.setup import check_mesh

    cfg = config_from_flagfile("configs/tiny_qwen3_vl_cpu.flags", engine="vllm")
    assert cfg.model.family == "qwen3_vl"
    check_mesh(cfg, Processes())
    monkeypatch.setitem(family.FAMILY, "qwen3_vl", dataclasses.replace(family.FAMILY["qwen3_vl"], vllm_engine=False))
    with pytest.raises(ConfigError, match="use --engine=hf"):
        check_mesh(cfg, Processes())


def test_vllm_refuses_videos_at_load_for_a_family_it_runs_on_images_only(tmp_path, monkeypatch):
    """vLLM runs Qwen3-VL on images only (``Family.vllm_videos``): a training set with videos stops when it is
    loaded (before any program or engine is built), naming the file, the count and --engine=hf. Shown on the tiny
    Qwen2.5-VL's synthetic videos with its family marked images-only (the tiny Qwen3-VL's word-level tokenizer has
    no words for Qwen3-VL's "<0.2 seconds>" timestamps; a real Qwen3-VL tokenizer has)."""
    import dataclasses

    from rollplex_jax.models import family

    monkeypatch.setitem(family.FAMILY, "qwen2_5_vl",
                        dataclasses.replace(family.FAMILY["qwen2_5_vl"], vllm_videos=False))
    with pytest.raises(ConfigError, match=r"data\.jsonl: \d+ videos.*--engine=hf"):
        runner_from_flagfile("configs/video_cpu.flags", workdir=tmp_path, engine="vllm", synthetic_n=8, eval_n=4,
                             log=_quiet)
