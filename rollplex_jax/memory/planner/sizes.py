"""What both layouts are built from: persistent state, the rollout engine, inputs and micro-batch rows, per device.

``shared_sizes`` (the ``layouts`` module doc has the formulas): the weights, gradients, master weights and
Adam moments as each parameter's shard on the training mesh (``shards``), the FSDP-gathered copies the
programs hold, the engine's rebuilt weights from the per-tensor sharing classification
(``sharing_classification``), the engine's KV cache and working set, the step's inputs and rollouts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

from rollplex_jax.config import Config, ModelConfig
from rollplex_jax.config.shapes import planned_micro_batch
from rollplex_jax.memory.planner import rows
from rollplex_jax.memory.planner.activations import block_temp, layer_temp
from rollplex_jax.memory.planner.shards import Gathered, gathered, shard_counts
from rollplex_jax.memory.planner.types import (
    F32,
    Lengths,
    ParamCounts,
    PlanMesh,
    ProgramModel,
    dtype_bytes,
    param_counts,
    split_dim,
)


def sharing_classification(cfg: Config) -> dict:
    """The weight-sharing classification of the config's train mesh and rollout TP (vLLM's layout for
    --engine=vllm or rollout_tp > 1, else the transformers engine's), without the per-device list."""
    return copy.deepcopy(_classification(cfg.model, cfg.mesh, cfg.rollout.engine))


@functools.lru_cache(maxsize=8)
def _classification(model: ModelConfig, mesh, engine: str) -> dict:
    from rollplex_jax.weights.classify import plan_sharing  # here: importing the planner does not load jax

    rep = plan_sharing(model, mesh, engine=engine).report()
    per = rep.pop("per_device")
    rep["per_device_max"] = {k: max(d["bytes"][k] for d in per) for k in rep["bytes"]}
    return rep


