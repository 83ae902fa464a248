"""HFEngine: zero-copy binding, safety of the views, sampling, and log-prob consistency with JAX.

Consistency criterion (NeMo-RL): mean over response tokens of exp(|engine logprob - JAX logprob|)
<= 1.0001 in fp32 and <= 1.043 in bf16.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rollout_torch.hf_engine import HFEngine
from rollout_torch.weights import LiveViewError, checksums
from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_contract.layout import ALIGNED, REBUILT, VIEW
from rollplex_jax.config import tiny_model_config
from rollplex_jax.config.model import tiny_qwen3_vl_config
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl.fused import to_hf
from rollplex_jax.models.vl.names import normalize_name
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.weights.sharing import WeightPublisher, donated
from tests.hf_reference import mm_inputs

ROWS = [[5, 6, ("image", (1, 8, 8)), 7], [10, ("image", (1, 4, 6)), 11, ("video", (2, 4, 4)), 12, 13], [20, 21]]
STOP = (2, 7, 9)


def _setup(dtype="float32", seed=0, family=tiny_model_config):
    cfg = dataclasses.replace(family(), dtype=dtype)
    params = init_params(cfg, jax.random.key(seed), std=0.1)
    inp = mm_inputs(cfg, ROWS, np.random.default_rng(0))
    if dtype == "bfloat16":
        inp["pixel_values"] = inp["pixel_values"]  # pixels stay fp32 on the host; both sides cast
    eng = HFEngine(cfg.to_hf_dict(), max_batch=4)
    WeightPublisher(eng, cfg).publish(params, version=0)
    return cfg, params, inp, eng


def _jax_logprobs(cfg, params, inp, ro):
    state, last = M.prefix_forward(params, cfg, M.prepare_inputs(cfg, **inp))
    ids, mask = jnp.asarray(ro.response_ids), jnp.asarray(ro.mask)
    return np.asarray(M.suffix_logprobs(last, M.suffix_forward(params, cfg, state, ids, mask), ids, mask))


@pytest.mark.parametrize("family", [tiny_model_config, tiny_qwen3_vl_config], ids=["qwen2_5_vl", "qwen3_vl"])
def test_every_tensor_is_a_zero_copy_view(family):
    cfg, params, _, eng = _setup(family=family)
    bound = {normalize_name(k): t for k, t in eng.bound_tensors().items()}  # the checkpoint's names
    assert set(bound) == set(to_hf(params, cfg))
    spans = [(a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes) for a in params.values()]
    for name, t in bound.items():  # q/k/v, gate/up: row ranges of the fused actor buffer, the rest whole
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(a <= lo and hi <= b for a, b in spans), name
        if name in params:
            assert lo == params[name].unsafe_buffer_pointer(), name
    del bound, t  # our references count as live views too
    rep = eng.sharing_report()
    assert rep.counts[REBUILT] == 0 and rep.bytes[REBUILT] == 0
    assert rep.fractions()[ALIGNED] + rep.fractions()[VIEW] == 1.0  # views: q/k/v, gate/up row ranges
    assert rep.counts[VIEW] > 0
    eng.release()


def test_tied_embeddings_share_one_buffer():
    cfg = dataclasses.replace(tiny_model_config(), tie_word_embeddings=True)
    params = init_params(cfg, jax.random.key(0))
    eng = HFEngine(cfg.to_hf_dict())
    WeightPublisher(eng, cfg).publish(params, version=0)
    ptr = params["model.embed_tokens.weight"].unsafe_buffer_pointer()
    assert eng.model.lm_head.weight.data_ptr() == ptr
    assert eng.model.model.language_model.embed_tokens.weight.data_ptr() == ptr
    eng.release()


@pytest.mark.parametrize("dtype,bound,family", [("float32", 1.0001, tiny_model_config),
                                                ("bfloat16", 1.043, tiny_model_config),
                                                ("float32", 1.0001, tiny_qwen3_vl_config)],
                         ids=["float32", "bfloat16", "qwen3_vl"])
def test_engine_logprobs_match_jax_actor(dtype, bound, family):
    cfg, params, inp, eng = _setup(dtype, family=family)
    ro = eng.generate(Prompts(**inp), 4, SamplingParams(max_new_tokens=6, stop_token_ids=STOP, seed=3))
    lp = _jax_logprobs(cfg, params, inp, ro)
    real = ro.mask.astype(bool)
    crit = float(np.exp(np.abs(lp[real] - ro.logprobs[real])).mean())
    print(f"{dtype}: mean exp|dlogp| = {crit:.7f} over {real.sum()} tokens")
    assert crit <= bound
    eng.release()


def test_sampling_shapes_stop_tokens_and_seed():
    cfg, params, inp, eng = _setup()
    sp = SamplingParams(max_new_tokens=8, stop_token_ids=STOP, seed=11)
    a = eng.generate(Prompts(**inp), 3, sp)
    b = eng.generate(Prompts(**inp), 3, sp)
    c = eng.generate(Prompts(**inp), 3, dataclasses.replace(sp, seed=12))
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.response_ids, c.response_ids)
    assert a.response_ids.shape[:2] == (3, 3) and a.logprobs.shape == a.response_ids.shape
    for i in range(3):
        for j in range(3):
            n = a.lengths[i, j]
            row = a.response_ids[i, j]
            if a.finish_reasons[i][j] == "stop":
                assert row[n - 1] in STOP and not np.isin(row[:n - 1], STOP).any()
            else:
                assert n == sp.max_new_tokens and not np.isin(row, STOP).any()
            assert (row[n:] == cfg.pad_token_id).all() and (a.logprobs[i, j, n:] == 0).all()
            assert (a.logprobs[i, j, :n] < 0).all()
    eng.release()


def test_greedy_follows_the_jax_argmax():
    cfg, params, inp, eng = _setup()
    ro = eng.generate(Prompts(**inp), 1, SamplingParams(temperature=0.0, max_new_tokens=5))
    ids = ro.response_ids
    full_ids = np.concatenate([inp["input_ids"], ids[:, 0]], 1)
    full = dict(inp, input_ids=full_ids, attention_mask=np.concatenate([inp["attention_mask"], ro.mask[:, 0]], 1))
    logits = np.asarray(M.full_forward(params, cfg, M.prepare_inputs(cfg, **full)))
    tp = inp["input_ids"].shape[1]
    np.testing.assert_array_equal(logits[:, tp - 1:-1].argmax(-1), ids[:, 0])
    eng.release()


def test_rebind_after_donating_updates_keeps_engine_equal_to_actor():
    cfg, params, inp, eng = _setup()
    pub = WeightPublisher(eng, cfg)
    pub.publish(params, version=0)

    @functools.partial(jax.jit, donate_argnums=0)
    def update(p, key):  # stands in for the optimizer step: same shapes, donated
        keys = dict(zip(sorted(p), jax.random.split(key, len(p)), strict=True))
        return {k: v + 1e-2 * jax.random.normal(keys[k], v.shape, v.dtype) for k, v in p.items()}

    sp = SamplingParams(max_new_tokens=6, seed=0)
    before = eng.generate(Prompts(**inp), 2, sp)
    for step in range(1, 4):
        pub.release()  # drop views first, or donation silently does nothing
        old_ptrs = {k: v.unsafe_buffer_pointer() for k, v in params.items()}
        old = params
        params = update(params, jax.random.key(step))
        assert donated(old)
        reused = sum(params[k].unsafe_buffer_pointer() == old_ptrs[k] for k in params)
        assert reused == len(params)  # the update wrote in place: no second copy of the weights
        pub.publish(params, version=step)
        engine_sums = checksums({normalize_name(k): t for k, t in eng.bound_tensors().items()})
        actor_sums = checksums({k: torch.from_numpy(np.array(v)) for k, v in to_hf(params, cfg).items()})
        assert engine_sums == actor_sums
    after = eng.generate(Prompts(**inp), 2, sp)
    assert not np.array_equal(before.logprobs, after.logprobs)
    lp = _jax_logprobs(cfg, params, inp, after)
    real = after.mask.astype(bool)
    assert np.exp(np.abs(lp[real] - after.logprobs[real])).mean() <= 1.0001
    pub.release()


def test_a_live_view_is_reported_and_blocks_donation():
    cfg, params, _, eng = _setup()
    leaked = eng.model.lm_head.weight  # someone keeps a reference to a bound tensor
    with pytest.raises(LiveViewError, match="still referenced"):
        eng.release()
    # The hazard the check exists for: with a live view, JAX does not donate (no warning).
    x = params["lm_head.weight"]
    y = jax.jit(lambda a: a * 2, donate_argnums=0)(x)
    assert not x.is_deleted()
    assert y.unsafe_buffer_pointer() != leaked.data_ptr()
    del leaked


def test_rollout_never_writes_to_actor_weights():
    cfg, params, inp, eng = _setup()
    before = checksums({k: torch.from_numpy(np.array(v)) for k, v in params.items()})
    eng.generate(Prompts(**inp), 2, SamplingParams(max_new_tokens=4))
    assert checksums({k: torch.from_numpy(np.array(v)) for k, v in params.items()}) == before
    # An in-place op on a bound tensor raises (views are inference tensors; engines run under no_grad).
    with torch.no_grad(), pytest.raises(RuntimeError, match="[Ii]nference"):
        eng.model.lm_head.weight.mul_(1.0)
    eng.release()


def test_generate_before_bind_is_a_clear_error():
    eng = HFEngine(tiny_model_config().to_hf_dict())
    with pytest.raises(RuntimeError, match="before bind"):
        eng.generate(Prompts(input_ids=np.ones((1, 2), np.int64), attention_mask=np.ones((1, 2), np.int64)), 1,
                     SamplingParams())


def test_a_layout_that_does_not_describe_the_model_is_refused():
    cfg = tiny_model_config()
    params = init_params(cfg, jax.random.key(0))
    pub = WeightPublisher(HFEngine(cfg.to_hf_dict()), cfg)
    pub.layout = [et for et in pub.layout if "q_proj" not in et.target]  # as if the trainer forgot q_proj
    with pytest.raises(ValueError, match=r"no tensor for HF.s model\.language_model\.layers\.0\.self_attn\.q_proj"):
        pub.publish(params, version=0)
