"""Softmax attention over key/value *sources* without a [T, S] score matrix (pure JAX, CPU and GPU).

What: ``attention(q, sources)`` computes softmax(q k^T / sqrt(d)) v of queries q [B, N, T, H, d] over
the keys of one or more sources, in ONE softmax (the suffix's answers attend to the prompt's shared
boundary KV and causally to themselves). Each source describes its mask compactly, never as a
[T, S] array:

- ``valid`` [B, S] or [B, N, S]: key validity (left or right padding, segment padding);
- ``causal`` with a static ``q_offset``: key j is visible to query i iff j <= i + q_offset;
- ``segments`` [B, (N,) S] with ``q_segments`` [B, N, T] (int): key j is visible to query i only if their
  segment ids are equal (packed rows: several sequences in one row, ``vl/packing.py``);
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
- ``row_groups`` (segment ids only; the vision tower's frames packed into full-attention rows): the rows
  are visited one at a time in an outer loop, each over the key blocks its own ids can see (a block whose
  valid keys' ids meet none of a query block's is fully masked: skipping it changes nothing), instead of
  every row over the union of all rows' blocks. Measured in ``CPU_ROW_BLOCK``'s comment: 45 -> 20 ms on
  the mixed-size bench's frames.
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

import jax
import jax.numpy as jnp

from rollplex_jax.config import CPU_BLOCK_BYTES
from rollplex_jax.models.blockwise import blockwise_attention
from rollplex_jax.models.masks import block_mask, einsum_sub, group_heads, segment_ids, squeeze_axes
from rollplex_jax.models.platform import platform

log = logging.getLogger(__name__)
_F32 = jnp.float32
# The CPU block of a per-row call (``row_groups``). Measured (2026-12-07, this 2-core CPU, value_and_grad, 2 heads
# of d 16, median of 7): frames [780, 200] + [400, 300, 250] patches in two rows of 1024: 45 ms batched at block
# 512 (the cache's), per row 43 / 27 / 24 / 20 / 29 ms at blocks 512 / 256 / 128 / 64 / 32; 4 rows of one
# 324-patch frame in 512: 16.7 batched, per row 19 / 19 / 10 / 11 / 17 ms.
CPU_ROW_BLOCK = 64


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


def attention(q: jax.Array, sources: list[KVSource], *, impl: str = "blockwise", block: int = 512,
              row_groups: int = 0) -> jax.Array:
    """Softmax attention (fp32 softmax) of q [B, N, T, H, d] over the sources' keys together.

    Args:
      impl: ``blockwise``, ``dense`` or ``cudnn`` (``ProgramConfig.attention``).
      block: query/key block length of the blockwise path (``ProgramConfig.attention_block``).
      row_groups: with segment ids and rows longer than a block, > 0 visits the B rows one at a time (viewed as
        [row_groups, B / row_groups], the groups a sharded call splits B into), each over the blocks its own ids
        see (``blockwise.py``): the vision tower's frames packed into rows. 0: every row with every block.

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
        block, row_groups = _blocking(block, q.shape, sources, row_groups)
    if impl == "dense" or (t <= block and all(s.length <= block for s in sources)):
        return dense_attention(q, sources)
    return blockwise_attention(q, sources, block, row_groups)


def _blocking(block: int, shape: tuple, sources: list[KVSource], row_groups: int) -> tuple[int, int]:
    """(block, row_groups) of a blockwise call of q ``shape`` [B, N, T, H, d]: rows one at a time where the
    sources have segment ids, a row is longer than its block (within one block there is nothing to skip) and
    the batched call is more than one dense block (4 rows of one 256-patch frame: 3.6 ms dense, 4.6 per row)."""
    b, n, t, h, _ = shape
    length = max(s.length for s in sources)
    batched = cache_block(block, b * n * h, t, length)
    if row_groups and any(segment_ids(s) is not None for s in sources) and max(t, length) > batched:
        row_block = cache_block(block, row_groups * n * h, t, length, per_row=True)
        if max(t, length) > row_block:
            return row_block, row_groups
    return batched, 0