def _engine_owned(cfg: Config, classification: dict) -> float:
    """The engine-owned weight bytes per device: the classification's rebuilt bytes, except where the runtime's vLLM
    TP ranks (several processes, ``--rollout_tp`` > 1 at train TP != rollout TP or fsdp > 1) read the params
    resharded onto the rollout's TP layout (``multihost.RolloutTPCopy``, ``MeshConfig.rollout_ranks_own_shards``):
    then that copy (each parameter split over rollout_tp as training splits it over tp, fused tensors regrouped by
    the rollout TP) and what is still rebuilt from it."""
    m = cfg.mesh
    if m.processes == 1 or m.rollout_tp == 1 or m.rollout_ranks_own_shards:
        return classification["extra_bytes_per_device"]
    rollout = dataclasses.replace(m, train_dp=m.train_devices // m.rollout_tp, train_fsdp=1, train_tp=m.rollout_tp)
    model = cfg.model.with_param_layout(m.rollout_tp, cfg.model.text.vocab_multiple)
    copy = shard_counts(dataclasses.replace(cfg, model=model), 1, m.rollout_tp).total * dtype_bytes(cfg.model)
    return copy + sharing_classification(dataclasses.replace(cfg, model=model, mesh=rollout))["extra_bytes_per_device"]


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Per-device figures both layouts share (bytes, unless a count)."""

    counts: ParamCounts
    compute: float  # compute weights = gradients (each parameter's shard on the fsdp x tp mesh)
    ref: float  # reference weights (0 when the reference is not used)
    master: float  # fp32 master weights (0 in fp32)
    moments: float  # Adam's two fp32 moments
    opt_elems: float  # parameter elements of the optimizer's shard on one device
    gathered: Gathered  # bytes of the FSDP-gathered weights a backward / a forward / the suffix forward hold
    rollout_copy: float  # a full rollout shard: naive colocation's engine weights
    rebuilt: float  # the engine-owned (rebuilt) bytes of the classification: rollplex's engine weights
    classification: dict
    rows_roll: int  # sequences one engine replica decodes at once
    rollout_kv: float
    engine_tmp: float  # the engine's decode / prefill working set
    other_naive: float
    inputs_rollplex: float  # one copy of the prefix rows' inputs (whole on the busiest device)
    rollouts: float  # the rollouts' arrays on the device
    r_mb: int  # micro-batch rows per device
    logits_row: float  # vocab-parallel logits per token


def _kv_heads(m: ModelConfig, degree: int) -> int:
    return max(1, math.ceil(m.text.num_key_value_heads / degree))


def _engine(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel) -> tuple[int, float, float]:
    """(rows per replica, KV cache bytes, working set bytes) of the rollout engine (same in both layouts)."""
    m = cfg.model
    x, v, b = m.text, m.vision, dtype_bytes(m)
    Tp, Tr = lengths.prompt_tokens, lengths.response_tokens
    patches = lengths.vision_tokens * v.spatial_merge_size**2
    rows_roll = min(math.ceil(cfg.rl.batch_prompts * cfg.rollout.group_size / mesh.rollout_replicas),
                    cfg.rollout.max_batch)
    rollout_kv = rows_roll * (Tp + Tr) * x.num_hidden_layers * 2 * _kv_heads(m, mesh.rollout_tp) * x.head_dim * b
    rtp = mesh.rollout_tp  # the engine's TP splits heads and MLP widths, not the residual stream
    decode_tmp = (rows_roll * x.vocab_size * 2 * F32
                  + rows_roll * (3 * x.intermediate_size / rtp + 3 * x.hidden_size) * b)
    chunk = min(pm.prefill_chunk, rows_roll * Tp)  # tokens of one prefill step: chunk / Tp prompts of Tp tokens
    prefill_tmp = (layer_temp(m, chunk / min(chunk, Tp), min(chunk, Tp), Tp, pm, rtp)
                   + 2 * chunk * x.hidden_size * b
                   + block_temp(m, patches, pm, tp=rtp) + 2 * patches * v.hidden_size * b)
    return rows_roll, rollout_kv, max(decode_tmp, prefill_tmp)


def shared_sizes(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel) -> Sizes:
    """Persistent state, the engine, inputs and micro-batch rows: what both layouts are built from."""
    m, v = cfg.model, cfg.model.vision
    b, counts, shard = dtype_bytes(m), param_counts(cfg), shard_counts(cfg, mesh.fsdp, mesh.tp)
    P = counts.total
    Tp, Tr = lengths.prompt_tokens, lengths.response_tokens
    patches = lengths.vision_tokens * v.spatial_merge_size**2  # per prompt row
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    bs = mesh.batch_shards
    compute = shard.total * b
    g = gathered(cfg, mesh.fsdp, mesh.tp)
    classification = sharing_classification(cfg)
    rows_roll, rollout_kv, engine_tmp = _engine(cfg, lengths, mesh, pm)
    # Inputs and rollouts ("other"). The host-built inputs (prepare_inputs) are whole on the busiest device: the
    # programs take them replicated (measured in aot.compiled_memory's arguments; at run time some are put on the
    # first device only, the others replicated).
    rows_dev = math.ceil(B * G / bs)
    rollouts_b = rows_dev * Tr * 4 * 3
    return Sizes(
        counts=counts, compute=compute, ref=compute if cfg.rl.uses_reference else 0.0,
        master=shard.total * F32 / mesh.optimizer_shards if m.dtype != "float32" else 0.0,
        moments=2 * shard.trainable * F32 / mesh.optimizer_shards, opt_elems=shard.total / mesh.optimizer_shards,
        gathered=Gathered(g.all * b, g.forward * b, g.text_forward * b),
        rollout_copy=P * b / mesh.rollout_tp, rebuilt=_engine_owned(cfg, classification),
        classification=classification, rows_roll=rows_roll, rollout_kv=rollout_kv, engine_tmp=engine_tmp,
        other_naive=B * G * (patches * v.patch_dim * F32 + (Tp + Tr) * 4 * 6) + rollouts_b,
        inputs_rollplex=rows.prefix_rows_total(cfg) * (patches * v.patch_dim * F32 + Tp * 4 * 6),
        rollouts=rollouts_b,
        r_mb=math.ceil(min(planned_micro_batch(cfg), B * G) / bs), logits_row=split_dim(m.text.vocab_size, mesh.tp))


