"""Shape buckets (``--shape_buckets``, ``config/shapes.py``) and token-budget micro-batches (``--micro_batch_tokens``)
compute what exact shapes compute.

- Padding contributes nothing, bitwise: with the same (bucketed) shapes, random contents in the padding patches,
  the padding token slots of the left-padded rows and the empty packed slots give bit-for-bit the same logits at
  real positions and the same parameter gradients (padding is masked or multiplied by an exact zero cotangent;
  nothing else changes, so the float operations are the same ones in the same order).
- Bucketed vs exact shapes (more padding, other packed rows, other attention blocks): the model's logits and
  gradients within 1e-5 of each tensor's largest entry (fp32 summation order, as tests/models/test_packing.py), and
  2 RL steps of either schedule, images and videos: per-step loss and KL within 1e-5, final params within the
  update-scale tolerance of tests/equivalence.py (why it is robust to reduction order: there).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import ConfigError, ProgramConfig, RlConfig, tiny_model_config
from rollplex_jax.config.shapes import Buckets, StepShapes, parse_buckets, pow2
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl import packing as P
from rollplex_jax.models.vl.params import init_params
from tests.equivalence import assert_same_updates
from tests.hf_reference import mm_inputs
from tests.programs.test_rollplex_equivalence import LR, TOL, _config, _mixed_prompts, _steps, _video_prompts

SMALL = "4:16:1.5"  # small buckets: the tiny test prompts get padded in every bucketed dimension
ROWS = [
    [5, 6, ("image", (1, 8, 8)), 7, ("image", (1, 4, 6)), 8, 9],
    [10, 11],
    [12, ("video", (2, 4, 4)), 13],
    [17, ("image", (1, 4, 4)), 18, 19, 20],
]


def test_buckets_round_up_to_few_sizes():
    b = Buckets(64, 512, 1.25)
    assert [b.up(n) for n in (1, 64, 65, 512, 513, 641)] == [64, 64, 128, 512, 640, 832]
    assert b.up(100, cap=90) == 100 and b.up(70, cap=100) == 100 and b.up(0) == 0
    assert len({b.up(n) for n in range(100, 2001)}) <= 14  # log(max/min), not one per size
    assert parse_buckets("off") is None and parse_buckets("8:32:1.5") == Buckets(8, 32, 1.5)
    assert [pow2(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8] and pow2(5, cap=6) == 6
    with pytest.raises(ValueError, match="STEP:LINEAR_UNTIL:RATIO"):
        parse_buckets("64x512")
    with pytest.raises(ConfigError, match="shape_buckets"):
        ProgramConfig(shape_buckets="64:32:1.25")


def test_a_budget_too_small_for_one_sequence_names_the_smallest(tmp_path):
    with pytest.raises(ConfigError, match="at least --max_prompt_len \\+ --max_new_tokens = 67"):
        dataclasses.replace(_config(tmp_path, "x"), rl=RlConfig(micro_batch_tokens=66))


def test_stable_packing_is_always_packed_into_power_of_two_rows():
    mask = np.zeros((6, 8), int)
    for r, n in enumerate([8, 8, 1, 1, 1, 1]):
        mask[r, 8 - n:] = 1
    assert P.pack_layout(mask)[2] == 3
    slot, seg, p = P.pack_layout(mask, stable=True)
    assert p == 4 and (seg[3] == -1).all()  # 3 rows hold the tokens; the 4th is empty
    assert P.pack_layout(np.ones((3, 5), int), stable=True)[2] == 3  # capped at the rows


def test_stable_packing_takes_the_row_length_with_the_fewest_slots():
    mask = np.zeros((4, 8), int)
    for r, n in enumerate([3, 8, 2, 5]):
        mask[r, 8 - n:] = 1
    slot, seg, p = P.pack_layout(mask, stable=True)  # rows of T = 8: 8 | 5 + 3 | 2 -> 3, 4 rows of 8 = 32 slots
    assert (p, seg.shape[1]) == (4, 8)
    assert slot[1][mask[1] > 0].min() == 0  # the longest row first (first-fit decreasing): not the batch's order
    slot, seg, p = P.pack_layout(mask, stable=True, row_lengths=[24])  # 1 row of 24 (18 tokens) < 4 of 8
    assert (p, seg.shape[1]) == (1, 24) and sorted(seg[0][seg[0] >= 0]) == [0] * 3 + [1] * 8 + [2] * 2 + [3] * 5
    slot, seg, p = P.pack_layout(mask, stable=True, row_lengths=[12, 24])  # 8 + 3 | 5 + 2: a tie, the shorter
    assert (p, seg.shape[1]) == (2, 12)
    assert Buckets(4, 16, 1.5).between(9, 40) == [12, 16, 24, 36]


def test_packed_rows_out_of_batch_order_keep_each_image_with_its_tokens(model):
    """First-fit decreasing puts the second prompt (the longer, with the larger image) first in the packed row:
    each placeholder still takes its own image's embedding (``Packing.vision_index``), not the next in the row."""
    cfg, params, _ = model
    inp = mm_inputs(cfg, [[5, ("image", (1, 4, 4)), 6], [10, 11, ("image", (1, 8, 8)), 12, 13, 14]],
                    np.random.default_rng(3))
    exact = M.prepare_inputs(cfg, **inp)
    t = inp["input_ids"].shape[1]
    packed = M.prepare_inputs(cfg, **inp, opts=M.InputOptions(pack=True, buckets=parse_buckets(SMALL)))
    slot = np.asarray(packed.packing.unpack)
    real = np.asarray(inp["attention_mask"]) > 0
    assert packed.packing.segments.shape[0] == 2 and slot[1][real[1]].min() < slot[0][real[0]].min()
    a = np.asarray(M.full_forward(params, cfg, exact))[real]
    b = np.asarray(M.full_forward(params, cfg, packed))[real]
    assert t == packed.input_ids.shape[1]
    np.testing.assert_allclose(b, a, atol=TOL * max(1.0, float(np.abs(a).max())), rtol=0)


