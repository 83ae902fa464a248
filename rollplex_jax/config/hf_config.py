"""A checkpoint's ``config.json`` <-> ``ModelConfig``, for each model family (``model.FAMILIES``).

Field names and defaults follow transformers 5.25's ``Qwen2_5_VLConfig`` and ``Qwen3VLConfig`` (a field a
checkpoint leaves out takes transformers' default, so a config loads as transformers would load it); 4.x's
layout with the text fields at the top level is read too. Qwen3-VL's differences (``docs/qwen3_vl_survey.md``):
an explicit ``head_dim``, no q/k/v bias (``attention_bias``), an RMSNorm on q and k, interleaved M-RoPE; a vision
tower without windows (every block attends to whole frames), a learned position table
(``num_position_embeddings``) and DeepStack taps (``deepstack_visual_indexes``).
"""

from __future__ import annotations

import dataclasses
import json
import os

from rollplex_jax.config.model import FAMILIES, ConfigError, TextConfig, VisionConfig

_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "bos_token_id",
        "eos_token_id", "pad_token_id")

# transformers' defaults where the families differ (Qwen3VLTextConfig / Qwen3VLVisionConfig).
_QWEN3_TEXT = dict(rope_theta=500000.0, mrope_section=(24, 20, 20), head_dim=128)
_QWEN3_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                     out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=(8, 16, 24),
                     hidden_act="gelu_pytorch_tanh")


def model_kwargs(d: dict, dtype: str | None) -> dict:
    """``ModelConfig``'s keyword arguments from a ``config.json`` dict."""
    family = d.get("model_type") or "qwen2_5_vl"
    if family not in FAMILIES:
        raise ConfigError(f"model_type={family!r} is not supported: expected one of {', '.join(map(repr, FAMILIES))}")
    t = dict(d.get("text_config") or {})
    for k, v in d.items():  # transformers 4.x kept text fields at the top level
        if k not in ("text_config", "vision_config") and k not in t:
            t[k] = v
    text = _text(t, family)
    vision = _vision(d.get("vision_config") or {}, text.hidden_size, family)
    tie = d.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    ids = {k: d.get(k, t.get(k)) for k in _IDS}
    ids = {k: (val[0] if isinstance(val, list) else val) for k, val in ids.items()}
    ids = {k: val for k, val in ids.items() if val is not None}
    if ids.get("pad_token_id") is None:
        ids["pad_token_id"] = ids.get("eos_token_id", 0)
    if dtype is None:
        dtype = {"bfloat16": "bfloat16"}.get(d.get("dtype", d.get("torch_dtype")), "float32")
    return dict(family=family, vision=vision, text=text, tie_word_embeddings=bool(tie), dtype=dtype, **ids)


def _text(t: dict, family: str) -> TextConfig:
    qwen3 = family == "qwen3_vl"
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    theta = _QWEN3_TEXT["rope_theta"] if qwen3 else TextConfig.rope_theta
    section = _QWEN3_TEXT["mrope_section"] if qwen3 else TextConfig.mrope_section
    extra = {}
    if qwen3:
        if t.get("attention_bias", False):
            raise ConfigError("text_config.attention_bias=True is not supported for Qwen3-VL (its checkpoints have "
                              "no q/k/v/o biases)")
        extra = dict(attention_head_dim=t.get("head_dim", _QWEN3_TEXT["head_dim"]), qkv_bias=False, qk_norm=True,
                     mrope_interleaved=True)
    return TextConfig(
        vocab_size=t.get("vocab_size", TextConfig.vocab_size),
        hidden_size=t.get("hidden_size", TextConfig.hidden_size),
        intermediate_size=t.get("intermediate_size", TextConfig.intermediate_size),
        num_hidden_layers=t.get("num_hidden_layers", TextConfig.num_hidden_layers),
        num_attention_heads=t.get("num_attention_heads", TextConfig.num_attention_heads),
        num_key_value_heads=t.get("num_key_value_heads", TextConfig.num_key_value_heads),
        rms_norm_eps=t.get("rms_norm_eps", TextConfig.rms_norm_eps),
        rope_theta=rope.get("rope_theta", t.get("rope_theta", theta)),
        mrope_section=tuple(rope.get("mrope_section", section)),
        max_position_embeddings=t.get("max_position_embeddings", TextConfig.max_position_embeddings),
        hidden_act=t.get("hidden_act", "silu"),
        **extra,
    )


