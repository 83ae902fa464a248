"""Qwen2.5-VL parameters: one flat pytree ``{name: array}`` in the rollout engine's tensor layout.

Names are those of a Qwen2.5-VL safetensors checkpoint on disk (``model.layers.N...``,
``visual.blocks.N...``, ``lm_head.weight``) except the fused ones (``fused.py``): the decoder's
``self_attn.qkv_proj`` (q, k, v) and ``mlp.gate_up_proj`` (gate, up), the vision blocks'
``mlp.gate_up_proj`` and ``attn.qkv`` (rows grouped per engine TP rank), and the vocabulary rows padded
to ``text.vocab_multiple``: vLLM's layout, so an engine aliases its tensors instead of rebuilding them.
Every linear weight is ``[out, in]`` as in torch (no transpose for DLPack). ``checkpoint_specs`` gives
the checkpoint's own tensors (what ``hf_checkpoint.py`` reads and writes, through ``fused.to_actor`` /
``to_hf``). ``lm_head.weight`` is absent when the embeddings are tied.

Every parameter carries logical axis names (``logical_axes``) that sharding
rules map onto mesh axes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rollplex_jax.config import ModelConfig
from rollplex_jax.models.family import family_of
from rollplex_jax.models.vl.fused import fused_tensors, to_actor, vocab_tensors

Params = dict[str, jax.Array]

# (shape, logical axes) per parameter name.
Spec = tuple[tuple[int, ...], tuple[str | None, ...]]


def _vision_specs(cfg: ModelConfig) -> dict[str, Spec]:
    return family_of(cfg).vision_specs(cfg)


def _text_specs(cfg: ModelConfig) -> dict[str, Spec]:
    t = cfg.text
    d, f, hd = t.hidden_size, t.intermediate_size, t.head_dim
    q, kv = t.num_attention_heads * hd, t.num_key_value_heads * hd
    specs: dict[str, Spec] = {
        "model.embed_tokens.weight": ((t.vocab_size, d), ("vocab", "embed")),
        "model.norm.weight": ((d,), ("norm",)),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = ((t.vocab_size, d), ("vocab", "embed"))
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        specs.update({
            p + "input_layernorm.weight": ((d,), ("norm",)),
            p + "post_attention_layernorm.weight": ((d,), ("norm",)),
            p + "self_attn.q_proj.weight": ((q, d), ("q_heads", "embed")),
            **({p + "self_attn.q_proj.bias": ((q,), ("q_heads",))} if t.qkv_bias else {}),
            p + "self_attn.k_proj.weight": ((kv, d), ("kv_heads", "embed")),
            **({p + "self_attn.k_proj.bias": ((kv,), ("kv_heads",))} if t.qkv_bias else {}),
            p + "self_attn.v_proj.weight": ((kv, d), ("kv_heads", "embed")),
            **({p + "self_attn.v_proj.bias": ((kv,), ("kv_heads",))} if t.qkv_bias else {}),
            **({p + "self_attn.q_norm.weight": ((hd,), ("norm",)),
                p + "self_attn.k_norm.weight": ((hd,), ("norm",))} if t.qk_norm else {}),
            p + "self_attn.o_proj.weight": ((d, q), ("embed", "q_heads")),
            p + "mlp.gate_proj.weight": ((f, d), ("mlp", "embed")),
            p + "mlp.up_proj.weight": ((f, d), ("mlp", "embed")),
            p + "mlp.down_proj.weight": ((d, f), ("embed", "mlp")),
        })
    return specs


def checkpoint_specs(cfg: ModelConfig) -> dict[str, Spec]:
    """Shape and logical axes of every tensor of a checkpoint (separate q/k/v, gate/up; the vocabulary)."""
    return {**_vision_specs(cfg), **_text_specs(cfg)}


def param_specs(cfg: ModelConfig) -> dict[str, Spec]:
    """Shape and logical axes of every actor parameter (the fused layout, ``fused.py``), in checkpoint order."""
    hf = checkpoint_specs(cfg)
    fused = fused_tensors(cfg)
    first = {ft.sources[0]: ft for ft in fused.values()}
    consumed = {s for ft in fused.values() for s in ft.sources}
    out: dict[str, Spec] = {}
    for name, (shape, axes) in hf.items():
        if name in first:
            ft = first[name]
            out[ft.name] = ((ft.rows, *shape[1:]), axes)
        elif name not in consumed:
            out[name] = ((cfg.text.vocab_rows, *shape[1:]), axes) if name in vocab_tensors(cfg) else (shape, axes)
    return out


def logical_axes(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    return {k: axes for k, (_, axes) in param_specs(cfg).items()}


def param_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


def param_shapes(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    dt = param_dtype(cfg)
    return {k: jax.ShapeDtypeStruct(shape, dt) for k, (shape, _) in param_specs(cfg).items()}


def count_params(shapes: dict) -> int:
    return int(sum(math.prod(s.shape) for s in shapes.values()))


def init_params(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
    """Random init as transformers does for Qwen2.5-VL: N(0, std) weights, zero biases, unit norms.

    Deterministic in ``key``: each checkpoint tensor's key is folded from a stable hash of its name (the
    values do not depend on the layout), then the tensors are laid out as the actor's (``fused.to_actor``).
    """
    return to_actor(init_checkpoint_tensors(cfg, key, std), cfg)


def init_checkpoint_tensors(cfg: ModelConfig, key: jax.Array, std: float = 0.02) -> Params:
    """``init_params`` in the checkpoint's layout (``checkpoint_specs``)."""
    dt = param_dtype(cfg)
    out: Params = {}
    for name, (shape, _) in checkpoint_specs(cfg).items():
        if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight", "ln_q.weight")):
            out[name] = jnp.ones(shape, dt)
        elif name.endswith(".bias"):
            out[name] = jnp.zeros(shape, dt)
        else:
            k = jax.random.fold_in(key, _stable_hash(name))
            out[name] = (std * jax.random.normal(k, shape, jnp.float32)).astype(dt)
    return out


def _stable_hash(name: str) -> int:
    h = 2166136261
    for ch in name.encode():
        h = ((h ^ ch) * 16777619) & 0x7FFFFFFF
    return h


def params_sha256(params: Params) -> str:
    """Hash of parameter names, dtypes, shapes and bytes (order-independent), for determinism checks."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(params):
        a = np.asarray(jax.device_get(params[name]))
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(str(a.shape).encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
