"""The equivalence checks (``launch.equivalence``, used by ``tests/equivalence.py`` and ``launch.bench``) leave out
the decoder's k bias only (its exact gradient is zero), not the q and v biases stored beside it in the actor's
fused ``qkv_proj.bias`` (``fused.py``): a perturbed q or v bias is detected, a perturbed k bias is not, and the
actor's fused layout is refused (it cannot exclude the k bias alone)."""

import jax
import numpy as np
import pytest

from launch.equivalence import checkpoint_layout, update_distance
from rollplex_jax.config import ModelConfig
from rollplex_jax.models.vl.fused import fused_tensors, unfuse_rows
from rollplex_jax.models.vl.params import init_params
from tests.equivalence import assert_same_gradients, assert_same_updates
from tests.paths import REPO

LR, UPDATES = 1e-3, 2


@pytest.fixture(scope="module")
def actor():
    cfg = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    return cfg, {k: np.asarray(v) for k, v in init_params(cfg, jax.random.key(0)).items()}


def _perturbed(cfg, params, part: int, layer: int = 1) -> dict:
    """The actor's params with part ``part`` (0 q, 1 k, 2 v) of layer ``layer``'s fused qkv bias moved by half an
    update scale (lr x updates) on every element: what a real error does to a whole tensor."""
    name = f"model.layers.{layer}.self_attn.qkv_proj.bias"
    ft = fused_tensors(cfg)[name]
    marker = np.zeros_like(params[name])
    rows = unfuse_rows(np.arange(marker.shape[0]), ft.parts, ft.groups)[part]  # the part's rows in the fused tensor
    marker[rows] = 0.5 * LR * UPDATES
    return dict(params, **{name: params[name] + marker})


@pytest.mark.parametrize("part,letter", [(0, "q"), (2, "v")])
def test_a_perturbed_q_or_v_bias_is_detected(actor, part, letter):
    cfg, params = actor
    ref = checkpoint_layout(params, cfg)
    got = checkpoint_layout(_perturbed(cfg, params, part), cfg)
    d = update_distance(got, ref, lr=LR, updates=UPDATES)
    assert d["worst"] == f"model.layers.1.self_attn.{letter}_proj.bias" and d["max"] >= 0.49
    with pytest.raises(AssertionError, match=f"{letter}_proj.bias"):
        assert_same_updates(got, ref, lr=LR, updates=UPDATES)
    with pytest.raises(AssertionError, match=f"{letter}_proj.bias"):
        assert_same_gradients(got, ref)


def test_a_perturbed_k_bias_is_forgiven(actor):
    cfg, params = actor
    ref = checkpoint_layout(params, cfg)
    got = checkpoint_layout(_perturbed(cfg, params, 1), cfg)
    assert not np.array_equal(got["model.layers.1.self_attn.k_proj.bias"], ref["model.layers.1.self_attn.k_proj.bias"])
    assert update_distance(got, ref, lr=LR, updates=UPDATES)["max"] == 0.0
    assert_same_updates(got, ref, lr=LR, updates=UPDATES)


def test_the_fused_layout_is_refused(actor):
    cfg, params = actor
    with pytest.raises(ValueError, match="checkpoint_layout"):
        update_distance(params, params, lr=LR, updates=UPDATES)
    with pytest.raises(ValueError, match="checkpoint_layout"):
        assert_same_gradients(params, params)
