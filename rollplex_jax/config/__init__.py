"""The run's configuration: one frozen tree, built once (from flags in ``launch/flags.py`` or in code).

- ``tree``: ``Config`` = {model, data, rollout, rl, optim, checkpoint, memory, mesh, run, programs}, each
  sub-config validated in ``__post_init__`` (``ConfigError`` names the field, the value and what is allowed);
- ``model``: ``ModelConfig`` = {vision, text} <-> a Hugging Face ``config.json`` (Qwen2.5-VL field names).

Both are re-exported here: ``from rollplex_jax.config import Config, ModelConfig``.
"""

from rollplex_jax.config.meshes import DP_PLACEMENTS
from rollplex_jax.config.model import (
    DTYPES,
    INTERNAL_DTYPES,
    ConfigError,
    ModelConfig,
    TextConfig,
    VisionConfig,
    tiny_model_config,
)
from rollplex_jax.config.tree import (
    ACTOR_PREFIX,
    ADVANTAGES,
    ATTENTIONS,
    CPU_BLOCK_BYTES,
    ENGINES,
    KL_ESTIMATORS,
    KL_MODES,
    LOSS_AGGS,
    LR_SCHEDULES,
    OPTIMIZER_POLICIES,
    REMATS,
    REWARD_FAILURES,
    SCHEDULES,
    SYNTHETIC_TASKS,
    CheckpointConfig,
    Config,
    DataConfig,
    MemoryConfig,
    MeshConfig,
    OptimConfig,
    ProgramConfig,
    RlConfig,
    RolloutConfig,
    RunConfig,
    default_compilation_cache_dir,
    parse_bytes,
)

__all__ = [
    "ACTOR_PREFIX", "ADVANTAGES", "ATTENTIONS", "CPU_BLOCK_BYTES", "CheckpointConfig", "Config", "ConfigError",
    "DP_PLACEMENTS", "DTYPES", "DataConfig", "ENGINES", "INTERNAL_DTYPES", "KL_ESTIMATORS", "KL_MODES", "LOSS_AGGS",
    "LR_SCHEDULES",
    "MemoryConfig", "MeshConfig", "ModelConfig", "OPTIMIZER_POLICIES", "OptimConfig", "ProgramConfig", "REMATS",
    "REWARD_FAILURES", "RlConfig", "RolloutConfig", "RunConfig", "SCHEDULES", "SYNTHETIC_TASKS", "TextConfig",
    "VisionConfig", "default_compilation_cache_dir", "parse_bytes", "tiny_model_config",
]
