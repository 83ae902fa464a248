"""Softmax attention over key/value *sources* without a [T, S] score matrix (pure JAX, CPU and GPU).

What: ``attention(q, sources)`` computes softmax(q k^T / sqrt(d)) v of queries q [B, N, T, H, d] over
the keys of one or more sources, in ONE softmax (the suffix's answers attend to the prompt's shared
boundary KV and causally to themselves). Each source describes its mask compactly, never as a
[T, S] array:

- ``valid`` [B, S] or [B, N, S]: key validity (left or right padding, segment padding);
- ``causal`` with a static ``q_offset``: key j is visible to query i iff j <= i + q_offset;
- ``segments`` [B, (N,) S] with ``q_segments`` [B, N, T] (int): key j is visible to query i only if their
  segment ids are equal (packed rows: several sequences in one row, ``qwen2_5_vl/packing.py``);
- k, v [B, S, K, d] (shared by the N axis: one prompt's KV serves its N answers, never copied N
  times) or [B, N, S, K, d]. GQA: H % K == 0, q is viewed as [.., K, G, d]; K/V are never repeated.

Vision segments (a window of <= 64 patches, or a whole frame) are the B axis of a call: the tower
gathers each segment's patches into [segments, longest] (padding at the end, ``valid`` marks it).

Why: the dense path (kept as ``--attention=dense``, the oracle) holds fp32 scores [B, N, H, T, S] and,
for the backward, probabilities of the same size; a Qwen2.5-VL-3B step planned at 667 GiB per device
with it. Measured, XLA temp bytes of value_and_grad of one attention (CPU compile, bf16, dense ->
blockwise at block 512): causal T 4096, H 16, K 2, d 128, left-padded: 3.57 -> 0.147 GiB; the suffix,
B 4 x N 8 answers x Tr 512 over a shared Tp 4096 prefix: 19.8 -> 3.06 GiB (0.94 at block 256, 0.64 at
128: the block is [B, N, H, bq, bk]); a vision frame of 5120 patches, 16 heads, d 80: 7.13 -> 0.229 GiB.

How (``blockwise``, FlashAttention-2 in ``lax`` loops, a ``jax.custom_vjp``):
- forward: for each query block (``attention_block`` rows), loop over the key blocks of each source
  keeping a running max m, sum l and fp32 accumulator (online softmax); the mask of a block is
  computed from ``valid`` and positions; causal sources only visit key blocks at or below the
  diagonal (the loop bounds depend on the block index, which is why this is a custom_vjp and not
  blocks scanned under ``jax.checkpoint``: a scan needs a fixed trip count, and autodiff of the
  scan would save per-block residuals). Saved for the backward: q, k, v, out and the row
  log-sum-exp [B, N, K, G, T] only.
- backward: one pass per source, outer loop over key blocks, inner over the query blocks that see
  them; scores are recomputed from q, k and the saved log-sum-exp; dk, dv accumulate per key block,
  dq in one fp32 [T] buffer carried through the loops. The shared source's dk, dv sum over N.
- lengths that blocks do not divide are padded (invalid keys, dropped query rows).
- a query row with no visible key (left padding under a causal mask) gives 0 and zero gradients,
  in both paths (the dense softmax of an all-masked row would average every value).
- a call whose queries and every source fit in one block runs the dense path: blockwise would
  compute that very block, plus loop overhead.
- on a CPU the block is first cut to fit the cache (``cache_block``: one fp32 score block of all the
  call's rows at most ``CPU_BLOCK_BYTES``), so a large batch of short rows runs blockwise too: a
  [32 rows x 4 heads, 277, 277] dense block streams through memory in every fused pass over it
  (measured 113 ms dense vs 30 ms at block 64, forward).

Memory: the largest attention temporaries are [B, N, H, bq, bk] fp32 blocks (16 MiB each for bq = bk =
512, H = 16, B = N = 1) instead of [B, N, H, T, S]; residuals are O(T).

``cudnn`` (``jax.nn.dot_product_attention(implementation="cudnn")``) is used where it expresses the
mask EXACTLY: one source whose valid keys are a prefix of each row (``right_padded``; it only takes
sequence lengths), causal only with q_offset 0 (it aligns top-left), bf16/fp16, head dim a multiple
of 8, on a GPU. That is the vision tower (windows and frames). The text model is not expressible:
prompts are left-padded and the suffix merges two sources in one softmax (cuDNN's log-sum-exp has no
gradient, so two calls cannot be merged). Everything else, and every call on a CPU, falls back to the
blockwise path with one log line per reason.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollplex_jax.config import CPU_BLOCK_BYTES
from rollplex_jax.models.platform import platform

log = logging.getLogger(__name__)
_F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "valid", "segments", "q_segments"],
                   meta_fields=["causal", "q_offset", "right_padded"])
@dataclasses.dataclass(frozen=True)
class KVSource:
    """Keys/values a query block attends to, with a compact mask description.

    k, v: [B, S, K, d] (shared by the N axis) or [B, N, S, K, d].
    valid: bool [B, S] (shared) or [B, N, S]: which keys exist (not padding).
    causal: key j is visible to query i only if j <= i + q_offset (static).
    right_padded: the caller guarantees ``valid`` is a prefix of every row (cuDNN takes lengths).
    segments: int [B, S] or [B, N, S] (like ``valid``), with q_segments int [B, N, T]: a key is visible to a
      query only where the two ids are equal (both or neither given).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    causal: bool = False
    q_offset: int = 0
    right_padded: bool = False
    segments: jax.Array | None = None
    q_segments: jax.Array | None = None

    @property
    def shared(self) -> bool:
        return self.k.ndim == 4

    @property
    def length(self) -> int:
        return self.k.shape[-3]


