"""One frozen configuration tree for a run, built once (from flags or in code).

Every sub-config validates itself in ``__post_init__`` and raises ``ConfigError``
naming the field, the bad value and what is allowed, so a bad flagfile fails at
start rather than deep inside a jit trace. Functions take the smallest
sub-config they need (``VisionConfig`` for the vision tower, ``TextConfig`` for
the decoder, ...), never the whole tree.

The model sub-configs (``model.py``; both re-exported by ``rollplex_jax.config``) mirror Hugging Face's
``Qwen2_5_VLConfig`` field names so that ``ModelConfig.from_hf_dict`` / ``to_hf_dict``
round-trip a checkpoint's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os

from rollplex_jax.config.meshes import MeshConfig
from rollplex_jax.config.model import ConfigError, ModelConfig, _require
from rollplex_jax.config.shapes import DEFAULT as DEFAULT_BUCKETS
from rollplex_jax.config.shapes import Buckets, parse_buckets

ENGINES = ("hf", "vllm")
SCHEDULES = ("serial", "rollplex")
ACTOR_PREFIX = ("residuals", "recompute")
ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
LOSS_AGGS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_MODES = ("loss", "reward", "off")
KL_ESTIMATORS = ("k1", "k2", "k3")
REWARD_FAILURES = ("zero", "raise")
LR_SCHEDULES = ("constant", "cosine")
SYNTHETIC_TASKS = ("colour", "quadrant", "count", "video_count")
ATTENTIONS = ("blockwise", "dense", "cudnn")
REMATS = ("layer", "none", "dots")


def _choice(section: str, name: str, value, allowed: tuple) -> None:
    _require(value in allowed, f"{section}.{name}", value, f"one of {', '.join(allowed)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where prompts come from, how their rows read, and the image/video/prompt limits applied when loading them.

    ``dataset`` is a .jsonl / .json / .parquet file or a directory of parquet files, read through EasyR1's
    column names (``prompt_key``, ``answer_key`` (dotted), ``image_key``, ``video_key``, ``image_dir``,
    ``format_prompt``: ``data/rows.py``); when it is empty, a built-in synthetic task (``synthetic_task``) is
    written into the workdir as JSONL. ``val_dataset`` (``eval_dataset`` is its older name; or a fresh synthetic
    set of ``eval_n`` prompts when training on a synthetic task) feeds validation (``RunConfig.val_*``) and the
    greedy evaluation at the end.
    Videos are sampled and sized by Qwen2.5-VL's rules (``video_*``; ``data/video_sampling.py``). Rows are
    checked at load time from the rows and the media's headers; pixels are decoded per batch, with
    ``image_cache_mb`` of preprocessed media kept per dataset (``data/image_cache.py``).
    """

    dataset: str = ""
    eval_dataset: str = ""
    val_dataset: str = ""  # validation prompts (EasyR1's data.val_files); eval_dataset is an alias
    synthetic_task: str = "colour"
    synthetic_n: int = 2048
    synthetic_image_size: int = 56
    synthetic_image_sizes: str = ""  # comma-separated sides: each example draws one (prompts of mixed lengths)
    synthetic_video_frames: int = 8  # video_count: frames per clip (at 2 fps)
    eval_n: int = 256
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_prompt_len: int = 2048
    # the longest prompt length the shape buckets pad to (0: the training set's longest prompt, resolved by the
    # runner at load, at most max_prompt_len): a data set of one prompt length is never padded past it
    prompt_bucket_cap: int = 0
    # merge units each fsdp device encodes per vision chunk (fixed-shape vision micro-batches of the Rollplex
    # prefix, models/vl/vision_chunks.py; with shape buckets): 0 = resolved by the runner at load
    # (config/shapes.vision_chunk_sizes: the set's largest frame or a device's share of a mean batch, a power of
    # two); -1 = off (the tower inside each prefix program). vision_batch_units: rows of a batch's embeddings
    # buffer (0 = resolved at load from the set's most vision tokens in a row)
    vision_chunk_units: int = 0
    vision_batch_units: int = 0
    vision_frame_units: int = 0  # full-attention row length in a chunk (0 = the set's largest frame, a power of 2)
    image_cache_mb: int = 1024  # per dataset: preprocessed patches of recently used images (0 = none)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = "videos"
    image_dir: str = ""
    format_prompt: str = ""
    video_fps: float = 2.0
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)

    def image_sizes(self) -> tuple[int, ...]:
        """``synthetic_image_sizes`` as ints (empty: every image ``synthetic_image_size``)."""
        try:
            return tuple(int(x) for x in self.synthetic_image_sizes.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"data.synthetic_image_sizes={self.synthetic_image_sizes!r}: give comma-separated "
                              "integers, e.g. 56,112,224") from None

    def __post_init__(self):
        _require(self.min_pixels > 0, "data.min_pixels", self.min_pixels, "must be > 0")
        _require(self.max_pixels >= self.min_pixels, "data.max_pixels", self.max_pixels,
                 f"must be >= min_pixels={self.min_pixels}")
        _require(self.max_prompt_len > 0, "data.max_prompt_len", self.max_prompt_len, "must be > 0")
        _require(self.prompt_bucket_cap >= 0, "data.prompt_bucket_cap", self.prompt_bucket_cap,
                 "must be >= 0 (0 = the training set's longest prompt)")
        _require(self.vision_chunk_units >= -1, "data.vision_chunk_units", self.vision_chunk_units,
                 "must be >= -1 (0 = from the training set, -1 = off)")
        _require(self.vision_batch_units >= 0, "data.vision_batch_units", self.vision_batch_units,
                 "must be >= 0 (0 = from the training set)")
        _require(self.vision_frame_units >= 0, "data.vision_frame_units", self.vision_frame_units,
                 "must be >= 0 (0 = from the training set)")
        _choice("data", "synthetic_task", self.synthetic_task, SYNTHETIC_TASKS)
        _require(self.synthetic_n > 0, "data.synthetic_n", self.synthetic_n, "must be > 0")
        _require(self.synthetic_image_size >= 56, "data.synthetic_image_size", self.synthetic_image_size,
                 "must be >= 56 px")
        sizes = self.image_sizes()
        _require(all(s >= 56 for s in sizes) and (not sizes or self.synthetic_task != "video_count"),
                 "data.synthetic_image_sizes", self.synthetic_image_sizes,
                 "must be comma-separated sides >= 56 px, for an image task")
        _require(self.synthetic_video_frames >= 8 and self.synthetic_video_frames % 2 == 0,
                 "data.synthetic_video_frames", self.synthetic_video_frames, "must be even and >= 8")
        _require(self.eval_n >= 0, "data.eval_n", self.eval_n, "must be >= 0")
        _require(not (self.val_dataset and self.eval_dataset and self.val_dataset != self.eval_dataset),
                 "data.val_dataset", self.val_dataset,
                 f"differs from its alias --eval_dataset={self.eval_dataset!r}; pass only one of the two")
        _require(self.image_cache_mb >= 0, "data.image_cache_mb", self.image_cache_mb, "must be >= 0 (0 = no cache)")
        for key in ("prompt_key", "answer_key", "image_key", "video_key"):
            _require(bool(getattr(self, key)), f"data.{key}", getattr(self, key), "must name a column")
        _require(self.video_fps > 0, "data.video_fps", self.video_fps, "must be > 0")
        _require(0 < self.video_min_pixels <= self.video_max_pixels, "data.video_max_pixels", self.video_max_pixels,
                 f"must be >= video_min_pixels={self.video_min_pixels} > 0")
        _require(0 < self.video_min_frames <= self.video_max_frames, "data.video_max_frames", self.video_max_frames,
                 f"must be >= video_min_frames={self.video_min_frames} > 0")
        _require(self.video_total_pixels > 0, "data.video_total_pixels", self.video_total_pixels, "must be > 0")

    # --- validation data (issue 18) ---
    @property
    def validation_dataset(self) -> str:
        """The validation file: ``val_dataset``, else its alias ``eval_dataset`` ('' = synthetic or none)."""
        return self.val_dataset or self.eval_dataset

    @property
    def has_validation(self) -> bool:
        """Whether the run has validation prompts: a file, or (training on a synthetic task) ``eval_n`` fresh ones."""
        return self.eval_n > 0 and bool(self.validation_dataset or not self.dataset)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The torch rollout engine and how it samples G answers per prompt.

    ``temperature`` is also the trainer's: every log-prob it trains on (old, reference, actor; the ratio, the KL and
    the entropy) is of ``softmax(logits / temperature)``, the distribution the rollout sampled from
    (``programs.actor.Spec``), as in TRL and verl. ``top_k`` / ``top_p`` only narrow what is sampled: training uses
    the temperature-scaled full distribution, untruncated (the usual choice, TRL's and verl's). Training needs
    ``temperature > 0``: at 0 (greedy) the policy is an argmax, with no log-probs to train; greedy decoding is for
    validation only (``--val_temperature=0``).
    """

    engine: str = "hf"
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    max_batch: int = 256
    torch_threads: int = 0  # 0: chosen from the cores (threads.py); N: N threads
    # Deadline of one generate call (run/watchdog.py): past it the step fails, a checkpoint of the last finished
    # step is written and launch.main exits 1. 1800 s: agent-lightning's rollout_timeout_seconds (on verl) and
    # torch.distributed's default timeout; long enough for a real rollout, short of burning a night. 0 = none.
    rollout_timeout_s: float = 1800.0
    # vLLM's gpu_memory_utilization (its weights + KV pool + working set as a fraction of the card, sized at its
    # start): 0 = from the memory plan on a GPU (planner/fractions.py), 0.3 on a CPU
    vllm_gpu_memory_utilization: float = 0.0

    def __post_init__(self):
        _choice("rollout", "engine", self.engine, ENGINES)
        _require(self.group_size >= 2, "rollout.group_size", self.group_size,
                 "must be >= 2 (group-relative advantages need at least 2 answers per prompt)")
        _require(self.temperature > 0, "rollout.temperature", self.temperature,
                 "must be > 0 for training rollouts: the trainer trains on softmax(logits / temperature), "
                 "undefined at 0 (greedy decoding is for validation only: --val_temperature=0)")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= 0, "rollout.top_k", self.top_k, "must be >= 0 (0 = off)")
        _require(self.max_new_tokens > 0, "rollout.max_new_tokens", self.max_new_tokens, "must be > 0")
        _require(self.max_batch > 0, "rollout.max_batch", self.max_batch, "must be > 0")
        _require(self.torch_threads >= 0, "rollout.torch_threads", self.torch_threads,
                 "must be >= 0 (0 = chosen from the cores)")
        _require(self.rollout_timeout_s >= 0, "rollout.rollout_timeout_s", self.rollout_timeout_s,
                 "must be >= 0 seconds (0 = no deadline)")
        _require(0 <= self.vllm_gpu_memory_utilization <= 1, "rollout.vllm_gpu_memory_utilization",
                 self.vllm_gpu_memory_utilization, "must be in [0, 1] (0 = from the memory plan)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RlConfig:
    """The RL algorithm: advantages, policy loss, KL to the reference, rewards, batch sizes.

    The reference runs only when the KL matters (``uses_reference``): ``kl_mode`` loss or reward with
    ``kl_coef > 0``, or ``log_kl`` (the KL as a metric only). ``kl_mode=loss`` with ``kl_coef=0`` (the
    demo) therefore runs no reference phase and holds no reference weights."""

    batch_prompts: int = 16
    advantage: str = "grpo"
    norm_by_std: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.2
    loss_agg: str = "token-mean"
    kl_mode: str = "loss"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    log_kl: bool = False
    reward: str = "exact_match"
    reward_timeout_s: float = 10.0
    reward_workers: int = 4
    reward_failure: str = "zero"
    reward_kwargs: str = ""  # JSON object of keyword arguments for the reward (EasyR1's reward_function_kwargs)
    mini_batches: int = 1
    micro_batch: int = 64
    # verl's ppo_max_token_len_per_gpu: each micro-batch holds as many whole sequences as fit this many (bucketed)
    # token slots per device, instead of ``micro_batch`` rows; 0 = off
    micro_batch_tokens: int = 0

    def __post_init__(self):
        _require(self.batch_prompts > 0, "rl.batch_prompts", self.batch_prompts, "must be > 0")
        _choice("rl", "advantage", self.advantage, ADVANTAGES)
        _require(0 <= self.clip_low < 1, "rl.clip_low", self.clip_low, "must be in [0, 1)")
        _require(self.clip_high >= 0, "rl.clip_high", self.clip_high, "must be >= 0")
        _choice("rl", "loss_agg", self.loss_agg, LOSS_AGGS)
        _choice("rl", "kl_mode", self.kl_mode, KL_MODES)
        _require(self.kl_coef >= 0, "rl.kl_coef", self.kl_coef, "must be >= 0")
        _choice("rl", "kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _require(bool(self.reward), "rl.reward", self.reward,
                 "a built-in (exact_match, numeric, format, math, r1v, choice) or module:function")
        _require(self.reward_timeout_s > 0, "rl.reward_timeout_s", self.reward_timeout_s, "must be > 0")
        _require(self.reward_workers > 0, "rl.reward_workers", self.reward_workers, "must be > 0")
        _choice("rl", "reward_failure", self.reward_failure, REWARD_FAILURES)
        try:
            kwargs = json.loads(self.reward_kwargs) if self.reward_kwargs else {}
        except json.JSONDecodeError as e:
            raise ConfigError(f"rl.reward_kwargs={self.reward_kwargs!r} is not JSON ({e}); pass an object such as "
                              "'{\"format_weight\": 0.1}'") from None
        _require(isinstance(kwargs, dict), "rl.reward_kwargs", self.reward_kwargs,
                 "must be a JSON object of keyword arguments, e.g. '{\"format_weight\": 0.1}'")
        _require(self.mini_batches > 0, "rl.mini_batches", self.mini_batches, "must be > 0")
        _require(self.micro_batch > 0, "rl.micro_batch", self.micro_batch, "must be > 0")
        _require(self.micro_batch_tokens >= 0, "rl.micro_batch_tokens", self.micro_batch_tokens,
                 "must be >= 0 (0 = micro-batches of --micro_batch rows)")

    @property
    def reward_kwargs_dict(self) -> dict:
        """``reward_kwargs`` parsed ({} when empty)."""
        return json.loads(self.reward_kwargs) if self.reward_kwargs else {}

    @property
    def uses_reference(self) -> bool:
        """Whether the reference model runs at all: the KL enters the objective (``kl_mode`` loss or reward
        with ``kl_coef > 0``), or ``log_kl`` asks for the KL as a metric. Otherwise the reference phase does
        not run and the reference weights are never placed on the device."""
        return self.log_kl or (self.kl_mode != "off" and self.kl_coef > 0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """optax AdamW with global-norm clipping and a learning-rate schedule over the run's steps.

    The defaults are EasyR1's for a pretrained checkpoint (``worker.actor.optim`` and ``max_grad_norm``: lr 1e-6,
    weight decay 1e-2, constant schedule, no warm-up, betas 0.9 / 0.999, clip 1.0), so ``--model_dir`` alone
    fine-tunes gently. The demos train a random model from scratch and state their own values in their flagfiles
    (configs/tiny_cpu.flags: lr 5e-4, cosine, no weight decay)."""

    lr: float = 1e-6
    lr_schedule: str = "constant"
    final_lr_frac: float = 0.05
    decay_steps: int = 0
    warmup_steps: int = 0
    weight_decay: float = 1e-2
    freeze_vision: bool = False
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0

    def __post_init__(self):
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _choice("optim", "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _require(0 <= self.final_lr_frac <= 1, "optim.final_lr_frac", self.final_lr_frac, "must be in [0, 1]")
        _require(self.decay_steps >= 0, "optim.decay_steps", self.decay_steps, "must be >= 0 (0 = --steps)")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _require(0 <= self.b1 < 1 and 0 <= self.b2 < 1, "optim.b1", (self.b1, self.b2), "b1, b2 must be in [0, 1)")
        _require(self.eps > 0, "optim.eps", self.eps, "must be > 0")
        _require(self.grad_clip > 0, "optim.grad_clip", self.grad_clip, "must be > 0")


OPTIMIZER_POLICIES = ("auto", "resident", "offload")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'80GiB', '512 MiB', '1.5e9', '2GB' -> bytes ('' -> 0). Raises ValueError naming the unit choices."""
    t = text.strip().lower().replace(" ", "")
    if not t:
        return 0
    i = len(t)
    while i and t[i - 1].isalpha():
        i -= 1
    num, unit = t[:i], t[i:]
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {unit!r} (use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB)")
    return int(float(num) * _UNITS[unit])


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Where each buffer class lives between its producer and last consumer (rollplex_jax/memory/meter.py)."""

    hbm_budget: str = ""
    optimizer_policy: str = "auto"
    optimizer_chunks: int = 4
    measure_memory: bool = True

    def __post_init__(self):
        try:
            n = parse_bytes(self.hbm_budget)
        except ValueError as e:
            raise ConfigError(f"memory.hbm_budget={self.hbm_budget!r} is invalid: {e}") from None
        _require(n >= 0, "memory.hbm_budget", self.hbm_budget, "must be >= 0 bytes ('' = no budget)")
        _choice("memory", "optimizer_policy", self.optimizer_policy, OPTIMIZER_POLICIES)
        _require(self.optimizer_chunks >= 1, "memory.optimizer_chunks", self.optimizer_chunks, "must be >= 1")

    @property
    def budget_bytes(self) -> int:
        """The per-device budget in bytes (0 = none)."""
        return parse_bytes(self.hbm_budget)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """orbax checkpoints under <workdir>/checkpoints every ``every`` steps (0 = only at the end)."""

    every: int = 0
    keep: int = 2

    def __post_init__(self):
        _require(self.every >= 0, "checkpoint.every", self.every, "must be >= 0")
        _require(self.keep > 0, "checkpoint.keep", self.keep, "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a run writes, how long it runs, its seed and schedule, and where its compiled programs are kept."""

    workdir: str = "runs/default"
    seed: int = 0
    steps: int = 1
    model_dir: str = ""
    schedule: str = "serial"
    prefix_sharing: bool = True
    overlap: bool = True
    actor_prefix: str = "residuals"
    resume: bool = False
    progress: bool = True
    # --- validation during training (issue 18; EasyR1 trainer.val_freq, val_before_train, val_generations_to_log)
    val_every: int = 0  # steps between validations; 0 = only at the end (finish)
    val_before_train: bool = False
    val_temperature: float = 0.0  # 0 = greedy; > 0 sampled with a fixed seed
    val_generations_to_log: int = 3
    # Persistent XLA compilation cache (run/compile_cache.py): '' = none. The flag defaults to the per-user
    # default_compilation_cache_dir(); a Config built in code has none unless given one.
    compilation_cache_dir: str = ""

    def __post_init__(self):
        _require(self.val_every >= 0, "run.val_every", self.val_every, "must be >= 0 (0 = only at the end)")
        _require(self.val_temperature >= 0, "run.val_temperature", self.val_temperature, "must be >= 0 (0 = greedy)")
        _require(self.val_generations_to_log >= 0, "run.val_generations_to_log", self.val_generations_to_log,
                 "must be >= 0")
        _require(self.steps >= 0, "run.steps", self.steps, "must be >= 0")
        _require(bool(self.workdir), "run.workdir", self.workdir, "must be a non-empty path")
        _choice("run", "schedule", self.schedule, SCHEDULES)
        _choice("run", "actor_prefix", self.actor_prefix, ACTOR_PREFIX)


