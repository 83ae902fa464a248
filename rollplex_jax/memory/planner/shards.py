"""What one device holds of the parameters on the fsdp x tp training mesh, and what FSDP gathers on top.

Per device (``model_shard_counts``): each parameter's shard under the sharding rules
(``parallel.mesh.spec_for_sizes``), summed. A dimension a mesh axis does not divide stays whole (e.g. a
kv-head count or vocabulary tp does not divide, every norm and bias), so a mesh of ``fsdp x tp`` devices
holds more than 1 / (fsdp tp) of the model per device (tiny demo model: 0.32 of it on fsdp 2 x tp 2, 0.44
on tp 4). Every device holds the same: the rules split a dimension evenly or not at all.

Gathered (``model_gathered``): a program on a mesh with fsdp > 1 all-gathers the weights it reads over
fsdp, each to its tp-shard (the shard on the same mesh with fsdp = 1), and holds the gathered copies as
temporaries beside its own shards (``memory_analysis`` temp bytes). Measured in CPU AOT compiles:

- a backward holds every weight's gathered copy at once (XLA issues all of its all-gathers early; a
  remat'd backward recomputes from saved inputs, which ``layers.rematerialise``'s optimization barrier
  cannot order: Qwen2.5-VL-3B's prefix vjp on 8 devices, 29.9 GiB of temp either way): ``all``;
- a forward gathers each decoder layer's and vision block's weights at that layer (the barrier orders
  them: the 3B prefix forward's temp grows 0.006 GiB per decoder layer with it, 0.17 without), the rest
  (embeddings, lm head, patch embedding, merger, final norms) for the whole program: ``forward`` =
  the rest + the largest layer + the largest block; the suffix forward reads no vision weights:
  ``text_forward``. On the tiny demo model (whose patch embedding and merger are 41% of its
  weights) a forward's temp holds 0.22 MiB of gathered weights on fsdp 2 x tp 2 (planned 0.14) and
  0.25 MiB on fsdp 4 (planned 0.32): its intercept in the rows, from compiles at 4 and 8 prefix rows.

GPU schedulers may hold fewer gathered copies at once: an upper bound there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

from rollplex_jax.config import Config, ModelConfig

_BLOCK = re.compile(r"^(model\.layers|visual\.blocks)\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class ShardCounts:
    """Parameter elements one device holds on an fsdp x tp training mesh."""

    total: int
    trainable: int


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Elements a program gathers over fsdp beyond the device's own shards (module doc)."""

    all: int  # every weight: a backward
    forward: int  # the non-layer weights + the largest decoder layer + the largest vision block
    text_forward: int  # the text model's non-layer weights + the largest decoder layer (the suffix)


def _shards(model: ModelConfig, fsdp: int, tp: int) -> dict[str, int]:
    """Elements per device of every parameter (``partition_spec``: an undivided dimension stays whole)."""
    from rollplex_jax.models.vl.params import param_specs  # here: no jax at import
    from rollplex_jax.parallel.mesh import spec_for_sizes

    degree = {"fsdp": fsdp, "tp": tp}
    out = {}
    for name, (shape, axes) in param_specs(model).items():
        spec = spec_for_sizes(shape, axes, degree)
        out[name] = math.prod(d // (degree[a] if a else 1) for d, a in zip(shape, spec, strict=True))
    return out


@functools.lru_cache(maxsize=64)
def model_shard_counts(model: ModelConfig, freeze_vision: bool, fsdp: int, tp: int) -> ShardCounts:
    """Per device: each parameter's shard, summed (module doc)."""
    own = _shards(model, fsdp, tp)
    frozen = sum(n for k, n in own.items() if k.startswith("visual.")) if freeze_vision else 0
    return ShardCounts(sum(own.values()), sum(own.values()) - frozen)


@functools.lru_cache(maxsize=64)
def model_gathered(model: ModelConfig, fsdp: int, tp: int) -> Gathered:
    """Elements of the gathered copies a backward, a forward and the suffix forward hold (module doc)."""
    if fsdp == 1:
        return Gathered(0, 0, 0)
    own, whole = _shards(model, fsdp, tp), _shards(model, 1, tp)
    blocks: dict[tuple[str, str], int] = {}
    rest = {"model": 0, "visual": 0}
    for name, n in own.items():
        extra = whole[name] - n
        hit = _BLOCK.match(name)
        if hit:
            blocks[hit.groups()] = blocks.get(hit.groups(), 0) + extra
        else:
            rest["visual" if name.startswith("visual.") else "model"] += extra
    layer = max((n for (kind, _), n in blocks.items() if kind == "model.layers"), default=0)
    block = max((n for (kind, _), n in blocks.items() if kind == "visual.blocks"), default=0)
    return Gathered(sum(whole.values()) - sum(own.values()), rest["model"] + rest["visual"] + layer + block,
                    rest["model"] + layer)


def shard_counts(cfg: Config, fsdp: int, tp: int) -> ShardCounts:
    """Parameter elements per device of the config's model on an fsdp x tp mesh."""
    return model_shard_counts(cfg.model, cfg.optim.freeze_vision, fsdp, tp)


def gathered(cfg: Config, fsdp: int, tp: int) -> Gathered:
    """Gathered elements per program kind of the config's model on an fsdp x tp mesh."""
    return model_gathered(cfg.model, fsdp, tp)
