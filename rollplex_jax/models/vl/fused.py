"""The actor's parameter layout: the rollout engine's fused tensors, converted to and from checkpoint tensors.

A Qwen2.5-VL checkpoint keeps q, k and v (and gate and up) as separate tensors; vLLM fuses them
(``qkv_proj``, ``gate_up_proj``, the vision ``attn.qkv`` split per rank) and pads the vocabulary to a
multiple of 64. The actor stores its parameters the engine's way, so that a training shard *is* the
engine rank's tensor (``sharing.py`` classifies it aligned) instead of a source it must be rebuilt from:

- a fused parameter is its parts (q, k, v / gate, up) cut into ``groups`` equal row blocks and stored
  group by group: ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]``. With ``groups`` = the engine's TP degree, rows
  ``[r R/g, (r+1) R/g)`` are rank r's ``[q_r; k_r; v_r]``: a contiguous row block, which a training TP of
  the same degree holds on one device. With one group it is ``[q; k; v]``, and the checkpoint's q, k, v
  are contiguous row ranges of it (the transformers engine reads them as zero-copy slices);
- the embedding and ``lm_head`` have ``vocab_rows`` rows (zero rows after the vocabulary, never read:
  ``text.lm_logits`` returns the vocabulary's logits only, so they get no gradient).

Training is unchanged by the layout: one matmul produces the fused output, which ``split_last`` cuts
into the parts (a reshape and slices). ``to_actor`` / ``to_hf`` convert a checkpoint's tensors (numpy
or jax) exactly (a permutation of rows and zero padding), both ways.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from rollplex_jax.config.model import ModelConfig
from rollplex_jax.models.family import family_of


@dataclasses.dataclass(frozen=True)
class FusedTensor:
    """One fused actor parameter: checkpoint ``sources`` concatenated along dim 0 are its ``parts`` (row
    counts, in order; a source may hold several parts, as the vision ``attn.qkv``), stored in ``groups``
    row groups. ``heads``: heads per part (the engine splits a part by whole heads)."""

    name: str
    sources: tuple[str, ...]
    parts: tuple[int, ...]
    groups: int
    heads: tuple[int, ...] | None = None

    @property
    def rows(self) -> int:
        return sum(self.parts)


def fused_tensors(cfg: ModelConfig) -> dict[str, FusedTensor]:
    """Every fused actor parameter by name (weights and biases)."""
    t, v = cfg.text, cfg.vision
    q, kv, f = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim, t.intermediate_size
    heads = (t.num_attention_heads, t.num_key_value_heads, t.num_key_value_heads)
    out: dict[str, FusedTensor] = {}

    def add(name, sources, parts, groups, kinds, heads=None):
        for k in kinds:
            out[f"{name}.{k}"] = FusedTensor(f"{name}.{k}", tuple(f"{s}.{k}" for s in sources), parts, groups,
                                             heads)

    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        add(p + "self_attn.qkv_proj", [p + "self_attn." + s for s in ("q_proj", "k_proj", "v_proj")],
            (q, kv, kv), t.qkv_groups, ("weight", "bias") if t.qkv_bias else ("weight",), heads)
        add(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], (f, f), t.mlp_groups, ("weight",))
    d, vf = v.hidden_size, v.intermediate_size
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        add(p + "attn.qkv", [p + "attn.qkv"], (d, d, d), v.qkv_groups, ("weight", "bias"), (v.num_heads,) * 3)
        if family_of(cfg).gated_vision_mlp:  # Qwen3-VL's is not (linear_fc1, linear_fc2)
            add(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], (vf, vf), v.mlp_groups,
                ("weight", "bias"))
    return out


def vocab_tensors(cfg: ModelConfig) -> tuple[str, ...]:
    """The parameters with ``vocab_rows`` rows (the embedding; lm_head unless tied)."""
    return ("model.embed_tokens.weight",) + (() if cfg.tie_word_embeddings else ("lm_head.weight",))


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def fuse_rows(parts: Sequence, groups: int):
    """Part arrays [s_j, ...] -> the fused array [sum s_j, ...] in ``groups`` row groups."""
    xp = _xp(parts[0])
    blocks = [a.reshape(groups, a.shape[0] // groups, *a.shape[1:]) for a in parts]
    out = xp.concatenate(blocks, axis=1)
    return out.reshape(-1, *out.shape[2:])


def unfuse_rows(a, parts: Sequence[int], groups: int) -> list:
    """The fused array [R, ...] -> its part arrays [s_j, ...] (``fuse_rows`` inverted)."""
    g = a.reshape(groups, a.shape[0] // groups, *a.shape[1:])
    out, off = [], 0
    for s in parts:
        n = s // groups
        out.append(g[:, off:off + n].reshape(s, *a.shape[1:]))
        off += n
    return out


def split_last(y, parts: Sequence[int], groups: int) -> list:
    """A fused matmul's output [..., R] -> the parts [..., s_j] (as ``unfuse_rows`` on the last axis)."""
    lead = y.shape[:-1]
    g = y.reshape(*lead, groups, y.shape[-1] // groups)
    out, off = [], 0
    for s in parts:
        n = s // groups
        out.append(g[..., off:off + n].reshape(*lead, s))
        off += n
    return out


def _split_sources(ft: FusedTensor, arrays: Sequence) -> list:
    """Source arrays -> part arrays (a source holding several parts is cut into equal-or-stated rows)."""
    xp = _xp(arrays[0])
    cat = arrays[0] if len(arrays) == 1 else xp.concatenate(list(arrays), axis=0)
    out, off = [], 0
    for s in ft.parts:
        out.append(cat[off:off + s])
        off += s
    return out


def to_actor(hf: Mapping, cfg: ModelConfig) -> dict:
    """Checkpoint tensors (``checkpoint_specs`` names) -> the actor's parameters (``param_specs``)."""
    fused = fused_tensors(cfg)
    consumed = {s for ft in fused.values() for s in ft.sources}
    out = {k: v for k, v in hf.items() if k not in consumed}
    for name, ft in fused.items():
        out[name] = fuse_rows(_split_sources(ft, [hf[s] for s in ft.sources]), ft.groups)
    rows = cfg.text.vocab_rows
    for name in vocab_tensors(cfg):
        a = out[name]
        if a.shape[0] != rows:
            xp = _xp(a)
            out[name] = xp.concatenate([a, xp.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)], axis=0)
    return out


