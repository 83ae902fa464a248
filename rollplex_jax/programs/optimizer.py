"""The optimizer step: AdamW on fp32 master weights, streamed chunk by chunk, optionally from host memory.

Layout of the optimizer state (``OptState``): the parameters are split into ``n`` chunks of about
equal bytes (sorted names, contiguous ranges); each chunk holds its optax AdamW state (fp32 moments,
step count) and, when the compute dtype is not fp32, its fp32 master weights (the compute weights,
shared with the rollout engine, are then re-cast from them after each update).

One update (``ChunkedOptimizer.update``):
1. ``clip`` (one program over all gradients): frozen parameters' gradients zeroed, global norm,
   ``optax.clip_by_global_norm`` -> the clipped gradients, the norm and ``ok`` (finite norm);
2. per chunk: bring its state to the device (if offloaded), ``update_chunk`` (donates that chunk's
   params and state: AdamW on the master weights, re-cast, kept unchanged when not ``ok``), send the
   new state back to host memory. Only one chunk of fp32 state is on the device at a time.

Since clipping uses the global norm and AdamW is element-wise, the result does not depend on the
number of chunks (tests/programs/test_optimizer.py: 1 vs 4 chunks give identical params).

ZeRO-1 (``zero``: ``--optimizer_shard=dp`` on a mesh with dp > 1): the master weights and moments are sharded over
dp as well (``mesh.zero_sharding``: dp added to a dimension of each tensor), and each chunk's update program has
its outputs laid out as its inputs (``program``): GSPMD then computes each device's part of the AdamW update on
its dp shard of the state and all-gathers the new weights over dp (the params stay replicated over dp).
AdamW is element-wise, so the result is the unsharded one (tests/test_sharded.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rollplex_jax.config import OptimConfig
from rollplex_jax.parallel.memory_kinds import to_device, to_host
from rollplex_jax.parallel.mesh import zero_sharding

FROZEN_VISION = ("visual.",)


def frozen_prefixes(optim: OptimConfig) -> tuple[str, ...]:
    return FROZEN_VISION if optim.freeze_vision else ()


class OptState(NamedTuple):
    """Per chunk: the optax state and the fp32 master weights (``optax.EmptyState()`` in fp32)."""

    chunks: tuple
    master: tuple


def learning_rate(optim: OptimConfig, total_steps: int) -> optax.Schedule:
    """Cosine (to final_lr_frac over decay_steps, default the run's steps) or constant, optional warm-up."""
    steps = max(optim.decay_steps or total_steps, 1)
    if optim.lr_schedule == "cosine":
        decay = optax.cosine_decay_schedule(optim.lr, max(steps - optim.warmup_steps, 1), alpha=optim.final_lr_frac)
    else:
        decay = optax.constant_schedule(optim.lr)
    if not optim.warmup_steps:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, optim.lr, optim.warmup_steps), decay],
                                [optim.warmup_steps])


