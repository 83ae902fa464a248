"""Pytrees between device memory and host memory (JAX memory kinds ``device`` and ``pinned_host``).

The optimizer state's ``offload`` policy (``programs/optimizer.py``) keeps its fp32 chunks in host memory and
brings one chunk at a time to the device; ``jax.device_put`` to the same sharding with another memory kind
copies (ENVIRONMENT.md: the source dies with its last reference).
"""

from __future__ import annotations

import jax


def _sharding(a: jax.Array, kind: str):
    return a.sharding.with_memory_kind(kind)


def _move(tree, kind: str):
    def put(a):
        if not isinstance(a, jax.Array) or a.sharding.memory_kind == kind:
            return a
        return jax.device_put(a, _sharding(a, kind))

    return jax.tree.map(put, tree)


def to_host(tree):
    """The same pytree in pinned host memory (a copy; the device buffers die with their last reference)."""
    return _move(tree, "pinned_host")


def to_device(tree):
    """The same pytree in device memory."""
    return _move(tree, "device")
