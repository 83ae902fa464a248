"""HFEngine keeps only the chosen tokens' log-probs (``ChosenLogprobs``), step by step.

The oracle is the previous implementation (``old_generate_rows``: ``generate(output_logits=True)``, all
steps' raw logits stacked, log-softmax, gather), kept here as a test helper: same tokens and bitwise-equal
log-probs on the multimodal test inputs, sampled (several warpers) and greedy, fp32 and bf16. Also checked:
the processor list transformers' ``generate`` builds holds nothing before the recorder (so it sees raw
scores), and the largest set of vocabulary-sized tensors alive during a call no longer grows with the steps.
"""

from __future__ import annotations

import weakref

import jax
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GenerationConfig, LogitsProcessorList

from rollout_torch.hf_engine import ChosenLogprobs, HFEngine, SeededSampler, _finish, answer_seeds
from rollplex_contract.batch import Prompts, Rollouts, SamplingParams
from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.qwen2_5_vl.params import init_params
from rollplex_jax.sharing import WeightPublisher
from tests.hf_reference import mm_inputs
from tests.rollout.test_hf_engine import ROWS, STOP, _setup


def old_generate_rows(eng: HFEngine, prompts: Prompts, rows: np.ndarray, sampling: SamplingParams,
                      seeds: np.ndarray):
    """The engine's ``_generate_rows`` before issue 17: every step's full-vocabulary logits kept and stacked."""
    kw = {k: v.to(eng.device) for k, v in eng._inputs(prompts, rows).items()}
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=sampling.max_new_tokens, min_new_tokens=0,
        eos_token_id=list(sampling.stop_token_ids) or None, pad_token_id=eng.pad_token_id,
        output_logits=True, return_dict_in_generate=True)
    procs = LogitsProcessorList([] if sampling.temperature == 0 else [SeededSampler(sampling, seeds, eng.device)])
    with torch.no_grad():
        out = eng.model.generate(**kw, generation_config=gen, logits_processor=procs)
    seqs = out.sequences[:, kw["input_ids"].shape[1]:]
    logits = torch.stack(out.logits, dim=1).float()  # [rows, steps, V]
    logp = torch.log_softmax(logits, -1).gather(-1, seqs[..., None])[..., 0].cpu().numpy()
    return _finish(seqs.cpu().numpy(), logp, sampling.stop_token_ids, eng.pad_token_id)


def old_generate(eng: HFEngine, prompts: Prompts, n: int, sampling: SamplingParams) -> Rollouts:
    """``HFEngine.generate`` on the old path (one chunk: at most max_batch rows)."""
    rows = np.repeat(np.arange(prompts.batch_size), n)
    assert len(rows) <= eng.max_batch
    seeds = answer_seeds(sampling.seed, sampling.first_prompt, prompts.batch_size, n)
    ids, logp, lengths, reasons = old_generate_rows(eng, prompts, rows, sampling, seeds)
    b, t = prompts.batch_size, ids.shape[1]
    return Rollouts(response_ids=ids.reshape(b, n, t), lengths=lengths.reshape(b, n),
                    finish_reasons=[reasons[i * n:(i + 1) * n] for i in range(b)],
                    logprobs=logp.reshape(b, n, t).astype(np.float32))


SAMPLINGS = [
    SamplingParams(max_new_tokens=8, stop_token_ids=STOP, seed=3),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=8, stop_token_ids=STOP, seed=4),
    SamplingParams(max_new_tokens=8, seed=5),  # no stop token: every row runs all 8 steps
    SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=STOP),  # greedy
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_tokens_and_bitwise_equal_logprobs_as_the_output_logits_path(dtype):
    cfg, params, inp, eng = _setup(dtype)
    eng.max_batch = 12  # 3 prompts x 4 answers in one chunk, as old_generate needs
    prompts = Prompts(**inp)
    for sp in SAMPLINGS:
        n = 1 if sp.temperature == 0 else 4
        new, old = eng.generate(prompts, n, sp), old_generate(eng, prompts, n, sp)
        np.testing.assert_array_equal(new.response_ids, old.response_ids)
        np.testing.assert_array_equal(new.lengths, old.lengths)
        assert new.finish_reasons == old.finish_reasons
        assert new.logprobs.tobytes() == old.logprobs.tobytes(), (sp, np.abs(new.logprobs - old.logprobs).max())
        assert (new.logprobs[new.mask.astype(bool)] < 0).all()
    eng.release()


def test_the_recorder_is_first_and_generate_adds_no_processor():
    """What generate actually runs, captured from ``_get_logits_processor``: our processors only, the recorder
    first. A transformers-built processor (min length, repetition penalty, suppress tokens, ...) would come
    before ours and change the scores the recorder sees."""
    cfg, params, inp, eng = _setup()
    eng.max_batch = 12  # one generate call each
    built = []
    real = eng.model._get_logits_processor
    eng.model._get_logits_processor = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    try:
        eng.generate(Prompts(**inp), 2, SAMPLINGS[1])
        eng.generate(Prompts(**inp), 1, SAMPLINGS[3])
    finally:
        del eng.model._get_logits_processor
    assert [[type(p) for p in lst] for lst in built] == [[ChosenLogprobs, SeededSampler], [ChosenLogprobs]]
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


def test_chosen_logprobs_gathers_each_step_once_extra_steps_dropped():
    rec = ChosenLogprobs()
    scores = [torch.randn(3, 7) for _ in range(4)]
    chosen = torch.tensor([[1, 2, 3, 4], [0, 0, 6, 6], [5, 4, 3, 2]])
    ids = torch.zeros(3, 2, dtype=torch.long)  # the prompt
    for k, s in enumerate(scores):
        assert rec(ids, s) is s  # scores pass through unchanged
        ids = torch.cat([ids, chosen[:, k:k + 1]], 1)
    want = torch.stack([torch.log_softmax(s, -1) for s in scores], 1).gather(-1, chosen[..., None])[..., 0]
    assert torch.equal(rec.finish(chosen[:, :3]), want[:, :3])  # a 4th step generate undid is dropped
    rec2 = ChosenLogprobs()
    for k, s in enumerate(scores):
        rec2(torch.cat([torch.zeros(3, 2, dtype=torch.long), chosen[:, :k]], 1), s)
    assert torch.equal(rec2.finish(chosen), want)


def test_bf16_scores_are_cast_before_the_softmax():
    rec = ChosenLogprobs()
    s = torch.randn(2, 5).to(torch.bfloat16)
    rec(torch.zeros(2, 1, dtype=torch.long), s)
    got = rec.finish(torch.tensor([[1], [3]]))
    assert got.dtype == torch.float32
    assert torch.equal(got[:, 0], torch.log_softmax(s.float(), -1)[[0, 1], [1, 3]])

