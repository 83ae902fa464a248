"""Device meshes per role and the logical-axis rules that shard parameters and activations on them.

Training (actor and reference): a 3-D mesh ``(dp, fsdp, tp)`` over the first ``dp x fsdp x tp`` devices
(``--train_dp``, default 1: HSDP, the weights sharded over ``fsdp x tp`` within each data-parallel group and
replicated across the ``dp`` groups; no rule maps a parameter axis to ``dp``).
Every parameter names its logical axes (``models/vl/params.py``); ``TRAIN_RULES`` maps
them onto mesh axes, Megatron-style for TP (column-parallel q/k/v, gate/up and vision qkv/mlp split
their output rows, row-parallel o/down split their input columns, the vocabulary is split) and
ZeRO-3-style for FSDP (the model dimension of every matrix is split over ``fsdp``):

| logical axis       | mesh axis | which tensors                                   |
|--------------------|-----------|-------------------------------------------------|
| vocab              | tp        | embed_tokens, lm_head rows                      |
| q_heads, kv_heads  | tp        | q/k/v rows (+ biases), o_proj columns           |
| mlp                | tp        | gate/up rows, down columns                      |
| embed              | fsdp      | the model dimension of every text matrix        |
| vision_qkv, vision_heads, vision_mlp, vision_merge_mlp | tp | vision tower, as the text |
| vision_embed, vision_merge_in | fsdp | the vision model dimension            |
| norm               | (none)    | norm weights are replicated                      |

A dimension that a mesh axis does not divide is replicated over that axis instead (listed by
``sharding_table`` so a user sees it). Activations: the residual stream is constrained at each
block boundary to rows split over ``dp x fsdp`` (``BATCH``: data parallel) and replicated over ``tp``
(``models/vl/layers.constrain_rows``), when a mesh is set (``jax.set_mesh``, which the
runner does around each step).
The reference scores on the training mesh with the same rules. Gradients: the batch is split over dp and
the parameters are replicated over it, so GSPMD sums each gradient over dp (an all-reduce) where the programs
constrain it to the parameters' layout (``constrain_like_params``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rollplex_jax.config import MeshConfig, ModelConfig
from rollplex_jax.models.vl.params import param_specs

AXES = ("dp", "fsdp", "tp")
BATCH = ("dp", "fsdp")  # the axes that split the batch (rows), outermost first
TRAIN_RULES: dict[str, str | None] = {
    "vocab": "tp", "q_heads": "tp", "kv_heads": "tp", "mlp": "tp", "embed": "fsdp",
    "vision_qkv": "tp", "vision_heads": "tp", "vision_mlp": "tp", "vision_merge_mlp": "tp",
    "vision_embed": "fsdp", "vision_merge_in": "fsdp", "norm": None,
}


class ShardingError(RuntimeError):
    """Parameters are not sharded as the mesh and rules say they should be."""


def describe(m: MeshConfig) -> str:
    """The training mesh as the flags that set it, e.g. ``--train_dp=2 x --train_fsdp=4 x --train_tp=1``."""
    return (f"--train_dp={m.train_dp} x " if m.train_dp > 1 else "") + \
        f"--train_fsdp={m.train_fsdp} x --train_tp={m.train_tp}"


def train_mesh(m: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ``(dp, fsdp, tp)`` training mesh over the first dp x fsdp x tp devices (all processes' devices, each
    process's together). ``m.dp_placement``: "across" (default): an fsdp x tp group is consecutive devices and a dp
    group's members are fsdp x tp devices apart, so with fsdp x tp = a process's (a node's) devices dp spans the
    processes (HSDP); "within": a dp group is dp consecutive devices and fsdp x tp spans the processes."""
    devices = list(jax.devices() if devices is None else devices)
    n = m.train_devices
    if n > len(devices):
        raise ValueError(f"{describe(m)} needs {n} devices but {len(devices)} are visible; on CPU set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    flat = np.array(devices[:n], dtype=object)
    if m.dp_placement == "within":
        grid = flat.reshape(m.train_fsdp, m.train_tp, m.train_dp).transpose(2, 0, 1)
    else:
        grid = flat.reshape(m.train_dp, m.train_fsdp, m.train_tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def batch_axes(sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The axes of ``BATCH`` larger than 1 in a mesh of these axis sizes (what a row dimension is split over)."""
    return tuple(a for a in BATCH if sizes.get(a, 1) > 1)


def partition_spec(shape: Sequence[int], logical: Sequence[str | None], mesh: Mesh,
                   rules: Mapping[str, str | None] = TRAIN_RULES) -> PartitionSpec:
    """Mesh axis per dimension; a dimension the mesh axis does not divide (or of size-1 axis) stays whole."""
    return spec_for_sizes(shape, logical, mesh.shape, rules)


def spec_for_sizes(shape: Sequence[int], logical: Sequence[str | None], sizes: Mapping[str, int],
                   rules: Mapping[str, str | None] = TRAIN_RULES) -> PartitionSpec:
    """``partition_spec`` from the mesh's axis sizes alone (no devices: the planner and the sharing
    classification lay out meshes larger than the machine)."""
    out = []
    for dim, name in zip(shape, logical, strict=True):
        axis = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule (mesh.TRAIN_RULES)")
        size = sizes[axis] if axis is not None else 1
        out.append(axis if size > 1 and dim % size == 0 else None)
    return PartitionSpec(*out)


def param_shardings(cfg: ModelConfig, mesh: Mesh,
                    rules: Mapping[str, str | None] = TRAIN_RULES) -> dict[str, NamedSharding]:
    """The NamedSharding of every parameter on ``mesh``."""
    return {name: NamedSharding(mesh, partition_spec(shape, axes, mesh, rules))
            for name, (shape, axes) in param_specs(cfg).items()}


def constrain_like_params(tree: Mapping[str, jax.Array], cfg: ModelConfig) -> dict[str, jax.Array]:
    """Inside a program: a params-shaped dict (gradients) laid out as the parameters are (``TRAIN_RULES`` on the
    mesh in context), so that what is added to it or updated from it keeps the params' layout. A no-op
    without a mesh in context (one device)."""
    m = jax.sharding.get_abstract_mesh()
    if m.empty or not set(AXES) <= set(m.axis_names):
        return dict(tree)
    specs = param_specs(cfg)
    return {k: jax.lax.with_sharding_constraint(g, partition_spec(g.shape, specs[k][1], m)) if k in specs else g
            for k, g in tree.items()}


def place(params: Mapping[str, jax.Array], shardings: Mapping[str, NamedSharding]) -> dict[str, jax.Array]:
    """``params`` laid out by ``shardings`` in buffers of their own: the output of a program, since
    ``device_put`` lets a replicated shard on the source's device alias the source buffer (even with
    ``may_alias=False``, jax 0.10), and two aliased trees die together when a program donates either."""
    out_shardings = {k: shardings[k] for k in params}
    return jax.jit(lambda t: t, out_shardings=out_shardings)(dict(params))


def check_sharded(params: Mapping[str, jax.Array], shardings: Mapping[str, NamedSharding], what: str = "params",
                  limit: int = 5) -> None:
    """Raises ``ShardingError`` naming the parameters whose layout differs from the configured one."""
    bad = []
    for k, v in params.items():
        want = shardings[k.split("#")[0]]
        want = want.with_memory_kind(v.sharding.memory_kind) if v.sharding.memory_kind else want
        if not v.sharding.is_equivalent_to(want, v.ndim):
            bad.append(f"{k}: {_describe(v.sharding)} (configured {_describe(want)})")
    if bad:
        raise ShardingError(f"{len(bad)} {what} are not sharded as configured: " + "; ".join(bad[:limit])
                            + (" ..." if len(bad) > limit else ""))


def _describe(s) -> str:
    return f"{s.spec} on mesh {dict(s.mesh.shape)}" if isinstance(s, NamedSharding) else f"{type(s).__name__}"


def sharding_table(cfg: ModelConfig, mesh: Mesh) -> dict:
    """Per mesh-axis pattern: tensors and bytes per device, and the tensors left whole by divisibility."""
    rows: dict[str, dict] = {}
    undivided = []
    b = np.dtype(cfg.dtype).itemsize
    for name, (shape, axes) in param_specs(cfg).items():
        spec = partition_spec(shape, axes, mesh)
        key = str(tuple(spec))
        r = rows.setdefault(key, {"tensors": 0, "bytes_per_device": 0})
        shards = math.prod(mesh.shape[a] for a in spec if a is not None)
        r["tensors"] += 1
        r["bytes_per_device"] += math.prod(shape) * b // shards
        for dim, ax in zip(shape, axes, strict=True):
            axis = TRAIN_RULES.get(ax) if ax else None
            if axis and mesh.shape[axis] > 1 and dim % mesh.shape[axis]:
                undivided.append(f"{name} dim {dim} ({ax}) over {axis}={mesh.shape[axis]}")
    return {"mesh": dict(mesh.shape), "patterns": rows, "undivided": undivided}


def zero_sharding(s, shape: Sequence[int]):
    """``s`` (a parameter's NamedSharding on a mesh with ``dp``) with ``dp`` added to the first dimension it
    divides together with that dimension's axes (dp major), for the optimizer state (ZeRO-1: ``--optimizer_shard``);
    ``s`` itself where dp is 1 or divides no dimension (then replicated over dp)."""
    if not isinstance(s, NamedSharding) or s.mesh.shape.get("dp", 1) == 1:
        return s
    spec = tuple(s.spec) + (None,) * (len(shape) - len(s.spec))
    for i, (dim, entry) in enumerate(zip(shape, spec, strict=True)):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        if dim % (math.prod(s.mesh.shape[a] for a in axes) * s.mesh.shape["dp"]) == 0:
            new = spec[:i] + (("dp", *axes) if axes else "dp",) + spec[i + 1:]
            return NamedSharding(s.mesh, PartitionSpec(*new), memory_kind=s.memory_kind)
    return s


def zero_shardings(shardings: Mapping[str, NamedSharding], cfg: ModelConfig) -> dict[str, NamedSharding]:
    """``zero_sharding`` of every parameter's sharding (what the optimizer state's tensors have with ZeRO-1)."""
    specs = param_specs(cfg)
    return {k: zero_sharding(s, specs[k][0]) for k, s in shardings.items()}


def per_param_leaves(tree, shardings: Mapping[str, NamedSharding]) -> dict[str, jax.Array]:
    """The leaves of ``tree`` (e.g. an optimizer state) keyed by a parameter name in their path and shaped
    like that parameter, named ``<param>#<n>`` (moments, master weights), for ``check_sharded``."""
    out: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in shardings]
        if names and isinstance(leaf, jax.Array):
            out[f"{names[-1]}#{len(out)}"] = leaf
    return out
