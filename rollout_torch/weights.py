"""The torch side of weight sharing: engine tensors made from the actor's buffers via DLPack.

Each engine tensor is described by a ``TensorSpec``: which actor arrays it is made of
(several = a fused tensor such as vLLM's ``qkv_proj``) and whether the engine wants
them transposed. Its class decides how it is provided:

- ``aligned``: one source, same layout -> ``torch.from_dlpack`` (zero copy, same pointer);
- ``view``: one source, other strides (a transpose) -> a strided view of the same buffer;
- ``rebuilt``: several sources or an incompatible layout -> an engine-owned buffer, allocated
  on the first bind and refilled *in place* on every later bind (its pointer never changes,
  so the engine's kernels and caches can hold it).

Safety rules enforced here:
- Views are created under ``torch.inference_mode()``, so they are inference tensors: any
  in-place op on them outside inference mode (engines decode under ``no_grad``) raises.
  Torch checks *after* the kernel ran, so the op is caught, not prevented: the run must stop.
  ``checksums`` lets tests (and a debug mode) prove no byte changed.
- ``release()`` verifies that no tensor still uses the storage of any view it handed out
  (however it was wrapped: ``nn.Parameter``, ``param.data = view``, slices): a live DLPack
  view silently blocks JAX buffer donation. It counts the users of each view's storage.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

ALIGNED, VIEW, REBUILT = "aligned", "view", "rebuilt"


class TensorSpec(NamedTuple):
    """An engine tensor: ``sources`` (actor param names) concatenated along dim 0, optionally transposed."""

    target: str
    sources: tuple[str, ...]
    transpose: bool = False

    @property
    def kind(self) -> str:
        if len(self.sources) > 1:
            return REBUILT
        return VIEW if self.transpose else ALIGNED


@dataclasses.dataclass(frozen=True)
class SharingReport:
    """Counts and bytes of engine tensors per class; ``extra_bytes`` = engine-owned (rebuilt) bytes.

    ``details``: the JAX side's per-device classification report (``SharingPlan.report``), when known."""

    counts: dict[str, int]
    bytes: dict[str, int]
    details: dict | None = None

    @property
    def extra_bytes(self) -> int:
        return self.bytes[REBUILT]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def fractions(self) -> dict[str, float]:
        total = max(self.total_bytes, 1)
        return {k: v / total for k, v in self.bytes.items()}

    def to_dict(self) -> dict:
        out = {"counts": dict(self.counts), "bytes": dict(self.bytes), "fractions": self.fractions(),
               "extra_bytes": self.extra_bytes, "second_copy_bytes": self.total_bytes}
        if self.details is not None:
            out["classification"] = self.details
        return out


class LiveViewError(RuntimeError):
    """A DLPack view of actor memory is still referenced after ``release()``."""


def dlpack_view(array: Any) -> torch.Tensor:
    """A zero-copy torch tensor over ``array``'s buffer (an inference tensor: in-place ops raise)."""
    with torch.inference_mode():
        return torch.from_dlpack(array)


