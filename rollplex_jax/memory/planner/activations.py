"""Activation and residual bytes of one decoder layer / vision block, and of whole forwards.

Pure formulas of the model config, rows, tokens and the ``ProgramModel``; bytes on one device of a
tensor-parallel group of ``tp`` devices, as the programs lay them out (``mesh.py``): the attention heads,
the MLP width and their activations are split over tp where tp divides them, the residual stream (every
[tokens, hidden] tensor, norms, rotary tables) is whole on every device (no sequence parallelism;
``tp_widths``). ``layouts`` combines them into the per-phase figures.

Notation: b = dtype bytes, D hidden size, F MLP width, H query heads, K kv heads, d head dim; r rows
of t tokens attending tk keys; n patches of a vision block (width dv, MLP Fv, hv heads of dh); F, H, K,
Fv and hv are per device (divided by tp where it divides them).

Saved activations (what a forward keeps for its backward; the actor prefix's vjp residuals are these
plus a copy of the linear weights, ``prefix_residual_bytes``). Per element counts read from the
program's jaxpr (``tests/launch/test_plan.py`` checks the total against ``jax.eval_shape`` of
``programs.split._actor_prefix_residuals`` within 15%). Per decoder layer:
  r t [5 D b + 2 D 4 (fp32 norm inputs) + 4 x 4 (norm statistics) + 4 d b (rotary tables)
       + 6 F b (SwiGLU) + (H + 2 K) d b (rotated q, k and v)]
  + attention: dense: r H t tk (2 x 4 + b + 1) (fp32 scores and probs, cast probs, mask) + 2 r H t 4;
               flash: r H t 4 (log-sum-exp);
per vision block the same pattern
  n [5 dv b + 2 dv 4 + 4 x 4 + 2 dh 4 + 3 hv dh b + 6 Fv b] + dense (attention gathered per segment: a
  window, or one image at full-attention blocks; g segments padded to s patches, square images
  assumed): hv g s^2 (2 x 4 + b + 1) + 2 hv g s 4 + 3 g s hv dh b (gathered q, k, v); flash: hv n 4;
plus the final norm / last-token logits input, the vision merger (5 [n/4, 4 dv] tensors) and the
index arrays. With per-layer activation checkpointing (``remat='layer'``) only each layer's and
block's input ([r, t, D] and [n, dv] in the dtype), the rotary tables and masks are saved.

Prefix residuals (the vjp residuals the actor prefix program returns, ``programs.split.ResidualPrefix``),
per device: the saved activations of the prefix forward over the prompt rows, plus the patches (cast to
the dtype). No weights: the residuals that are parameters (every linear weight the
backward reads) are left out and the params are passed to the prefix vjp again (issue 17; before, jit
returned them as fresh copies: 7.6 GiB per device at 32B).

Transient working sets (phase-local temporaries):
- ``layer_temp(r, t, tk)`` = r t (3 F + (H + 2 K) d + 3 D) b + attention (dense: r H t tk (8 + b);
  flash: r H t 4 + r t H d 4), a vision block likewise (``block_temp``: n (3 Fv + 3 hv dh + 3 dv) b);
- a backward step holds one more such working set beside the saved activations, which it frees layer
  by layer (``BWD_FACTOR`` = 1, calibrated against XLA's buffer assignment of the tiny demo's programs:
  tests/test_memory.py, planned vs measured within 15%); under remat it also holds what the one
  recomputed layer saves (``one_layer_saved``).
"""

from __future__ import annotations

import dataclasses
import math

from rollplex_jax.config import ModelConfig
from rollplex_jax.memory.planner.types import DENSE_PROGRAMS, F32, ProgramModel, dtype_bytes, split_dim

# Layer working sets a backward step holds beside the saved activations (see the module doc).
BWD_FACTOR = 1


def tp_widths(m: ModelConfig, tp: int = 1) -> tuple[int, int, int, int, int]:
    """Per-device (D, F, H, K, d) of a decoder layer on a tp group: heads and MLP width split, D whole."""
    x = m.text
    return (x.hidden_size, split_dim(x.intermediate_size, tp), split_dim(x.num_attention_heads, tp),
            split_dim(x.num_key_value_heads, tp), x.head_dim)


def tp_vision_widths(m: ModelConfig, tp: int = 1) -> tuple[int, int, int, int]:
    """Per-device (dv, Fv, hv, dh) of a vision block on a tp group."""
    v = m.vision
    return v.hidden_size, split_dim(v.intermediate_size, tp), split_dim(v.num_heads, tp), v.head_dim


