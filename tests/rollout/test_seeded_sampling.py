"""Per-answer seeded sampling (hf_engine.SeededSampler): the right distribution, and answers that do not
depend on which rows share their batch (what lets each process of a multi-process run decode a share)."""

import dataclasses

import numpy as np
import torch

from rollout_torch.hf_engine import SeededSampler, answer_seeds
from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_jax.config import tiny_model_config
from rollplex_jax.programs.sequences import select_rows
from tests.rollout.test_hf_engine import STOP, _setup


def _draws(sp: SamplingParams, logits: torch.Tensor, n: int) -> np.ndarray:
    """``n`` samples from one row of ``logits``: n rows with their own seeds, one step."""
    s = SeededSampler(sp, answer_seeds(sp.seed, 0, n, 1), torch.device("cpu"))
    return s(None, logits.expand(n, -1)).argmax(-1).numpy()


def test_gumbel_max_samples_the_warped_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    for t in (1.0, 0.7):
        freq = np.bincount(_draws(SamplingParams(temperature=t, seed=1), logits, n), minlength=6) / n
        want = torch.softmax(logits[0] / t, -1).numpy()
        np.testing.assert_allclose(freq, want, atol=0.012)  # ~4 standard errors at n = 20000
    top_k = _draws(SamplingParams(temperature=1.0, top_k=2, seed=2), logits, 4000)
    assert set(np.unique(top_k)) == {0, 1}
    p = torch.softmax(logits[0], -1).numpy()  # 0.61, 0.22, 0.14, ...: top-p 0.8 keeps tokens 0..2
    top_p = _draws(SamplingParams(temperature=1.0, top_p=0.8, seed=3), logits, 4000)
    assert set(np.unique(top_p)) == {0, 1, 2}
    freq = np.bincount(top_p, minlength=6)[:3] / 4000
    np.testing.assert_allclose(freq, p[:3] / p[:3].sum(), atol=0.03)


def test_a_share_of_the_prompts_samples_what_the_whole_batch_samples():
    cfg, params, inp, eng = _setup()
    prompts = Prompts(**inp)
    sp = SamplingParams(max_new_tokens=6, stop_token_ids=STOP, seed=5)
    whole = eng.generate(prompts, 3, sp)
    for lo, hi in ((0, 1), (1, 3), (2, 3)):
        part = select_rows(tiny_model_config(), prompts, np.arange(lo, hi))
        got = eng.generate(part, 3, dataclasses.replace(sp, first_prompt=lo))
        t = got.response_ids.shape[-1]
        np.testing.assert_array_equal(got.response_ids, whole.response_ids[lo:hi, :, :t])
        np.testing.assert_array_equal(got.lengths, whole.lengths[lo:hi])
    # and the engine's chunking (max_batch) does not matter either
    eng.max_batch = 2
    np.testing.assert_array_equal(eng.generate(prompts, 3, sp).response_ids, whole.response_ids)
    eng.release()
