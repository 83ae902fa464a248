"""Parameter tree invariants: names, logical axes per dimension, dtypes, determinism."""

import dataclasses

import jax
import numpy as np

from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.vl import model as M
from rollplex_jax.models.vl.params import init_params, logical_axes, param_specs, params_sha256
from tests.hf_reference import mm_inputs


def test_every_parameter_has_one_logical_axis_per_dimension():
    cfg = tiny_model_config()
    for name, (shape, axes) in param_specs(cfg).items():
        assert len(shape) == len(axes), name
    assert logical_axes(cfg)["model.layers.0.self_attn.qkv_proj.weight"] == ("q_heads", "embed")
    assert logical_axes(cfg)["model.layers.0.mlp.gate_up_proj.weight"] == ("mlp", "embed")


def test_tied_model_has_no_lm_head():
    cfg = dataclasses.replace(tiny_model_config(), tie_word_embeddings=True)
    assert "lm_head.weight" not in param_specs(cfg)


def test_init_is_deterministic_and_seed_dependent():
    cfg = tiny_model_config()
    a, b = init_params(cfg, jax.random.key(0)), init_params(cfg, jax.random.key(0))
    assert params_sha256(a) == params_sha256(b)
    assert params_sha256(a) != params_sha256(init_params(cfg, jax.random.key(1)))


def test_bfloat16_forward_runs_and_tracks_float32():
    cfg32 = tiny_model_config()
    cfg16 = dataclasses.replace(cfg32, dtype="bfloat16")
    p32 = init_params(cfg32, jax.random.key(0), std=0.1)
    p16 = jax.tree.map(lambda x: x.astype("bfloat16"), p32)
    assert all(x.dtype == jax.numpy.bfloat16 for x in init_params(cfg16, jax.random.key(0)).values())
    inp = mm_inputs(cfg32, [[5, ("image", (1, 8, 8)), 6, 7]], np.random.default_rng(0))
    l32 = np.asarray(M.full_forward(p32, cfg32, M.prepare_inputs(cfg32, **inp)))
    l16 = np.asarray(M.full_forward(p16, cfg16, M.prepare_inputs(cfg16, **inp)))
    assert np.isfinite(l16).all()
    # bf16 has ~3 significant digits: the logits agree to a few percent of their scale.
    assert np.abs(l16 - l32).max() <= 0.05 * np.abs(l32).max()
