"""The vision towers' shared operations (both families' ``vision.py``): activations, the group-local gathers,
attention within segments (windows, frames, frames packed in rows) and the segments' gathers, computed once per
call for every block."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rollplex_jax.config import ProgramConfig, VisionConfig
from rollplex_jax.models.attention import KVSource, attention
from rollplex_jax.models.vl.fused import split_last
from rollplex_jax.models.vl.layers import constrain_rows, linear, rotate_half

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def take_groups(x, idx):
    """Per group: ``x`` [N, ...] split into idx.shape[0] groups of rows, gathered by the group-local
    ``idx`` [groups, ...] -> [groups, *idx.shape[1:], ...]. A batched gather: on a mesh whose ``fsdp`` splits
    the rows into the same groups it is local to each device (a gather of a row-split array by global
    indices comes back replicated, every device holding every row)."""
    g = idx.shape[0]
    xg = constrain_rows(x.reshape(g, x.shape[0] // g, *x.shape[1:]))
    return constrain_rows(jax.vmap(lambda a, i: a[i])(xg, idx))


def segment_attention(p: dict, prefix: str, x, cos, sin, seg, cfg: VisionConfig, prog: ProgramConfig):
    """Bidirectional attention of x [N, D] within each segment: ``seg`` = (gather, slot, ids) of
    ``frame_segments``: gather [groups, S, L] holds each segment's patch indices local to its group of
    N / groups rows, padded at the end with N / groups (masked as keys, dropped as outputs); ids [groups, S, L]
    (or None): inside a segment a patch sees the patches of its own id only (frames of a vision chunk)."""
    gather, slot, ids = seg
    n = x.shape[0]
    g, segs, length = gather.shape
    local = n // g
    qkv = linear(x, p[prefix + "qkv.weight"], p[prefix + "qkv.bias"])
    d = cfg.hidden_size
    q, k, v = (a.reshape(n, cfg.num_heads, cfg.head_dim) for a in split_last(qkv, (d, d, d), cfg.qkv_groups))
    c, s = cos[:, None, :], sin[:, None, :]
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    q = (qf * c + rotate_half(qf) * s).astype(x.dtype)
    k = (kf * c + rotate_half(kf) * s).astype(x.dtype)
    valid = gather < local
    idx = jnp.minimum(gather, local - 1)

    def by_segment(a):  # [N, h, d] -> [groups * S, L, h, d]: segments are the batch axis
        return constrain_rows(take_groups(a, idx).reshape(g * segs, length, *a.shape[1:]))

    segments = None if ids is None else constrain_rows(ids.reshape(g * segs, length))
    src = KVSource(by_segment(k), by_segment(v), constrain_rows(valid.reshape(g * segs, length)), right_padded=True,
                   segments=segments, q_segments=None if ids is None else segments[:, None])
    # frames packed in rows (ids given): each row attends over its own frames' blocks only (``row_groups``)
    out = attention(by_segment(q)[:, None], [src], impl=prog.attention, block=prog.attention_block,
                    row_groups=g)[:, 0]
    out = take_groups(out.reshape(g * segs * length, -1), slot).reshape(n, -1)  # back to patch order
    return linear(out, p[prefix + "proj.weight"], p[prefix + "proj.bias"])


def frame_segments(unit_gather, unit: int, n: int, unit_ids=None):
    """(gather, slot, ids) of one segmentation over n patches, computed once for every block: merge-unit indices
    [groups, S, L] -> patch indices [groups, S, L * unit] (padding stays out of range), per group each of
    its n / groups patches' slot among the S x L * unit gathered rows, and the units' ids [groups, S, L] (frame
    ids of a vision chunk's full-attention rows, ``vision_chunks.py``) per patch, or None. The attention's output
    goes back to patch order by gathering those slots (each patch is in exactly one segment), not by scattering [N, D]
    values (whose index arrays XLA broadcasts to [N, D])."""
    g = jnp.asarray(unit_gather)
    gather = (g[..., None] * unit + jnp.arange(unit, dtype=g.dtype)).reshape(*g.shape[:2], -1)
    local, rows = n // gather.shape[0], gather.shape[1] * gather.shape[2]

    def slots(gi):  # [S, L] -> [local]: the slot numbers scattered to their patches (padding dropped)
        return jnp.zeros((local,), jnp.int32).at[gi.reshape(-1)].set(jnp.arange(rows, dtype=jnp.int32), mode="drop")

    ids = None if unit_ids is None else jnp.repeat(jnp.asarray(unit_ids), unit, axis=-1)
    return gather, jax.vmap(slots)(gather), ids