class WeightBinder:
    """Makes and re-makes the engine's tensors from the actor's arrays."""

    def __init__(self, specs: list[TensorSpec]):
        self.specs = list(specs)
        self._rebuilt: dict[str, torch.Tensor] = {}
        self._storages: list[torch.UntypedStorage] = []  # one per view handed out, to count its users

    def bind(self, arrays: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Engine tensors for the current actor arrays: views for aligned/view, refilled buffers for rebuilt."""
        out: dict[str, torch.Tensor] = {}
        for spec in self.specs:
            parts = [dlpack_view(arrays[s]) for s in spec.sources]
            if spec.kind == REBUILT:
                out[spec.target] = self._refill(spec, parts)
                del parts
                continue
            t = parts[0].t() if spec.transpose else parts[0]
            self._storages.append(t.untyped_storage())
            out[spec.target] = t
        return out

    def _refill(self, spec: TensorSpec, parts: list[torch.Tensor]) -> torch.Tensor:
        rows = sum(p.shape[0] for p in parts)
        shape = (rows, *parts[0].shape[1:])
        buf = self._rebuilt.get(spec.target)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != parts[0].dtype:
            buf = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
            self._rebuilt[spec.target] = buf
        with torch.no_grad():
            torch.cat(parts, dim=0, out=buf)
        return buf.t() if spec.transpose else buf

    def release(self) -> None:
        """Forgets every view handed out; raises ``LiveViewError`` if any tensor still uses one's storage."""
        alive = self.live_views
        if alive:  # maybe only reference cycles keep them: collect (slow, ~0.1-0.3 s) only then
            gc.collect()
            alive = self.live_views
        self._storages = []
        if alive:
            raise LiveViewError(f"{alive} DLPack view(s) of actor buffers are still referenced after release(); "
                                "drop them before any JAX program donates those buffers")

    @property
    def live_views(self) -> int:
        """Views whose storage has users besides this binder's own probe."""
        return sum(torch._C._storage_Use_Count(st._cdata) > 1 for st in self._storages)

    def report(self, arrays: Mapping[str, Any]) -> SharingReport:
        counts = {ALIGNED: 0, VIEW: 0, REBUILT: 0}
        nbytes = {ALIGNED: 0, VIEW: 0, REBUILT: 0}
        for spec in self.specs:
            counts[spec.kind] += 1
            nbytes[spec.kind] += sum(int(arrays[s].nbytes) for s in spec.sources)
        return SharingReport(counts, nbytes)


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes (for 'nothing wrote to the weights' and 'engine == actor' checks)."""
    out = {}
    for name, t in tensors.items():
        a = t.detach().contiguous()
        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        out[name] = hashlib.sha256(a.cpu().numpy().tobytes()).hexdigest()
    return out


# --- sharded training params: per engine rank, from the local training shards -------------------------------

def _slices(inner, outer) -> tuple[slice, ...]:
    """Index of box ``inner`` inside an array holding box ``outer`` (boxes: (start, stop) per dim)."""
    return tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(inner, outer, strict=True))


def _intersection(a, b):
    box = tuple((max(x, z), min(y, w)) for (x, y), (z, w) in zip(a, b, strict=True))
    return box if all(lo < hi for lo, hi in box) else None


class ShardedBinder:
    """The engine ranks' tensors made from the training shards (DLPack), as classified by the JAX side.

    ``ranks``: per device position, the rank tensors of the engine rank there: objects with ``target``,
    ``kind`` (aligned/view/rebuilt), ``pieces`` ((source, box) concatenated along dim 0), ``pad_rows``,
    ``transpose`` and ``shape`` (``rollplex_jax.sharing.RankTensor``). ``bind(shards)`` takes, per source,
    objects with ``position``, ``box`` and ``array`` (a DLPack-capable buffer holding that box) for every
    addressable shard (``rollplex_jax.sharing.device_shards``); it knows nothing of shardings:
    - aligned: ``torch.from_dlpack`` of the rank's own shard (same pointer);
    - view: a strided view of it (a slice along any dims and/or a transpose; pointer inside its buffer);
    - rebuilt: an engine-owned buffer (zero padding rows included), allocated on the first bind on the
      device of the rank's own shard and refilled in place on every later bind from whichever shards hold
      the pieces (the rank's own first): its pointer never changes.
    Views are inference tensors; ``release()`` checks none is still referenced (as ``WeightBinder``).
    """

    def __init__(self, ranks: Mapping[int, Any]):
        self.ranks = {p: tuple(ts) for p, ts in ranks.items()}
        self._rebuilt: dict[tuple[int, str], torch.Tensor] = {}
        self._storages: list[torch.UntypedStorage] = []

    def bind(self, shards: Mapping[str, Any]) -> dict[int, dict[str, torch.Tensor]]:
        """Per position, the engine rank's tensors by target name."""
        cache: dict[int, tuple[Any, torch.Tensor]] = {}  # id(array) -> (array, its torch view): one export per buffer

        def view(sh) -> torch.Tensor:
            hit = cache.get(id(sh.array))
            if hit is None:
                hit = cache[id(sh.array)] = (sh.array, dlpack_view(sh.array))
            return hit[1]

        out: dict[int, dict[str, torch.Tensor]] = {}
        try:
            for p, tensors in self.ranks.items():
                out[p] = {rt.target: self._tensor(p, rt, shards, view) for rt in tensors}
        finally:
            cache.clear()
        return out

    def _tensor(self, p: int, rt, shards: Mapping[str, Any], view) -> torch.Tensor:
        if rt.kind != REBUILT:
            ((src, box),) = rt.pieces
            own = next((sh for sh in shards[src] if sh.position == p and _intersection(sh.box, box) == box), None)
            if own is None:
                raise ValueError(f"{rt.target}: no shard of {src} on position {p} holds {box} (classified {rt.kind})")
            with torch.inference_mode():
                t = dlpack_view(own.array)
                if box != tuple(own.box):
                    t = t[_slices(box, own.box)]
                if rt.transpose:
                    t = t.t()
            self._storages.append(t.untyped_storage())
            return t
        key = (p, rt.target)
        buf = self._rebuilt.get(key)
        if buf is None:
            ref = self._own_shard(p, rt, shards)
            t = view(ref)
            buf = self._rebuilt[key] = torch.zeros(tuple(rt.shape), dtype=t.dtype, device=t.device)
        off = 0
        with torch.no_grad():
            for src, box in rt.pieces:
                rows = box[0][1] - box[0][0]
                for sh in self._cover(p, shards[src], box):
                    inter = _intersection(sh.box, box)
                    dst = ((off + inter[0][0] - box[0][0], off + inter[0][1] - box[0][0]),
                           *((lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(inter[1:], box[1:], strict=True)))
                    buf[tuple(slice(a, b) for a, b in dst)].copy_(view(sh)[_slices(inter, sh.box)])
                off += rows
        return buf.t() if rt.transpose else buf

    @staticmethod
    def _own_shard(p: int, rt, shards):
        srcs = [s for s, _ in rt.pieces] or [None]
        for src in srcs:
            for sh in shards.get(src, ()):
                if sh.position == p:
                    return sh
        any_src = next(iter(shards.values()))
        return next((sh for sh in any_src if sh.position == p), any_src[0])

    @staticmethod
    def _cover(p: int, src_shards, box):
        """Shards that together hold ``box`` once each (replicas de-duplicated, the rank's own preferred)."""
        chosen: dict[tuple, Any] = {}
        for sh in sorted(src_shards, key=lambda s: s.position != p):
            key = tuple(sh.box)
            if key not in chosen and _intersection(key, box) is not None:
                chosen[key] = sh
        covered = sum(math.prod(b - a for a, b in _intersection(k, box)) for k in chosen)
        if covered != math.prod(b - a for a, b in box):
            raise ValueError(f"the addressable shards do not cover {box} (multi-host gathers are not implemented)")
        return list(chosen.values())

    def rebuilt_buffers(self) -> dict[tuple[int, str], torch.Tensor]:
        return dict(self._rebuilt)

    def report(self, positions=None, details: dict | None = None) -> SharingReport:
        counts = {ALIGNED: 0, VIEW: 0, REBUILT: 0}
        nbytes = {ALIGNED: 0, VIEW: 0, REBUILT: 0}
        for p in (self.ranks if positions is None else positions):
            for rt in self.ranks[p]:
                counts[rt.kind] += 1
                nbytes[rt.kind] += int(rt.nbytes)
        return SharingReport(counts, nbytes, details)

    release = WeightBinder.release
    live_views = WeightBinder.live_views