def to_hf(params: Mapping, cfg: ModelConfig) -> dict:
    """The actor's parameters -> checkpoint tensors (``to_actor`` inverted; padding rows dropped)."""
    fused = fused_tensors(cfg)
    out = {k: v for k, v in params.items() if k not in fused}
    for name, ft in fused.items():
        parts = unfuse_rows(params[name], ft.parts, ft.groups)
        if len(ft.sources) == 1:
            xp = _xp(parts[0])
            out[ft.sources[0]] = xp.concatenate(parts, axis=0)
        else:
            out.update(zip(ft.sources, parts, strict=True))
    for name in vocab_tensors(cfg):
        out[name] = out[name][:cfg.text.vocab_size]
    return out


def layout_record(cfg: ModelConfig) -> dict[str, int]:
    """The actor's parameter layout as a checkpoint records it: a checkpoint restored under another layout
    would read rows in the wrong order, with the same shapes (``runner`` refuses it)."""
    return {"text_fuse_groups": cfg.text.fuse_groups, "vision_fuse_groups": cfg.vision.fuse_groups,
            "vocab_multiple": cfg.text.vocab_multiple}


def param_layout(train_tp: int, rollout_tp: int, engine: str) -> dict[str, int]:
    """The layout that costs training nothing and lets the engine alias most: row groups = the rollout TP
    when the training TP divides it (each training shard then holds whole groups), else the training TP;
    the vocabulary padded to vLLM's 64 for ``--engine=vllm``."""
    groups = rollout_tp if rollout_tp % train_tp == 0 else train_tp
    return {"fuse_groups": groups, "vocab_multiple": 64 if engine == "vllm" else 1}
