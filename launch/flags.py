"""Every absl flag of the project, and the one function that turns them into a ``Config``.

Flags are defined inside ``define_flags`` (not at import) so tests can define them
on a fresh ``flags.FlagValues()``. Bad values fail at parse time where absl can
check them (enums, bounds, validators); anything ``rollplex_jax.config`` rejects
while building the ``Config`` is re-raised as ``app.UsageError`` naming the flag.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from absl import app, flags

from rollplex_jax import config as C
from rollplex_jax.config import DTYPES, Config, ConfigError, DataConfig, ModelConfig, RunConfig
from rollplex_jax.models.vl.fused import param_layout

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent

# ConfigError field name -> the flag that sets it (model.* / vision.* / text.* come from the model file).
_FIELD_TO_FLAG = {
    "model.dtype": "dtype",
    "data.min_pixels": "min_pixels",
    "data.max_pixels": "max_pixels",
    "data.max_prompt_len": "max_prompt_len",
    "run.steps": "steps",
    "run.seed": "seed",
    "run.workdir": "workdir",
    "run.model_dir": "model_dir",
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines all flags on ``flag_values``; a second call on the same object is a no-op."""
    if "model_config" in flag_values:
        return
    fv = dict(flag_values=flag_values)
    data, run = DataConfig(), RunConfig()

    # --- model ---------------------------------------------------------------------------
    flags.DEFINE_string(
        "model_config", "configs/models/demo.json",
        "Path to a Qwen2.5-VL Hugging Face style config.json (random init from it). Relative paths "
        "are looked up in the current directory, then in the repo root. Ignored when --model_dir is set.", **fv)
    flags.DEFINE_string(
        "model_dir", run.model_dir,
        "A local Hugging Face checkpoint directory; when set, the model config is read from "
        "<model_dir>/config.json and --model_config is ignored. Empty = random init.", **fv)
    flags.DEFINE_enum("dtype", "float32", list(DTYPES), "Parameter and compute dtype.", **fv)

    # --- run -----------------------------------------------------------------------------
    flags.DEFINE_string("workdir", run.workdir, "Directory the run writes metrics, traces and checkpoints to.", **fv)
    flags.DEFINE_integer("seed", run.seed, "Random seed (params init, sampling, data order).", lower_bound=0, **fv)
    flags.DEFINE_integer("steps", run.steps, "Number of training steps.", lower_bound=0, **fv)
    flags.DEFINE_string(
        "compilation_cache_dir", C.default_compilation_cache_dir(),
        "Persistent XLA compilation cache: compiled programs are kept in this directory and loaded by later runs "
        "instead of compiled again (metrics perf/compiles, perf/compile_cache_hits). Default: "
        "$XDG_CACHE_HOME/rollplex_jax/xla, else ~/.cache/rollplex_jax/xla (resolved when the flags are defined). "
        "Empty = no cache. The cache is trusted code: anyone who can write to the directory can run code in "
        "this process, so keep it per user, never in a directory others can write to. Delete it to clear it.", **fv)

    # --- data ----------------------------------------------------------------------------
    flags.DEFINE_integer("min_pixels", data.min_pixels, "Lower bound on image pixels after smart_resize.",
                         lower_bound=1, **fv)
    flags.DEFINE_integer("max_pixels", data.max_pixels,
                         "Upper bound on image pixels after smart_resize; must be >= --min_pixels.",
                         lower_bound=1, **fv)
    flags.DEFINE_integer("max_prompt_len", data.max_prompt_len, "Longest prompt in tokens (image tokens included).",
                         lower_bound=1, **fv)

    # --- every other Config field: one flag each, named as the field (see _RENAMES) -----------
    for section, cls in _SECTIONS.items():
        for field in dataclasses.fields(cls):
            name = _flag_name(section, field.name)
            if name in flag_values:
                continue
            default, help_ = getattr(cls(), field.name), _HELP.get(name, f"{section}.{field.name}")
            choices = _CHOICES.get((section, field.name))
            if choices:
                flags.DEFINE_enum(name, default, list(choices), help_, **fv)
            elif isinstance(default, bool):
                flags.DEFINE_bool(name, default, help_, **fv)
            elif isinstance(default, int):
                flags.DEFINE_integer(name, default, help_, **fv)
            elif isinstance(default, float):
                flags.DEFINE_float(name, default, help_, **fv)
            else:
                flags.DEFINE_string(name, default, help_, **fv)

    # --- cross-flag checks at parse time -------------------------------------------------
    flags.register_validator("workdir", bool, message="--workdir must be a non-empty path", **fv)
    flags.register_multi_flags_validator(["min_pixels", "max_pixels"], _check_pixels, **fv)
    flags.register_multi_flags_validator(["model_config", "model_dir"], _check_model_source, **fv)


