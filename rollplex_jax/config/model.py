"""The model's configuration: Qwen2.5-VL's vision tower, decoder, special ids and dtype (part of ``Config``).

The sub-configs mirror Hugging Face's ``Qwen2_5_VLConfig`` field names so that
``ModelConfig.from_hf_dict`` / ``to_hf_dict`` round-trip a checkpoint's ``config.json``. Each validates
itself in ``__post_init__`` and raises ``ConfigError`` naming the field, the bad value and what is
allowed. ``config.py`` builds the run's whole tree on top of this module (and re-exports it).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

DTYPES = ("float32", "bfloat16")
# float16 only as the CPU compile's stand-in for bfloat16 (aot.CPU_STANDIN: memory analysis, never run); the
# --dtype flag offers DTYPES.
INTERNAL_DTYPES = ("float16",)
# The model families (HF's ``model_type``): ``models/family.py`` gives each one's code.
FAMILIES = ("qwen2_5_vl", "qwen3_vl")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def _require(cond: bool, field: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{field}={value!r} is invalid: {allowed}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """Qwen2.5-VL vision tower (ViT with windowed attention and a 2x2 patch merger)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 2048
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    tokens_per_second: int = 2
    hidden_act: str = "silu"
    # Qwen3-VL (``ModelConfig.family``): a learned num_position_embeddings-entry position table interpolated to
    # each frame's grid (0: none), and the blocks whose outputs go through their own mergers into the first
    # decoder layers (DeepStack). window_size 0: no windows (every block attends to whole frames).
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    # The image processor's normalization (preprocessor_config.json's, not config.json's): OpenAI CLIP's for
    # Qwen2.5-VL, 0.5 / 0.5 for Qwen3-VL (``hf_config.py`` sets it by family).
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    # Qwen3-VL's videos: each temporal step written as "<t seconds>" + its frame's pads between vision start and
    # end (``tokenizer.render_messages``); its positions take time from that text, not from tokens_per_second.
    video_timestamps: bool = False
    # Parameter layout, not architecture (never in config.json): fused rows interleaved per this many
    # tensor-parallel ranks (models/vl/fused.py); qkv_groups / mlp_groups: what divides evenly.
    fuse_groups: int = 1

    def __post_init__(self):
        _require(self.fuse_groups >= 1, "vision.fuse_groups", self.fuse_groups, "must be >= 1")
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "out_hidden_size"):
            _require(getattr(self, name) > 0, f"vision.{name}", getattr(self, name), "must be > 0")
        _require(self.window_size >= 0, "vision.window_size", self.window_size, "must be >= 0 (0: no windows)")
        _require(self.hidden_size % self.num_heads == 0, "vision.num_heads", self.num_heads,
                 f"must divide vision.hidden_size={self.hidden_size}")
        _require(self.head_dim % 4 == 0, "vision.hidden_size", self.hidden_size,
                 "head_dim must be a multiple of 4 (2-D rotary over h and w)")
        unit = self.patch_size * self.spatial_merge_size
        _require(self.window_size % unit == 0, "vision.window_size", self.window_size,
                 f"must be a multiple of patch_size*spatial_merge_size={unit}")
        _require(all(0 <= i < self.depth for i in self.fullatt_block_indexes),
                 "vision.fullatt_block_indexes", self.fullatt_block_indexes,
                 f"each index must be in [0, depth={self.depth})")
        _require(all(0 <= i < self.depth for i in self.deepstack_visual_indexes),
                 "vision.deepstack_visual_indexes", self.deepstack_visual_indexes,
                 f"each index must be in [0, depth={self.depth})")
        side = math.isqrt(self.num_position_embeddings)
        _require(self.num_position_embeddings >= 0 and side * side == self.num_position_embeddings,
                 "vision.num_position_embeddings", self.num_position_embeddings, "must be a square (or 0: none)")
        _require(self.hidden_act in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu"),
                 "vision.hidden_act", self.hidden_act, "one of silu, gelu, gelu_pytorch_tanh, quick_gelu")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def qkv_groups(self) -> int:
        """Row groups of the fused ``attn.qkv`` (one per engine TP rank: each holds whole heads)."""
        return math.gcd(self.fuse_groups, self.num_heads)

    @property
    def mlp_groups(self) -> int:
        """Row groups of the fused ``mlp.gate_up_proj``."""
        return math.gcd(self.fuse_groups, self.intermediate_size)

    @property
    def patch_dim(self) -> int:
        """Length of one flattened (C, T, P, P) patch in ``pixel_values``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merger_window(self) -> int:
        """Window side in merged (LLM) tokens; 1 without windows (``window_size`` 0: the layout's windows are
        then single merge units, which no block attends over)."""
        return max(1, self.window_size // self.spatial_merge_size // self.patch_size)

    @property
    def embed_width(self) -> int:
        """Width of one vision token's embeddings as the tower returns them: the merger's output, then each
        DeepStack merger's, side by side (the vision buffer's row, ``vision_chunks.py``)."""
        return self.out_hidden_size * (1 + len(self.deepstack_visual_indexes))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextConfig:
    """Qwen2 decoder with M-RoPE."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 11008
    num_hidden_layers: int = 36
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    hidden_act: str = "silu"
    # Qwen3 decoder: an explicit head_dim (0: hidden_size / num_attention_heads), q/k/v biases (Qwen2's), an RMSNorm
    # on each head's q and k, and M-RoPE's t/h/w bands interleaved instead of in three blocks.
    attention_head_dim: int = 0
    qkv_bias: bool = True
    qk_norm: bool = False
    mrope_interleaved: bool = False
    # Parameter layout (see VisionConfig.fuse_groups) and the vocabulary rows' padding multiple (vLLM: 64).
    fuse_groups: int = 1
    vocab_multiple: int = 1

    def __post_init__(self):
        _require(self.fuse_groups >= 1, "text.fuse_groups", self.fuse_groups, "must be >= 1")
        _require(self.vocab_multiple >= 1, "text.vocab_multiple", self.vocab_multiple, "must be >= 1")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            _require(getattr(self, name) > 0, f"text.{name}", getattr(self, name), "must be > 0")
        _require(self.attention_head_dim > 0 or self.hidden_size % self.num_attention_heads == 0,
                 "text.num_attention_heads", self.num_attention_heads,
                 f"must divide text.hidden_size={self.hidden_size} (or give text.head_dim)")
        _require(self.attention_head_dim >= 0 and self.attention_head_dim % 2 == 0, "text.head_dim",
                 self.attention_head_dim, "must be even and >= 0 (0: hidden_size / num_attention_heads)")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "text.num_key_value_heads",
                 self.num_key_value_heads, f"must divide num_attention_heads={self.num_attention_heads}")
        _require(len(self.mrope_section) == 3 and sum(self.mrope_section) * 2 == self.head_dim,
                 "text.mrope_section", self.mrope_section,
                 f"needs 3 entries summing to head_dim/2={self.head_dim // 2}")
        _require(self.hidden_act == "silu", "text.hidden_act", self.hidden_act, "only silu is supported")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def qkv_groups(self) -> int:
        """Row groups of the fused ``qkv_proj`` (one per engine TP rank; whole KV heads in each)."""
        return math.gcd(self.fuse_groups, self.num_key_value_heads)

    @property
    def mlp_groups(self) -> int:
        """Row groups of the fused ``gate_up_proj``."""
        return math.gcd(self.fuse_groups, self.intermediate_size)

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and lm_head parameters: the vocabulary padded to ``vocab_multiple``."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A whole model of one family (``FAMILIES``: HF's ``model_type``): vision tower, decoder, special token ids
    and dtype."""

    family: str = "qwen2_5_vl"
    vision: VisionConfig = dataclasses.field(default_factory=VisionConfig)
    text: TextConfig = dataclasses.field(default_factory=TextConfig)
    tie_word_embeddings: bool = False
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int = 151643
    eos_token_id: int = 151645
    pad_token_id: int = 151643
    dtype: str = "float32"

    def __post_init__(self):
        _require(self.dtype in DTYPES + INTERNAL_DTYPES, "model.dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        _require(self.family in FAMILIES, "model.family", self.family, f"one of {', '.join(FAMILIES)}")
        qwen3 = self.family == "qwen3_vl"
        v = self.vision
        _require((v.window_size == 0) == qwen3, "vision.window_size", v.window_size,
                 "Qwen3-VL has no windows (0); Qwen2.5-VL needs them (> 0)")
        _require((v.num_position_embeddings > 0) == qwen3, "vision.num_position_embeddings",
                 v.num_position_embeddings, "Qwen3-VL needs its position table (> 0); Qwen2.5-VL has none (0)")
        _require(qwen3 or not v.deepstack_visual_indexes, "vision.deepstack_visual_indexes",
                 v.deepstack_visual_indexes, "DeepStack is Qwen3-VL's (empty for Qwen2.5-VL)")
        _require(len(v.deepstack_visual_indexes) <= self.text.num_hidden_layers, "vision.deepstack_visual_indexes",
                 v.deepstack_visual_indexes, f"at most text.num_hidden_layers={self.text.num_hidden_layers} taps")
        _require(self.vision.out_hidden_size == self.text.hidden_size, "vision.out_hidden_size",
                 self.vision.out_hidden_size, f"must equal text.hidden_size={self.text.hidden_size}")
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                     "bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, name)
            _require(0 <= v < self.text.vocab_size, f"model.{name}", v,
                     f"must be in [0, vocab_size={self.text.vocab_size})")

    def with_param_layout(self, fuse_groups: int = 1, vocab_multiple: int = 1) -> ModelConfig:
        """This model with the actor's parameters laid out for an engine: fused rows in ``fuse_groups``
        groups (its TP degree) and the vocabulary padded to ``vocab_multiple`` (``fused.py``)."""
        return dataclasses.replace(
            self, vision=dataclasses.replace(self.vision, fuse_groups=fuse_groups),
            text=dataclasses.replace(self.text, fuse_groups=fuse_groups, vocab_multiple=vocab_multiple))

    def hf_layout(self) -> ModelConfig:
        """The same model with the checkpoint's own layout (no groups, no padding)."""
        return self.with_param_layout(1, 1)

    # --- Hugging Face config.json <-> ModelConfig (``hf_config.py``) -------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, dtype: str | None = None) -> ModelConfig:
        """Builds a config from a Qwen2.5-VL or Qwen3-VL ``config.json`` dict (transformers 4.x or 5.x layout)."""
        from rollplex_jax.config.hf_config import model_kwargs

        return cls(**model_kwargs(d, dtype))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"model config file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config file {str(path)!r} is not valid JSON: {e}") from None
        cfg = cls.from_hf_dict(d, dtype=dtype)
        if os.path.basename(os.fspath(path)) != "config.json":  # a bare model config, not a checkpoint's
            return cfg
        from rollplex_jax.config.hf_config import read_processor_config, with_processor_config

        proc = read_processor_config(os.path.dirname(os.fspath(path)) or ".")
        return cfg if proc is None else dataclasses.replace(cfg, vision=with_processor_config(cfg.vision, *proc))

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict transformers 5 writes for this model (a Qwen2.5-VL one loads in 4.x too)."""
        from rollplex_jax.config.hf_config import hf_dict

        return hf_dict(self)


def tiny_model_config(**overrides) -> ModelConfig:
    """The tiny Qwen2.5-VL-shaped model used by tests and the CPU demo.

    Vocabulary 256 with the special ids at the top, vision width 32 with windows
    of 2x2 merged tokens (56 px), text width 64 with GQA 4:2.
    """
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, window_size=56,
                  out_hidden_size=64, fullatt_block_indexes=(1,), tokens_per_second=2)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                mrope_section=(2, 3, 3), max_position_embeddings=4096)
    vision.update(overrides.pop("vision", {}))
    text.update(overrides.pop("text", {}))
    ids = dict(image_token_id=250, video_token_id=251, vision_start_token_id=248,
               vision_end_token_id=249, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ids.update(overrides)
    return ModelConfig(vision=VisionConfig(**vision), text=TextConfig(**text), **ids)


def tiny_qwen3_vl_config(**overrides) -> ModelConfig:
    """A tiny Qwen3-VL-shaped model (tests): patch 16, a 4x4 learned position table, DeepStack from vision block 0
    into decoder layer 0, text width 64 with GQA 4:2 and an explicit head_dim of 32 (not 64 / 4)."""
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, window_size=0,
                  image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), video_timestamps=True,
                  out_hidden_size=64, fullatt_block_indexes=(0, 1), hidden_act="gelu_pytorch_tanh",
                  num_position_embeddings=16, deepstack_visual_indexes=(0,), tokens_per_second=1)
    text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, attention_head_dim=32,
                mrope_section=(6, 5, 5), max_position_embeddings=4096, qkv_bias=False, qk_norm=True,
                mrope_interleaved=True)
    vision.update(overrides.pop("vision", {}))
    vision["fullatt_block_indexes"] = tuple(range(vision["depth"]))
    text.update(overrides.pop("text", {}))
    ids = dict(image_token_id=250, video_token_id=251, vision_start_token_id=248,
               vision_end_token_id=249, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    ids.update(overrides)
    return ModelConfig(family="qwen3_vl", vision=VisionConfig(**vision), text=TextConfig(**text), **ids)