def _vision(v: dict, text_hidden: int, family: str) -> VisionConfig:
    defaults = {f: getattr(VisionConfig, f) for f in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                                      "patch_size", "hidden_act")}
    extra: dict = dict(window_size=v.get("window_size", VisionConfig.window_size),
                       tokens_per_second=v.get("tokens_per_second", VisionConfig.tokens_per_second))
    if family == "qwen3_vl":
        defaults.update({k: _QWEN3_VISION[k] for k in defaults})
        extra = dict(window_size=0, tokens_per_second=1, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                     video_timestamps=True,
                     num_position_embeddings=v.get("num_position_embeddings",
                                                   _QWEN3_VISION["num_position_embeddings"]),
                     deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes",
                                                          _QWEN3_VISION["deepstack_visual_indexes"])))
    depth = v.get("depth", defaults["depth"])
    full = tuple(range(depth)) if family == "qwen3_vl" else \
        tuple(v.get("fullatt_block_indexes", VisionConfig.fullatt_block_indexes))
    return VisionConfig(
        depth=depth,
        hidden_size=v.get("hidden_size", defaults["hidden_size"]),
        intermediate_size=v.get("intermediate_size", defaults["intermediate_size"]),
        num_heads=v.get("num_heads", defaults["num_heads"]),
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        patch_size=v.get("patch_size", defaults["patch_size"]),
        spatial_merge_size=v.get("spatial_merge_size", VisionConfig.spatial_merge_size),
        temporal_patch_size=v.get("temporal_patch_size", VisionConfig.temporal_patch_size),
        out_hidden_size=v.get("out_hidden_size", text_hidden),
        fullatt_block_indexes=full,
        rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        hidden_act=v.get("hidden_act", defaults["hidden_act"]),
        **extra,
    )


def hf_dict(cfg) -> dict:
    """The ``config.json`` dict transformers 5 writes for ``cfg`` (a ``ModelConfig``)."""
    t, v = cfg.text, cfg.vision
    qwen3 = cfg.family == "qwen3_vl"
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section)}
    text = {
        "model_type": f"{cfg.family}_text",
        "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "rms_norm_eps": t.rms_norm_eps, "hidden_act": t.hidden_act,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_parameters": {**rope, "mrope_interleaved": True} if qwen3 else rope,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id, "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    vision = {
        "model_type": "qwen3_vl" if qwen3 else "qwen2_5_vl_vision",
        "depth": v.depth, "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
        "spatial_merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
    }
    if qwen3:
        text.update(head_dim=t.head_dim, attention_bias=False)
        vision.update(out_hidden_size=v.out_hidden_size, hidden_act=v.hidden_act,
                      num_position_embeddings=v.num_position_embeddings,
                      deepstack_visual_indexes=list(v.deepstack_visual_indexes))
    else:  # the key order transformers writes (configs/models/tiny.json is compared as text)
        vision.update(window_size=v.window_size, out_hidden_size=v.out_hidden_size,
                      fullatt_block_indexes=list(v.fullatt_block_indexes), hidden_act=v.hidden_act,
                      tokens_per_second=v.tokens_per_second,
                      rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    arch = "Qwen3VLForConditionalGeneration" if qwen3 else "Qwen2_5_VLForConditionalGeneration"
    return {
        "architectures": [arch], "model_type": cfg.family, "dtype": cfg.dtype,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        **{k: getattr(cfg, k) for k in _IDS[:4]},
        "text_config": text, "vision_config": vision,
    }


# the processor files a checkpoint may carry: transformers 4.x's, or 5.x's with the image processor nested
PROCESSOR_FILES = (("preprocessor_config.json", None), ("processor_config.json", "image_processor"))
_SIZES = (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
          ("temporal_patch_size", "temporal_patch_size"))


def read_processor_config(model_dir: str | os.PathLike) -> tuple[str, dict] | None:
    """(path, the image processor's settings) of a checkpoint directory's processor file, or None without one."""
    for name, key in PROCESSOR_FILES:
        path = os.path.join(os.fspath(model_dir), name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"processor config {path!r} is not valid JSON: {e}") from None
        d = d.get(key) if key else d
        if isinstance(d, dict):
            return path, d
    return None


def with_processor_config(vision: VisionConfig, path: str, d: dict) -> VisionConfig:
    """``vision`` with the checkpoint's image normalization (``image_mean`` / ``image_std`` of its processor file
    ``path``), after checking that the file cuts the patches the weights take (patch, merge and temporal sizes
    equal the config's) and rescales and normalizes as the pipeline does. Min / max pixels stay flags
    (``--min_pixels`` / ``--max_pixels``: a run's budget, not the model's)."""
    for key, field in _SIZES:
        if key in d and int(d[key]) != getattr(vision, field):
            raise ConfigError(f"{path}: {key}={d[key]} but config.json's vision {field} is "
                              f"{getattr(vision, field)}: the image processor must cut the patches the model's "
                              f"weights take; fix one of the two files")
    if d.get("do_rescale", True) is False or abs(float(d.get("rescale_factor", 1 / 255)) - 1 / 255) > 1e-9:
        raise ConfigError(f"{path}: do_rescale / rescale_factor other than 1/255 is not supported (pixels are "
                          "rescaled by 1/255 as Qwen's processors do)")
    if d.get("do_normalize", True) is False:
        raise ConfigError(f"{path}: do_normalize=false is not supported (Qwen's processors normalize)")
    norm = {}
    for key in ("image_mean", "image_std"):
        if key in d:
            x = d[key]
            x = [x] * 3 if isinstance(x, (int, float)) else list(x)
            if len(x) != 3 or (key == "image_std" and min(x) <= 0):
                raise ConfigError(f"{path}: {key}={d[key]!r} is not three channel values (std > 0)")
            norm[key] = tuple(float(v) for v in x)
    return dataclasses.replace(vision, **norm)