def attention(q: jax.Array, sources: list[KVSource], *, impl: str = "blockwise", block: int = 512) -> jax.Array:
    """Softmax attention (fp32 softmax) of q [B, N, T, H, d] over the sources' keys together.

    Args:
      impl: ``blockwise``, ``dense`` or ``cudnn`` (``ProgramConfig.attention``).
      block: query/key block length of the blockwise path (``ProgramConfig.attention_block``).

    Returns:
      [B, N, T, H * d] in q's dtype; 0 in rows with no visible key.
    """
    b, n, t, h, d = q.shape
    sources = [dataclasses.replace(s, valid=s.valid.astype(bool)) for s in sources]  # e.g. int attention masks
    if impl == "cudnn":
        out = _cudnn(q, sources)
        if out is not None:
            return out.reshape(b, n, t, h * d)
        impl = "blockwise"
    if impl not in ("blockwise", "dense"):
        raise ValueError(f"attention impl {impl!r}: use blockwise, dense or cudnn")
    if impl == "blockwise":
        block = cache_block(block, b * n * h, t, max(s.length for s in sources))
    if impl == "dense" or (t <= block and all(s.length <= block for s in sources)):
        return dense_attention(q, sources)
    return blockwise_attention(q, sources, block)


def cache_block(block: int, rows: int, t: int, s: int) -> int:
    """The blockwise block length to use for ``rows`` = B*N*H score rows, T queries and S keys (at most ``block``).

    On a CPU, ``block`` is halved (not below 16) until one fp32 score block [rows, bq, bk] fits
    ``CPU_BLOCK_BYTES``: the batch axes (B prompts x N answers, or the vision tower's segments) all sit in
    every block, and a block that leaves the cache is streamed through memory by each of the several fused
    passes over it (scores, max, exp, sum, the value product). Measured (2026-12, this 2-core CPU, fp32, min
    of 4): 32 vision frames of 1024 patches, 2 heads, d 16 (configs/bench_vlm448_cpu.flags): forward 599 /
    400 / 242 / 250 ms and gradient 1642 / 1032 / 763 / 693 ms at blocks 512 / 256 / 128 / 64; the text
    decoder's causal attention, 32 rows x 277 tokens, 4 heads over 2 kv heads, d 16: forward 113 (dense,
    one block) / 56 / 30 ms and gradient 172 / 208 / 96 ms at 512 / 128 / 64. Results equal up to float
    summation order (5e-7). Elsewhere (GPU) ``block`` is returned as given."""
    if platform() != "cpu":
        return block
    while block > 16 and rows * min(block, t) * min(block, s) * 4 > CPU_BLOCK_BYTES:
        block //= 2
    return block