@pytest.fixture(scope="module")
def model():
    cfg = tiny_model_config()
    return cfg, init_params(cfg, jax.random.key(0), std=0.1), mm_inputs(cfg, ROWS, np.random.default_rng(1))


def _inputs(cfg, inp, buckets, pad_to=None):
    rows = dict(inp)
    if pad_to is not None:  # the prompt-length bucket, as the ops pad it (left)
        extra = pad_to - rows["input_ids"].shape[1]
        rows["input_ids"] = np.pad(rows["input_ids"], ((0, 0), (extra, 0)))
        rows["attention_mask"] = np.pad(rows["attention_mask"], ((0, 0), (extra, 0)))
    return M.prepare_inputs(cfg, **rows, opts=M.InputOptions(pack=True, buckets=buckets))


def _loss_and_grads(cfg, params, inputs, real, pad_left=0):
    """Loss = a fixed random projection of the logits at real positions (``pad_left``: the rows' extra left
    padding, the projection moved with them), its value, the logits and the parameter gradients."""
    ct = jax.random.normal(jax.random.key(2), (real.shape[0], real.shape[1] - pad_left, cfg.text.vocab_size))
    ct = jnp.pad(ct, ((0, 0), (pad_left, 0), (0, 0)))

    def loss(p):
        logits = M.full_forward(p, cfg, inputs)
        return jnp.sum(jnp.where(real[..., None], logits * ct, 0)), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _scramble(inputs: M.ModelInputs, n_real_patches: int, rng) -> M.ModelInputs:
    """The same inputs with random contents in every padding slot: patches past the real ones, token ids at masked
    positions of the left-padded rows, and the empty slots of the packed rows."""
    pix = np.array(inputs.pixel_values)
    pix[n_real_patches:] = rng.normal(size=pix[n_real_patches:].shape)
    ids = np.array(inputs.input_ids)
    pad = np.asarray(inputs.attention_mask) == 0
    ids[pad] = rng.integers(0, 30, size=int(pad.sum()))
    pk = inputs.packing
    pids = np.array(pk.input_ids)
    empty = np.asarray(pk.segments) < 0
    pids[empty] = rng.integers(0, 30, size=int(empty.sum()))
    return dataclasses.replace(inputs, pixel_values=jnp.asarray(pix), input_ids=jnp.asarray(ids),
                               packing=dataclasses.replace(pk, input_ids=jnp.asarray(pids)))


def test_padding_contributes_nothing_bitwise(model):
    cfg, params, inp = model
    inputs = _inputs(cfg, inp, parse_buckets(SMALL), pad_to=40)
    n_real = len(inp["pixel_values"])
    assert inputs.pixel_values.shape[0] > n_real and inputs.packing is not None  # there is padding to scramble
    real = jnp.asarray(np.asarray(inputs.attention_mask) > 0)
    (loss_a, logits_a), grads_a = _loss_and_grads(cfg, params, inputs, real)
    (loss_b, logits_b), grads_b = _loss_and_grads(cfg, params, _scramble(inputs, n_real, np.random.default_rng(5)),
                                                  real)
    assert float(loss_a) == float(loss_b)
    assert (np.asarray(logits_a)[np.asarray(real)] == np.asarray(logits_b)[np.asarray(real)]).all()
    for name in grads_a:
        assert (np.asarray(grads_a[name]) == np.asarray(grads_b[name])).all(), name


