"""HFEngine prefills each prompt once for its answers and keeps only the chosen tokens' log-probs (``hf_decode``).

The oracle is transformers' own ``generate`` on the repeated prompts (``generate_rows``: ``output_logits=True``,
every step's raw logits stacked, divided by the temperature (1 when greedy), log-softmax over the whole
vocabulary, gather: the distribution the trainer trains on), kept here as a test helper: same tokens, lengths and
finish reasons, and log-probs equal to float noise, on the multimodal test inputs, sampled (several warpers) and
greedy, fp32 and bf16. Also checked: the vision tower and the prompt prefill run once per prompt (not once per
answer), finished answers leave the decode batch, and the largest set of vocabulary-sized tensors alive during a
call does not grow with the steps.
"""

from __future__ import annotations

import contextlib
import weakref

import jax
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GenerationConfig, LogitsProcessorList

from rollout_torch.hf_engine import HFEngine, SeededSampler, _finish, answer_seeds
from rollplex_contract.batch import Prompts, Rollouts, SamplingParams
from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.weights.sharing import WeightPublisher
from tests.hf_reference import mm_inputs
from tests.rollout.test_hf_engine import ROWS, STOP, _setup


def generate_rows(eng: HFEngine, prompts: Prompts, rows: np.ndarray, sampling: SamplingParams,
                      seeds: np.ndarray):
    """``rows`` answered by transformers' ``generate`` (each prompt repeated per answer), every step's
    full-vocabulary logits kept and stacked: the engine before issues 17 and 19."""
    kw = {k: v.to(eng.device) for k, v in eng._inputs(prompts, rows).items()}
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=sampling.max_new_tokens, min_new_tokens=0,
        eos_token_id=list(sampling.stop_token_ids) or None, pad_token_id=eng.pad_token_id,
        output_logits=True, return_dict_in_generate=True)
    procs = LogitsProcessorList([] if sampling.temperature == 0 else [SeededSampler(sampling, seeds, eng.device)])
    with torch.no_grad():
        out = eng.model.generate(**kw, generation_config=gen, logits_processor=procs)
    seqs = out.sequences[:, kw["input_ids"].shape[1]:]
    logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, V], raw
    logp = torch.log_softmax(logits / (sampling.temperature or 1.0), -1).gather(-1, seqs[..., None])[..., 0]
    logp = logp.cpu().numpy()
    return _finish(seqs.cpu().numpy(), logp, sampling.stop_token_ids, eng.pad_token_id)


def old_generate(eng: HFEngine, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
    """``HFEngine.generate`` through transformers' ``generate`` (one chunk: at most max_batch rows)."""
    rows = np.repeat(np.arange(prompts.batch_size), n)
    assert len(rows) <= eng.max_batch
    seeds = answer_seeds(sampling.seed, sampling.first_prompt, prompts.batch_size, n)
    ids, logp, lengths, reasons = generate_rows(eng, prompts, rows, sampling, seeds)
    b, t = prompts.batch_size, ids.shape[1]
    return Rollouts(response_ids=ids.reshape(b, n, t), lengths=lengths.reshape(b, n),
                    finish_reasons=[reasons[i * n:(i + 1) * n] for i in range(b)],
                    logprobs=logp.reshape(b, n, t).astype(np.float32))


# The prompt KV now comes from a P-row prefill instead of a P x n-row one, and finished rows leave the batch,
# so the GEMMs see other row counts: the same math in another blocking, a few fp32 ulps per op through two
# layers (log-probs of magnitude <= ~6: 1e-5 is ~20 ulps of it). bf16 rounds each activation to 8 bits, so a
# one-ulp flip in an intermediate moves a log-prob by up to ~2^-7 of its logit scale.
LOGP_TOL = {"float32": 1e-5, "bfloat16": 5e-2}

SAMPLINGS = [
    SamplingParams(max_new_tokens=8, stop_token_ids=STOP, seed=3),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, stop_token_ids=STOP, seed=4),
    SamplingParams(max_new_tokens=8, seed=5),  # no stop token: every row runs all 8 steps
    SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=STOP),  # greedy
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_answers_and_logprobs_as_transformers_generate(dtype):
    cfg, params, inp, eng = _setup(dtype)
    eng.max_batch = 12  # 3 prompts x 4 answers in one chunk, as generate_rows needs
    prompts = Prompts(**inp)
    worst = 0.0
    for sp in SAMPLINGS:
        n = 1 if sp.temperature == 0 else 4
        new, old = eng.generate(prompts, n, sp), old_generate(eng, prompts, n, sp)
        np.testing.assert_array_equal(new.response_ids, old.response_ids)
        np.testing.assert_array_equal(new.lengths, old.lengths)
        assert new.finish_reasons == old.finish_reasons
        worst = max(worst, float(np.abs(new.logprobs - old.logprobs).max()))
        assert (new.logprobs[new.mask.astype(bool)] < 0).all()
    print(dtype, "max |dlogp| vs generate", worst)
    assert worst <= LOGP_TOL[dtype]
    eng.release()


