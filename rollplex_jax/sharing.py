"""The JAX side of weight sharing with the rollout engine.

The actor's parameter arrays are the canonical storage. Between updates they are
*published* to the engine (which makes DLPack views of them, or refills its rebuilt
buffers); before any program that donates them runs, the engine must *release*
every view, since a live view silently blocks donation (ENVIRONMENT.md). This
module is the one place that sequences the two, and it checks the result.

Parallelism-aware classification (train mesh vs rollout TP degree) extends this
with per-shard specs (issue 7); on one device every HF-engine tensor is aligned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax


class BindableEngine(Protocol):
    def bind(self, params: Mapping[str, Any]) -> None: ...

    def release(self) -> None: ...


class WeightPublisher:
    """Publishes actor params (with a version number) to an engine, and takes them back.

    ``publish`` waits for the arrays to be computed (DLPack needs ready buffers), then binds;
    ``release`` drops the engine's views so the next update may donate the buffers.
    """

    def __init__(self, engine: BindableEngine):
        self.engine = engine
        self.version: int | None = None

    def publish(self, params: Mapping[str, jax.Array], version: int) -> None:
        jax.block_until_ready(params)
        self.engine.bind(params)
        self.version = version

    def release(self) -> None:
        if self.version is not None:
            self.engine.release()
        self.version = None


def donated(old: Mapping[str, jax.Array]) -> bool:
    """True when every array of ``old`` was consumed by a donating program."""
    return all(a.is_deleted() for a in old.values())
