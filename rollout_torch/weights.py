"""The torch side of weight sharing: an engine rank's tensors made from the actor's training shards (DLPack).

The trainer classifies every engine tensor (``rollplex_contract.layout``: aligned / view / rebuilt) and
hands the binder, per device position, that rank's ``RankTensor`` list; ``bind`` then takes the shards.
The binder knows nothing of shardings or of JAX:

- ``aligned``: ``torch.from_dlpack`` of the rank's own shard (zero copy, same pointer);
- ``view``: a strided view of it (a slice along any dims and/or a transpose; pointer inside its buffer);
- ``rebuilt``: an engine-owned buffer (zero padding rows included), allocated on the first bind on the
  device of the rank's own shard and refilled *in place* on every later bind from whichever shards hold
  the pieces (the rank's own first): its pointer never changes, so the engine's kernels and caches can
  hold it.

Safety rules enforced here:
- Views are created under ``torch.inference_mode()``, so they are inference tensors: any in-place op on
  them outside inference mode (engines decode under ``no_grad``) raises. Torch checks *after* the kernel
  ran, so the op is caught, not prevented: the run must stop. ``checksums`` lets tests (and a debug mode)
  prove no byte changed.
- ``release()`` verifies that no tensor still uses the storage of any view it handed out (however it was
  wrapped: ``nn.Parameter``, ``param.data = view``, slices): a live DLPack view silently blocks JAX buffer
  donation. It counts the users of each view's storage.
"""

from __future__ import annotations

import gc
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollplex_contract.layout import (
    REBUILT,
    RankTensor,
    Shard,
    SharingReport,
    box_size,
    intersection,
    slices,
)


class LiveViewError(RuntimeError):
    """A DLPack view of actor memory is still referenced after ``release()``."""


def dlpack_view(array: Any) -> torch.Tensor:
    """A zero-copy torch tensor over ``array``'s buffer (an inference tensor: in-place ops raise)."""
    with torch.inference_mode():
        return torch.from_dlpack(array)


class ShardedBinder:
    """The engine ranks' tensors made from the training shards, as classified by the trainer.

    ``ranks``: device position -> that position's engine rank's ``RankTensor`` list.
    """

    def __init__(self, ranks: Mapping[int, Sequence[RankTensor]]):
        self.ranks = {p: tuple(ts) for p, ts in ranks.items()}
        self._rebuilt: dict[tuple[int, str], torch.Tensor] = {}
        self._storages: list[torch.UntypedStorage] = []  # one per view handed out, to count its users

    def bind(self, shards: Mapping[str, Sequence[Shard]]) -> dict[int, dict[str, torch.Tensor]]:
        """Per position, the engine rank's tensors by target name. ``shards``: per source parameter, its
        addressable ``Shard``s."""
        cache: dict[int, tuple[Any, torch.Tensor]] = {}  # id(array) -> (array, its torch view): one export each

        def view(sh: Shard) -> torch.Tensor:
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

    def _tensor(self, p: int, rt: RankTensor, shards: Mapping[str, Sequence[Shard]], view) -> torch.Tensor:
        if rt.kind != REBUILT:
            return self._view(p, rt, shards)
        key = (p, rt.target)
        buf = self._rebuilt.get(key)
        if buf is None:
            t = view(self._own_shard(p, rt, shards))
            buf = self._rebuilt[key] = torch.zeros(tuple(rt.shape), dtype=t.dtype, device=t.device)
        off = 0
        with torch.no_grad():
            for src, box in rt.pieces:
                for sh in self._cover(p, shards[src], box):
                    inter = intersection(sh.box, box)
                    dst = ((off + inter[0][0] - box[0][0], off + inter[0][1] - box[0][0]),
                           *((lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(inter[1:], box[1:], strict=True)))
                    buf[tuple(slice(a, b) for a, b in dst)].copy_(view(sh)[slices(inter, sh.box)])
                off += box[0][1] - box[0][0]
        return buf.t() if rt.transpose else buf

    def _view(self, p: int, rt: RankTensor, shards: Mapping[str, Sequence[Shard]]) -> torch.Tensor:
        ((src, box),) = rt.pieces
        own = next((sh for sh in shards[src] if sh.position == p and intersection(sh.box, box) == box), None)
        if own is None:
            raise ValueError(f"{rt.target}: no shard of {src} on position {p} holds {box} (classified {rt.kind})")
        with torch.inference_mode():
            t = dlpack_view(own.array)
            if box != tuple(own.box):
                t = t[slices(box, own.box)]
            if rt.transpose:
                t = t.t()
        self._storages.append(t.untyped_storage())
        return t

    @staticmethod
    def _own_shard(p: int, rt: RankTensor, shards: Mapping[str, Sequence[Shard]]) -> Shard:
        """A shard on position ``p`` (for the rebuilt buffer's device and dtype)."""
        for src in rt.sources or [None]:
            for sh in shards.get(src, ()):
                if sh.position == p:
                    return sh
        any_src = next(iter(shards.values()))
        return next((sh for sh in any_src if sh.position == p), any_src[0])

    @staticmethod
    def _cover(p: int, src_shards: Sequence[Shard], box) -> list[Shard]:
        """Shards that together hold ``box`` once each (replicas de-duplicated, the rank's own preferred)."""
        chosen: dict[tuple, Shard] = {}
        for sh in sorted(src_shards, key=lambda s: s.position != p):
            key = tuple(sh.box)
            if key not in chosen and intersection(key, box) is not None:
                chosen[key] = sh
        if sum(box_size(intersection(k, box)) for k in chosen) != box_size(box):
            raise ValueError(f"the addressable shards do not cover {box} (multi-host gathers are not implemented)")
        return list(chosen.values())

    def rebuilt_buffers(self) -> dict[tuple[int, str], torch.Tensor]:
        return dict(self._rebuilt)

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

    def report(self, positions: Sequence[int] | None = None, details: dict | None = None) -> SharingReport:
        """Counts and bytes per class of the ranks at ``positions`` (default all)."""
        ps = self.ranks if positions is None else positions
        return SharingReport.of([rt for p in ps for rt in self.ranks[p]], details)


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes (for 'nothing wrote to the weights' and 'engine == actor' checks)."""
    out = {}
    for name, t in tensors.items():
        a = t.detach().contiguous()
        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        out[name] = hashlib.sha256(a.cpu().numpy().tobytes()).hexdigest()
    return out
