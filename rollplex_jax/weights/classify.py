"""Which engine tensors can alias the training shards, on which device (pure Python where it can be).

For every engine tensor (its layout: ``engine_layouts.py``) and every device, the training shard held there
(train mesh, ``parallel/mesh.TRAIN_RULES``) is compared with what the rollout engine rank placed there needs
(its TP degree, its own layout: vLLM's fused q/k/v and gate/up, padded vocab; the transformers engine's HF
layout): ``aligned``, ``view`` or ``rebuilt`` (``rollplex_contract.layout``). ``plan_sharing`` needs no devices
(``launch.plan`` classifies a 32-device setting on a CPU box); ``plan_for_params`` and ``device_shards`` turn
real (sharded) arrays into what the engines bind (``rollout_torch.weights.ShardedBinder``). On one device every
transformers-engine tensor is aligned.

The *placement*: the training mesh's devices (row-major over (fsdp, tp), i.e. mesh.devices.flat) host
``N / t_r`` rollout replicas, replica j = devices [j t_r, (j+1) t_r), rank = position in it (N = lcm(train
devices, t_r): when t_r exceeds the training mesh, a replica spans several data-parallel copies of it, device i
holding the training shard of position i mod train devices).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rollplex_contract.layout import (
    ALIGNED,
    KINDS,
    REBUILT,
    VIEW,
    Box,
    RankTensor,
    Shard,
    box_size,
    contains,
    full_box,
    intersection,
)
from rollplex_jax.config import MeshConfig, ModelConfig
from rollplex_jax.models.vl.params import param_specs
from rollplex_jax.weights import engine_layouts
from rollplex_jax.weights.engine_layouts import EngineTensor, layout_for


def shard_box(shape: Sequence[int], spec: Sequence[Any], mesh_shape: Mapping[str, int],
              coords: Mapping[str, int]) -> Box:
    """The index box of the shard at mesh ``coords`` of an array of ``shape`` laid out by ``spec``
    (a PartitionSpec: per dim None, an axis name or a tuple of axis names, major to minor)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for dim, entry in zip(shape, spec, strict=True):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        n, idx = 1, 0
        for a in axes:
            n, idx = n * mesh_shape[a], idx * mesh_shape[a] + coords[a]
        if dim % n:
            raise ValueError(f"dimension {dim} is not divisible by the {n} shards of {entry!r}")
        size = dim // n
        out.append((int(idx * size), int((idx + 1) * size)))
    return tuple(out)