def resolve_path(path: str) -> pathlib.Path | None:
    """An existing file for ``path``: as given if absolute, else under the CWD, then the repo root."""
    p = pathlib.Path(path).expanduser()
    for candidate in [p] if p.is_absolute() else [pathlib.Path.cwd() / p, REPO_ROOT / p]:
        if candidate.is_file():
            return candidate
    return None


def _check_pixels(d: dict) -> bool:
    if d["max_pixels"] < d["min_pixels"]:
        raise flags.ValidationError(f"--max_pixels={d['max_pixels']} must be >= --min_pixels={d['min_pixels']}")
    return True


def _model_source(model_config: str, model_dir: str) -> tuple[str, str, pathlib.Path | None]:
    """(flag name, raw flag value, resolved config.json or None)."""
    if model_dir:
        p = pathlib.Path(model_dir).expanduser() / "config.json"
        return "model_dir", model_dir, p if p.is_file() else None
    return "model_config", model_config, resolve_path(model_config) if model_config else None


def _check_model_source(d: dict) -> bool:
    flag, raw, path = _model_source(d["model_config"] or "", d["model_dir"] or "")
    if path is None:
        if flag == "model_dir":
            raise flags.ValidationError(
                f"--model_dir={raw!r}: {os.path.join(raw, 'config.json')!r} does not exist "
                "(expected a local Hugging Face checkpoint directory)")
        where = list(dict.fromkeys([os.getcwd(), str(REPO_ROOT)]))
        raise flags.ValidationError(
            f"--model_config={raw!r}: model config file not found (looked under {', '.join(where)}); "
            "pass the path of a Qwen2.5-VL config.json, or --model_dir")
    return True


def config_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Config:
    """Builds the run's ``Config`` from parsed flags; raises ``app.UsageError`` naming the bad flag."""
    f = flag_values
    flag, raw, path = _model_source(f.model_config, f.model_dir)
    if path is None:  # normally caught at parse time by _check_model_source
        try:
            _check_model_source({"model_config": f.model_config, "model_dir": f.model_dir})
        except flags.ValidationError as e:
            raise app.UsageError(str(e)) from None
    try:
        model = ModelConfig.from_json_file(path, dtype=f.dtype)
    except ConfigError as e:
        field = str(e).split("=", 1)[0]
        if field in _FIELD_TO_FLAG:
            raise _usage_error(e, f) from None
        raise app.UsageError(f"--{flag}={raw!r} (model config file {str(path)!r}): {e}") from None
    try:
        sections = {sec: cls(**{fl.name: f[_flag_name(sec, fl.name)].value for fl in dataclasses.fields(cls)})
                    for sec, cls in _SECTIONS.items()}
        mesh = sections["mesh"]  # the actor's parameters in the engine's layout (fused.param_layout)
        model = model.with_param_layout(**param_layout(mesh.train_tp, mesh.rollout_tp, sections["rollout"].engine))
        cache = f.compilation_cache_dir  # the directory used, as the config and run_summary.json show it
        sections["run"] = dataclasses.replace(
            sections["run"], compilation_cache_dir=os.path.abspath(os.path.expanduser(cache)) if cache else "")
        return Config(model=model, **sections)
    except ConfigError as e:
        raise _usage_error(e, f) from None


def _usage_error(e: ConfigError, f: flags.FlagValues) -> app.UsageError:
    field = str(e).split("=", 1)[0]
    name = _FIELD_TO_FLAG.get(field)
    if name is None and "." in field:
        section, attr = field.split(".", 1)
        if section in _SECTIONS and _flag_name(section, attr) in f:
            name = _flag_name(section, attr)
    if name is None:
        return app.UsageError(f"invalid flags: {e}")
    return app.UsageError(f"--{name}={f[name].value!r}: {e}")