# ---------------------------------------------------------------------------------------------
# Masks and einsums shared by both paths. Scores are laid out [B, N, K, G, Tq, S] ("bnkgqs").
# ---------------------------------------------------------------------------------------------


def _sub(src: KVSource) -> str:
    return "bskd" if src.shared else "bnskd"


@dataclasses.dataclass(frozen=True)
class _MaskView:
    """The static part of a source's mask description (what ``_mask`` reads besides ``valid``)."""

    shared: bool
    causal: bool
    q_offset: int


def _mask(src: KVSource | _MaskView, valid, q_start, bq: int, k_start, bk: int, segs=None) -> jax.Array:
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


def _segs(src: KVSource):
    """The source's (query segments, key segments), or None."""
    if (src.segments is None) != (src.q_segments is None):
        raise ValueError("KVSource: give both segments and q_segments, or neither")
    return None if src.segments is None else (src.q_segments, src.segments)


def _group(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, N, T, H, d] -> [B, N, T, K, G, d] (a view: GQA without repeating K/V)."""
    b, n, t, h, d = q.shape
    return q.reshape(b, n, t, num_kv_heads, h // num_kv_heads, d)


def _squeeze(x: jax.Array, letters: str, drop: str) -> tuple[jax.Array, str]:
    """x with the axes named in ``drop`` (all of size 1) reshaped away, and its einsum letters."""
    keep = [i for i, c in enumerate(letters) if c not in drop]
    return x.reshape([x.shape[i] for i in keep]), "".join(letters[i] for i in keep)


def dense_attention(q: jax.Array, sources: list[KVSource]) -> jax.Array:
    """The oracle: fp32 scores of every source concatenated, one softmax. q [B, N, T, H, d] -> [B, N, T, H*d].

    Size-1 N and G axes are left out of the einsums (free reshapes): with them XLA's CPU fusion makes extra
    passes over the scores (measured: the vision tower's bytes accessed 108 -> 185 MB)."""
    b, n, t, h, d = q.shape
    kh = sources[0].k.shape[-2]
    drop = ("n" if n == 1 else "") + ("g" if h == kh else "")
    qg, q_sub = _squeeze(_group(q, kh), "bnqkgd", drop)
    s_sub = "".join(c for c in "bnkgqs" if c not in drop)
    neg = jnp.finfo(_F32).min
    scores, masks = [], []
    for s in sources:
        k, k_sub = _squeeze(s.k, _sub(s), drop)
        x = jnp.einsum(f"{q_sub},{k_sub}->{s_sub}", qg, k)
        mask = jnp.broadcast_to(_mask(s, s.valid, 0, t, 0, s.length, _segs(s)), (b, n, kh, h // kh, t, s.length))
        masks.append(mask)
        scores.append(jnp.where(mask.reshape(x.shape), x.astype(_F32) * d**-0.5, neg))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
    parts = jnp.split(probs, [sum(s.length for s in sources[:i + 1]) for i in range(len(sources) - 1)], axis=-1)
    out = 0
    for p, s in zip(parts, sources, strict=True):
        v, v_sub = _squeeze(s.v, _sub(s), drop)
        out = out + jnp.einsum(f"{s_sub},{v_sub}->{q_sub}", p, v)
    out = out.reshape(b, n, t, kh, h // kh, d)
    # A row with no visible key: 0 (the blockwise path's definition), not the mean of every value; zeroing
    # the output (not the [T, S] probabilities) also zeroes that row's gradient.
    if any(_segs(s) is not None for s in sources):  # the masks say it (segments make it O(T S) anyway)
        seen = functools.reduce(jnp.logical_or, [m.any(axis=-1) for m in masks])  # [B, N, K, G, T]
        seen = jnp.moveaxis(seen, -1, 2)[..., None]  # [B, N, T, K, G, 1]
    else:
        seen = functools.reduce(jnp.logical_or, [_row_seen(s, t) for s in sources])[..., None]
    return jnp.where(seen, out, 0).reshape(b, n, t, h * d)


def _row_seen(src: KVSource, t: int) -> jax.Array:
    """[B, 1 or N, T, 1, 1]: whether query row i sees any valid key of ``src`` (O(S), not O(T S))."""
    valid = src.valid[:, None] if src.shared else src.valid  # [B, 1 or N, S]
    if not src.causal:
        seen = jnp.broadcast_to(jnp.any(valid, axis=-1, keepdims=True), (*valid.shape[:2], t))
    else:  # row i sees keys j <= i + q_offset: some is valid iff the running count at that key is > 0
        count = jnp.cumsum(valid, axis=-1, dtype=jnp.int32)
        last = jnp.arange(t) + src.q_offset
        seen = (last >= 0) & (jnp.take(count, jnp.clip(last, 0, src.length - 1), axis=-1) > 0)
    return seen[..., None, None]


# ---------------------------------------------------------------------------------------------
# Blockwise path.
# ---------------------------------------------------------------------------------------------


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
    qg = _pad_to(_group(q, sources[0].k.shape[-2]), 2, bq)
    ks = tuple(_pad_to(s.k, s.k.ndim - 3, bk) for s, bk in zip(sources, bks, strict=True))
    vs = tuple(_pad_to(s.v, s.v.ndim - 3, bk) for s, bk in zip(sources, bks, strict=True))
    valids = tuple(_pad_to(s.valid, s.valid.ndim - 1, bk, False) for s, bk in zip(sources, bks, strict=True))
    segs = tuple(None if _segs(s) is None
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
    view = _MaskView(shared=spec.shared[s], causal=spec.causal[s], q_offset=spec.q_offset[s])
    if seg is not None:
        seg = (_slice(seg[0], i * spec.bq, spec.bq, 2), _slice(seg[1], j * bk, bk, seg[1].ndim - 1))
    mask = _mask(view, vj, i * spec.bq, spec.bq, j * bk, bk, seg)
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


# ---------------------------------------------------------------------------------------------
# cuDNN path (GPU only), for the cases it expresses exactly.
# ---------------------------------------------------------------------------------------------


@functools.cache
def _note(message: str) -> None:
    """Logs each fallback reason once per process (they are decided at trace time, per shape)."""
    log.warning("--attention=cudnn: %s; using the blockwise kernel", message)


def _cudnn_unsupported(q: jax.Array, sources: list[KVSource]) -> str | None:
    """Why cuDNN cannot compute this call exactly, or None if it can."""
    if platform() != "gpu":
        return f"cuDNN needs a GPU (compiling for {platform()})"
    if len(sources) != 1:
        return "several KV sources in one softmax (the suffix over a prefix)"
    src = sources[0]
    if src.segments is not None:
        return "segment ids (packed rows)"
    if not src.right_padded:
        return "keys not right-padded (cuDNN takes only sequence lengths; prompts are left-padded)"
    if src.causal and src.q_offset:
        return "causal with a query offset (cuDNN aligns causal masks top-left)"
    if src.shared and q.shape[1] > 1:
        return "keys shared by N > 1 query rows (cuDNN would need them copied N times)"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"dtype {q.dtype} (cuDNN takes bf16/fp16)"
    if q.shape[-1] % 8:
        return f"head dim {q.shape[-1]} not a multiple of 8"
    return None


def _cudnn(q: jax.Array, sources: list[KVSource]) -> jax.Array | None:
    """cuDNN flash attention of q [B, N, T, H, d] (out [B, N, T, H, d]), or None where it does not apply."""
    reason = _cudnn_unsupported(q, sources)
    if reason is None:
        src = sources[0]
        b, n, t, h, d = q.shape
        k, v = (src.k[:, None], src.v[:, None]) if src.shared else (src.k, src.v)
        valid = src.valid[:, None] if src.shared else src.valid
        fold = (b * n, src.length, k.shape[-2], d)
        lengths = jnp.sum(valid, axis=-1, dtype=jnp.int32).reshape(b * n)
        try:
            out = jax.nn.dot_product_attention(q.reshape(b * n, t, h, d), k.reshape(fold), v.reshape(fold),
                                               is_causal=src.causal, key_value_seq_lengths=lengths,
                                               implementation="cudnn")
            return out.reshape(b, n, t, h, d)
        except (NotImplementedError, ValueError, RuntimeError) as e:  # shapes/versions cuDNN refuses
            reason = f"cuDNN refused the call ({e})"
    _note(reason)
    return None