def rank_pieces(et: EngineTensor, shapes: Mapping[str, Sequence[int]], t_r: int, r: int
                ) -> tuple[tuple[tuple[str, Box], ...], int]:
    """The (source, box) pieces that rank ``r`` of ``t_r`` holds of ``et`` (concatenated along dim 0), and
    its zero padding rows."""
    (s,) = et.sources
    shape = shapes[s]
    rest = full_box(shape)[1:]
    if et.tp_dim is None:
        return ((s, ((0, et.rows or shape[0]), *rest)),), 0
    if et.tp_dim == 1:
        c = _divide(shape[1], t_r, et.target)
        box = list(full_box(shape))
        box[1] = (r * c, (r + 1) * c)
        return ((s, tuple(box)),), 0
    if et.pad_multiple:
        rows = shape[0]
        padded = -(-rows // et.pad_multiple) * et.pad_multiple
        per = _divide(padded, t_r, et.target)
        a, b = r * per, min((r + 1) * per, rows)
        pieces = [(s, ((a, b), *rest))] if b > a else []
        return tuple(pieces), per - max(0, b - a)
    parts = et.parts or (et.rows or shape[0],)
    heads = et.heads or (None,) * len(parts)
    g = et.groups
    stride = sum(parts) // g  # rows per group: [part_0 rows; part_1 rows; ...] of that group
    offsets = [sum(parts[:j]) // g for j in range(len(parts))]
    pieces = []
    for j in (range(len(parts)) if et.take is None else et.take):
        k = t_r if heads[j] is None else min(t_r, heads[j])
        if t_r % k:
            raise ValueError(f"{et.target}: {heads[j]} heads cannot be replicated evenly over {t_r} rollout ranks")
        n = _divide(parts[j], k, et.target)
        a, b = (r // (t_r // k)) * n, (r // (t_r // k) + 1) * n  # rows of part j, in the part's own order
        c = parts[j] // g
        for grp in range(a // c, -(-b // c)):
            lo, hi = max(a, grp * c), min(b, (grp + 1) * c)
            start = grp * stride + offsets[j] + lo - grp * c
            pieces.append((s, ((start, start + hi - lo), *rest)))
    return _merge(pieces), 0


def _divide(n: int, k: int, what: str) -> int:
    if n % k:
        raise ValueError(f"{what}: dimension {n} is not divisible by rollout TP {k}")
    return n // k


def _merge(pieces) -> tuple[tuple[str, Box], ...]:
    """Adjacent pieces of one source that continue each other along dim 0 become one."""
    out: list[tuple[str, Box]] = []
    for s, box in pieces:
        if out and out[-1][0] == s and out[-1][1][0][1] == box[0][0] and out[-1][1][1:] == box[1:]:
            prev = out[-1][1]
            out[-1] = (s, ((prev[0][0], box[0][1]), *box[1:]))
        else:
            out.append((s, box))
    return tuple(out)


def classify_tensor(et: EngineTensor, pieces, pad_rows: int, local: Mapping[str, Box], itemsize: int,
                    full_shape: Sequence[int] = ()) -> RankTensor:
    """aligned: one piece, no transpose, the whole local shard; view: one piece inside the local shard (a
    strided slice and/or a transpose); rebuilt: anything else (fused, several row ranges, padding, remote)."""
    shapes = [tuple(b - a for a, b in box) for _, box in pieces]
    rest = shapes[0][1:] if shapes else tuple(full_shape[1:])
    shape = (sum(s[0] for s in shapes) + pad_rows, *rest)
    nbytes = int(math.prod(shape) * itemsize)
    local_bytes = int(sum(box_size(intersection(box, local[s])) for s, box in pieces) * itemsize)
    if len(pieces) == 1 and not pad_rows and contains(local[pieces[0][0]], pieces[0][1]):
        kind = ALIGNED if pieces[0][1] == local[pieces[0][0]] and not et.transpose else VIEW
    else:
        kind = REBUILT
    return RankTensor(et.target, kind, tuple(pieces), pad_rows, et.transpose, shape, nbytes, local_bytes)


@dataclasses.dataclass(frozen=True)
class SharingPlan:
    """Per device position (0..devices-1, mesh.devices.flat order): the rank tensors of the engine rank there."""

    layout: str
    train_mesh: dict[str, int]
    rollout_tp: int
    devices: int
    itemsize: int
    ranks: dict[int, tuple[RankTensor, ...]]

    placement: str = "blocked"
    held: Mapping[str, tuple[int, ...]] | None = None  # per source: its shard's elements per training position

    def rank_of(self, position: int) -> int:
        return rank_of(position, self.devices, self.rollout_tp, self.placement)

    def report(self, positions: Sequence[int] | None = None, by_role: bool = True) -> dict:
        """Counts, bytes and byte fractions per class over ``positions`` (default all) and per device; extra
        bytes per device (engine-owned = rebuilt; max over devices) vs a full second copy of the rollout shard,
        and the physical floor of the extra bytes (``floor_bytes``; needs ``held``)."""
        positions = sorted(self.ranks) if positions is None else list(positions)
        counts = dict.fromkeys(KINDS, 0)
        nbytes = dict.fromkeys(KINDS, 0)
        per_device, roles = [], {}
        for p in positions:
            dc, db = dict.fromkeys(KINDS, 0), dict.fromkeys(KINDS, 0)
            remote = 0
            for rt in self.ranks[p]:
                dc[rt.kind] += 1
                db[rt.kind] += rt.nbytes
                if rt.kind == REBUILT:
                    remote += rt.nbytes - rt.local_bytes
                if by_role:
                    role = roles.setdefault(_role(rt.target), dict.fromkeys(KINDS, 0))
                    role[rt.kind] += rt.nbytes
            for k in KINDS:
                counts[k] += dc[k]
                nbytes[k] += db[k]
            floor = floor_bytes(self.ranks[p], self.held, p, self.itemsize) if self.held else None
            per_device.append({"device": p, "rank": self.rank_of(p), "counts": dc, "bytes": db, "floor_bytes": floor,
                               "rollout_shard_bytes": sum(db.values()), "remote_bytes": remote})
        total = max(sum(nbytes.values()), 1)
        extra = max(d["bytes"][REBUILT] for d in per_device)
        floor = max(d["floor_bytes"] for d in per_device) if self.held else None
        copy = max(d["rollout_shard_bytes"] for d in per_device)
        out = {
            "layout": self.layout, "train_mesh": dict(self.train_mesh), "rollout_tp": self.rollout_tp,
            "placement": self.placement,
            "devices": self.devices, "replicas": self.devices // self.rollout_tp, "positions": len(positions),
            "counts": counts, "bytes": nbytes, "fractions": {k: round(v / total, 4) for k, v in nbytes.items()},
            "extra_bytes_per_device": extra, "second_copy_bytes_per_device": copy,
            "extra_vs_second_copy": round(extra / copy, 4) if copy else 0.0,
            "remote_bytes_per_device": max(d["remote_bytes"] for d in per_device),
            "floor_bytes_per_device": floor,
            "extra_over_floor_bytes_per_device": None if floor is None else extra - floor,
            "floor_vs_second_copy": None if floor is None else round(floor / copy, 4) if copy else 0.0,
            "per_device": per_device,
        }
        if by_role:
            out["by_role"] = roles
        return out


def floor_bytes(tensors: Sequence[RankTensor], held: Mapping[str, Sequence[int]], position: int, itemsize: int) -> int:
    """The physical floor of the engine-owned bytes at one device: per source s, the distinct elements the rank
    reads of s (union of its boxes: a tied embedding counts once; padding rows are no pieces) minus those of s's
    training shard there, where positive (no layout of same-size shards holds more of it), summed, in bytes."""
    boxes: dict[str, set[Box]] = {}
    for s, box in (piece for rt in tensors for piece in rt.pieces):
        boxes.setdefault(s, set()).add(box)
    return sum(max(0, union_size(b) - held[s][position % len(held[s])]) for s, b in boxes.items()) * itemsize


def union_size(boxes) -> int:
    """Elements covered by index boxes (overlaps once): slabs along dim 0, recursively."""
    boxes = set(boxes)
    if len(boxes) <= 1:
        return sum(box_size(b) for b in boxes)
    cuts = sorted({c for b in boxes for c in b[0]})
    return sum((hi - lo) * union_size([b[1:] for b in boxes if b[0][0] <= lo and hi <= b[0][1]])
               for lo, hi in zip(cuts, cuts[1:], strict=False))


def _role(target: str) -> str:
    """A tensor's name with its layer/block index replaced by '*' (groups the report)."""
    parts = target.split(".")
    return ".".join("*" if p.isdigit() and i and parts[i - 1] in ("layers", "blocks") else p
                    for i, p in enumerate(parts))


def rank_of(position: int, devices: int, rollout_tp: int, placement: str = "blocked") -> int:
    """The engine rank at ``position``. blocked (the default): replica j = positions [j t_r, (j+1) t_r);
    strided: replica j = positions j, j + R, j + 2R, ... (R = devices / t_r replicas), which puts rank r of
    a TP-t_r engine on the training TP rank whose shard starts its rows when training TP > t_r."""
    if placement == "blocked":
        return position % rollout_tp
    if placement == "strided":
        return position // (devices // rollout_tp)
    raise ValueError(f"placement must be blocked or strided, not {placement!r}")


@dataclasses.dataclass(frozen=True)
class TrainShards:
    """The training side of a classification: every parameter's shape, its shard's box on each training
    position (``boxes[name][i]``, len = training devices), the parameters' item size and the mesh's shape
    (for the report; None: ``{"devices": n}``)."""

    shapes: Mapping[str, Sequence[int]]
    boxes: Mapping[str, Sequence[Box]]
    itemsize: int
    mesh: Mapping[str, int] | None = None


def classify(layout: str | Sequence[EngineTensor], train: TrainShards, rollout_tp: int, *,
             positions: Sequence[int] | None = None, cfg: ModelConfig | None = None, placement: str = "blocked",
             layout_name: str | None = None) -> SharingPlan:
    """Classifies every engine tensor on every device against the training shards; the plan covers
    lcm(training devices, rollout_tp) positions (``positions``: only those)."""
    name = layout_name or (layout if isinstance(layout, str) else "custom")
    tensors = engine_layouts.for_engine(layout, cfg) if isinstance(layout, str) else list(layout)
    if name == "hf" and rollout_tp != 1:
        raise ValueError(f"the transformers engine has no tensor parallelism: rollout_tp={rollout_tp} needs "
                         "--engine=vllm")
    n_train = len(next(iter(train.boxes.values())))
    devices = math.lcm(n_train, rollout_tp)
    ranks = {}
    for p in (range(devices) if positions is None else positions):
        local = {s: b[p % n_train] for s, b in train.boxes.items()}
        r = rank_of(p, devices, rollout_tp, placement)
        ranks[p] = tuple(classify_tensor(et, *rank_pieces(et, train.shapes, rollout_tp, r), local, train.itemsize,
                                         train.shapes[et.sources[0]]) for et in tensors)
    return SharingPlan(name, dict(train.mesh or {"devices": n_train}), rollout_tp, devices, train.itemsize, ranks,
                       placement)


def plan_sharing(cfg: ModelConfig, mesh: MeshConfig, layout: str | None = None, engine: str = "hf",
                 positions: Sequence[int] | None = None, placement: str = "blocked") -> SharingPlan:
    """The classification for a training mesh (dp x fsdp x tp, TRAIN_RULES) and rollout TP, without devices."""
    from rollplex_jax.parallel.mesh import AXES, spec_for_sizes

    mesh_shape = {"dp": mesh.train_dp, "fsdp": mesh.train_fsdp, "tp": mesh.train_tp}
    specs = param_specs(cfg)
    coords = [dict(zip(AXES, map(int, np.unravel_index(p, tuple(mesh_shape[a] for a in AXES))), strict=True))
              for p in range(mesh.train_devices)]
    boxes = {}
    for name, (shape, axes) in specs.items():
        spec = spec_for_sizes(shape, axes, mesh_shape)
        boxes[name] = [shard_box(shape, spec, mesh_shape, c) for c in coords]
    layout = layout or layout_for(engine, mesh.rollout_tp)
    train = TrainShards({k: s for k, (s, _) in specs.items()}, boxes, np.dtype(cfg.dtype).itemsize, mesh_shape)
    plan = classify(layout, train, mesh.rollout_tp, positions=positions, cfg=cfg, placement=placement)
    return dataclasses.replace(plan, held={k: tuple(map(box_size, b)) for k, b in boxes.items()})


# --- JAX arrays -> what the torch binder reads ---------------------------------------------------------

def device_order(params: Mapping[str, jax.Array]) -> list[jax.Device]:
    """The training devices in placement order: a NamedSharding's mesh.devices.flat (else the one device)."""
    for a in params.values():
        s = a.sharding
        if isinstance(s, jax.sharding.NamedSharding):
            return list(s.mesh.devices.flat)
    return [next(iter(next(iter(params.values())).devices()))]


def param_boxes(params: Mapping[str, jax.Array], order: Sequence[jax.Device]) -> dict[str, list[Box]]:
    """Per parameter, the index box of its training shard on each device of ``order``."""
    out = {}
    for name, a in params.items():
        m = a.sharding.devices_indices_map(a.shape)
        out[name] = [_index_box(m[d], a.shape) for d in order]
    return out


def _index_box(index, shape) -> Box:
    return tuple(sl.indices(dim)[:2] for sl, dim in zip(index, shape, strict=True)) if index else ()


def device_shards(params: Mapping[str, jax.Array], order: Sequence[jax.Device] | None = None,
                  positions: Sequence[int] | None = None) -> dict[str, list[Shard]]:
    """Per parameter, its addressable shards as ``Shard``s (zero-copy buffers; only ``positions`` if given)."""
    order = device_order(params) if order is None else order
    pos = {d: i for i, d in enumerate(order)}
    keep = None if positions is None else set(positions)
    out = {}
    for name, a in params.items():
        shards = a.addressable_shards
        if len(shards) == 1 and shards[0].device in pos and a.is_fully_addressable:  # unsharded: the array itself
            out[name] = [Shard(pos[shards[0].device], full_box(a.shape), a)]
            continue
        out[name] = [Shard(pos[s.device], _index_box(s.index, a.shape), s.data) for s in shards
                     if s.device in pos and (keep is None or pos[s.device] in keep)]
    return out


def plan_for_params(params: Mapping[str, jax.Array], layout: str | Sequence[EngineTensor], rollout_tp: int = 1,
                    cfg: ModelConfig | None = None, positions: Sequence[int] | None = None,
                    placement: str = "blocked", layout_name: str | None = None) -> SharingPlan:
    """The classification for actual (possibly sharded) arrays, from their shardings."""
    order = device_order(params)
    boxes = param_boxes(params, order)
    mesh = next((dict(a.sharding.mesh.shape) for a in params.values()
                 if isinstance(a.sharding, jax.sharding.NamedSharding)), {"devices": len(order)})
    itemsize = np.dtype(next(iter(params.values())).dtype).itemsize
    train = TrainShards({k: tuple(v.shape) for k, v in params.items()}, boxes, itemsize, mesh)
    plan = classify(layout, train, rollout_tp, positions=positions, cfg=cfg, placement=placement,
                    layout_name=layout_name)
    return dataclasses.replace(plan, held={k: tuple(map(box_size, b)) for k, b in boxes.items()})
