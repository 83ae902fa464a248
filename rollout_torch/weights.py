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
    """Counts and bytes of engine tensors per class; ``extra_bytes`` = engine-owned (rebuilt) bytes."""

    counts: dict[str, int]
    bytes: dict[str, int]

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
        return {"counts": dict(self.counts), "bytes": dict(self.bytes), "fractions": self.fractions(),
                "extra_bytes": self.extra_bytes, "second_copy_bytes": self.total_bytes}


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
