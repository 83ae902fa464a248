"""Sharing by layout (issue 7): pure classification, and the binder on fake CPU devices.

Every rank's tensors must equal the TP shard vLLM (or the HF engine) would hold (numpy reference slicing,
exact), and share the training buffer whenever classified aligned or view; rebuilt buffers keep their
pointer across binds and hold the new values after an update.
"""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

from rollout_torch.weights import ShardedBinder
from rollplex_jax import engine_layouts as EL
from rollplex_jax import mesh as M
from rollplex_jax import sharing as S
from rollplex_jax.config import MeshConfig, ModelConfig, tiny_model_config
from rollplex_jax.models.qwen2_5_vl.params import init_params, param_specs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(**text):
    """Tiny model; vision heads 4 so that vision TP up to 4 is valid in vLLM."""
    return tiny_model_config(vision=dict(num_heads=4), text=text)


def _kinds(plan, target):
    return [next(rt.kind for rt in plan.ranks[p] if rt.target == target) for p in sorted(plan.ranks)]


# --- pure classification ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fsdp,tp", [(4, 1), (1, 4), (2, 2), (1, 2)])
def test_shard_box_matches_devices_indices_map(fsdp, tp):
    cfg = _cfg()
    mesh = M.train_mesh(MeshConfig(train_fsdp=fsdp, train_tp=tp))
    shape = dict(mesh.shape)
    specs = param_specs(cfg)
    extra = {"both": ((8, 12), PartitionSpec(("fsdp", "tp"))), "cols": ((4, 8), PartitionSpec(None, "tp"))}
    cases = [(s, M.partition_spec(s, ax, mesh)) for s, ax in specs.values()] + list(extra.values())
    for shp, spec in cases:
        idx = NamedSharding(mesh, spec).devices_indices_map(shp)
        for p, d in enumerate(mesh.devices.flat):
            coords = dict(zip(M.AXES, np.unravel_index(p, (fsdp, tp)), strict=True))
            want = tuple(sl.indices(n)[:2] for sl, n in zip(idx[d], shp, strict=True))
            assert S.shard_box(shp, spec, shape, coords) == want, (shp, spec, p)


def test_single_device_hf_is_all_aligned():
    rep = S.plan_sharing(_cfg(), MeshConfig()).report()
    assert rep["layout"] == "hf" and rep["counts"]["view"] == rep["counts"]["rebuilt"] == 0
    assert rep["fractions"]["aligned"] == 1.0 and rep["extra_bytes_per_device"] == 0
    json.dumps(rep)


def test_hf_layout_refuses_rollout_tp():
    with pytest.raises(ValueError, match="tensor parallelism"):
        S.plan_sharing(_cfg(), MeshConfig(train_tp=2, rollout_tp=2), layout="hf")


def test_same_tp_unfused_layout_is_all_aligned():
    cfg = _cfg(num_key_value_heads=4)  # 4 KV heads: no KV replication at t_r=4
    rep = S.plan_sharing(cfg, MeshConfig(train_tp=4, rollout_tp=4), layout="tp").report()
    assert rep["counts"]["view"] == rep["counts"]["rebuilt"] == 0 and rep["extra_bytes_per_device"] == 0


def test_kv_heads_fewer_than_ranks_are_replicated_and_rebuilt():
    plan = S.plan_sharing(_cfg(), MeshConfig(train_tp=4, rollout_tp=4), layout="tp")  # 2 KV heads, 4 ranks
    k = "model.layers.0.self_attn.k_proj.weight"
    assert _kinds(plan, k) == ["rebuilt"] * 4
    assert [plan.ranks[p][0].kind for p in range(4)] == ["aligned"] * 4  # patch_embed: replicated
    boxes = [next(rt.pieces for rt in plan.ranks[p] if rt.target == k) for p in range(4)]
    assert [b[0][1][0] for b in boxes] == [(0, 16), (0, 16), (16, 32), (16, 32)]  # head r // 2


def test_higher_rollout_tp_gives_views():
    plan = S.plan_sharing(_cfg(), MeshConfig(train_tp=1, rollout_tp=4), layout="tp")  # 1 train device, 4 ranks
    assert plan.devices == 4
    for t in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert _kinds(plan, t) == ["view"] * 4, t
    assert _kinds(plan, "model.norm.weight") == ["aligned"] * 4
    # train tp=2, t_r=4: the rank's rows are a slice of the local shard only where the placement lines up
    plan = S.plan_sharing(_cfg(), MeshConfig(train_tp=2, rollout_tp=4), layout="tp")
    assert _kinds(plan, "model.layers.0.mlp.up_proj.weight") == ["view", "rebuilt", "rebuilt", "view"]
    rep = plan.report()
    assert rep["counts"]["view"] > 0 and 0 < rep["extra_bytes_per_device"] < rep["second_copy_bytes_per_device"]


