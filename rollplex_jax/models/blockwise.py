"""The blockwise (FlashAttention-2) kernel of ``attention.py``: online softmax in ``lax`` loops, a ``jax.custom_vjp``.

How it works, and why it is a custom_vjp, is in ``attention.py``'s docstring; this module holds the kernel.
With ``row_groups`` the forward and backward loop over the rows first (``_rows_fwd``, ``_rows_bwd``): each row's
loops are bounded by the blocks its segment ids see (``_seg_bounds``), computed for every row before the loop.
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
    row_groups: int = 0  # > 0: rows one at a time, the B axis viewed as [row_groups, B / row_groups] (below)


def _pad_to(x: jax.Array, axis: int, multiple: int, value=0) -> jax.Array:
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def blockwise_attention(q: jax.Array, sources: list[KVSource], block: int, row_groups: int = 0) -> jax.Array:
    """q [B, N, T, H, d] -> [B, N, T, H*d] by the online-softmax kernel (custom_vjp, module docstring).

    row_groups > 0 (segmented sources only): the rows are visited one at a time (the B axis viewed as
    [row_groups, B / row_groups], the first axis kept as a batch: the fsdp groups of a sharded call), each with
    the key blocks its own segment ids can see (``_seg_bounds``), instead of every row with every block."""
    b, n, t, h, d = q.shape
    bq = min(block, t)
    bks = tuple(min(block, s.length) for s in sources)
    segmented = any(segment_ids(s) is not None for s in sources)
    spec = _Spec(bq=bq, bk=bks, causal=tuple(s.causal for s in sources),
                 q_offset=tuple(s.q_offset for s in sources), shared=tuple(s.shared for s in sources),
                 scale=d**-0.5, row_groups=row_groups if segmented and row_groups > 0 and b % row_groups == 0 else 0)
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


def _narrow(lo, hi, bounds, index):
    """[lo, hi) intersected with a row's segment bounds (``_seg_bounds``: lo [n], hi [n]) at ``index``."""
    if bounds is None:
        return lo, hi
    return jnp.maximum(lo, bounds[0][index]), jnp.minimum(hi, bounds[1][index])


