"""Masks and einsum layouts shared by the dense and blockwise attention paths (``attention.py``, ``blockwise.py``).

Scores are laid out [B, N, K, G, Tq, S] ("bnkgqs"): B rows, N query rows per shared KV row, K kv heads,
G query heads per kv head (GQA), Tq queries, S keys.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from rollplex_jax.models.attention import KVSource


def einsum_sub(src: KVSource) -> str:
    return "bskd" if src.shared else "bnskd"


@dataclasses.dataclass(frozen=True)
class MaskView:
    """The static part of a source's mask description (what ``block_mask`` reads besides ``valid``)."""

    shared: bool
    causal: bool
    q_offset: int


def block_mask(src: KVSource | MaskView, valid, q_start, bq: int, k_start, bk: int, segs=None) -> jax.Array:
    """Visible keys of a [bq, bk] block starting at (q_start, k_start), broadcastable to "bnkgqs".

    valid: the block's key validity [B, bk] (shared source) or [B, N, bk]; segs: None or the block's
    (query segments [B, N, bq], key segments shaped like ``valid``)."""
    m = valid[:, None] if src.shared else valid  # [B, 1 or N, bk]
    m = m[:, :, None, None, None, :]
    if src.causal:
        qpos = q_start + jnp.arange(bq)[:, None] + src.q_offset
        m = m & (qpos >= k_start + jnp.arange(bk)[None, :])
    if segs is not None:
        qs, ks = segs
        ks = ks[:, None] if src.shared else ks
        m = m & (qs[:, :, None, None, :, None] == ks[:, :, None, None, None, :])
    return m


def segment_ids(src: KVSource):
    """The source's (query segments, key segments), or None."""
    if (src.segments is None) != (src.q_segments is None):
        raise ValueError("KVSource: give both segments and q_segments, or neither")
    return None if src.segments is None else (src.q_segments, src.segments)


def group_heads(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, N, T, H, d] -> [B, N, T, K, G, d] (a view: GQA without repeating K/V)."""
    b, n, t, h, d = q.shape
    return q.reshape(b, n, t, num_kv_heads, h // num_kv_heads, d)


def squeeze_axes(x: jax.Array, letters: str, drop: str) -> tuple[jax.Array, str]:
    """x with the axes named in ``drop`` (all of size 1) reshaped away, and its einsum letters."""
    keep = [i for i, c in enumerate(letters) if c not in drop]
    return x.reshape([x.shape[i] for i in keep]), "".join(letters[i] for i in keep)