def inner_transform(optim: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (element-wise; clipping is done over all chunks first). Frozen params take no update at all."""
    adamw = optax.adamw(learning_rate(optim, total_steps), b1=optim.b1, b2=optim.b2, eps=optim.eps,
                        weight_decay=optim.weight_decay)
    if not optim.freeze_vision:
        return adamw
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()},
                                 lambda p: {k: "frozen" if k.startswith(FROZEN_VISION) else "train" for k in p})


def chunk_names(params: dict, n: int) -> list[tuple[str, ...]]:
    """Sorted parameter names cut into at most ``n`` contiguous groups of about equal bytes."""
    names = sorted(params)
    sizes = np.array([np.prod(params[k].shape) * jnp.dtype(params[k].dtype).itemsize for k in names], np.float64)
    edges = np.cumsum(sizes) / max(sizes.sum(), 1.0)
    groups: list[list[str]] = [[] for _ in range(min(n, len(names)))]
    for name, e in zip(names, edges, strict=True):
        groups[min(int(e * len(groups) - 1e-9), len(groups) - 1)].append(name)
    return [tuple(g) for g in groups if g]


def _clip(grad_clip: float, frozen: tuple[str, ...], grads: dict):
    grads = {k: jnp.zeros_like(g) if k.startswith(frozen) else g for k, g in grads.items()} if frozen else grads
    gnorm = optax.global_norm(grads)
    clipped, _ = optax.clip_by_global_norm(grad_clip).update(grads, optax.EmptyState())
    return clipped, gnorm, jnp.isfinite(gnorm)


def _update_chunk(tx: optax.GradientTransformation, params: dict, state, master, grads: dict, ok):
    """AdamW on one chunk (on the fp32 master weights when there are any); unchanged when not ``ok``."""
    if isinstance(master, optax.EmptyState):
        updates, new_state = tx.update(grads, state, params)
        new_params, new_master = optax.apply_updates(params, updates), master
    else:
        g32 = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        updates, new_state = tx.update(g32, state, master)
        new_master = optax.apply_updates(master, updates)
        new_params = {k: new_master[k].astype(params[k].dtype) for k in params}
    keep = functools.partial(jax.tree.map, lambda new, old: jnp.where(ok, new, old))
    return keep(new_params, params), keep(new_state, state), keep(new_master, master)


class ChunkedOptimizer:
    """AdamW + global-norm clipping over ``n_chunks`` chunks; state in host memory between updates if
    ``offload``. ``update`` has the signature of a donating program: (params, state, grads) ->
    (new params, new state, {grad_norm, update_ok}); the old params and state are consumed."""

    def __init__(self, optim: OptimConfig, total_steps: int, *, n_chunks: int = 1, offload: bool = False,
                 zero: bool = False):
        self.optim, self.n_chunks, self.offload, self.zero = optim, n_chunks, offload, zero
        self.tx = inner_transform(optim, total_steps)
        self._clip = jax.jit(functools.partial(_clip, optim.grad_clip, frozen_prefixes(optim)))
        self._chunk = jax.jit(functools.partial(_update_chunk, self.tx), donate_argnums=(0, 1, 2))
        self._programs: dict[int, Callable] = {}
        self._meter = None
        self.names: list[tuple[str, ...]] | None = None
        self.on_chunk: Callable[[dict], None] | None = None  # memory meter hook: called with each chunk live

    def track(self, meter) -> None:
        """Counts the optimizer programs' XLA temp bytes in the ``update`` phase of ``meter``."""
        self._meter = meter
        self._clip = meter.track(self._clip, "update", "clip")
        self._chunk = meter.track(self._chunk, "update", "update_chunk")

    def program(self, i: int, params: dict, state, master) -> Callable:
        """Chunk ``i``'s update program for these (arrays or abstract) inputs: without ZeRO the one shared program;
        with it a program per chunk whose outputs keep the inputs' layouts (module doc)."""
        if not self.zero:
            return self._chunk
        if i not in self._programs:
            out = jax.tree.map(lambda x: x.sharding, (params, state, master))
            fn = jax.jit(functools.partial(_update_chunk, self.tx), donate_argnums=(0, 1, 2), out_shardings=out)
            self._programs[i] = self._meter.track(fn, "update", "update_chunk") if self._meter else fn
        return self._programs[i]

    def shard_state(self, state):
        """``state`` with its parameter-shaped tensors sharded over dp too (ZeRO-1; as it is without ``zero``)."""
        if not self.zero:
            return state
        return jax.tree.map(lambda x: jax.device_put(x, zero_sharding(x.sharding, x.shape)) if x.ndim else x, state)

    def init(self, params: dict) -> OptState:
        self.names = chunk_names(params, self.n_chunks)
        chunks, masters = [], []
        for names in self.names:
            p = {k: params[k] for k in names}
            master = optax.EmptyState() if all(v.dtype == jnp.float32 for v in p.values()) else \
                {k: v.astype(jnp.float32) for k, v in p.items()}
            chunks.append(self.tx.init(p if isinstance(master, optax.EmptyState) else master))
            masters.append(master)
        return self.place(self.shard_state(OptState(tuple(chunks), tuple(masters))))

    def place(self, state: OptState) -> OptState:
        """Puts a state (e.g. a restored checkpoint) where this optimizer keeps it between updates."""
        return to_host(state) if self.offload else to_device(state)

    def update(self, params: dict, state: OptState, grads: dict):
        if self.names is None:
            self.names = chunk_names(params, self.n_chunks)
        clipped, gnorm, ok = self._clip(grads)
        new_params, chunks, masters = {}, [], []
        for i, (names, s, m) in enumerate(zip(self.names, state.chunks, state.master, strict=True)):
            if self.offload:
                s, m = to_device((s, m))
            p = {k: params[k] for k in names}
            p_new, s_new, m_new = self.program(i, p, s, m)(p, s, m, {k: clipped[k] for k in names}, ok)
            if self.on_chunk is not None:
                self.on_chunk({"params": p_new, "state": s_new, "master": m_new, "clipped": clipped})
            if self.offload:
                s_new, m_new = to_host((s_new, m_new))
            new_params.update(p_new)
            chunks.append(s_new)
            masters.append(m_new)
        new_params = {k: new_params[k] for k in params}  # the caller's order
        return new_params, OptState(tuple(chunks), tuple(masters)), {"grad_norm": gnorm, "update_ok": ok}