def test_lower_rollout_tp_than_training_is_rebuilt():
    plan = S.plan_sharing(_cfg(), MeshConfig(train_tp=4, rollout_tp=2), layout="tp")
    for t in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        assert _kinds(plan, t) == ["rebuilt"] * 4
    assert _kinds(plan, "model.norm.weight") == ["aligned"] * 4
    rt = next(rt for rt in plan.ranks[1] if rt.target == "model.layers.0.mlp.up_proj.weight")
    assert rt.local_bytes == 0 and rt.shape == (64, 64)  # rank 1 needs rows 64..128; device 1 holds 32..64
    strided = S.plan_sharing(_cfg(), MeshConfig(train_tp=4, rollout_tp=2), layout="tp", placement="strided")
    rt = next(rt for rt in strided.ranks[1] if rt.target == "model.layers.0.mlp.up_proj.weight")
    assert rt.local_bytes == rt.nbytes // 2  # strided: rank 0 on device 1 holds half of its rows locally


def test_vllm_fused_tensors_are_rebuilt():
    plan = S.plan_sharing(_cfg(num_key_value_heads=4), MeshConfig(train_tp=4, rollout_tp=4), engine="vllm")
    lm = "language_model.model.layers.0."
    for t in (lm + "self_attn.qkv_proj.weight", lm + "mlp.gate_up_proj.weight", "visual.blocks.0.attn.qkv.weight",
              "visual.blocks.0.mlp.gate_up_proj.weight"):
        assert _kinds(plan, t) == ["rebuilt"] * 4, t
    for t in (lm + "self_attn.o_proj.weight", lm + "mlp.down_proj.weight", "language_model.lm_head.weight"):
        assert _kinds(plan, t) == ["aligned"] * 4, t
    one = S.plan_sharing(_cfg(), MeshConfig(), engine="vllm", layout="vllm")  # one device, t_r=1
    assert _kinds(one, "visual.blocks.0.attn.qkv.weight") == ["aligned"]  # [q; k; v] rows are the HF tensor
    assert _kinds(one, lm + "self_attn.qkv_proj.weight") == ["rebuilt"]


def test_vocab_padding_rows_are_rebuilt():
    et = EL.EngineTensor("embed", ("e",), 0, pad_multiple=64)
    assert S.rank_pieces(et, {"e": (100, 8)}, 2, 0) == ((("e", ((0, 64), (0, 8))),), 0)
    assert S.rank_pieces(et, {"e": (100, 8)}, 2, 1) == ((("e", ((64, 100), (0, 8))),), 28)
    rt = S.classify_tensor(et, *S.rank_pieces(et, {"e": (100, 8)}, 2, 1), {"e": ((0, 100), (0, 8))}, 4)
    assert rt.kind == "rebuilt" and rt.shape == (64, 8)


def test_fsdp_with_one_rollout_rank_is_rebuilt():
    rep = S.plan_sharing(_cfg(), MeshConfig(train_fsdp=4), layout="hf").report()
    per = rep["per_device"][0]
    assert per["counts"]["view"] == 0 and per["counts"]["aligned"] > 0  # norms
    assert rep["fractions"]["rebuilt"] > 0.99
    assert rep["remote_bytes_per_device"] < rep["extra_bytes_per_device"]  # a quarter is local


def test_32b_paper_setting_is_classified_quickly():
    cfg = ModelConfig.from_json_file(os.path.join(REPO, "configs", "models", "qwen2_5_vl_32b.json"), dtype="bfloat16")
    rep = S.plan_sharing(cfg, MeshConfig(train_tp=8, rollout_tp=4), engine="vllm").report()
    assert rep["devices"] == 8 and rep["replicas"] == 2
    total = sum(rep["bytes"].values())
    n_params = sum(int(np.prod(s)) for s, _ in param_specs(cfg).values())
    assert abs(total - 2 * 2 * n_params) < total * 0.01  # 2 replicas x bf16 (norms repeat per rank)
    assert rep["second_copy_bytes_per_device"] == pytest.approx(2 * n_params / 4, rel=0.01)
    json.dumps(rep)


# --- the binder on fake CPU devices ----------------------------------------------------------------------