class VocabTensors(TorchDispatchMode):
    """Peak bytes of the live storages of tensors whose last dim is the vocabulary, over the ops run inside.

    Liveness: a storage counts while some tensor made by an op under the mode that uses it is alive (weak
    references; views share their base's storage and are counted once)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.peak = vocab, 0
        self.storages: dict[int, tuple[int, list]] = {}  # data_ptr -> (nbytes, weakrefs to its tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        live = {p: (b, [r for r in refs if r() is not None]) for p, (b, refs) in self.storages.items()}
        self.storages = {p: v for p, v in live.items() if v[1]}  # a dead storage's address may be reused
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == self.vocab:
                s = t.untyped_storage()
                nbytes, refs = self.storages.get(s.data_ptr(), (s.nbytes(), []))
                self.storages[s.data_ptr()] = (nbytes, refs + [weakref.ref(t)])
        self.peak = max(self.peak, sum(b for b, _ in self.storages.values()))
        return out


def _vocab_peak(eng, prompts, n, sp, old: bool) -> int:
    with VocabTensors(eng.model.config.text_config.vocab_size) as mode:
        if old:
            old_generate(eng, prompts, n, sp)
        else:
            eng.generate(prompts, n, sp)
    return mode.peak


def test_no_rows_x_steps_x_vocab_tensor_is_held():
    vocab = 1000  # no other dimension of the tiny model is 1000
    cfg = tiny_model_config(text={"vocab_size": vocab})
    params = init_params(cfg, jax.random.key(0), std=0.1)
    eng = HFEngine(cfg.to_hf_dict(), max_batch=8)
    WeightPublisher(eng, cfg).publish(params, version=0)
    prompts = Prompts(**mm_inputs(cfg, ROWS[:2], np.random.default_rng(0)))
    rows, row_step = 8, 4 * vocab  # 2 prompts x 4 answers; one step of one row in fp32
    peaks = {}
    for steps in (8, 32):
        sp = SamplingParams(max_new_tokens=steps, seed=1)  # no stop token: all rows run every step
        peaks["new", steps] = _vocab_peak(eng, prompts, 4, sp, old=False)
        peaks["old", steps] = _vocab_peak(eng, prompts, 4, sp, old=True)
    print({k: v / (rows * row_step) for k, v in peaks.items()}, "x rows x V x 4 bytes")  # measured: new 12, 12;
    for steps in (8, 32):  # old 24, 96 (the tuple of logits, their stacked copy, its log-softmax: 3 x steps)
        assert peaks["old", steps] >= 3 * steps * rows * row_step
        assert peaks["new", steps] <= 16 * rows * row_step  # one step's temporaries (model, sampler, recorder)
    assert peaks["new", 32] == peaks["new", 8]  # does not grow with the number of steps
    eng.release()


@contextlib.contextmanager
def recorded_passes(eng):
    """Counts what each model pass sees while inside: vision patches encoded, the language model's rows x tokens."""
    seen = {"patches": 0, "lm": []}
    def count_patches(module, args, kw):
        seen["patches"] += (args[0] if args else kw["hidden_states"]).shape[0]

    h1 = eng.model.model.visual.register_forward_pre_hook(count_patches, with_kwargs=True)
    h2 = eng.model.model.language_model.register_forward_pre_hook(
        lambda m, args, kw: seen["lm"].append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True)
    try:
        yield seen
    finally:
        h1.remove()
        h2.remove()


@pytest.mark.parametrize("max_batch", [12, 5, 2])
def test_each_prompt_is_encoded_and_prefilled_once_and_finished_answers_leave_the_batch(max_batch):
    cfg, params, inp, eng = _setup()
    eng.max_batch = max_batch
    prompts = Prompts(**inp)
    n, sp = 4, SAMPLINGS[1]
    with recorded_passes(eng) as seen:
        ro = eng.generate(prompts, n, sp)
    lengths = ro.lengths.reshape(-1)
    # max_batch 12 or 5: whole groups per chunk (12 -> one chunk; 5 -> one prompt per chunk); 2 < n: the 4
    # answers of a prompt in 2 chunks of 2, so each prompt is prefilled twice
    prefills_per_prompt = 1 if max_batch >= n else -(-n // max_batch)
    assert seen["patches"] == prefills_per_prompt * len(inp["pixel_values"])  # not n x: once per prompt
    prefill = [s for s in seen["lm"] if s[1] > 1]
    assert sum(r for r, _ in prefill) == prefills_per_prompt * prompts.batch_size
    assert ro.prefill_tokens == prefills_per_prompt * int(inp["attention_mask"].sum())
    decode_rows = sum(r for r, t in seen["lm"] if t == 1)
    # every answer decodes one pass per token after its first (the prefill's logits give the first), none after
    # its stop token: the decode passes' rows add up to the answers' lengths minus one each
    assert decode_rows == int((lengths - 1).sum())
    assert (lengths < sp.max_new_tokens).any()  # some answer stopped early, so rows did leave
    eng.release()


def test_per_answer_prefill_samples_the_same_answers_and_encodes_n_times():
    """``share_prefill=False`` (launch.bench_rollout's baseline): every answer prefills its own prompt copy, as
    ``generate`` does: n x the vision patches and prompt tokens, the same answers."""
    cfg, params, inp, eng = _setup()
    eng.max_batch, n, sp = 12, 4, SAMPLINGS[1]
    prompts = Prompts(**inp)
    shared = eng.generate(prompts, n, sp)
    eng.share_prefill = False
    with recorded_passes(eng) as seen:
        alone = eng.generate(prompts, n, sp)
    assert seen["patches"] == n * len(inp["pixel_values"])
    assert alone.prefill_tokens == n * shared.prefill_tokens == n * int(inp["attention_mask"].sum())
    np.testing.assert_array_equal(alone.response_ids, shared.response_ids)
    np.testing.assert_allclose(alone.logprobs, shared.logprobs, atol=LOGP_TOL["float32"])
    eng.release()