def layer_saved(m: ModelConfig, r: int, t: int, tk: int, pm: ProgramModel, tp: int = 1) -> float:
    """Saved activations of one decoder layer over r rows of t tokens attending tk keys (no remat)."""
    b = dtype_bytes(m)
    dd, f, h, k, d = tp_widths(m, tp)
    per_token = 5 * dd * b + 2 * dd * F32 + 4 * F32 + 4 * d * b + 6 * f * b + (2 * k + h) * d * b
    att = r * h * t * tk * (2 * F32 + b + 1) + 2 * r * h * t * F32 if pm.attention == "dense" else r * h * t * F32
    return r * t * per_token + att + 2 * dd * b


def _segments(m: ModelConfig, n: int, per_image: int | None, full: bool) -> tuple[float, float]:
    """(segments, padded patches per segment) of one vision block over n patches of images of
    ``per_image`` patches (square grids assumed): full-attention blocks attend within each image, the
    others within windows of ``window_size`` px, padded to the largest window (vision.py)."""
    v = m.vision
    per_image = per_image or n
    images = n / per_image
    if full:
        return images, per_image
    unit = v.spatial_merge_size**2
    side = max(1, round(math.sqrt(per_image / unit)))  # merge units per side
    win = v.merger_window
    return images * math.ceil(side / win) ** 2, min(win, side) ** 2 * unit


def block_saved(m: ModelConfig, n: int, pm: ProgramModel, per_image: int | None = None,
                full: bool = False, tp: int = 1) -> float:
    """Saved activations of one vision block over n patches (no remat)."""
    b = dtype_bytes(m)
    dv, fv, hv, dh = tp_vision_widths(m, tp)
    per_patch = 5 * dv * b + 2 * dv * F32 + 4 * F32 + 2 * dh * F32 + 3 * hv * dh * b + 6 * fv * b
    if pm.attention == "dense":  # gathered per segment: q, k, v copies, scores/probs, row statistics
        segs, size = _segments(m, n, per_image, full)
        slots = segs * size
        att = hv * segs * size * size * (2 * F32 + b + 1) + 2 * hv * slots * F32 + 3 * slots * hv * dh * b
    else:
        att = hv * n * F32
    return n * per_patch + att + 2 * dv * b


def _blocks_saved(m: ModelConfig, n: int, pm: ProgramModel, per_image: int | None, tp: int) -> float:
    v = m.vision
    full = sum(1 for i in range(v.depth) if i in v.fullatt_block_indexes)
    return (full * block_saved(m, n, pm, per_image, True, tp)
            + (v.depth - full) * block_saved(m, n, pm, per_image, False, tp))


def _text_const(m: ModelConfig, r: int, t: int, vision: bool) -> float:
    """Final norm, last-token hidden state, index arrays (+ the vision scatter mask and indices)."""
    dd, b = m.text.hidden_size, dtype_bytes(m)
    out = r * t * (dd * b + dd * F32 + 2 * F32) + r * dd * b + r * 2 * 4 + dd * b
    if vision:
        out += r * t * dd + r * t * 4
    return out


