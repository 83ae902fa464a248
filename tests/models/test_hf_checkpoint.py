"""hf_checkpoint: loads what transformers writes (single file, sharded, tied, untied, bf16, both
tensor-name spellings) bit-exactly, writes what transformers loads, and names what is wrong."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from safetensors.torch import save_file as torch_save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.vl.fused import to_hf
from rollplex_jax.models.vl.hf_checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from rollplex_jax.models.vl.params import param_specs

SHARD = "20KB"  # the tiny model is ~760 KB in f32: forces many shards


def hf_model(tie: bool, dtype=torch.float32, seed: int = 0):
    """A tiny random transformers Qwen2.5-VL; every tensor (norms and biases too) random."""
    d = tiny_model_config(tie_word_embeddings=tie).to_hf_dict()
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**d))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.to(dtype).eval()


def our_name(hf_name: str) -> str:
    """transformers' in-memory state_dict name -> on-disk checkpoint name."""
    if hf_name.startswith("model.language_model."):
        return "model." + hf_name[len("model.language_model."):]
    if hf_name.startswith("model.visual."):
        return "visual." + hf_name[len("model.visual."):]
    return hf_name


def torch_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()


def jax_bytes(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def expected(model) -> dict[str, torch.Tensor]:
    sd = {our_name(k): v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        assert torch_bytes(sd.pop("lm_head.weight")) == torch_bytes(sd["model.embed_tokens.weight"])
    return sd


def assert_equals_torch(params, sd, cfg=None):
    """The actor's params, in the checkpoint's layout (fused.to_hf), hold exactly the torch tensors' bytes."""
    params = to_hf(params, cfg or tiny_model_config(tie_word_embeddings="lm_head.weight" not in params))
    assert set(params) == set(sd)
    for k, t in sd.items():
        assert params[k].shape == tuple(t.shape), k
        assert jax_bytes(params[k]) == torch_bytes(t), k


def assert_same_bytes(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert jax_bytes(a[k]) == jax_bytes(b[k]), k


def weight_files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    return hf_model(tie=request.param)


@pytest.mark.parametrize("shard", [None, SHARD], ids=["single", "sharded"])
def test_load_transformers_checkpoint(model, shard, tmp_path):
    kw = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(tmp_path, **kw)
    assert (len(weight_files(tmp_path)) > 3) == (shard is not None)
    cfg, params = load_hf_checkpoint(tmp_path)
    assert cfg == tiny_model_config(tie_word_embeddings=model.config.tie_word_embeddings)
    assert list(params) == list(param_specs(cfg))
    assert all(isinstance(v, jnp.ndarray) and v.dtype == jnp.float32 for v in params.values())
    assert_equals_torch(params, expected(model))


@pytest.mark.parametrize("shard", [None, 20_000], ids=["single", "sharded"])
def test_save_round_trips_and_loads_in_transformers(model, shard, tmp_path):
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_checkpoint(tmp_path / "hf")
    written = save_hf_checkpoint(tmp_path / "ours", cfg, params, max_shard_bytes=shard)
    assert written == weight_files(tmp_path / "ours")
    if shard is None:
        assert written == [SINGLE_FILE]
    else:
        assert len(written) > 3 and (tmp_path / "ours" / INDEX_FILE).exists()
        index = json.loads((tmp_path / "ours" / INDEX_FILE).read_text())
        assert set(index["weight_map"]) == set(to_hf(params, cfg)) and set(index["weight_map"].values()) == set(written)
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in to_hf(params, cfg).values())
        for f in written:  # a tensor over the limit gets a shard of its own
            n_in = list(index["weight_map"].values()).count(f)
            assert n_in == 1 or os.path.getsize(tmp_path / "ours" / f) < shard + 4096  # + header
    for f in written:
        with safe_open(str(tmp_path / "ours" / f), framework="np") as fh:
            assert fh.metadata() == {"format": "pt"}

    cfg2, params2 = load_hf_checkpoint(tmp_path / "ours")
    assert cfg2 == cfg
    assert_same_bytes(params, params2)

    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert back.config.tie_word_embeddings == model.config.tie_word_embeddings
    sd, sd_back = model.state_dict(), back.state_dict()
    assert set(sd) == set(sd_back)
    for k in sd:
        assert torch_bytes(sd[k]) == torch_bytes(sd_back[k]), k


def test_resave_replaces_old_weight_files(tmp_path):
    model = hf_model(tie=False)
    model.save_pretrained(tmp_path, max_shard_size=SHARD)
    cfg, params = load_hf_checkpoint(tmp_path)
    save_hf_checkpoint(tmp_path, cfg, params)  # single file over a sharded set
    assert weight_files(tmp_path) == [SINGLE_FILE] and not (tmp_path / INDEX_FILE).exists()
    save_hf_checkpoint(tmp_path, cfg, params, max_shard_bytes=100_000)
    assert SINGLE_FILE not in weight_files(tmp_path) and (tmp_path / INDEX_FILE).exists()
    assert_same_bytes(params, load_hf_checkpoint(tmp_path)[1])


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_bf16_round_trip(tie, tmp_path):
    model = hf_model(tie=tie, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf", max_shard_size=SHARD)
    cfg, params = load_hf_checkpoint(tmp_path / "hf")
    assert cfg.dtype == "bfloat16"
    assert all(v.dtype == jnp.bfloat16 for v in params.values())
    assert_equals_torch(params, expected(model))

    save_hf_checkpoint(tmp_path / "ours", cfg, params, max_shard_bytes=10_000)
    with safe_open(str(tmp_path / "ours" / weight_files(tmp_path / "ours")[0]), framework="pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"BF16"}
    assert_same_bytes(params, load_hf_checkpoint(tmp_path / "ours")[1])
    back = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.bfloat16)
    sd, sd_back = model.state_dict(), back.state_dict()
    for k in sd:
        assert sd_back[k].dtype == torch.bfloat16 and torch_bytes(sd[k]) == torch_bytes(sd_back[k]), k


def test_dtype_override_casts(tmp_path):
    model = hf_model(tie=False)
    model.save_pretrained(tmp_path)
    cfg, params = load_hf_checkpoint(tmp_path, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    assert_equals_torch(params, {k: v.to(torch.bfloat16) for k, v in expected(model).items()})


def test_accepts_in_memory_names(tmp_path):
    """Files written from transformers' state_dict spell `model.language_model.*` / `model.visual.*`."""
    model = hf_model(tie=False)
    model.save_pretrained(tmp_path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.startswith("model.language_model.") for k in sd) and any(k.startswith("model.visual.") for k in sd)
    torch_save_file(sd, str(tmp_path / SINGLE_FILE), metadata={"format": "pt"})
    _, params = load_hf_checkpoint(tmp_path)
    assert_equals_torch(params, expected(model))


# ----------------------------------------------------------------------------- errors


@pytest.fixture()
def ours(tmp_path):
    """A checkpoint written by us from a tiny random model: (dir, cfg, params)."""
    model = hf_model(tie=False, seed=1)
    model.save_pretrained(tmp_path / "hf")
    cfg, params = load_hf_checkpoint(tmp_path / "hf")
    save_hf_checkpoint(tmp_path / "ours", cfg, params)
    return tmp_path / "ours", cfg, params


def rewrite(path, edit):
    """Reads a safetensors file, applies edit(dict) and writes it back."""
    with safe_open(str(path), framework="np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_missing_config(ours):
    d, _, _ = ours
    os.remove(d / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json.*does not exist"):
        load_hf_checkpoint(d)


def test_missing_weights(tmp_path):
    tmp_path.joinpath("config.json").write_text(json.dumps(tiny_model_config().to_hf_dict()))
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf_checkpoint(tmp_path)


def test_missing_tensor(ours):
    d, _, _ = ours
    names = ["model.layers.1.mlp.up_proj.weight", "visual.blocks.0.attn.qkv.bias"]
    rewrite(d / SINGLE_FILE, lambda t: [t.pop(n) for n in names])
    with pytest.raises(CheckpointError, match="missing tensors") as e:
        load_hf_checkpoint(d)
    assert all(n in str(e.value) for n in names)
    assert "unexpected" not in str(e.value) and "shape" not in str(e.value)


def test_wrong_shape(ours):
    d, _, _ = ours
    name = "model.layers.0.self_attn.k_proj.weight"
    rewrite(d / SINGLE_FILE, lambda t: t.update({name: t[name][:16]}))
    with pytest.raises(CheckpointError, match="shape mismatches") as e:
        load_hf_checkpoint(d)
    assert f"{name} (expected (32, 64), found (16, 64))" in str(e.value)


def test_unexpected_tensor(ours):
    d, _, _ = ours
    rewrite(d / SINGLE_FILE, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((4,), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(d)


def test_missing_shard(ours, tmp_path):
    _, cfg, params = ours
    d = tmp_path / "sharded"
    written = save_hf_checkpoint(d, cfg, params, max_shard_bytes=50_000)
    os.remove(d / written[2])
    with pytest.raises(CheckpointError, match="shard files listed in model.safetensors.index.json are missing") as e:
        load_hf_checkpoint(d)
    assert written[2] in str(e.value) and written[1] not in str(e.value)


def test_tensor_listed_in_index_but_not_in_shard(ours, tmp_path):
    _, cfg, params = ours
    d = tmp_path / "sharded"
    save_hf_checkpoint(d, cfg, params, max_shard_bytes=50_000)
    index = json.loads((d / INDEX_FILE).read_text())
    name = "model.norm.weight"
    rewrite(d / index["weight_map"][name], lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"{name} \(in {index['weight_map'][name]}\)"):
        load_hf_checkpoint(d)


def test_tied_lm_head_that_differs(tmp_path):
    model = hf_model(tie=True)
    model.save_pretrained(tmp_path)
    embed = "model.embed_tokens.weight"
    rewrite(tmp_path / SINGLE_FILE, lambda t: t.update({"lm_head.weight": t[embed].copy()}))
    _, params = load_hf_checkpoint(tmp_path)  # equal to the embedding: dropped
    assert "lm_head.weight" not in params
    rewrite(tmp_path / SINGLE_FILE, lambda t: t.update({"lm_head.weight": t[embed] + 1}))
    with pytest.raises(CheckpointError, match="ties word embeddings but 'lm_head.weight' differs"):
        load_hf_checkpoint(tmp_path)


def test_untied_without_lm_head(tmp_path):
    hf_model(tie=True).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = cfg["text_config"]["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): lm_head\.weight"):
        load_hf_checkpoint(tmp_path)


def test_save_checks_params(ours, tmp_path):
    _, cfg, params = ours
    bad = dict(params)
    del bad["model.norm.weight"]
    with pytest.raises(CheckpointError, match="params to save.*model.norm.weight"):
        save_hf_checkpoint(tmp_path / "bad", cfg, bad)