def _key_blocks(spec: _Spec, s: int, i, nk: int, bounds=None):
    """[lo, hi) key blocks of source s that query block i can see (all of them unless causal or bounded)."""
    if not spec.causal[s]:
        return _narrow(0, nk, bounds, i)
    last_row = (i + 1) * spec.bq - 1 + spec.q_offset[s]
    return _narrow(0, jnp.clip(last_row // spec.bk[s] + 1, 0, nk), bounds, i)


def _query_blocks(spec: _Spec, s: int, j, nq: int, bounds=None):
    """[lo, hi) query blocks that see some key of key block j of source s."""
    if not spec.causal[s]:
        return _narrow(0, nq, bounds, j)
    return _narrow(jnp.clip((j * spec.bk[s] - spec.q_offset[s]) // spec.bq, 0, nq), nq, bounds, j)


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
    if spec.row_groups:
        out, lse = _rows_fwd(spec, q, (ks, vs, valids, segs))
    else:
        out, lse = _fwd(spec, q, (ks, vs, valids, segs), None)
    return out, (q, ks, vs, valids, segs, out, lse)


def _bounds_of(bounds, s: int, keys: bool):
    """Source s's (lo, hi) segment bounds over key blocks (``keys``) or query blocks, or None."""
    if bounds is None or bounds[s] is None:
        return None
    return bounds[s][:2] if keys else bounds[s][2:]


def _fwd(spec: _Spec, q, srcs: tuple, bounds):
    """(out like q, log-sum-exp [B, N, K, G, T]) of q over the sources (ks, vs, valids, segs)."""
    ks, vs, valids, segs = srcs
    b, n, t, kh, g, d = q.shape
    nq = t // spec.bq

    def q_block(i, carry):
        out, lse = carry
        qi = _slice(q, i * spec.bq, spec.bq, 2)
        state = (jnp.full((b, n, kh, g, spec.bq), -jnp.inf, _F32), jnp.zeros((b, n, kh, g, spec.bq), _F32),
                 jnp.zeros((b, n, kh, g, spec.bq, d), _F32))
        for s, src in enumerate(_Src(*a) for a in zip(ks, vs, valids, segs, strict=True)):
            lo, hi = _key_blocks(spec, s, i, src.k.shape[-3] // spec.bk[s], _bounds_of(bounds, s, True))
            state = jax.lax.fori_loop(lo, hi, functools.partial(_fwd_step, spec, s, qi, i, src), state)
        m, total, acc = state
        seen = total > 0
        o = acc / jnp.where(seen, total, 1.0)[..., None]
        # +inf where nothing was visible: the backward's exp(s - lse) is then 0 there.
        lse_i = jnp.where(seen, m + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.einsum("bnkgqd->bnqkgd", o).astype(q.dtype),
                                                  i * spec.bq, axis=2)
        return out, jax.lax.dynamic_update_slice_in_dim(lse, lse_i, i * spec.bq, axis=4)

    return jax.lax.fori_loop(0, nq, q_block, (jnp.zeros_like(q), jnp.zeros((b, n, kh, g, t), _F32)))


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


def _source_bwd(spec: _Spec, s: int, g: _Grad, src: _Src, dq, bounds=None):
    """Gradients w.r.t. one source's k, v (fp32, like k) and its share of dq, looping over key blocks."""
    k, v = src.k, src.v
    bk, axis = spec.bk[s], k.ndim - 3
    nq, nk = g.q.shape[2] // spec.bq, k.shape[axis] // bk

    def k_block(j, carry):
        dq, dk, dv = carry
        kj, vj = _slice(k, j * bk, bk, axis), _slice(v, j * bk, bk, axis)
        zeros = jnp.zeros(kj.shape, _F32)
        lo, hi = _query_blocks(spec, s, j, nq, bounds)
        step = functools.partial(_bwd_step, spec, s, (kj, vj), j, g, src)
        dq, dkj, dvj = jax.lax.fori_loop(lo, hi, step, (dq, zeros, zeros))
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * bk, axis=axis)
        return dq, dk, jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * bk, axis=axis)

    zeros = jnp.zeros(k.shape, _F32)
    return jax.lax.fori_loop(0, nk, k_block, (dq, zeros, zeros))


def _flash_bwd(spec: _Spec, res, do):
    q, ks, vs, valids, segs, out, lse = res
    delta = jnp.einsum("bnqkgd,bnqkgd->bnkgq", do.astype(_F32), out.astype(_F32))
    g, srcs = _Grad(q, do, lse, delta), (ks, vs, valids, segs)
    dq, dks, dvs = _rows_bwd(spec, g, srcs) if spec.row_groups else _bwd(spec, g, srcs, None)
    return (dq.astype(q.dtype), tuple(dk.astype(k.dtype) for dk, k in zip(dks, ks, strict=True)),
            tuple(dv.astype(v.dtype) for dv, v in zip(dvs, vs, strict=True)), None, None)


def _bwd(spec: _Spec, g: _Grad, srcs: tuple, bounds):
    """fp32 (dq, dks, dvs) of the sources (ks, vs, valids, segs)."""
    dq, dks, dvs = jnp.zeros(g.q.shape, _F32), [], []
    for s, src in enumerate(_Src(*a) for a in zip(*srcs, strict=True)):
        dq, dk, dv = _source_bwd(spec, s, g, src, dq, _bounds_of(bounds, s, False))
        dks.append(dk)
        dvs.append(dv)
    return dq, tuple(dks), tuple(dvs)


# ---------------------------------------------------------------------------------------------
# Rows one at a time (``row_groups``): each row visits only the blocks its segment ids can see.
# ---------------------------------------------------------------------------------------------


def _as_rows(x, groups: int):
    """[B, ...] -> [groups, B / groups, ...] (the first axis stays a batch: a sharded call's fsdp groups)."""
    return x.reshape(groups, x.shape[0] // groups, *x.shape[1:])


def _row(tree, groups: int, r):
    """Row r of every [B, ...] array of ``tree``: [groups, ...]."""
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(_as_rows(x, groups), r, 1, keepdims=False), tree)


def _put_row(rows, r, value):
    return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v.astype(a.dtype), r, 1), rows, value)


def _seg_bounds(spec: _Spec, s: int, t: int, valid, seg):
    """Per row r of B / row_groups: (klo, khi) [R, nq], the key blocks each query block's segment ids can see,
    and (qlo, qhi) [R, nk], the query blocks that see each key block (unions over the groups and N); None
    without segments. A block outside them has no valid key whose id is in any of its queries' ids: fully
    masked, it adds p = 0 and rescales by 1 (bitwise nothing), so skipping it is exact."""
    if seg is None:
        return None
    qseg, kseg = seg
    if spec.shared[s]:
        kseg, valid = kseg[:, None], valid[:, None]
    bk, nq, nk = spec.bk[s], t // spec.bq, kseg.shape[-1] // spec.bk[s]
    big = jnp.iinfo(kseg.dtype).max
    kb, vb = kseg.reshape(*kseg.shape[:-1], nk, bk), valid.reshape(*valid.shape[:-1], nk, bk)
    kmin = jnp.where(vb, kb, big).min(-1)[:, :, None]  # [B, N or 1, 1, nk]: the ids of the block's valid keys
    kmax = jnp.where(vb, kb, -big).max(-1)[:, :, None]
    ids = qseg[..., None]  # [B, N, T, 1]
    b, n = qseg.shape[:2]
    cover = ((kmin <= ids) & (ids <= kmax)).reshape(spec.row_groups, b // spec.row_groups, n, nq, spec.bq, nk)
    vis = cover.any(axis=(0, 2, 4))  # [R, nq, nk]
    vis_t, jk, iq = jnp.swapaxes(vis, 1, 2), jnp.arange(nk), jnp.arange(nq)
    return (jnp.where(vis, jk, nk).min(-1), jnp.where(vis, jk + 1, 0).max(-1),
            jnp.where(vis_t, iq, nq).min(-1), jnp.where(vis_t, iq + 1, 0).max(-1))


def _all_bounds(spec: _Spec, t: int, srcs: tuple):
    _, _, valids, segs = srcs
    return tuple(_seg_bounds(spec, s, t, valid, seg) for s, (valid, seg) in enumerate(zip(valids, segs, strict=True)))


def _rows_fwd(spec: _Spec, q, srcs: tuple):
    groups = spec.row_groups
    bounds = _all_bounds(spec, q.shape[2], srcs)

    def row(r, carry):
        return _put_row(carry, r, _fwd(spec, _row(q, groups, r), _row(srcs, groups, r),
                                       jax.tree.map(lambda a: a[r], bounds)))

    b, n, t, kh, g, _ = q.shape
    init = (jnp.zeros(_as_rows(q, groups).shape, q.dtype), jnp.zeros((groups, b // groups, n, kh, g, t), _F32))
    out, lse = jax.lax.fori_loop(0, b // groups, row, init)
    return out.reshape(q.shape), lse.reshape(b, n, kh, g, t)


def _rows_bwd(spec: _Spec, g: _Grad, srcs: tuple):
    groups = spec.row_groups
    bounds = _all_bounds(spec, g.q.shape[2], srcs)

    def row(r, carry):
        return _put_row(carry, r, _bwd(spec, _row(g, groups, r), _row(srcs, groups, r),
                                       jax.tree.map(lambda a: a[r], bounds)))

    like = (g.q, srcs[0], srcs[1])
    init = jax.tree.map(lambda x: jnp.zeros(_as_rows(x, groups).shape, _F32), like)
    grads = jax.lax.fori_loop(0, g.q.shape[0] // groups, row, init)
    return jax.tree.map(lambda a, x: a.reshape(x.shape), grads, like)


_flash.defvjp(_flash_fwd, _flash_bwd)
