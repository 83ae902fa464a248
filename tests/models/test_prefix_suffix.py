"""suffix(prefix(prompt), responses) equals full(prompt ++ response), fp32, max abs diff <= 1e-5.

The prefix's boundary KV is computed once per prompt and shared by its N responses
(the suffix reads it without an N axis); responses have different lengths (right padding),
prompts have different lengths (left padding) and carry images and a video.
With the default programs (one block: dense) and with 4-long blocks (the blockwise kernel).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import ProgramConfig, tiny_model_config
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl.params import init_params
from tests.hf_reference import mm_inputs

TOL = 1e-5
PROGS = {"default": ProgramConfig(), "blocks4": ProgramConfig(attention_block=4)}

PROMPTS = [
    [5, 6, ("image", (1, 8, 8)), 7, ("image", (1, 4, 6)), 8, 9],
    [10, ("video", (2, 4, 4)), 11, 12],
]


def _responses(rng, b, n, t, vocab):
    ids = rng.integers(3, 200, size=(b, n, t))
    lengths = rng.integers(1, t + 1, size=(b, n))
    lengths[0, 0] = t
    mask = (np.arange(t)[None, None] < lengths[..., None]).astype(np.int64)
    return np.where(mask > 0, ids, 0), mask


@pytest.mark.parametrize("prog", list(PROGS))
@pytest.mark.parametrize("tie", [False, True])
def test_suffix_over_shared_prefix_equals_full_forward(tie, prog):
    import dataclasses
    cfg = dataclasses.replace(tiny_model_config(), tie_word_embeddings=tie)
    params = init_params(cfg, jax.random.key(0), std=0.1)
    rng = np.random.default_rng(1)
    prompt = mm_inputs(cfg, PROMPTS, rng)
    b, tp = prompt["input_ids"].shape
    n, tr = 3, 5
    resp, resp_mask = _responses(rng, b, n, tr, cfg.text.vocab_size)

    prog = PROGS[prog]
    state, last_logits = jax.jit(functools.partial(M.prefix_forward, prog=prog), static_argnums=1)(
        params, cfg, M.prepare_inputs(cfg, **prompt))
    assert state.k.shape == (cfg.text.num_hidden_layers, b, tp, cfg.text.num_key_value_heads, cfg.text.head_dim)
    suffix = jax.jit(functools.partial(M.suffix_forward, prog=prog), static_argnums=1)(
        params, cfg, state, jnp.asarray(resp), jnp.asarray(resp_mask))
    assert suffix.shape == (b, n, tr, cfg.text.vocab_size)

    # Full rows: each (prompt, response) pair as one sequence [prompt (left padded), response (right padded)].
    ids = np.concatenate([np.repeat(prompt["input_ids"][:, None], n, 1), resp], -1).reshape(b * n, -1)
    mask = np.concatenate([np.repeat(prompt["attention_mask"][:, None], n, 1), resp_mask], -1).reshape(b * n, -1)
    n_img = int(np.prod(prompt["image_grid_thw"], -1).sum())
    img_pix = np.split(prompt["pixel_values"][:n_img], np.cumsum(np.prod(prompt["image_grid_thw"], -1))[:-1])
    vid_pix = prompt["pixel_values"][n_img:]
    # Image patches of prompt 0 (both images) repeated n times; prompt 1's video repeated n times.
    full_inp = dict(
        input_ids=ids, attention_mask=mask,
        pixel_values=np.concatenate([np.concatenate(img_pix)] * n + [vid_pix] * n),
        image_grid_thw=np.concatenate([prompt["image_grid_thw"]] * n),
        video_grid_thw=np.concatenate([prompt["video_grid_thw"]] * n),
    )
    full = np.asarray(M.full_forward(params, cfg, M.prepare_inputs(cfg, **full_inp), prog=prog))
    full = full.reshape(b, n, tp + tr, -1)

    np.testing.assert_allclose(np.asarray(last_logits), full[:, 0, tp - 1], atol=TOL, rtol=0)
    real = resp_mask.astype(bool)
    diff = np.abs(np.asarray(suffix)[real] - full[:, :, tp:][real]).max()
    assert diff <= TOL, (diff, np.abs(full).max())
    assert np.abs(full).max() > 0.1  # logits are not trivially tiny


def test_prefix_is_shared_not_copied():
    """The suffix program's boundary KV input has no response axis: its size is independent of N."""
    cfg = tiny_model_config()
    params = init_params(cfg, jax.random.key(0))
    prompt = mm_inputs(cfg, PROMPTS, np.random.default_rng(0))
    state, _ = M.prefix_forward(params, cfg, M.prepare_inputs(cfg, **prompt))
    for n in (1, 4):
        resp = jnp.ones((2, n, 3), jnp.int32)
        lowered = jax.jit(M.suffix_forward, static_argnums=1).lower(params, cfg, state, resp, resp)
        k_in = [a for a in jax.tree.leaves(lowered.args_info) if a.shape == state.k.shape]
        assert len(k_in) == 2  # k and v, each once, shaped [L, B, Tp, K, d] for any N