def cache_block(block: int, rows: int, t: int, s: int, per_row: bool = False) -> int:
    """The blockwise block length to use for ``rows`` = B*N*H score rows, T queries and S keys (at most ``block``).

    On a CPU, ``block`` is halved (not below 16) until one fp32 score block [rows, bq, bk] fits
    ``CPU_BLOCK_BYTES``: the batch axes (B prompts x N answers, or the vision tower's segments) all sit in
    every block, and a block that leaves the cache is streamed through memory by each of the several fused
    passes over it (scores, max, exp, sum, the value product). Measured (2026-12, this 2-core CPU, fp32, min
    of 4): 32 vision frames of 1024 patches, 2 heads, d 16 (configs/bench_vlm448_cpu.flags): forward 599 /
    400 / 242 / 250 ms and gradient 1642 / 1032 / 763 / 693 ms at blocks 512 / 256 / 128 / 64; the text
    decoder's causal attention, 32 rows x 277 tokens, 4 heads over 2 kv heads, d 16: forward 113 (dense,
    one block) / 56 / 30 ms and gradient 172 / 208 / 96 ms at 512 / 128 / 64. Results equal up to float
    summation order (5e-7). Elsewhere (GPU) ``block`` is returned as given.

    ``per_row`` (rows visited one at a time, skipping the blocks their segment ids do not see): at most
    ``CPU_ROW_BLOCK``, small enough to skip at a frame's granularity."""
    if platform() != "cpu":
        return block
    if per_row:
        block = min(block, CPU_ROW_BLOCK)
    while block > 16 and rows * min(block, t) * min(block, s) * 4 > CPU_BLOCK_BYTES:
        block //= 2
    return block


def dense_attention(q: jax.Array, sources: list[KVSource]) -> jax.Array:
    """The oracle: fp32 scores of every source concatenated, one softmax. q [B, N, T, H, d] -> [B, N, T, H*d].

    Size-1 N and G axes are left out of the einsums (free reshapes): with them XLA's CPU fusion makes extra
    passes over the scores (measured: the vision tower's bytes accessed 108 -> 185 MB)."""
    b, n, t, h, d = q.shape
    kh = sources[0].k.shape[-2]
    drop = ("n" if n == 1 else "") + ("g" if h == kh else "")
    qg, q_sub = squeeze_axes(group_heads(q, kh), "bnqkgd", drop)
    s_sub = "".join(c for c in "bnkgqs" if c not in drop)
    neg = jnp.finfo(_F32).min
    scores, masks = [], []
    for s in sources:
        k, k_sub = squeeze_axes(s.k, einsum_sub(s), drop)
        x = jnp.einsum(f"{q_sub},{k_sub}->{s_sub}", qg, k)
        mask = block_mask(s, s.valid, 0, t, 0, s.length, segment_ids(s))
        mask = jnp.broadcast_to(mask, (b, n, kh, h // kh, t, s.length))
        masks.append(mask)
        scores.append(jnp.where(mask.reshape(x.shape), x.astype(_F32) * d**-0.5, neg))
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
    parts = jnp.split(probs, [sum(s.length for s in sources[:i + 1]) for i in range(len(sources) - 1)], axis=-1)
    out = 0
    for p, s in zip(parts, sources, strict=True):
        v, v_sub = squeeze_axes(s.v, einsum_sub(s), drop)
        out = out + jnp.einsum(f"{s_sub},{v_sub}->{q_sub}", p, v)
    out = out.reshape(b, n, t, kh, h // kh, d)
    # A row with no visible key: 0 (the blockwise path's definition), not the mean of every value; zeroing
    # the output (not the [T, S] probabilities) also zeroes that row's gradient.
    if any(segment_ids(s) is not None for s in sources):  # the masks say it (segments make it O(T S) anyway)
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
