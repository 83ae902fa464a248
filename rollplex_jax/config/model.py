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
    # Parameter layout, not architecture (never in config.json): fused rows interleaved per this many
    # tensor-parallel ranks (models/qwen2_5_vl/fused.py); qkv_groups / mlp_groups: what divides evenly.
    fuse_groups: int = 1

    def __post_init__(self):
        _require(self.fuse_groups >= 1, "vision.fuse_groups", self.fuse_groups, "must be >= 1")
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
            _require(getattr(self, name) > 0, f"vision.{name}", getattr(self, name), "must be > 0")
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
        """Window side in merged (LLM) tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size


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
    # Parameter layout (see VisionConfig.fuse_groups) and the vocabulary rows' padding multiple (vLLM: 64).
    fuse_groups: int = 1
    vocab_multiple: int = 1

    def __post_init__(self):
        _require(self.fuse_groups >= 1, "text.fuse_groups", self.fuse_groups, "must be >= 1")
        _require(self.vocab_multiple >= 1, "text.vocab_multiple", self.vocab_multiple, "must be >= 1")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads"):
            _require(getattr(self, name) > 0, f"text.{name}", getattr(self, name), "must be > 0")
        _require(self.hidden_size % self.num_attention_heads == 0, "text.num_attention_heads",
                 self.num_attention_heads, f"must divide text.hidden_size={self.hidden_size}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "text.num_key_value_heads",
                 self.num_key_value_heads, f"must divide num_attention_heads={self.num_attention_heads}")
        _require(len(self.mrope_section) == 3 and sum(self.mrope_section) * 2 == self.head_dim,
                 "text.mrope_section", self.mrope_section,
                 f"needs 3 entries summing to head_dim/2={self.head_dim // 2}")
        _require(self.hidden_act == "silu", "text.hidden_act", self.hidden_act, "only silu is supported")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

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
    """A whole Qwen2.5-VL model: vision tower, decoder, special token ids and dtype."""

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

    # --- Hugging Face config.json <-> ModelConfig -------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, dtype: str | None = None) -> ModelConfig:
        """Builds a config from a Qwen2.5-VL ``config.json`` dict (transformers 4.x or 5.x layout)."""
        if d.get("model_type") not in (None, "qwen2_5_vl"):
            raise ConfigError(f"model_type={d.get('model_type')!r} is not supported: expected 'qwen2_5_vl'")
        t = dict(d.get("text_config") or {})
        for k, v in d.items():  # transformers 4.x kept text fields at the top level
            if k not in ("text_config", "vision_config") and k not in t:
                t[k] = v
        v = d.get("vision_config") or {}
        rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
        vrope = v.get("rope_parameters") or {}
        hidden = t.get("hidden_size", TextConfig.hidden_size)
        text = TextConfig(
            vocab_size=t.get("vocab_size", TextConfig.vocab_size),
            hidden_size=hidden,
            intermediate_size=t.get("intermediate_size", TextConfig.intermediate_size),
            num_hidden_layers=t.get("num_hidden_layers", TextConfig.num_hidden_layers),
            num_attention_heads=t.get("num_attention_heads", TextConfig.num_attention_heads),
            num_key_value_heads=t.get("num_key_value_heads", TextConfig.num_key_value_heads),
            rms_norm_eps=t.get("rms_norm_eps", TextConfig.rms_norm_eps),
            rope_theta=rope.get("rope_theta", t.get("rope_theta", TextConfig.rope_theta)),
            mrope_section=tuple(rope.get("mrope_section", TextConfig.mrope_section)),
            max_position_embeddings=t.get("max_position_embeddings", TextConfig.max_position_embeddings),
            hidden_act=t.get("hidden_act", "silu"),
        )
        vision = VisionConfig(
            depth=v.get("depth", VisionConfig.depth),
            hidden_size=v.get("hidden_size", VisionConfig.hidden_size),
            intermediate_size=v.get("intermediate_size", VisionConfig.intermediate_size),
            num_heads=v.get("num_heads", VisionConfig.num_heads),
            in_channels=v.get("in_channels", v.get("in_chans", 3)),
            patch_size=v.get("patch_size", VisionConfig.patch_size),
            spatial_merge_size=v.get("spatial_merge_size", VisionConfig.spatial_merge_size),
            temporal_patch_size=v.get("temporal_patch_size", VisionConfig.temporal_patch_size),
            window_size=v.get("window_size", VisionConfig.window_size),
            out_hidden_size=v.get("out_hidden_size", hidden),
            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", VisionConfig.fullatt_block_indexes)),
            rope_theta=vrope.get("rope_theta", 10000.0),
            tokens_per_second=v.get("tokens_per_second", VisionConfig.tokens_per_second),
            hidden_act=v.get("hidden_act", "silu"),
        )
        tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
        ids = {k: d.get(k, t.get(k, getattr(cls, k, None))) for k in (
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
            "bos_token_id", "eos_token_id", "pad_token_id")}
        ids = {k: (val[0] if isinstance(val, list) else val) for k, val in ids.items()}
        ids = {k: val for k, val in ids.items() if val is not None}
        if ids.get("pad_token_id") is None:
            ids["pad_token_id"] = ids.get("eos_token_id", 0)
        if dtype is None:
            dtype = {"bfloat16": "bfloat16"}.get(d.get("dtype", d.get("torch_dtype")), "float32")
        return cls(vision=vision, text=text, tie_word_embeddings=bool(tie), dtype=dtype, **ids)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"model config file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config file {str(path)!r} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d, dtype=dtype)

    def to_hf_dict(self) -> dict:
        """The ``config.json`` dict transformers 5 writes for this model (loadable by 4.x too)."""
        t, v = self.text, self.vision
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "dtype": self.dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "text_config": {
                "model_type": "qwen2_5_vl_text",
                "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
                "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
                "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
                "rms_norm_eps": t.rms_norm_eps, "hidden_act": t.hidden_act,
                "max_position_embeddings": t.max_position_embeddings,
                "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta,
                                    "mrope_section": list(t.mrope_section)},
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id, "tie_word_embeddings": self.tie_word_embeddings,
            },
            "vision_config": {
                "model_type": "qwen2_5_vl_vision",
                "depth": v.depth, "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
                "window_size": v.window_size, "out_hidden_size": v.out_hidden_size,
                "fullatt_block_indexes": list(v.fullatt_block_indexes), "hidden_act": v.hidden_act,
                "tokens_per_second": v.tokens_per_second,
                "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
            },
        }


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
