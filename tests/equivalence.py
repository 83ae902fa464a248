"""Comparing two trainings that must compute the same updates, robustly to reduction order (shared by tests).

Why not ``assert_allclose(params_a, params_b, rtol, atol)``: two correct programs that sum partial
products in another order (a sharded mesh, the prefix/suffix split, another CPU's vector width) give
gradients that differ by fp32 rounding, ~1e-7 of the terms summed. Adam divides each gradient component
by its own running RMS (+ eps): where a component is ~0 that rounding noise is amplified up to ``lr /
eps`` times and can move a parameter by a sizeable fraction of an update, on one CPU and not on another
(issue 16: 1 of 8,192 elements off by 1.5e-6 on this machine, within 1e-6 on the one it was written on).
A tolerance on the parameter *values* either hides real errors (too loose) or fails on noise (too tight).

The comparison here is in units of the update itself: each AdamW step moves an element by about ``lr``
(|m_hat / sqrt(v_hat)| ~ 1), so after ``updates`` steps the motion scale is ``lr * updates``. Two runs
that differ only by reduction order differ by a small fraction of it (measured <= 1e-3 of it: see the
tests), while a real error (a wrong sign, a missing micro-batch, a stale prefix, a wrong mask) changes
updates by O(lr) on many elements (``launch.equivalence``). Stated tolerance: |a - b| <= ``rel`` x lr x
updates + 4 ulp(b), per element, ``rel`` = 2% by default (>= 20x the measured noise, <= 1/25 of one real
update error), with Adam eps 1e-6 in these tests (eps bounds the amplification at lr / eps). Gradient
*scale* errors that Adam's normalisation hides are caught by the metrics (loss, grad_norm, kl) compared
beside it, and where a test can by comparing the gradients themselves (``assert_same_gradients``).
"""

from __future__ import annotations

import numpy as np

from launch.equivalence import ZERO_GRADIENT, require_checkpoint_layout, update_distance


def assert_same_updates(got: dict, ref: dict, *, lr: float, updates: int, rel: float = 0.02,
                        exclude: tuple[str, ...] = ZERO_GRADIENT) -> float:
    """Asserts ``got`` and ``ref`` (final params of two runs from the same start, in the checkpoint's layout:
    ``launch.equivalence.checkpoint_layout``) differ by at most ``rel`` of the update scale per element (module
    docstring); returns the worst fraction of the tolerance."""
    assert set(got) == set(ref)
    d = update_distance(got, ref, lr=lr, updates=updates, exclude=exclude)
    assert d["max"] <= rel, (f"{d['worst']}: differs by {d['max']:.3g} of the update scale lr {lr} x {updates} "
                             f"updates (> {rel})")
    return d["max"] / rel


def assert_same_gradients(got: dict, ref: dict, *, rtol: float = 1e-5,
                          exclude: tuple[str, ...] = ZERO_GRADIENT) -> float:
    """Gradients before any optimizer: per tensor, |got - ref| <= rtol x max|ref| (reduction-order noise is
    ~1e-7 x sqrt(terms) of the largest entry in fp32); returns the worst relative difference. In the checkpoint's
    layout (``launch.equivalence.checkpoint_layout``), as ``assert_same_updates``."""
    require_checkpoint_layout(ref)
    assert set(got) == set(ref)
    worst = 0.0
    for name, b in ref.items():
        if name.endswith(exclude):
            continue
        a, b = np.asarray(got[name], np.float64), np.asarray(b, np.float64)
        top = np.abs(b).max()
        if top == 0:
            assert np.abs(a).max() <= 1e-12, name
            continue
        d = float(np.abs(a - b).max() / top)
        assert d <= rtol, f"{name}: gradients differ by {d:.3g} of the largest entry (> {rtol})"
        worst = max(worst, d)
    return worst