_SECTIONS = {"data": C.DataConfig, "rollout": C.RolloutConfig, "rl": C.RlConfig, "optim": C.OptimConfig,
             "checkpoint": C.CheckpointConfig, "memory": C.MemoryConfig, "mesh": C.MeshConfig,
             "run": C.RunConfig, "programs": C.ProgramConfig}
# Flags whose name is not the field's (kept short, or the names scripts rely on: ARCHITECTURE.md).
_RENAMES = {("checkpoint", "every"): "checkpoint_every", ("checkpoint", "keep"): "checkpoint_keep"}
_CHOICES = {
    ("rollout", "engine"): C.ENGINES, ("run", "schedule"): C.SCHEDULES, ("run", "actor_prefix"): C.ACTOR_PREFIX,
    ("rl", "advantage"): C.ADVANTAGES,
    ("rl", "loss_agg"): C.LOSS_AGGS, ("rl", "kl_mode"): C.KL_MODES, ("rl", "kl_estimator"): C.KL_ESTIMATORS,
    ("rl", "reward_failure"): C.REWARD_FAILURES, ("optim", "lr_schedule"): C.LR_SCHEDULES,
    ("data", "synthetic_task"): C.SYNTHETIC_TASKS, ("memory", "optimizer_policy"): C.OPTIMIZER_POLICIES,
    ("programs", "attention"): C.ATTENTIONS, ("programs", "remat"): C.REMATS, ("mesh", "dp_placement"): C.DP_PLACEMENTS,
}
_HELP = {
    "dataset": "Training prompts: a .jsonl, .json (PATH@KEY for an array inside an object) or .parquet file, or a "
               "directory of .parquet files (one split), read through --prompt_key/--answer_key/--image_key/"
               "--video_key. Empty = write the built-in --synthetic_task into <workdir>/data and use it.",
    "prompt_key": "Column of the prompt: a string with <image>/<video> placeholders, or chat messages "
                  "[{role, content}] (verl). Without placeholders the media go before the text.",
    "answer_key": "Column of the ground truth (a string or number); a dotted path such as "
                  "reward_model.ground_truth reaches into nested columns.",
    "image_key": "Column of the images: one item or a list; an item is a path, bytes or {bytes, path}.",
    "video_key": "Column of the videos: a path, a {video: path or [frames], fps/nframes/...} dict, a list of frame "
                 "image paths (one video), or a list of those.",
    "image_dir": "Directory relative image and video paths start from (default: the dataset file's directory).",
    "format_prompt": "Prompt template: a jinja file (the prompt as {{ content }}, other columns by name), or the "
                     "built-in math or r1v (EasyR1's wording). Empty = the prompt as it is.",
    "video_fps": "Frames per second sampled from each video (Qwen2.5-VL: 2.0).",
    "video_min_pixels": "Lower bound on a video frame's pixels after smart_resize (Qwen: 128*28*28).",
    "video_max_pixels": "Upper bound on a video frame's pixels (Qwen: 768*28*28); the total budget may lower it.",
    "video_min_frames": "Fewest frames sampled from a video (rounded up to a multiple of 2).",
    "video_max_frames": "Most frames sampled from a video (Qwen: 768).",
    "video_total_pixels": "Pixel budget over all of a video's frames: each frame gets at most total/frames*2 "
                          "(Qwen: 128000*28*28*0.9).",
    "eval_dataset": "Older name of --val_dataset (kept working; pass one of the two).",
    "synthetic_task": "Built-in task used when --dataset is empty: colour, quadrant, count (images) or video_count "
                      "(mp4 clips: how many times a square appears).",
    "synthetic_n": "Number of synthetic training prompts to write.",
    "synthetic_image_size": "Side in px of the synthetic images or video frames (56 = 2x2 vision tokens; 112 = 4x4).",
    "synthetic_image_sizes": "Image tasks: comma-separated sides in px, each synthetic example drawing one (seeded): "
                             "prompts of mixed lengths (e.g. 56,112,224,448); empty = every image "
                             "--synthetic_image_size.",
    "synthetic_video_frames": "video_count: frames per clip at 2 fps (even, >= 8; every 2 frames are one temporal "
                              "step of the vision tower).",
    "eval_n": "Synthetic validation prompts written when training on a synthetic task (a --val_dataset file is used "
              "whole); 0 = no validation and no final evaluation.",
    "image_cache_mb": "MiB of preprocessed image patches each dataset keeps (least recently used dropped first); "
                      "images are decoded when a batch needs them. 0 = decode every time.",
    "engine": "Rollout engine: hf (transformers, everywhere) or vllm (where installed).",
    "group_size": "G: answers sampled per prompt.",
    "temperature": "Sampling temperature of training rollouts (> 0), and of the trainer: every log-prob it trains on "
                   "(old, reference, actor: ratio, KL, entropy) is of softmax(logits / temperature), the distribution "
                   "sampled from.",
    "top_p": "Nucleus sampling threshold (1 = off). Sampling only: training uses the temperature-scaled full "
             "distribution, untruncated.",
    "top_k": "Top-k sampling (0 = off). Sampling only: training uses the temperature-scaled full distribution, "
             "untruncated.",
    "max_new_tokens": "Longest answer in tokens.",
    "max_batch": "Most sequences the rollout engine generates at once.",
    "torch_threads": "CPU threads of the torch rollout in every phase. 0 (default): on a CPU decode half the cores, "
                     "at least 1, so that torch and XLA's pool (all cores, fixed at start) do not oversubscribe "
                     "them while the prefix programs overlap the decode (parallel/threads.py); on a GPU decode "
                     "torch's own choice. N: N threads.",
    "rollout_timeout_s": "Deadline in seconds of one rollout (the engine's generate call; validation's too). Past it "
                         "the step fails naming the step and the engine, a checkpoint of the last finished step is "
                         "written and the run exits 1 (rerun with --resume). A hung decode cannot be stopped, so the "
                         "process ends (rollplex_jax/run/watchdog.py). 0 = no deadline.",
    "vllm_gpu_memory_utilization": "With --engine=vllm: vLLM's gpu_memory_utilization (its weights, KV pool and "
                                   "working set as a fraction of the card, sized when it starts). 0 (default): on a "
                                   "GPU from the run's memory plan (what `python -m launch.plan` prints: the engine's "
                                   "weight copy, KV cache and working set, plus 5% of the card), 0.3 on a CPU.",
    "batch_prompts": "B: prompts per RL step (B x G sequences).",
    "advantage": "Advantage estimator.",
    "norm_by_std": "GRPO: divide by the group std (--nonorm_by_std = Dr. GRPO).",
    "clip_low": "PPO ratio clip below 1.",
    "clip_high": "PPO ratio clip above 1 (DAPO clip-higher when > --clip_low).",
    "loss_agg": "How token losses are averaged.",
    "kl_mode": "KL to the reference: in the loss, in the reward, or off.",
    "kl_coef": "KL coefficient. With 0 (or --kl_mode=off) the reference does not run at all and its weights are "
               "never placed on the device, unless --log_kl.",
    "log_kl": "Run the reference and report the KL to it (metric kl) even when it is not in the objective "
              "(--kl_coef=0 or --kl_mode=off).",
    "kl_estimator": "KL estimator: k1, k2 or k3 (low variance).",
    "reward": "Reward: exact_match, numeric, format, math (last \\boxed{} graded by math-verify; 0.9 accuracy + 0.1 "
              "format), r1v (<think>/<answer>; 0.5 + 0.5), choice (option letter), or module:function in the form "
              "fn(response, answer), verl's compute_score(data_source, solution_str, ground_truth, extra_info) or "
              "EasyR1's compute_score(reward_input) / compute_score(reward_inputs) (detected by parameter names; "
              "see rollplex_jax/rl/reward_calls.py). A function may return a number or a dict with 'score' / "
              "'overall' and parts (logged as reward/<part>).",
    "reward_kwargs": "JSON object of keyword arguments for the reward function (EasyR1's reward_function_kwargs), "
                     "e.g. '{\"format_weight\": 0.2}' for math or r1v. Empty = none.",
    "reward_timeout_s": "Per-call timeout of the reward function; a timeout gives reward 0 (counted).",
    "reward_workers": "Threads running reward calls.",
    "reward_failure": "On a reward exception/timeout: zero (count it in reward/failures) or raise (stop).",
    "mini_batches": "Optimizer steps per RL step (the batch split in this many mini-batches).",
    "micro_batch": "Sequences per forward/backward (gradient accumulation over micro-batches).",
    "prompt_bucket_cap": "The longest prompt length (tokens) the shape buckets pad prompts to; 0 (default) = the "
                         "training set's longest prompt, found at load, at most --max_prompt_len: data of one "
                         "prompt length is never padded past it.",
    "vision_chunk_units": "Merge units (vision tokens) each device encodes per vision chunk: with shape buckets "
                          "the Rollplex prefix encodes a batch's images and video frames in chunks of this fixed "
                          "shape, one part per --train_fsdp device (their number varies, their shape does not; an "
                          "image larger than a part gets a chunk of its own, a power of two up); 0 (default) = the "
                          "larger of the training set's largest image or frame and a device's share of a batch's "
                          "mean vision tokens, rounded up to a power of two; -1 = off: the vision tower runs "
                          "inside each prefix program, padded to a power of two (a new program for each new "
                          "combination of sizes).",
    "vision_batch_units": "Rows of a batch's vision-embeddings buffer (vision chunks): 0 (default) = twice the "
                          "vision tokens of --batch_prompts of the training set's largest rows, plus a chunk (all "
                          "its parts).",
    "vision_frame_units": "Length (merge units) of a vision chunk's full-attention rows, which hold whole frames "
                          "told apart by segment ids: 0 (default) = the training set's largest image or frame, "
                          "rounded up to a power of two.",
    "micro_batch_tokens": "Token budget per device of one scoring / training micro-batch (verl's "
                          "ppo_max_token_len_per_gpu): each micro-batch holds as many whole sequences as fit this many "
                          "(bucketed) token slots, so its shape is fixed by the budget, not by the data; 0 = "
                          "--micro_batch rows. Must be at least --max_prompt_len + --max_new_tokens.",
    "lr": "Peak learning rate.",
    "lr_schedule": "Learning-rate schedule over --steps.",
    "final_lr_frac": "Cosine schedule: final lr as a fraction of --lr.",
    "decay_steps": "Cosine schedule horizon in steps (0 = --steps); longer than the run keeps the lr higher.",
    "warmup_steps": "Linear warm-up steps.",
    "weight_decay": "AdamW weight decay.",
    "b1": "Adam beta1.",
    "b2": "Adam beta2.",
    "eps": "Adam epsilon.",
    "grad_clip": "Global gradient-norm clip.",
    "checkpoint_every": "Save an orbax checkpoint every N steps (0 = only at the end).",
    "checkpoint_keep": "Checkpoints kept.",
    "schedule": "serial: rollout, then reference, then actor over full sequences (the baseline); rollplex: "
                "prefix work of reference and actor dispatched while the rollout decodes, then suffixes.",
    "prefix_sharing": "rollplex: one prefix per prompt shared by its G answers (--noprefix_sharing: one per answer).",
    "overlap": "rollplex: dispatch the prefix programs before decoding starts (--nooverlap: after it ends).",
    "actor_prefix": "rollplex: keep the actor prefix's autograd residuals, or only its boundary KV and recompute "
                    "the prefix forward in the update (less memory, more compute).",
    "freeze_vision": "Do not train the vision tower (actor and reference then share one vision encoding per prompt).",
    "resume": "Continue the run in --workdir from its latest complete checkpoint (same per-step metrics and final "
              "params as an uninterrupted run). Without it, a --workdir that has checkpoints is refused.",
    "progress": "Show a progress bar.",
    # --- validation (issue 18; EasyR1's val_files, val_freq, val_before_train, val_generations_to_log) ---
    "val_dataset": "Validation prompts (same format as --dataset; --eval_dataset is its older name). Empty = a fresh "
                   "synthetic set of --eval_n prompts (other seed) when training on a synthetic task, else none.",
    "val_every": "Validate every N steps (EasyR1's val_freq; metrics val/* in that step's metrics.jsonl row); 0 = only "
                 "at the end (finish). The run always validates at the end when it has validation prompts.",
    "val_before_train": "Also validate before the first step (metrics.jsonl row of step 0).",
    "val_temperature": "Validation sampling temperature: 0 = greedy (default), > 0 = sampled with a fixed seed (the "
                       "same at every validation, so runs and validations are reproducible; --top_p/--top_k apply). "
                       "eval/greedy_accuracy in "
                       "run_summary.json is always greedy.",
    "val_generations_to_log": "Validation answers to log (the first k prompts: prompt, response, ground truth, "
                              "score) to <workdir>/val_generations.jsonl and the console; 0 = none.",
    "hbm_budget": "Accelerator memory per device the run must stay under, with a unit (e.g. 80GiB, 512MiB; '' = "
                  "none). The runtime offloads the optimizer state if that is what it takes, or refuses to start "
                  "naming the smallest budget that fits (see launch.plan).",
    "optimizer_policy": "Optimizer state (fp32 master weights + Adam moments): resident on the device, offload "
                        "(host memory between updates, streamed back in --optimizer_chunks chunks), or auto "
                        "(offload only if --hbm_budget needs it).",
    "optimizer_chunks": "Chunks of the streaming optimizer step when the optimizer state is offloaded.",
    "measure_memory": "Measure live device bytes per phase and buffer class (metrics memory/*, plots/memory.png).",
    "train_dp": "Training mesh: data-parallel degree outside fsdp x tp (HSDP): parameters and reference sharded "
                "over fsdp x tp and replicated over dp, the batch split over dp x fsdp, gradients reduced over dp, "
                "the optimizer state sharded over dp too (--optimizer_shard). Devices: dp x fsdp x tp.",
    "optimizer_shard": "With --train_dp > 1: dp (the default, auto) shards the fp32 master weights and Adam moments "
                       "over dp as well (ZeRO-1: each data-parallel group's copy of the state split dp ways; the "
                       "update computes its part and the new weights are all-gathered over dp), none keeps a whole "
                       "copy per group.",
    "dp_placement": "With --train_dp > 1, where the data-parallel groups lie: across (default: a group's members are "
                    "fsdp x tp devices apart, so dp spans the processes / nodes and fsdp, tp stay within one, HSDP) "
                    "or within (a group is consecutive devices: dp within a node, fsdp x tp across nodes).",
    "process_devices": "Devices each process drives, with one rollout engine per process on its first device: 0 = "
                       "the job's own (launch.main; launch.plan plans 1, one process per device, as the SLURM "
                       "script starts on GPUs: every device decodes, and each engine's copy of split weights is "
                       "all-gathered for the rollout only); a single process keeps its engine's rebuilt buffers "
                       "between steps (refilled after each update). Set, it must match the job.",
    "train_fsdp": "Training mesh: FSDP degree (actor and reference).",
    "train_tp": "Training mesh: tensor-parallel degree (actor and reference).",
    "rollout_tp": "Rollout engine tensor-parallel degree.",
    "attention": "Attention kernel of every JAX program: blockwise (online softmax over --attention_block blocks, "
                 "never a [T, S] score matrix), dense (all scores at once: the oracle), or cudnn (cuDNN flash "
                 "attention on a GPU where it expresses the mask exactly, i.e. the vision tower in bf16; blockwise "
                 "everywhere else and on CPU, with a log line).",
    "attention_block": "Query/key block length of the blockwise kernel; a call whose queries and keys all fit in one "
                       "block uses the dense path (the same single block).",
    "packing": "Padding-free scoring and training: pack the rows' real tokens into fewer rows of the same length "
               "with segment ids (exact: the padded computation up to float summation order) wherever that saves a "
               "row; --nopacking: left-padded rows as the rollout returns them.",
    "shape_buckets": "STEP:LINEAR_UNTIL:RATIO: the trainer pads prompt and answer lengths, vision patches (masked "
                     "padding patches) and packed rows up to buckets (multiples of STEP up to LINEAR_UNTIL, then "
                     "x RATIO steps; counts to powers of two), so data of every size compiles a few programs once "
                     "instead of new ones every step. 'off': exact shapes.",
    "remat": "Rematerialisation per decoder layer and vision block: layer (keep only each layer's input for the "
             "backward), dots (also the weight matmuls' outputs), none (keep every intermediate).",
}


def _flag_name(section: str, field: str) -> str:
    return _RENAMES.get((section, field), field)
