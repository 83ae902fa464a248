"""The JAX side of weight sharing with the rollout engine: publishing the params, taking them back.

The actor's parameter arrays are the canonical storage. Between updates they are *published* to the
engine; before any program that donates them runs, the engine must *release* every view, since a
live view silently blocks donation (ENVIRONMENT.md). ``WeightPublisher`` is the one place that
sequences the two, and it checks the result.

Which engine tensor aliases which training shard is decided in ``classify.py`` (once per layout of the
params); the engine binds views, and its rebuilt buffers are refilled after each update on a side thread.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax

from rollplex_contract.layout import REBUILT, SharingReport
from rollplex_jax.config import ModelConfig
from rollplex_jax.weights import engine_layouts
from rollplex_jax.weights.classify import SharingPlan, device_shards, plan_for_params


class WeightPublisher:
    """Publishes actor params (with a version number) to an engine in the engine's own layout, and takes
    them back.

    ``publish`` waits for the arrays to be computed (DLPack needs ready buffers), classifies the engine's
    layout against their shardings (once per layout of the params), then binds the engine rank at device
    position 0; ``release`` drops the engine's views so the next update may donate the buffers.
    ``refill`` (right after an update) copies the new params into the engine's rebuilt buffers on a side
    thread, so that the next ``publish`` of those params, on the critical path before the rollout, only
    creates views. ``gather``: params -> the arrays the engine reads (a multi-process run's all-gathered
    replicated copy, ``multihost.replicated_copy``; they live until ``release``); None = the params themselves.
    With a gather there is no side-thread refill: the gather is a collective every process must issue in the
    same order, which a thread of its own would not keep. ``rollout_tp`` > 1: the engine is one tensor-parallel
    rank, the one at device ``position`` (``classify.device_order``), bound to that device's shards.
    """

    def __init__(self, engine, cfg: ModelConfig, gather: Callable[[Mapping[str, jax.Array]], dict] | None = None,
                 rollout_tp: int = 1, position: int = 0):
        self.engine = engine
        self.layout = engine_layouts.for_engine(engine.layout, cfg)
        self.gather = gather
        self.rollout_tp, self.position = rollout_tp, position
        self.plan: SharingPlan | None = None
        self._key = None
        self._arrays = None
        self.version: int | None = None
        self._refill: _Refill | None = None
        self._published: tuple = (None, {})  # (layout key, weak refs to the arrays) of the last publish
        self.refilled_bytes = 0  # of the last refill whose params were then published

    def publish(self, params: Mapping[str, jax.Array], version: int) -> None:
        done = self.join()
        jax.block_until_ready(params)
        arrays = dict(params) if self.gather is None else self.gather(params)
        key = _layout_key(arrays)
        if not _layout_equal(key, self._key):
            self.plan = plan_for_params(arrays, self.layout, self.rollout_tp, positions=[self.position],
                                        layout_name=self.engine.layout)
            self._key = key
        refilled = done is not None and _same(arrays, done.params) and done.nbytes > 0
        self.refilled_bytes = done.nbytes if refilled else 0
        again = self.gather is None and _layout_equal(key, self._published[0]) and _same(arrays, self._published[1])
        at = {"position": self.position} if self.position else {}  # a TP rank (vLLM); the HF engine has rank 0 only
        self.engine.bind(self.plan.ranks[self.position], device_shards(arrays), refilled=refilled or again, **at)
        self._arrays = arrays if self.gather is not None else None
        # the same arrays published again (a skipped update, validation): the rebuilt buffers hold them already
        self._published = (key, {k: weakref.ref(v) for k, v in arrays.items()} if self.gather is None else {})
        self.version = version

    def refill(self, params: Mapping[str, jax.Array], tracer=None, step: int = 0) -> None:
        """Starts copying ``params`` (the update's output) into the engine's rebuilt buffers on a side thread;
        ``publish`` (or ``join``) waits for it. Nothing to do before the first publish, with a gather, or when
        nothing is rebuilt. ``tracer``: records the copy as a span "refill" on lane "weights", labelled ``step`` + 1
        (the step whose rollout reads these weights: its ``publish`` waits for the copy, so the span is in that
        step's ``time/refill_s``)."""
        self.join()
        if self.gather is not None or self.plan is None or self.version is not None:
            return  # still bound (views alive), or nothing classified yet: publish fills
        if not any(rt.kind == REBUILT for rt in self.plan.ranks[self.position]):
            return
        self._refill = _Refill(self.engine, dict(params), self._key, tracer, step)

    def ready(self, params: Mapping[str, jax.Array]) -> None:
        """Waits until ``params`` are computed and a refill in flight is done (what ``publish`` waits for first)."""
        if self._refill is not None:
            self._refill.wait()
        jax.block_until_ready(params)

    def join(self) -> _Refill | None:
        """Waits for a refill in flight (re-raising its error); returns it (None if none was started)."""
        r, self._refill = self._refill, None
        if r is not None:
            r.wait()
        return r

    def release(self) -> None:
        if self.version is not None:
            self.engine.release()
        self._arrays = None
        self.version = None

    def report(self) -> SharingReport:
        """The engine's counts and bytes per class of the last bind, with the per-device classification."""
        if self.plan is None:
            raise RuntimeError("report() needs a publish() first")
        rep = self.engine.sharing_report()
        return dataclasses.replace(rep, details=self.plan.report(positions=[self.position]))


def _layout_key(arrays: Mapping[str, jax.Array]) -> tuple:
    """What the classification depends on: names, shapes, dtypes and shardings."""
    return tuple((k, tuple(v.shape), str(v.dtype), v.sharding) for k, v in arrays.items())


def _layout_equal(a: tuple | None, b: tuple | None) -> bool:
    """Two layout keys describe the same shards (names, shapes, dtypes; shardings by what they place where: a
    program's output may spell the same NamedSharding another way, e.g. P('fsdp') vs P('fsdp', None))."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(ka == kb and sa == sb and da == db and (xa == xb or xa.is_equivalent_to(xb, len(sa)))
               for (ka, sa, da, xa), (kb, sb, db, xb) in zip(a, b, strict=True))


def _same(a: Mapping[str, jax.Array], b: Mapping[str, Any]) -> bool:
    """The very same arrays (identity: jax arrays are immutable, so the same array holds the same values);
    ``b``'s values may be weak references."""
    return bool(b) and a.keys() == b.keys() and all(
        a[k] is (v() if isinstance(v, weakref.ref) else v) for k, v in b.items())


class _Refill:
    """One refill of an engine's rebuilt buffers from ``params`` on a thread of its own (``WeightPublisher``)."""

    def __init__(self, engine, params: dict, key: tuple, tracer, step: int):
        self.params, self.key, self.nbytes = params, key, 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, tracer, step), name="weights-refill",
                                         daemon=True)
        self._thread.start()

    def _run(self, engine, tracer, step: int) -> None:
        try:
            jax.block_until_ready(self.params)  # the update's output: DLPack needs ready buffers
            start = tracer.now() if tracer is not None else 0.0  # the copy alone, not the update's tail
            if _layout_equal(_layout_key(self.params), self.key):  # else the next publish classifies anew and fills
                self.nbytes = engine.refill(device_shards(self.params))
            if tracer is not None:
                tracer.add("weights", "refill", step + 1, start, tracer.now(), bytes=self.nbytes)
        except BaseException as e:  # noqa: BLE001  (re-raised by wait(), on the caller's thread)
            self._error = e

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError("refilling the engine's rebuilt weight buffers failed") from self._error


def donated(old: Mapping[str, jax.Array]) -> bool:
    """True when every array of ``old`` was consumed by a donating program."""
    return all(a.is_deleted() for a in old.values())
