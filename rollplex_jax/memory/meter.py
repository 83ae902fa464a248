"""Phase-aware memory at run time: where buffers live, and how many device bytes each phase holds.

Buffer classes, phases and default policies are in ``classes`` (shared with the planner).
This module
- measures, per phase of each step, the live device bytes of each class on the busiest device
  (one device: that device; a mesh: the per-device figure the planner predicts): ``MemoryMeter.mark``
  takes the arrays the scheduler holds by class at the end of a phase (while the phase's inputs
  and outputs are both alive; the step's model inputs as ``other``), de-duplicated by (device,
  buffer pointer); every other live device array of the process is reported apart as
  ``memory/<phase>_unattributed_bytes`` (a leak shows there); programs run through ``track`` add their XLA
  temp bytes (``compiled.memory_analysis()``) as ``activations`` (a backend without memory analysis: 0,
  with a warning naming the program, once; any other failure to lower or compile raises); the torch
  engine's own tensors (rebuilt weights) count as ``rollout_weights``. Where the backend has
  ``memory_stats`` (GPU) the meter also records ``peak_bytes_in_use`` per phase.
- counts theta_k bytes that outlived a donating update (``undonated_bytes``: an in-flight checkpoint
  copy or a user's numpy view blocks donation; torch views are checked released by the ShardedBinder).

What is not measured on CPU: the rollout engine's KV cache (torch allocates it inside
``generate``); the planner predicts it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import jax

from rollplex_jax.memory.classes import CLASSES, PHASES


def _leaves(tree) -> Iterable[jax.Array]:
    return (a for a in jax.tree.leaves(tree) if isinstance(a, jax.Array))


def _buffers(a: jax.Array):
    """(key, bytes) of each device-memory shard of ``a`` (key = device id, buffer pointer)."""
    if a.is_deleted() or a.sharding.memory_kind not in (None, "device"):
        return
    # A shard's buffer pointer waits for the array to be computed while holding the GIL (measured, jax 0.10.2: a
    # thread ran 1 of 159 ticks during an 8 s wait); block_until_ready waits the same time without it, so the
    # lost-process check (parallel/liveness.py) still runs while a collective with a dead peer never completes.
    a.block_until_ready()
    for shard in a.addressable_shards:
        d = shard.data
        try:
            ptr = d.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - some backends cannot expose a pointer; count by identity
            ptr = id(d)
        yield (shard.device.id, ptr), d.nbytes


def live_buffer_bytes(tree) -> int:
    """Bytes of a pytree's live device buffers, summed over devices, each buffer counted once (arrays in host
    memory and deleted ones count 0). ``aot.abstract_shard_bytes`` is its ahead-of-time counterpart: the
    bytes one device would hold of abstract arrays."""
    seen = {}
    for a in _leaves(tree):
        for key, n in _buffers(a):
            seen[key] = n
    return sum(seen.values())


def live_by_class(named: dict[str, Any], extra: dict[str, int] | None = None) -> tuple[dict[str, int], int]:
    """(device bytes per class on the busiest device, bytes of every other live array on that device).

    Per device: a buffer named under several classes counts once, in the first (callers list weights
    first, so a residual that is a parameter buffer counts as weights); ``extra`` adds bytes per class on
    the first local device (the torch engine's own tensors live there). The busiest device is the one
    whose named bytes are largest: on one device that device, on a mesh the figure the planner's
    per-device plan predicts. The second figure is process-wide on that device (another runner's arrays
    in the same notebook count there), so it is reported apart, not in a run's peak.
    """
    owner: dict = {}
    for cls, tree in named.items():
        if cls not in CLASSES:
            raise KeyError(f"unknown buffer class {cls!r}; known: {sorted(CLASSES)}")
        for a in _leaves(tree):
            for key, n in _buffers(a):
                owner.setdefault(key, (cls, n))
    per_device: dict[int, dict[str, int]] = {}
    for (dev, _), (cls, n) in owner.items():
        row = per_device.setdefault(dev, dict.fromkeys(named, 0))
        row[cls] += n
    first = per_device.setdefault(jax.local_devices()[0].id, dict.fromkeys(named, 0))
    for cls, n in (extra or {}).items():
        first[cls] = first.get(cls, 0) + n
    busiest = max(per_device, key=lambda d: sum(per_device[d].values()))
    rest = {}
    for a in jax.live_arrays():
        for key, n in _buffers(a):
            if key not in owner and key[0] == busiest:
                rest[key] = n
    return per_device[busiest], sum(rest.values())


class NoMemoryAnalysis(RuntimeError):
    """The backend compiled a program but cannot say how many temp bytes it uses."""


def temp_bytes(fn, *args) -> int:
    """XLA's temp (scratch) bytes of the jitted ``fn`` compiled for ``args`` (compilation is cached).

    Raises ``NoMemoryAnalysis`` where the backend has no memory analysis (``Compiled.memory_analysis``
    returns None, or raises ``NotImplementedError`` as JAX documents it may); any other error (a bad
    argument, a failed compile) propagates."""
    compiled = fn.lower(*args).compile()
    try:
        analysis = compiled.memory_analysis()
    except NotImplementedError as e:
        raise NoMemoryAnalysis(f"{type(e).__name__}: {e}") from e
    if analysis is None or getattr(analysis, "temp_size_in_bytes", None) is None:
        raise NoMemoryAnalysis(f"memory_analysis() returned {analysis!r}")
    return int(analysis.temp_size_in_bytes)


@dataclasses.dataclass
class PhaseRecord:
    by_class: dict[str, int] = dataclasses.field(default_factory=dict)
    activations: int = 0
    backend_peak: int | None = None
    unattributed: int = 0
    undonated: int = 0


class MemoryMeter:
    """Per-step, per-phase peak device bytes by buffer class. One per run; no global state.

    ``mark(phase, **classes)`` at the end of a phase; ``track(fn, phase)`` wraps a jitted program so
    its temp bytes count in ``phase``; ``step_metrics()`` returns and resets the step's figures.
    """

    def __init__(self, enabled: bool = True, engine_bytes: Callable[[], int] | None = None):
        self.enabled = enabled
        self.engine_bytes = engine_bytes or (lambda: 0)
        self._temps: dict[tuple, int] = {}
        self._phases: dict[str, PhaseRecord] = {}
        self._unanalysed: set[str] = set()  # programs whose temp bytes the backend cannot report (warned once)

    def _record(self, phase: str) -> PhaseRecord:
        if phase not in PHASES:
            raise KeyError(f"unknown phase {phase!r}; known: {PHASES}")
        return self._phases.setdefault(phase, PhaseRecord())

    def track(self, fn, phase: str, name: str | None = None):
        """``fn`` (a jitted program) wrapped: each call adds its temp bytes to ``phase`` (max per phase)."""
        name = name or getattr(fn, "__name__", repr(fn))

        def run(*args):
            if self.enabled:
                sig = (name, tuple((getattr(a, "shape", None), str(getattr(a, "dtype", type(a))))
                                   for a in jax.tree.leaves(args)))
                if sig not in self._temps:
                    self._temps[sig] = self._temp_bytes(fn, name, args)
                rec = self._record(phase)
                rec.activations = max(rec.activations, self._temps[sig])
            return fn(*args)

        run.lower = fn.lower
        return run

    def _temp_bytes(self, fn, name: str, args) -> int:
        """The program's temp bytes, or 0 with a warning (once per program) where the backend cannot say."""
        try:
            return temp_bytes(fn, *args)
        except NoMemoryAnalysis as e:
            if name not in self._unanalysed:
                self._unanalysed.add(name)
                warnings.warn(f"memory: no temp bytes for program {name!r} on this backend ({e}); its "
                              "activations count 0 in the measured peaks", RuntimeWarning, stacklevel=3)
            return 0

    def mark(self, phase: str, **classes) -> None:
        """Snapshot at the end of ``phase``: the arrays the caller holds, by class, plus all other live ones."""
        if not self.enabled:
            return
        rec = self._record(phase)
        engine = int(self.engine_bytes())
        by_class, rest = live_by_class({k: v for k, v in classes.items() if v is not None},
                                       {"rollout_weights": engine} if engine else None)
        rec.unattributed = max(rec.unattributed, rest)
        total = sum(by_class.values())
        if total >= sum(rec.by_class.values()):
            rec.by_class = by_class
        stats = _backend_stats()
        if stats is not None:
            rec.backend_peak = max(rec.backend_peak or 0, stats)

    def undonated(self, old: dict) -> None:
        """Records theta_k's bytes that outlived the update (``memory/update/undonated_bytes``)."""
        if self.enabled:
            rec = self._record("update")
            rec.undonated = max(rec.undonated, undonated_bytes(old))

    def step_metrics(self) -> dict[str, float]:
        """``memory/<phase>_peak_bytes`` and ``memory/<phase>/<class>_bytes`` of the step; starts the next."""
        if not self.enabled:
            return {}
        out: dict[str, float] = {}
        for phase, rec in self._phases.items():
            by_class = dict(rec.by_class)
            by_class["activations"] = by_class.get("activations", 0) + rec.activations
            out[f"memory/{phase}_peak_bytes"] = float(sum(by_class.values()))
            for cls, n in by_class.items():
                out[f"memory/{phase}/{cls}_bytes"] = float(n)
            out[f"memory/{phase}_unattributed_bytes"] = float(rec.unattributed)
            if phase == "update":
                out["memory/update_undonated_bytes"] = float(rec.undonated)
            if rec.backend_peak is not None:
                out[f"memory/{phase}_backend_peak_bytes"] = float(rec.backend_peak)
        self._phases = {}
        return out


def _backend_stats() -> int | None:
    """Peak bytes in use on device 0 where the backend reports it (GPU/TPU); None on CPU."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", stats.get("bytes_in_use", 0)))


def undonated_bytes(old: dict) -> int:
    """Device bytes of ``old`` (theta_k) still alive after a donating update.

    Donation is skipped (the program copies instead) while anything else holds the buffer: a torch
    view (the ShardedBinder checks those are released before any update), an in-flight asynchronous
    checkpoint's host copy, or a user's numpy view in a notebook. The result is still exact; the
    cost is memory, which this counts.
    """
    return live_buffer_bytes(old)  # donated (deleted) buffers count 0


def peak_row(history: list[dict]) -> dict[str, float]:
    """One metrics row holding, for each phase, the ``memory/<phase>*`` figures of the step where that
    phase's peak was highest (a step that skipped its update has no train/update phase)."""
    out: dict[str, float] = {}
    for phase in PHASES:
        key = f"memory/{phase}_peak_bytes"
        rows = [h for h in history if key in h]
        if rows:
            best = max(rows, key=lambda h: h[key])
            out.update({k: v for k, v in best.items() if k.startswith(f"memory/{phase}/") or k == key})
    return out
