"""The training loop that ``launch.main`` and notebooks share: data -> step -> metrics -> checkpoints.

    runner = Runner(config)          # builds tokenizer, data, params, engine, programs (no global state)
    for metrics in runner.run(10):   # yields each step's metrics (also written to <workdir>)
        ...
    summary = runner.finish()        # validation + greedy evaluation, run_summary.json, plots

Each step is one call into ``step.rl_step``; building a run is ``run.setup``, its memory policy and
report ``memory.policy``, its summary fields ``run.summary``. This module wires them, runs the loop and
writes outputs. A step that fails (a rollout past ``--rollout_timeout_s``: ``run.watchdog``; a reward error with
``--reward_failure=raise``) gives its batch back and leaves the state of the last finished step, which
``save_after_failure`` checkpoints (``launch.main`` does, then exits 1). From a flagfile:
``launch.api.runner_from_flagfile`` (flag parsing lives in ``launch``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from rollplex_jax.config import Config, ConfigError
from rollplex_jax.data import dataset as data_lib
from rollplex_jax.memory import policy as memory_policy
from rollplex_jax.memory.meter import MemoryMeter
from rollplex_jax.models.vl.fused import layout_record
from rollplex_jax.models.vl.params import params_sha256
from rollplex_jax.parallel import mesh as mesh_lib
from rollplex_jax.parallel import multihost
from rollplex_jax.programs.actor import make_programs
from rollplex_jax.programs.split import make_split_programs
from rollplex_jax.rl.rewards import RewardRunner, resolve_reward_fn
from rollplex_jax.run import compile_cache, compiles, outputs, validation
from rollplex_jax.run import setup as run_setup
from rollplex_jax.run import summary as run_summary
from rollplex_jax.run.checkpoint import Checkpointer
from rollplex_jax.run.watchdog import located
from rollplex_jax.step import rl_step
from rollplex_jax.trace import Tracer, plot_timeline, write_chrome_trace


class Runner:
    """One training run. Two runners in one process do not share any state.

    Args:
      cfg: the run's configuration.
      log: receives the runner's log lines (default: stderr).
      rebuild: ``(**flag overrides) -> Config`` for ``fork`` (``launch.api.runner_from_flagfile`` sets it).
    """

    def __init__(self, cfg: Config, *, log=None, rebuild: Callable[..., Config] | None = None):
        self.cfg, self.rebuild = cfg, rebuild
        compile_cache.use(cfg.run.compilation_cache_dir)  # before the run's first compilation
        self.procs = multihost.Processes.current()  # several: a jax.distributed job (launch.main starts it)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        if self.procs.many and log is None:
            self.log = lambda msg: print(f"[process {self.procs.index}] {msg}", file=sys.stderr, flush=True)
        self.workdir = os.path.abspath(cfg.run.workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self._build_data()
        run_setup.check_mesh(cfg, self.procs)
        self.cfg = cfg = run_setup.resolve_process_devices(self.cfg, self.procs)
        self._build_state()
        self._build_step()
        self.tracer = Tracer()
        self.checkpointer = Checkpointer(self.workdir, cfg.checkpoint.keep)
        self.step = 0
        self.history: list[dict] = []
        self.last: rl_step.StepResult | None = None
        self.last_prompts: list[data_lib.Example] = []
        self._stop_requested = False
        self._warned_reward = False
        self._steps_here = 0  # steps run by this process (a resumed run's first one compiles everything)
        self._t0 = time.perf_counter()
        self._resume_or_start()
        self.writer = outputs.MetricsWriter(self.workdir, keep_steps=self.step) if self.procs.writer else \
            outputs.NoWriter()

    def _build_data(self) -> None:
        cfg = self.cfg
        self.tokenizer = run_setup.tokenizer(cfg)
        load = functools.partial(run_setup.load_split, cfg, self.tokenizer, self.workdir, self.procs, log=self.log)
        self.train_set, self.train_report = load("train")
        self.eval_set = load("eval")[0] if cfg.data.has_validation else None  # --val_dataset, or synthetic ones
        self.last_validation: validation.Validation | None = None
        self.sampler = data_lib.PromptSampler(len(self.train_set), cfg.rl.batch_prompts, cfg.run.seed)
        self.cfg = cfg = run_setup.resolve_data_shapes(cfg, self.train_set)
        self.lengths = memory_policy.data_lengths(cfg, self.train_set)

    def _build_state(self) -> None:
        cfg = self.cfg
        source = f"loading the checkpoint {cfg.run.model_dir}" if cfg.run.model_dir else \
            f"random init (no --model_dir; seed {cfg.run.seed})"
        with run_setup.timed(self.log, f"model: {source}"):
            placed = run_setup.initial_params(cfg)
        self.mesh, self.shardings = placed.mesh, placed.shardings
        self.optimizer_policy = memory_policy.optimizer_policy(cfg, self.lengths, self.log)
        offload = self.optimizer_policy == "offload"
        self.programs = make_programs(cfg.model, cfg.rl, cfg.optim, cfg.run.steps, offload_optimizer=offload,
                                      optimizer_chunks=cfg.memory.optimizer_chunks if offload else 1,
                                      prog=cfg.programs, temperature=cfg.rollout.temperature)
        self.programs.optimizer.zero = cfg.mesh.zero_dp  # ZeRO-1 over dp (--optimizer_shard)
        with self.mesh_scope():
            opt_state = self.programs.optimizer.init(placed.params)
        self.state = rl_step.TrainState(placed.params, opt_state, placed.ref_params)
        self.check_sharding()

    def _build_step(self) -> None:
        cfg = self.cfg
        with run_setup.timed(self.log, f"engine: building --engine={cfg.rollout.engine}"):
            plan = memory_policy.plan_run(cfg, self.lengths, self.optimizer_policy) if cfg.rollout.engine == "vllm" \
                else None  # vLLM's share of the card (gpu_memory_utilization) comes from the plan
            self.engine = run_setup.make_engine(cfg, plan)
        self.meter = MemoryMeter(cfg.memory.measure_memory, engine_bytes=self._engine_own_bytes)
        fn, kwargs = resolve_reward_fn(cfg.rl.reward), cfg.rl.reward_kwargs_dict
        try:
            self.reward = RewardRunner(functools.partial(fn, **kwargs) if kwargs else fn,
                                       timeout_s=cfg.rl.reward_timeout_s, max_workers=cfg.rl.reward_workers,
                                       on_failure=cfg.rl.reward_failure)
        except ValueError as e:
            raise ConfigError(f"--reward={cfg.rl.reward!r} (--reward_kwargs={cfg.rl.reward_kwargs!r}): {e}") from None
        split = None
        if cfg.run.schedule == "rollplex":
            split = make_split_programs(cfg.model, cfg.rl, cfg.programs, temperature=cfg.rollout.temperature)
        if cfg.memory.measure_memory:
            self.programs, split = run_setup.tracked(self.meter, self.programs, split)
        self.ctx = rl_step.StepContext(
            cfg=cfg, programs=self.programs, engine=self.engine,
            publisher=run_setup.publisher(cfg, self.engine, self.mesh, self.procs, self.state.params),
            reward_fn=self.reward,
            decode=self.tokenizer.decode, stop_ids=tuple(sorted({self.tokenizer.eos_id, cfg.model.eos_token_id})),
            split=split, meter=self.meter, procs=self.procs)

    def _resume_or_start(self) -> None:
        latest = self.checkpointer.latest_step()
        if latest is not None and not self.cfg.run.resume:
            self.checkpointer.close()
            raise ConfigError(f"--workdir={self.cfg.run.workdir} already has checkpoints (latest: step {latest}); "
                              "pass --resume to continue that run, or choose another --workdir")
        if latest is not None:
            self._restore(latest)
            self.check_sharding()
        elif self.cfg.run.resume:
            self.log(f"resume: no checkpoint in {self.checkpointer.directory}; starting from step 0")

    def _restore(self, step: int) -> None:
        """Continues from checkpoint ``step``: train state, data position; metrics after it are dropped."""
        t0, saved, layout = time.perf_counter(), self.checkpointer.meta(step).get("param_layout"), \
            layout_record(self.cfg.model)
        if saved != layout:  # same shapes, other row order: restoring would silently scramble the weights
            raise ConfigError(f"checkpoint {step} in {self.checkpointer.directory} holds the actor's parameters in "
                              f"layout {saved} (models/vl/fused.py), this run's flags give {layout} "
                              "(from --train_tp, --rollout_tp, --engine): resume with the flags it was saved with")
        tree, meta = self.checkpointer.restore(step, _state_tree(self.state))
        self.state = rl_step.TrainState(tree["params"], self.programs.optimizer.place(tree["opt_state"]),
                                          self.state.ref_params)
        if self.params_sha256() != meta["params_sha256"]:
            raise RuntimeError(f"checkpoint {step} in {self.checkpointer.directory} is corrupt: its params do not "
                               "hash to the value recorded when it was saved")
        self.sampler = data_lib.PromptSampler.from_state(meta["sampler"], n_examples=len(self.train_set))
        self.step = int(meta["step"])
        self.history = [r for r in outputs.read_metrics(self.workdir) if r["step"] <= self.step] \
            if os.path.exists(os.path.join(self.workdir, "metrics.jsonl")) else []
        self.log(f"resume: continuing from the checkpoint of step {self.step} in {self.checkpointer.directory} "
                 f"(restored in {time.perf_counter() - t0:.1f} s)")

    # --- state ---------------------------------------------------------------------------------------
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
        if s.ref_params is not None:
            mesh_lib.check_sharded(s.ref_params, self.shardings, "reference params")
        state = mesh_lib.zero_shardings(self.shardings, self.cfg.model) if self.cfg.mesh.zero_dp else self.shardings
        mesh_lib.check_sharded(mesh_lib.per_param_leaves(s.opt_state, state), state, "optimizer state tensors")

    def _engine_own_bytes(self) -> int:
        """Bytes of weight tensors the engine owns (rebuilt, not views of the actor's buffers)."""
        try:
            return int(self.engine.sharing_report().extra_bytes)
        except RuntimeError:  # not bound yet
            return 0

    # --- the loop ----------------------------------------------------------------------------------
    def run(self, steps: int | None = None):
        """Runs ``steps`` more steps (default: up to cfg.run.steps), yielding each step's metrics."""
        target = self.cfg.run.steps if steps is None else self.step + steps
        bar = outputs.progress_bar(target - self.step) if self.cfg.run.progress and target > self.step else None
        if self.step == 0 and self.cfg.run.val_before_train and self.eval_set and \
                not any(r["step"] == 0 for r in self.history):
            self._record(0, self.validate())
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
        """One RL step of the configured schedule; its metrics (also written to metrics.jsonl)."""
        position = self.sampler.state()  # a failed step gives its batch back (save_after_failure saves it)
        batch = [self.train_set[i] for i in self.sampler.next_indices()]
        prompts = data_lib.collate(batch, self.tokenizer.pad_id)
        step_fn = rl_step.rollplex_step if self.cfg.run.schedule == "rollplex" else rl_step.serial_step
        first = self.last is None  # this process's first step: jit compiles its programs
        if first:
            cached = " or loads them from --compilation_cache_dir" if self.cfg.run.compilation_cache_dir else ""
            self.log(f"step {self.step + 1}: the first step compiles its programs (XLA){cached}: this takes a while")
        t0 = time.perf_counter()
        self._steps_here += 1
        try:
            with self.mesh_scope(), located(f"step {self.step + 1}"), \
                    compiles.watch(self.step + 1, nth=self._steps_here) as compiled:
                result = step_fn(self.ctx, self.state, prompts, [e.answer for e in batch], seed=self._seed(self.step),
                                 step=self.step, tracer=self.tracer, extras=[getattr(e, "extra", {}) for e in batch])
        except BaseException:
            self.sampler = data_lib.PromptSampler.from_state(position)
            raise
        if first:
            self.log(f"step {self.step + 1}: done in {time.perf_counter() - t0:.1f} s ({compiled.summary()})")
        compiles.warn_if_late(compiled)
        self.state, self.last, self.last_prompts = result.state, result, batch
        self.step += 1
        metrics = {**result.metrics, **compiled.metrics()}
        if metrics.get("reward/failures") and not self._warned_reward:
            self._warned_reward = True
            self.log(f"warning: step {self.step}: the reward function failed on {int(metrics['reward/failures'])} "
                     f"answer(s) (exception or timeout > {self.cfg.rl.reward_timeout_s}s); they got reward 0. "
                     "Counted per step in reward/failures; --reward_failure=raise stops on the first one.")
        for key in ("skipped_steps/no_signal", "skipped_steps/nonfinite"):
            prev = self.history[-1].get(key + "_total", 0.0) if self.history else 0.0
            metrics[key + "_total"] = prev + metrics.get(key, 0.0)
        metrics.update(self.meter.step_metrics())
        every = self.cfg.run.val_every
        if every and self.step % every == 0 and self.eval_set:
            metrics.update(self.validate())
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
                "config": self.cfg.to_dict(), "param_layout": layout_record(self.cfg.model)}
        self.checkpointer.save(self.step, _state_tree(self.state), meta)

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

    def save_after_failure(self) -> str:
        """After an error out of ``run`` / ``train_step``: a checkpoint of the last finished step (waited for) when
        there is one to keep; returns what was done, in words (``launch.main`` prints it, then exits 1).

        The failed step leaves ``state`` as the last finished step wrote it unless its update had started: a rollout
        timeout or a reward error strikes before; an update that failed after donating the state left its buffers
        deleted, which is checked. Not with several processes: a save is collective, and the others may be stuck
        elsewhere (their periodic checkpoints, ``--checkpoint_every``, stand).
        """
        if self.step == 0:
            return "checkpoint: none written (no step had finished)"
        if self.procs.many:
            return (f"checkpoint: none written after the failure (a save is collective over the {self.procs.count} "
                    f"processes); the last periodic one: step {self.checkpointer.latest_step()}")
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(_state_tree(self.state))):
            return (f"checkpoint: none written (the failed step's update had consumed the train state); the last "
                    f"periodic one: step {self.checkpointer.latest_step()}")
        self.save()
        self.checkpointer.wait()
        return (f"checkpoint: step {self.step} (the last finished step) saved in {self.checkpointer.directory}; "
                "rerun with --resume to continue from it")

    def _seed(self, step: int) -> int:
        return self.cfg.run.seed * 1_000_003 + step

    # --- validation, evaluation and summary (validation.py) ----------------------------------------
    def validate(self, *, temperature: float | None = None, log_generations: bool = True) -> dict:
        """Validation now: one answer per held-out prompt (each process its share), greedy at ``--val_temperature=0``
        else sampled with the run's fixed validation seed; returns the ``val/*`` metrics ({} without prompts) and
        logs the first ``--val_generations_to_log`` answers. ``temperature`` overrides ``--val_temperature``."""
        if not self.eval_set:
            return {}
        r = self.cfg.run
        t = r.val_temperature if temperature is None else float(temperature)
        val = validation.ValPrompts(self.eval_set, self.reward, self.tokenizer.pad_id, validation.val_seed(r.seed),
                                    self.mesh_scope)
        with located(f"validation at step {self.step}"):
            v = validation.validate(self.ctx, self.state.params, val, step=self.step, temperature=t,
                                    n_log=r.val_generations_to_log if log_generations else 0)
        if self.procs.writer:
            validation.write_generations(self.workdir, v.generations, self.log)
        self.last_validation = v
        return dict(v.metrics)

    def evaluate(self) -> dict:
        """Greedy validation on the held-out prompts: ``eval/greedy_accuracy`` (= its ``val/accuracy``) and
        ``eval/n``; the last validation when it was greedy at this step, else a new one."""
        if not self.eval_set:
            return {}
        v = self.last_validation
        m = v.metrics if v is not None and (v.step, v.temperature) == (self.step, 0.0) else \
            self.validate(temperature=0.0, log_generations=False)
        return {"eval/greedy_accuracy": m["val/accuracy"], "eval/n": int(m["val/n"])}

    def _record(self, step: int, metrics: dict) -> None:
        """Adds ``metrics`` to the row of ``step`` (metrics.jsonl and history): that row when it is the last one,
        else a new row."""
        self.writer.amend(step, metrics)
        if self.history and self.history[-1]["step"] == step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"step": step, **metrics})

    def finish(self) -> dict:
        """Validates at the final step (unless it just did), evaluates greedily, writes run_summary.json and plots,
        saves a final checkpoint; returns the summary."""
        val = {}
        if self.eval_set:
            v = self.last_validation
            val = v.metrics if v is not None and v.step == self.step else self.validate()
            self._record(self.step, val)
        ev = self.evaluate()
        self.save()
        summary = {"config": self.cfg.to_dict(), "versions": run_summary.versions(),
                   "device_kind": jax.devices()[0].device_kind, "steps_done": self.step,
                   **run_summary.reward_summary(self.history), **ev, **val, "params_sha256": self.params_sha256(),
                   "weight_sharing": run_summary.sharing_summary(self.ctx.publisher.report(),
                                                                 self.ctx.publisher.gather),
                   "memory": self.memory_report(), "data": {"train": self.train_report.to_dict()},
                   "compilation": run_summary.compile_summary(self.cfg.run.compilation_cache_dir, self.history),
                   "wall_s": time.perf_counter() - self._t0}
        if self.procs.many:
            summary["processes"] = self.procs.count
        if self.procs.writer:  # process 0 writes the run's files
            self._write_outputs(summary, ev)
        self.close()
        return summary

    def _write_outputs(self, summary: dict, ev: dict) -> None:
        outputs.write_summary(self.workdir, summary)
        if self.history:
            outputs.plot_reward(self.history, os.path.join(self.workdir, "plots", "reward.png"),
                                eval_accuracy=ev.get("eval/greedy_accuracy"), reward_name=self.cfg.rl.reward)
            if any(k.startswith("memory/") for k in self.history[-1]):
                outputs.plot_memory(self.history, os.path.join(self.workdir, "plots", "memory.png"),
                            title=f"{self.cfg.run.schedule}: device memory per phase (at each phase's peak step)")
        self.write_timeline()

    def memory_report(self) -> dict:
        """Measured peak per phase (busiest device) and, for the rollplex schedule, the planner's prediction."""
        return memory_policy.memory_report(self.cfg, self.history, self.lengths, self.optimizer_policy)

    def close(self) -> None:
        """Releases files and threads without evaluating (``finish`` calls it)."""
        self.ctx.publisher.join()  # a weight refill in flight reads the params
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

    # --- the Python API for notebooks and scripts ----------------------------------------------------
    def fork(self, workdir: str | os.PathLike, *, log=None, **overrides) -> Runner:
        """A new runner in ``workdir`` that continues from this one's current step with some flags changed.

            rollplex = serial.fork("runs/nb_rollplex", schedule="rollplex")   # same params, optimizer, data position

        Saves a checkpoint of the current step (waited for) and copies it, with metrics.jsonl up to it, into
        ``workdir`` (which must not have checkpoints yet); the new runner resumes from it, configured by
        ``rebuild(**overrides, workdir=workdir, resume=True)`` (runners made by
        ``launch.api.runner_from_flagfile``: the same flagfile and overrides plus these).
        """
        if self.rebuild is None:
            raise ValueError("fork() needs a runner made with rebuild= (launch.api.runner_from_flagfile sets it)")
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
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps({k: outputs._jsonable(v) for k, v in r.items()}) + "\n"
                         for r in self.history if r["step"] <= step)
        rebuild = self.rebuild
        cfg = rebuild(**{**overrides, "workdir": workdir, "resume": True})
        return Runner(cfg, log=log or self.log, rebuild=lambda **o: rebuild(**{**overrides, **o}))

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


def _state_tree(state: rl_step.TrainState) -> dict:
    return {"params": state.params, "opt_state": state.opt_state}
