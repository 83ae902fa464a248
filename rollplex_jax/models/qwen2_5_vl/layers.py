"""Small numerical building blocks shared by the vision tower and the decoder.

They follow transformers' Qwen2.5-VL numerics: RMSNorm computed in fp32 and cast
back before the weight multiply; linear weights in torch's ``[out, in]`` layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w[out, in].T (+ b)."""
    y = jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding on x [..., T, H, hd] with tables [..., T, hd] (broadcast over heads)."""
    return x * cos[..., None, :] + rotate_half(x) * sin[..., None, :]


def constrain_rows(x: jax.Array) -> jax.Array:
    """Activation constraint at a block boundary: rows (dim 0) split over the mesh axis ``fsdp`` (data
    parallel), every other dimension replicated (so over ``tp`` the residual stream is whole).

    A no-op without a mesh in context (``jax.set_mesh``; single-device runs), on a mesh without an
    ``fsdp`` axis > 1, or when ``fsdp`` does not divide the rows (GSPMD then chooses)."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty or "fsdp" not in m.axis_names:
        return x
    n = m.shape["fsdp"]
    if n == 1 or x.shape[0] % n:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec("fsdp"))
