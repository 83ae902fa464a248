"""The blockwise (FlashAttention-2) kernel of ``attention.py``: online softmax in ``lax`` loops, a ``jax.custom_vjp``.

How it works, and why it is a custom_vjp, is in ``attention.py``'s docstring; this module holds the kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from rollplex_jax.models.masks import MaskView, block_mask, group_heads, segment_ids

if TYPE_CHECKING:
    from rollplex_jax.models.attention import KVSource

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of a blockwise call: block lengths (padded lengths divide them) and masks."""

    bq: int
    bk: tuple[int, ...]
    causal: tuple[bool, ...]
    q_offset: tuple[int, ...]
    shared: tuple[bool, ...]
    scale: float


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def blockwise_attention(q: jax.Array, sources: list[KVSource], block: int) -> jax.Array:
    """q [B, N, T, H, d] -> [B, N, T, H*d] by the online-softmax kernel (custom_vjp, module docstring)."""
    b, n, t, h, d = q.shape
    bq = min(block, t)
    bks = tuple(min(block, s.length) for s in sources)
    spec = _Spec(bq=bq, bk=bks, causal=tuple(s.causal for s in sources),
                 q_offset=tuple(s.q_offset for s in sources), shared=tuple(s.shared for s in sources),
                 scale=d**-0.5)
    qg = _pad_to(group_heads(q, sources[0].k.shape[-2]), 2, bq)
    ks = tuple(_pad_to(s.k, s.k.ndim - 3, bk) for s, bk in zip(sources, bks, strict=True))
    vs = tuple(_pad_to(s.v, s.v.ndim - 3, bk) for s, bk in zip(sources, bks, strict=True))
    valids = tuple(_pad_to(s.valid, s.valid.ndim - 1, bk, False) for s, bk in zip(sources, bks, strict=True))
    segs = tuple(None if segment_ids(s) is None
                 else (_pad_to(s.q_segments, 2, bq, -1), _pad_to(s.segments, s.segments.ndim - 1, bk, -2))
                 for s, bk in zip(sources, bks, strict=True))
    out = _flash(spec, qg, ks, vs, valids, segs)
    return out[:, :, :t].reshape(b, n, t, h * d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(spec: _Spec, q, ks, vs, valids, segs):
    return _flash_fwd(spec, q, ks, vs, valids, segs)[0]


def _key_blocks(spec: _Spec, s: int, i, nk: int):
    """[lo, hi) key blocks of source s that query block i can see (all of them unless causal)."""
    if not spec.causal[s]:
        return 0, nk
    last_row = (i + 1) * spec.bq - 1 + spec.q_offset[s]
    return 0, jnp.clip(last_row // spec.bk[s] + 1, 0, nk)


def _query_blocks(spec: _Spec, s: int, j, nq: int):
    """[lo, hi) query blocks that see some key of key block j of source s."""
    if not spec.causal[s]:
        return 0, nq
    return jnp.clip((j * spec.bk[s] - spec.q_offset[s]) // spec.bq, 0, nq), nq


def _slice(x, start, size: int, axis: int):
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


class _Src(NamedTuple):
    """One source's arrays inside the blockwise loops: keys, values, key validity, segment ids (or None)."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    seg: tuple | None


class _Grad(NamedTuple):
    """What every backward block reads: q, the output's cotangent do, the saved log-sum-exp, delta = rowsum(do o)."""

    q: jax.Array
    do: jax.Array
    lse: jax.Array
    delta: jax.Array


def _block_scores(spec: _Spec, s: int, qi, kj, src: _Src, i, j):
    """Scaled fp32 scores [B, N, K, G, bq, bk] of query block i against key block j, and the block's mask."""
    bk, valid, seg = spec.bk[s], src.valid, src.seg
    sub = "bskd" if spec.shared[s] else "bnskd"
    scores = jnp.einsum(f"bnqkgd,{sub}->bnkgqs", qi, kj, preferred_element_type=_F32) * spec.scale
    vj = _slice(valid, j * bk, bk, valid.ndim - 1)
    view = MaskView(shared=spec.shared[s], causal=spec.causal[s], q_offset=spec.q_offset[s])
    if seg is not None:
        seg = (_slice(seg[0], i * spec.bq, spec.bq, 2), _slice(seg[1], j * bk, bk, seg[1].ndim - 1))
    mask = block_mask(view, vj, i * spec.bq, spec.bq, j * bk, bk, seg)
    return scores, mask


def _fwd_step(spec: _Spec, s: int, qi, i, src: _Src, j, state):
    """One online-softmax update of (max, sum, acc) [B, N, K, G, bq](, d) with key block j of source s."""
    m, total, acc = state
    bk, axis = spec.bk[s], src.k.ndim - 3
    kj, vj = _slice(src.k, j * bk, bk, axis), _slice(src.v, j * bk, bk, axis)
    scores, mask = _block_scores(spec, s, qi, kj, src, i, j)
    scores = jnp.where(mask, scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # nothing visible yet: keep exp() at 0, not NaN
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    sub = "bskd" if spec.shared[s] else "bnskd"
    pv = jnp.einsum(f"bnkgqs,{sub}->bnkgqd", p.astype(src.v.dtype), vj, preferred_element_type=_F32)
    return m_new, alpha * total + p.sum(axis=-1), alpha[..., None] * acc + pv


def _flash_fwd(spec: _Spec, q, ks, vs, valids, segs):
    """Forward of q [B, N, T, K, G, d]: (out like q, (residuals)); out 0 where no key is visible."""
    b, n, t, kh, g, d = q.shape
    nq = t // spec.bq

    def q_block(i, carry):
        out, lse = carry
        qi = _slice(q, i * spec.bq, spec.bq, 2)
        state = (jnp.full((b, n, kh, g, spec.bq), -jnp.inf, _F32), jnp.zeros((b, n, kh, g, spec.bq), _F32),
                 jnp.zeros((b, n, kh, g, spec.bq, d), _F32))
        for s, src in enumerate(_Src(*a) for a in zip(ks, vs, valids, segs, strict=True)):
            lo, hi = _key_blocks(spec, s, i, src.k.shape[-3] // spec.bk[s])
            state = jax.lax.fori_loop(lo, hi, functools.partial(_fwd_step, spec, s, qi, i, src), state)
        m, total, acc = state
        seen = total > 0
        o = acc / jnp.where(seen, total, 1.0)[..., None]
        # +inf where nothing was visible: the backward's exp(s - lse) is then 0 there.
        lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.einsum("bnkgqd->bnqkgd", o).astype(q.dtype),
                                                  i * spec.bq, axis=2)
        return out, jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * spec.bq, axis=4)

    out, lse = jax.lax.fori_loop(0, nq, q_block, (jnp.zeros_like(q), jnp.zeros((b, n, kh, g, t), _F32)))
    return out, (q, ks, vs, valids, segs, out, lse)


def _bwd_step(spec: _Spec, s: int, kv_j: tuple, j, g: _Grad, src: _Src, i, carry):
    """Query block i's share of the gradients through key block j (``kv_j``: its keys and values) of source s."""
    dq, dk, dv = carry
    (kj, vj), bq = kv_j, spec.bq
    qi, doi = _slice(g.q, i * bq, bq, 2), _slice(g.do, i * bq, bq, 2)
    scores, mask = _block_scores(spec, s, qi, kj, src, i, j)
    lse_i, delta_i = _slice(g.lse, i * bq, bq, 4), _slice(g.delta, i * bq, bq, 4)
    p = jnp.where(mask, jnp.exp(scores - lse_i[..., None]), 0.0)
    sub = "bskd" if spec.shared[s] else "bnskd"
    dv = dv + jnp.einsum(f"bnkgqs,bnqkgd->{sub}", p.astype(g.do.dtype), doi, preferred_element_type=_F32)
    dp = jnp.einsum(f"bnqkgd,{sub}->bnkgqs", doi, vj, preferred_element_type=_F32)
    ds = (p * (dp - delta_i[..., None]) * spec.scale).astype(g.q.dtype)
    dk = dk + jnp.einsum(f"bnkgqs,bnqkgd->{sub}", ds, qi, preferred_element_type=_F32)
    dqi = jnp.einsum(f"bnkgqs,{sub}->bnqkgd", ds, kj, preferred_element_type=_F32)
    dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * bq, bq, 2) + dqi, i * bq, axis=2)
    return dq, dk, dv


def _source_bwd(spec: _Spec, s: int, g: _Grad, src: _Src, dq):
    """Gradients w.r.t. one source's k, v (fp32, like k) and its share of dq, looping over key blocks."""
    k, v = src.k, src.v
    bk, axis = spec.bk[s], k.ndim - 3
    nq, nk = g.q.shape[2] // spec.bq, k.shape[axis] // bk

    def k_block(j, carry):
        dq, dk, dv = carry
        kj, vj = _slice(k, j * bk, bk, axis), _slice(v, j * bk, bk, axis)
        zeros = jnp.zeros(kj.shape, _F32)
        lo, hi = _query_blocks(spec, s, j, nq)
        step = functools.partial(_bwd_step, spec, s, (kj, vj), j, g, src)
        dq, dkj, dvj = jax.lax.fori_loop(lo, hi, step, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * bk, axis=axis)
        return dq, dk, jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * bk, axis=axis)

    zeros = jnp.zeros(k.shape, _F32)
    return jax.lax.fori_loop(0, nk, k_block, (dq, zeros, zeros))


def _flash_bwd(spec: _Spec, res, do):
    q, ks, vs, valids, segs, out, lse = res
    delta = jnp.einsum("bnqkgd,bnqkgd->bnkgq", do.astype(_F32), out.astype(_F32))
    g = _Grad(q, do, lse, delta)
    dq, dks, dvs = jnp.zeros(q.shape, _F32), [], []
    for s, src in enumerate(_Src(*a) for a in zip(ks, vs, valids, segs, strict=True)):
        dq, dk, dv = _source_bwd(spec, s, g, src, dq)
        dks.append(dk.astype(src.k.dtype))
        dvs.append(dv.astype(src.v.dtype))
    return dq.astype(q.dtype), tuple(dks), tuple(dvs), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