def _place(params, cfg, fsdp, tp):
    mesh = M.train_mesh(MeshConfig(train_fsdp=fsdp, train_tp=tp))
    return M.place(params, M.param_shardings(cfg, mesh))


def _expected(full, rt):
    parts = [full[s][tuple(slice(a, b) for a, b in box)] for s, box in rt.pieces]
    rest = parts[0].shape[1:] if parts else rt.shape[1:]
    parts.append(np.zeros((rt.pad_rows, *rest), np.float32))
    x = np.concatenate(parts, 0)
    return x.T if rt.transpose else x


def _buffer(shards, src, p, box):
    sh = next(s for s in shards[src] if s.position == p and s.box == box or
              s.position == p and all(a <= c and d <= b for (a, b), (c, d) in zip(s.box, box, strict=True)))
    return sh.array.unsafe_buffer_pointer(), sh.array.nbytes


def check_binding(cfg, params, plan, binder):
    """Binds ``params``: values exact; aligned/view share the shard's buffer. Returns rebuilt pointers."""
    full = {k: np.asarray(v) for k, v in params.items()}
    shards = S.device_shards(params)
    out = binder.bind(shards)
    rebuilt = {}
    for p, tensors in out.items():
        for rt in plan.ranks[p]:
            t = tensors[rt.target]
            np.testing.assert_array_equal(t.numpy(), _expected(full, rt), err_msg=f"{rt.target} @ {p}")
            if rt.kind == "rebuilt":
                rebuilt[(p, rt.target)] = t.data_ptr()
                continue
            ptr, n = _buffer(shards, rt.pieces[0][0], p, rt.pieces[0][1])
            if rt.kind == "aligned":
                assert t.data_ptr() == ptr, (rt.target, p)
            else:
                assert ptr <= t.data_ptr() < ptr + n, (rt.target, p)
    del out, tensors, t
    return rebuilt


CASES = [(4, 1, 1, "hf"), (1, 4, 1, "hf"), (2, 2, 1, "hf"), (1, 4, 4, "vllm"), (1, 4, 2, "vllm"), (1, 4, 1, "vllm"),
         (2, 2, 2, "vllm"), (2, 2, 4, "vllm"), (4, 1, 4, "tp"), (2, 2, 4, "tp"), (1, 4, 4, "tp"), (1, 2, 2, "tp")]


@pytest.mark.parametrize("fsdp,tp,t_r,layout", CASES)
def test_binder_per_rank(fsdp, tp, t_r, layout):
    cfg = _cfg()
    params = _place(init_params(cfg, jax.random.key(0)), cfg, fsdp, tp)
    plan = S.plan_for_params(params, layout, t_r, cfg=cfg)
    pure = S.plan_sharing(cfg, MeshConfig(train_fsdp=fsdp, train_tp=tp, rollout_tp=t_r), layout=layout)
    assert plan.ranks == pure.ranks  # the shardings of real arrays classify as the pure plan does
    binder = ShardedBinder(plan.ranks)
    first = check_binding(cfg, params, plan, binder)
    binder.release()
    new = _place(init_params(cfg, jax.random.key(1)), cfg, fsdp, tp)  # an "update"
    assert check_binding(cfg, new, plan, binder) == first  # rebuilt buffers refilled in place
    binder.release()
    kinds = {rt.kind for ts in plan.ranks.values() for rt in ts}
    if (fsdp, tp, t_r, layout) == (1, 2, 2, "tp"):
        assert kinds == {"aligned"}
    if (fsdp, tp, t_r, layout) == (1, 4, 4, "tp"):
        assert kinds == {"aligned", "rebuilt"}  # rebuilt: k/v (2 KV heads replicated over 4 ranks)
    if fsdp == 4 and t_r == 4:  # fsdp splits the model dim, TP the other: every matrix rebuilt
        assert all(rt.kind == "rebuilt" for rt in plan.ranks[1] if len(rt.shape) == 2)


def test_binder_release_detects_live_views():
    cfg = _cfg()
    params = _place(init_params(cfg, jax.random.key(0)), cfg, 1, 4)
    plan = S.plan_for_params(params, "vllm", 4, cfg=cfg)
    binder = ShardedBinder(plan.ranks)
    keep = binder.bind(S.device_shards(params))[2]["language_model.model.layers.0.self_attn.o_proj.weight"]
    with pytest.raises(Exception, match="still referenced"):
        binder.release()
    with pytest.raises(RuntimeError):
        keep.add_(1)  # an inference tensor: in-place writes outside inference mode raise
    del keep


