"""Small numerical building blocks shared by the vision tower and the decoder.

They follow transformers' Qwen2.5-VL numerics: RMSNorm computed in fp32 and cast
back before the weight multiply; linear weights in torch's ``[out, in]`` layout.
``rematerialise`` wraps one decoder layer or vision block in ``jax.checkpoint`` by policy, and
``layer_params`` hands it only that layer's entries of the flat parameter dict.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rollplex_jax.models.platform import platform


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w[out, in].T (+ b)."""
    y = jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """torch's LayerNorm (biased variance), computed in fp32 and cast back."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xf = xf - mean
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding on x [..., T, H, hd] with tables [..., T, hd] (broadcast over heads)."""
    return x * cos[..., None, :] + rotate_half(x) * sin[..., None, :]


# ProgramConfig.remat -> what a layer keeps for its backward ("none": everything, no checkpoint).
_REMAT_POLICIES = {
    "layer": jax.checkpoint_policies.nothing_saveable,  # only the layer's inputs; the rest is recomputed
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # also the weight matmuls' outputs
}


def rematerialise(fn, remat: str):
    """``fn`` (one layer or block) checkpointed by policy ``remat`` (``ProgramConfig.remat``).

    The layers are unrolled (see model.py for the measured compile times), so ``prevent_cse`` stays on:
    without it XLA may merge the backward's recomputation with the forward and keep everything alive."""
    if remat == "none":
        return fn
    if remat not in _REMAT_POLICIES:
        raise ValueError(f"remat {remat!r}: use layer, dots or none")

    def ordered(p, x, *rest):
        # The layer's params pass an optimization barrier together with its input, so on a mesh their FSDP
        # all-gathers (inserted where the matmuls use them) cannot be scheduled before the previous layer is
        # done: XLA otherwise issues every layer's all-gather early and holds all gathered weights at once.
        p, x = jax.lax.optimization_barrier((p, x))
        return fn(p, x, *rest)

    return jax.checkpoint(ordered, policy=_REMAT_POLICIES[remat])


def compiler_options(remat: str) -> dict | None:
    """XLA options a program with ``remat`` needs on this backend: on CPU, keep ``jax.checkpoint``'s
    optimization barriers (XLA's CPU pipeline removes them before its last CSE pass, which then merges the
    backward's recomputation into the forward and undoes most of the remat: measured 128 -> 72 MiB temp on an
    8-layer toy once kept). GPU pipelines remove them only after scheduling: nothing to change there."""
    if remat == "none" or platform() != "cpu":
        return None
    return {"xla_disable_hlo_passes": "cse_barrier_expander"}


def layer_params(params: dict, prefix: str) -> dict:
    """The entries of ``params`` under ``prefix`` (e.g. ``model.layers.3.``): what one checkpointed layer
    takes as input, so its residuals are views of those arrays, nothing else."""
    return {k: v for k, v in params.items() if k.startswith(prefix)}


def _batch_axes() -> tuple[tuple[str, ...], int]:
    """(the mesh in context's batch axes larger than 1 (``mesh.BATCH``: dp, fsdp), their product); ((), 1)
    without a mesh."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty:
        return (), 1
    axes = tuple(a for a in ("dp", "fsdp") if a in m.axis_names and m.shape[a] > 1)
    return axes, math.prod(m.shape[a] for a in axes)


def fsdp_size() -> int:
    """Parts the batch is split into on the mesh in context (``jax.set_mesh``: dp x fsdp); 1 without one."""
    return _batch_axes()[1]


def _rows_spec(axes: tuple[str, ...]):
    return axes[0] if len(axes) == 1 else axes


def constrain_rows(x: jax.Array, dims: tuple[int, ...] = (0,)) -> jax.Array:
    """Activation constraint at a block boundary: rows split over the batch axes ``dp x fsdp`` (data
    parallel), every other dimension replicated (so over ``tp`` the residual stream is whole). The rows are the
    first of ``dims`` that the batch axes divide: a text block [B, N, T, D] passes ``(0, 1)``, so a suffix
    micro-batch of fewer prompts than devices splits its answers instead (without it GSPMD replicated the
    micro-batch: every device computed all of it).

    A no-op without a mesh in context (``jax.set_mesh``; single-device runs), on a mesh whose batch axes are
    all 1, or when they divide none of ``dims`` (GSPMD then chooses)."""
    axes, n = _batch_axes()
    dim = next((d for d in dims if d < x.ndim and x.shape[d] % n == 0), None)
    if n == 1 or dim is None:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*([None] * dim), _rows_spec(axes)))


def constrain_kv(x: jax.Array) -> jax.Array:
    """Keys or values [B, T, K, d] of padded rows: rows over ``dp x fsdp`` and heads over ``tp`` where they
    divide them, as the layer that computed them had them. Needed after a gather out of packed rows
    (``packing.unpack_rows``), whose result GSPMD otherwise replicates (measured: the boundary KV of a
    shape-bucketed prefix on fsdp 2 x tp 2 held twice its share per device). A no-op without a mesh."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty:
        return x
    spec = [None] * x.ndim
    axes, n = _batch_axes()
    if axes and x.shape[0] % n == 0:
        spec[0] = _rows_spec(axes)
    if "tp" in m.axis_names and m.shape["tp"] > 1 and x.shape[2] % m.shape["tp"] == 0:
        spec[2] = "tp"
    return x if not any(spec) else jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))