def _vision_const(m: ModelConfig, n: int) -> float:
    """Merger (norm + 5 [n/4, 4 dv] tensors), patches cast to the dtype, window index arrays."""
    v, b = m.vision, dtype_bytes(m)
    dv, unit = v.hidden_size, v.spatial_merge_size**2
    return (n * (dv * b + dv * F32 + 2 * F32) + 5 * (n // unit) * unit * dv * b + n * v.patch_dim * b
            + 2 * (n // unit) * 4 + dv * b)


@dataclasses.dataclass(frozen=True)
class Pass:
    """What one forward covers on one device: ``rows`` of ``tokens`` attending ``keys`` keys, and ``patches``
    vision patches of images of ``per_image`` patches each (None: patches / rows)."""

    rows: float
    tokens: int
    keys: int
    patches: float = 0
    per_image: int | None = None


def saved_activations(m: ModelConfig, fwd: Pass, pm: ProgramModel, tp: int = 1, text_const: bool = True) -> float:
    """Saved activations of a forward (for its backward) over ``fwd``'s rows, tokens, keys and patches, whole
    model, on one device of a tp group."""
    L, dd, d, b = m.text.num_hidden_layers, m.text.hidden_size, m.text.head_dim, dtype_bytes(m)
    v = m.vision
    r, t, tk, n, per_image = fwd.rows, fwd.tokens, fwd.keys, fwd.patches, fwd.per_image
    if pm.remat in ("none", "dots"):  # dots: planned as no remat (an upper bound)
        out = L * layer_saved(m, r, t, tk, pm, tp)
        if n:
            out += _blocks_saved(m, n, pm, per_image or (n // r if r else None), tp)
    else:  # layer inputs, rotary tables and masks once
        out = L * r * t * dd * b + 2 * r * t * d * b + (r * t * tk if pm.attention == "dense" else 0)
        if n:
            out += v.depth * n * v.hidden_size * b + 2 * n * v.head_dim * F32
    if text_const:
        out += _text_const(m, r, t, vision=n > 0)
    if n:
        out += _vision_const(m, n)
    return out


def one_layer_saved(m: ModelConfig, r: int, t: int, tk: int, n: int, pm: ProgramModel, tp: int = 1) -> float:
    """What one recomputed layer/block saves during the backward under remat (0 without remat)."""
    if pm.remat in ("none", "dots"):
        return 0.0
    full = dataclasses.replace(pm, remat="none")
    return max(layer_saved(m, r, t, tk, full, tp),
               block_saved(m, n, full, n // r if r else None, True, tp) if n else 0.0)


def layer_temp(m: ModelConfig, r: int, t: int, tk: int, pm: ProgramModel, tp: int = 1) -> float:
    """Transient working set of one decoder layer's forward."""
    b = dtype_bytes(m)
    dd, f, h, k, d = tp_widths(m, tp)
    att = r * h * t * tk * (2 * F32 + b) if pm.attention == "dense" else r * h * t * F32 + r * t * h * d * F32
    return r * t * (3 * f + (h + 2 * k) * d + 3 * dd) * b + att


def block_temp(m: ModelConfig, n: int, pm: ProgramModel, segment: int | None = None, tp: int = 1) -> float:
    """Transient working set of one vision block's forward over n patches, attending within segments of
    ``segment`` patches (one image at full-attention blocks, the largest case; default: all n)."""
    if n <= 0:
        return 0.0
    b = dtype_bytes(m)
    dv, fv, hv, dh = tp_vision_widths(m, tp)
    s = n if segment is None else min(segment, n)
    att = hv * n * s * (2 * F32 + b) if pm.attention == "dense" else hv * n * F32 + n * hv * dh * F32
    return n * (3 * fv + 3 * hv * dh + 3 * dv) * b + att


def prefix_residual_bytes(m: ModelConfig, rows: int, prompt_tokens: int, vision_tokens: int,
                          pm: ProgramModel = DENSE_PROGRAMS, *, tp: int = 1, vision: bool = True,
                          text_rows: float | None = None) -> float:
    """Bytes of the actor prefix's vjp residuals on one device of a tp group: saved activations of ``rows``
    prompts (in ``text_rows`` rows where packed; default ``rows``); the weights are not among them."""
    unit = m.vision.spatial_merge_size**2
    vision = vision and vision_tokens > 0  # no patches: the vision tower does not run
    n = rows * vision_tokens * unit if vision else 0
    t = rows if text_rows is None else text_rows
    return saved_activations(m, Pass(t, prompt_tokens, prompt_tokens, n), pm, tp=tp)


def backward_carry(m: ModelConfig, tokens: float, patches: float, tp: int = 1, gpu: bool = False) -> float:
    """What a remat'd backward keeps per layer until its end: one fp32 and one dtype copy of each decoder
    layer's input stream and two fp32 copies of each vision block's (measured in CPU AOT compiles of the
    prefix vjp at Qwen2.5-VL-3B shapes, 8 prompts of 2048 tokens / 5120 patches: its temp grows 12.4 KB per
    token per decoder layer and 10.2 KB per patch per vision block; the 3B per-layer/block widths are 2048
    and 1280). On a tp group XLA splits these copies over tp (nothing constrains them): at 32B widths on
    tp 8 the recomputing gradient program's temp grows 14.7 KB per token per layer, the layer's saved input
    (10.2 KB, whole) plus about (4 + 2) x 5120 / 8 B. XLA's GPU compile of the same programs (``gpu``) keeps one
    16-bit copy per decoder layer and none of the vision blocks' (3B prefix vjp, 8 prompts of 2048 tokens: its
    temp beyond the gathered weights is 2.46 GB, the 36 layers' [16384, 2048] bf16 inputs 2.42 GB)."""
    b = dtype_bytes(m)
    if gpu:
        return m.text.num_hidden_layers * tokens * m.text.hidden_size * b / tp
    return (m.text.num_hidden_layers * tokens * m.text.hidden_size * (F32 + b)
            + m.vision.depth * patches * m.vision.hidden_size * 2 * F32) / tp