def test_hf_engine_binds_fsdp_sharded_params():
    from rollout_torch.hf_engine import HFEngine
    from rollplex_contract.batch import Prompts, SamplingParams

    cfg = tiny_model_config()
    params = init_params(cfg, jax.random.key(0), std=0.1)
    sharded = _place(params, cfg, 4, 1)
    eng = HFEngine(cfg.to_hf_dict())
    pub = S.WeightPublisher(eng, cfg)
    pub.publish(sharded, version=0)
    rep = pub.report()
    assert rep.counts["rebuilt"] > 0 and rep.counts["aligned"] > 0 and rep.counts["view"] == 0
    assert rep.to_dict()["classification"]["train_mesh"] == {"fsdp": 4, "tp": 1}
    bound = eng.bound_tensors()
    norm = "model.norm.weight"
    assert bound[norm].data_ptr() == sharded[norm].addressable_shards[0].data.unsafe_buffer_pointer()
    for k, t in bound.items():
        np.testing.assert_array_equal(t.detach().numpy(), np.asarray(params[k]), err_msg=k)
    ptrs = {k: t.data_ptr() for k, t in bound.items()}
    del bound, t
    ids = np.array([[5, 6, 7, 8]], np.int32)
    prompts = Prompts(input_ids=ids, attention_mask=np.ones_like(ids))
    sp = SamplingParams(max_new_tokens=4, temperature=0.0)
    got = eng.generate(prompts, 1, sp).response_ids
    eng.release()
    ref = HFEngine(cfg.to_hf_dict())
    S.WeightPublisher(ref, cfg).publish(params, version=0)
    np.testing.assert_array_equal(got, ref.generate(prompts, 1, sp).response_ids)
    ref.release()
    new = init_params(cfg, jax.random.key(5), std=0.1)
    pub.publish(_place(new, cfg, 4, 1), version=1)
    bound = eng.bound_tensors()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert bound[q].data_ptr() == ptrs[q]  # rebuilt: same buffer, new values
    np.testing.assert_array_equal(bound[q].detach().numpy(), np.asarray(new[q]))
    del bound
    eng.release()


EIGHT = textwrap.dedent("""
    import jax, numpy as np
    from rollout_torch.weights import ShardedBinder
    from rollplex_jax import sharing as S
    from rollplex_jax.config import MeshConfig
    from rollplex_jax.models.qwen2_5_vl.params import init_params
    from tests.test_sharing_layout import _cfg, _place, check_binding
    cfg = _cfg(num_key_value_heads=4)
    cfg = cfg.__class__(**{**cfg.__dict__, "vision": cfg.vision.__class__(**{**cfg.vision.__dict__, "num_heads": 8,
                                                                               "hidden_size": 64})})
    out = {}
    for fsdp, tp, t_r, layout in [(1, 8, 4, "vllm"), (1, 8, 8, "vllm"), (2, 4, 4, "tp"), (1, 8, 8, "tp")]:
        params = _place(init_params(cfg, jax.random.key(0)), cfg, fsdp, tp)
        plan = S.plan_for_params(params, layout, t_r, cfg=cfg)
        assert plan.ranks == S.plan_sharing(cfg, MeshConfig(train_fsdp=fsdp, train_tp=tp, rollout_tp=t_r),
                                            layout=layout).ranks
        b = ShardedBinder(plan.ranks)
        first = check_binding(cfg, params, plan, b); b.release()
        assert check_binding(cfg, _place(init_params(cfg, jax.random.key(1)), cfg, fsdp, tp), plan, b) == first
        b.release()
        out[f"{fsdp}x{tp}/{t_r}/{layout}"] = plan.report(by_role=False)["counts"]
    print("OK", out)
""")


def test_binder_on_8_devices_subprocess():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", EIGHT], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
    counts = eval(r.stdout.split("OK", 1)[1])  # noqa: S307 (our own subprocess)
    # same TP: only q/k/v (weights + biases, 2 layers) of the 4 heads replicated over 8 ranks are rebuilt
    assert counts["1x8/8/tp"]["view"] == 0 and counts["1x8/8/tp"]["rebuilt"] == 12 * 8


def test_dataclass_is_hashable_and_layouts_cover_every_param():
    cfg = _cfg()
    for name in ("hf", "tp", "vllm", "vllm_text"):
        used = {s for et in EL.for_engine(name, cfg) for s in et.sources}
        want = {k for k in param_specs(cfg) if name != "vllm_text" or not k.startswith("visual.")}
        assert used == want, name
    assert dataclasses.is_dataclass(EL.EngineTensor) and hash(EL.EngineTensor("a", ("b",)))
    torch.manual_seed(0)