def default_compilation_cache_dir(environ=None) -> str:
    """The per-user compilation cache: ``$XDG_CACHE_HOME/rollplex_jax/xla`` when that is set (an absolute path, as
    the XDG spec asks), else ``~/.cache/rollplex_jax/xla``. Per user because the cache is trusted code."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rollplex_jax", "xla")


# On a CPU one fp32 score block [B, N, H, bq, bk] of the blockwise attention is kept at most this large, so it
# stays in the cache (``models/attention.cache_block``); the simulator prices those bytes at a cache-sized rate.
CPU_BLOCK_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramConfig:
    """How the JAX programs compute (not what): attention kernel, its block size, rematerialisation.

    ``attention``: ``blockwise`` (online-softmax blocks, never a [T, S] score matrix; a call whose
    queries and keys all fit in one block runs the dense path, which computes that same block),
    ``dense`` (the oracle: fp32 scores of every key at once) or ``cudnn`` (cuDNN flash attention on a
    GPU for the cases it expresses exactly, blockwise otherwise; see ``models/attention.py``).
    ``remat``: per decoder layer and vision block, ``layer`` keeps only each layer's input for the
    backward, ``dots`` also its weight matmuls' outputs, ``none`` every intermediate.
    ``packing``: scoring and training run on the rows' real tokens packed into fewer rows of the same length
    (segment ids; ``models/vl/packing.py``) wherever that saves a row; ``False``: left-padded rows.
    ``shape_buckets``: ``STEP:LINEAR_UNTIL:RATIO`` (``config/shapes.py``): prompt and answer lengths, vision
    patches and packed rows are padded up to a few bucketed sizes, so real data of every size compiles a handful
    of programs once; ``off``: exact shapes (a new compile for every new shape).
    """

    attention: str = "blockwise"
    attention_block: int = 512  # query/key block length of the blockwise kernel
    remat: str = "layer"
    packing: bool = True
    shape_buckets: str = DEFAULT_BUCKETS

    def __post_init__(self):
        try:
            parse_buckets(self.shape_buckets)
        except ValueError as e:
            raise ConfigError(f"programs.shape_buckets: {e}") from None
        _choice("programs", "attention", self.attention, ATTENTIONS)
        _require(self.attention_block >= 1, "programs.attention_block", self.attention_block, "must be >= 1")
        _choice("programs", "remat", self.remat, REMATS)

    @property
    def buckets(self) -> Buckets | None:
        """The parsed ``shape_buckets`` (None: exact shapes)."""
        return parse_buckets(self.shape_buckets)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The whole run. Built once (``launch.flags.config_from_flags``), then passed explicitly."""

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    rl: RlConfig = dataclasses.field(default_factory=RlConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    memory: MemoryConfig = dataclasses.field(default_factory=MemoryConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    programs: ProgramConfig = dataclasses.field(default_factory=ProgramConfig)

    def __post_init__(self):
        if (self.run.val_every or self.run.val_before_train) and not self.data.has_validation:
            run = self.run
            raise ConfigError(f"run.val_every={run.val_every} (val_before_train={run.val_before_train}) needs "
                              f"validation prompts: pass --val_dataset (and --eval_n > 0, now {self.data.eval_n}) or "
                              "train on a synthetic task; or set --val_every=0 --noval_before_train")
        longest = self.data.max_prompt_len + self.rollout.max_new_tokens
        _require(self.rl.micro_batch_tokens == 0 or self.rl.micro_batch_tokens >= longest,
                 "rl.micro_batch_tokens", self.rl.micro_batch_tokens,
                 f"must hold one whole sequence: at least --max_prompt_len + --max_new_tokens = {longest} "
                 "(or 0: micro-batches of --micro_batch rows)")
        n_rows = self.rl.batch_prompts * self.rollout.group_size
        _require(self.rl.mini_batches <= n_rows, "rl.mini_batches", self.rl.mini_batches,
                 f"must be <= batch_prompts * group_size = {n_rows}")
        if self.run.schedule == "rollplex":
            _require(self.rl.batch_prompts % self.rl.mini_batches == 0, "rl.mini_batches", self.rl.mini_batches,
                     f"must divide batch_prompts={self.rl.batch_prompts} with --schedule=rollplex "
                     "(a mini-batch is a set of whole prompt groups)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