def test_bucketed_inputs_compute_the_exact_shapes_result(model):
    cfg, params, inp = model
    exact = M.prepare_inputs(cfg, **inp, opts=M.InputOptions(pack=True))
    t = inp["input_ids"].shape[1]
    bucketed = _inputs(cfg, inp, parse_buckets(SMALL), pad_to=40)
    assert bucketed.layout["window_gather"].shape[1] >= exact.layout["window_gather"].shape[1]
    real = np.asarray(inp["attention_mask"]) > 0
    (la, logits_a), ga = _loss_and_grads(cfg, params, exact, jnp.asarray(real))
    (lb, logits_b), gb = _loss_and_grads(cfg, params, bucketed, jnp.asarray(np.pad(real, ((0, 0), (40 - t, 0)))),
                                         pad_left=40 - t)

    def close(a, b):
        np.testing.assert_allclose(a, b, atol=TOL * max(1.0, float(np.abs(b).max())), rtol=0)

    close(np.asarray(lb), np.asarray(la))
    close(np.asarray(logits_b)[:, 40 - t:][real], np.asarray(logits_a)[real])
    for name in ga:
        close(np.asarray(gb[name]), np.asarray(ga[name]))


def _compare_steps(a, b, updates=2):
    (ma, pa), (mb, pb) = a, b
    assert any(m["skipped_steps/no_signal"] == 0 for m in ma)
    for x, y in zip(ma, mb, strict=True):
        assert x["reward/mean"] == y["reward/mean"]
        for key in ("loss", "kl"):
            assert abs(x[key] - y[key]) <= TOL, (key, x[key], y[key])
    return assert_same_updates(pb, pa, lr=LR, updates=updates)


def _bucketed(cfg, buckets=SMALL, **rl):
    return dataclasses.replace(cfg, programs=ProgramConfig(shape_buckets=buckets),
                               rollout=dataclasses.replace(cfg.rollout, max_new_tokens=5),
                               rl=dataclasses.replace(cfg.rl, **rl))


@pytest.mark.parametrize("schedule,budget", [("serial", 0), ("rollplex", 0), ("serial", 90), ("rollplex", 90)])
def test_bucketed_steps_equal_exact_shapes(tmp_path, schedule, budget):
    """Images, prompts of 18, 3 and 8 tokens: every dimension padded (prompt 18 -> 24, answers to 4 or 5, patches,
    windows, packed rows); with a 90-token budget: micro-batches of 2 prefix rows (rollplex) / 3 rows (serial)."""
    exact = _bucketed(_config(tmp_path, "e", schedule=schedule), "off")
    prompts = _mixed_prompts(exact.model)
    bucketed = _bucketed(_config(tmp_path, "b", schedule=schedule), micro_batch_tokens=budget)
    worst = _compare_steps(_steps(exact, prompts), _steps(bucketed, prompts))
    print(f"{schedule} budget {budget}: worst param difference {worst:.3g} of the tolerance")


def test_bucketed_video_steps_equal_exact_shapes(tmp_path):
    """Videos of 4 and 3 temporal steps (and an image) fall into the same patch buckets as images."""
    exact = _bucketed(_config(tmp_path, "e", schedule="rollplex"), "off")
    prompts = _video_prompts(exact.model, tmp_path)
    worst = _compare_steps(_steps(exact, prompts), _steps(_bucketed(_config(tmp_path, "b", schedule="rollplex")),
                                                          prompts))
    print(f"video: worst param difference {worst:.3g} of the tolerance")


def test_budget_micro_batches_have_one_shape():
    s = StepShapes(Buckets(64, 512, 1.25), prompt_cap=600, answer_cap=100, micro_batch=64, micro_batch_tokens=4096)
    assert s.prompt_len(130) == 192 and s.answer_len(70) == 100 and s.answer_len(20) == 64
    assert s.serial_rows(192 + 64) == 16 and s.answers(192, 64, 8) == 8 * 5  # 5 prefix rows of 192 + 8 x 64
    assert s.answers(3000, 64, 32) == (4096 - 3000) // 64  # one row's answers in chunks beside its prefix
