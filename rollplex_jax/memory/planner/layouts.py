"""The two layouts: per-device bytes of every buffer class in every phase, and what they assume.

``build_plan(cfg, lengths, mesh, programs, policy)`` predicts the bytes each buffer class of
``classes.CLASSES`` occupies on one device in each phase of ``classes.PHASES`` (rollout,
score, train, update), for two layouts:

- ``naive_colocation``: serial colocation with everything resident all the time: actor compute
  weights, gradients, fp32 master weights and Adam moments, reference weights, a second full copy of
  the weights for the rollout engine (at the rollout TP degree) and the engine's KV cache (its pool
  stays allocated); one prefix per sample (no prefix sharing), no boundary state; scoring and
  training run over full (prompt ++ answer) sequences, one micro-batch at a time.
- ``rollplex``: what our runtime does under the config: the reference and actor prefixes run during
  the rollout and their boundary KV lives until its last consumer (reference part: score; actor part:
  train), one prefix per prompt when ``cfg.run.prefix_sharing`` (else one per sample); the actor
  prefix's vjp residuals live from rollout to train when ``cfg.run.actor_prefix == 'residuals'``
  (with ``'recompute'`` the train program recomputes the prefix forward instead); the optimizer state
  and master weights are resident, or (``policy == 'offload'``) in host memory outside ``update`` and
  streamed through the device one chunk of 1/``cfg.memory.optimizer_chunks`` at a time during
  ``update``; the engine's KV cache exists only during the rollout; the rollout engine reads the
  actor's compute weights (no copy) except for a rebuilt part (rollout weights below).

The mesh, sharding and program model are described in ``types``; the per-layer formulas in
``activations``; choosing the optimizer policy under a budget in ``budget``.

Sizes (P params, b = dtype bytes, L decoder layers, K kv heads, d head dim, V vocabulary,
Tp / Tv / Tr prompt / vision / answer tokens per row from ``Lengths``, kv heads per device
``max(1, ceil(K / tp))``):
- rollout KV per device = rows x (Tp + Tr) x L x 2 x K_dev(rollout_tp) x d x b (no prompt sharing
  inside the engine: an upper bound for vLLM's prefix caching);
- boundary KV per device = (actor + reference) [L, B', Tp, K_dev(tp), d] x 2 (k, v) x b + the last
  logits [B', V] fp32, B' = B (prefix sharing) or B * G, rows divided over the D / tp batch shards;
- rollout weights: naive = P x b / rollout_tp (a full second copy);
  rollplex: the engine-owned (rebuilt) bytes of the per-tensor classification
  (``sharing.plan_sharing``, the largest of any device); aligned and view tensors alias the actor's
  compute weights; the classification also reports the physical floor of the rebuilt bytes
  (``floor_bytes_per_device``: what a rollout rank reads that its device's training shards cannot hold in
  any layout, ``sharing.floor_bytes``). (Before issue 7 this was assumed to be
  ``max(0, P / rollout_tp - P / (fsdp * tp)) x b``, the part not held locally: ``remote_bytes_per_device``
  of the classification, a lower bound for an engine that takes split pieces.)

Activations (phase-local temporaries of the largest program in a phase), per device:
- rollout: the engine's decode temporaries (rows x V fp32 logits and sampling probs) or one prefill
  chunk (``ProgramModel.prefill_chunk`` tokens through a layer, plus one prompt's vision encoder),
  whichever is larger; rollplex adds the prefix programs' working set running beside it (one layer
  of the prefix forward over the prompt rows, and two residual streams);
- score: the reference forward over one micro-batch: naive over full sequences (vision tower per
  row, fp32 logits [rows, Tp + Tr, V/tp] and their log-softmax), rollplex the suffix only
  (logits over Tr);
- train: forward + backward over one micro-batch of ``cfg.rl.micro_batch`` rows (global, i.e.
  ceil(micro_batch / (D / tp)) rows per device): saved activations (no weight copy inside one
  program), the backward's layer working set, the fp32 logits, their cotangent and log-softmax, and
  one gradient-sized buffer (the micro-batch's gradient before it is added to the accumulator, or the
  suffix and prefix parts before they are added); rollplex: the suffix over Tr tokens attending
  Tp + Tr keys per micro-batch, then the prefix vjp over the first mini-batch's prompt rows and the
  boundary-KV cotangents accumulated for them (with ``--actor_prefix=recompute``, the recomputed prefix
  of one micro-batch's prompt rows: its saved activations and backward);
- with fsdp > 1 the train programs also hold the gathered weights of every layer (``gathered_weights``:
  XLA issues the backward's all-gathers early; measured in CPU AOT compiles); the prefix vjp
  holds a text layer's and a vision block's working sets together and a per-layer carry
  (``activations.backward_carry``), calibrated against ``launch.plan --compile`` at 3B and scale_cpu;
- update: the clipped gradients (a copy) and the fp32 AdamW temporaries (cast gradients and the
  update) over the optimizer shard: all of it at once (naive), one chunk at a time (rollplex).
- other: the prompts' inputs (fp32 patches, ids, masks, positions), whole on every device (the host builds
  them and the programs take them replicated), and the rollouts; naive keeps per-sample inputs (each
  prompt's patches repeated for its G answers, as the serial schedule's micro-batches are built up front).

Naive colocation vs the paper's "about 165 GiB per GPU" (Qwen2.5-VL-32B, 32 x H800): with
``configs/qwen2_5_vl_32b_h800x32.flags`` this planner's naive layout gives about 82 GiB, 25 of them the 256
answers' inputs held whole on every device (dense attention with per-layer recompute: about 102 GiB). It is
our runtime's sharding with everything resident, not the paper's stack: weights, bf16 gradients, fp32
master weights and Adam moments all sharded over the 32 GPUs (ZeRO-3 style), a rollout KV cache of exactly
the sequences a replica decodes, one sequence per GPU per micro-batch with a memory-efficient attention
kernel and per-layer recompute, and by definition no boundary KV. The paper's stack is planned by
``baseline.megatron_vllm`` (``launch.plan --baseline=megatron_vllm``, HYPOTHETICAL): weights over TP 8 only,
Megatron's fp32 main-grad buffers, its distributed optimizer over the data-parallel group, vLLM's pool at
gpu_memory_utilization 0.9 x 80 GiB, per-sample actor and reference boundary KV: about 147 GiB, 18 GiB under
the paper's figure (not tuned to match). vLLM's gpu_memory_utilization moves it most (0.45: -36 GiB); without
a distributed optimizer (master weights and moments over TP only) it is +35 GiB (182 GiB).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

from rollplex_jax.config import Config, ModelConfig
from rollplex_jax.memory.classes import CLASSES, PHASES
from rollplex_jax.memory.planner.activations import (
    BWD_FACTOR,
    Pass,
    backward_carry,
    block_temp,
    layer_temp,
    one_layer_saved,
    prefix_residual_bytes,
    saved_activations,
)
from rollplex_jax.memory.planner.types import (
    F32,
    Lengths,
    ParamCounts,
    Plan,
    PlanMesh,
    ProgramModel,
    dtype_bytes,
    param_counts,
)

WEIGHT_SHARING_RULE = (
    "rollout weights: per-tensor classification (rollplex_jax/weights/sharing.py) of the engine's tensors against the "
    "training shards on each device (rank r of rollout replica j on training device j*rollout_tp + r): aligned "
    "and view tensors alias the actor's compute weights, rebuilt ones (fused, resharded, padded) are "
    "engine-owned buffers; rollout_weights = the largest rebuilt bytes of any device")


def sharing_classification(cfg: Config) -> dict:
    """The weight-sharing classification of the config's train mesh and rollout TP (vLLM's layout for
    --engine=vllm or rollout_tp > 1, else the transformers engine's), without the per-device list."""
    return copy.deepcopy(_classification(cfg.model, cfg.mesh, cfg.rollout.engine))


@functools.lru_cache(maxsize=8)
def _classification(model: ModelConfig, mesh, engine: str) -> dict:
    from rollplex_jax.weights.sharing import plan_sharing  # here: importing the planner does not load jax

    rep = plan_sharing(model, mesh, engine=engine).report()
    per = rep.pop("per_device")
    rep["per_device_max"] = {k: max(d["bytes"][k] for d in per) for k in rep["bytes"]}
    return rep


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Per-device figures both layouts share (bytes, unless a count)."""

    counts: ParamCounts
    compute: float  # compute weights = gradients (sharded over fsdp * tp)
    ref: float  # reference weights (0 when the reference is not used)
    master: float  # fp32 master weights (0 in fp32)
    moments: float  # Adam's two fp32 moments
    rollout_copy: float  # a full rollout shard: naive colocation's engine weights
    rebuilt: float  # the engine-owned (rebuilt) bytes of the classification: rollplex's engine weights
    classification: dict
    rows_roll: int  # sequences one engine replica decodes at once
    rollout_kv: float
    engine_tmp: float  # the engine's decode / prefill working set
    other_naive: float
    other_rollplex: float
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
    b, counts = dtype_bytes(m), param_counts(cfg)
    P, D = counts.total, mesh.devices
    Tp, Tr = lengths.prompt_tokens, lengths.response_tokens
    patches = lengths.vision_tokens * v.spatial_merge_size**2  # per prompt row
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    bs = mesh.batch_shards
    compute = P * b / mesh.weight_shards
    classification = sharing_classification(cfg)
    rows_roll, rollout_kv, engine_tmp = _engine(cfg, lengths, mesh, pm)
    # Inputs and rollouts ("other"). The host-built inputs (prepare_inputs) are whole on every device: the
    # programs take them replicated (measured in aot.compiled_memory's arguments).
    rows_dev = math.ceil(B * G / bs)
    rollouts_b = rows_dev * Tr * 4 * 3
    return Sizes(
        counts=counts, compute=compute, ref=compute if cfg.rl.uses_reference else 0.0,
        master=P * F32 / D if m.dtype != "float32" else 0.0, moments=2 * counts.trainable * F32 / D,
        rollout_copy=P * b / mesh.rollout_tp, rebuilt=classification["extra_bytes_per_device"],
        classification=classification, rows_roll=rows_roll, rollout_kv=rollout_kv, engine_tmp=engine_tmp,
        other_naive=B * G * (patches * v.patch_dim * F32 + (Tp + Tr) * 4 * 6) + rollouts_b,
        other_rollplex=prefix_rows_total(cfg) * (patches * v.patch_dim * F32 + Tp * 4 * 6) + rollouts_b,
        r_mb=math.ceil(min(cfg.rl.micro_batch, B * G) / bs), logits_row=m.text.vocab_size / mesh.tp)


def _zeros() -> dict:
    return {p: {c: 0.0 for c in CLASSES} for p in PHASES}


def naive_colocation(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes) -> dict:
    """{phase: {class: bytes}} of serial colocation with everything resident (module doc)."""
    grads = s.compute
    act = naive_activations(cfg, lengths, mesh, pm, s)
    naive = _zeros()
    for p in PHASES:
        naive[p].update(compute_weights=s.compute, master_weights=s.master, optimizer_state=s.moments,
                        ref_weights=s.ref, rollout_weights=s.rollout_copy, rollout_kv=s.rollout_kv,
                        gradients=grads, other=s.other_naive, activations=act[p])
    naive["train"]["activations"] += grads  # the micro-batch's gradient before it is added to the accumulator
    naive["update"]["activations"] += grads  # the clipped gradients
    return naive


def naive_activations(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes) -> dict:
    """{phase: bytes} of the serial schedule's phase-local temporaries over full sequences, one micro-batch per
    program, without a gradient-sized buffer (module doc; ``baseline`` reuses them)."""
    m = cfg.model
    x, v, b = m.text, m.vision, dtype_bytes(m)
    Tr, tp, r_mb = lengths.response_tokens, mesh.tp, s.r_mb
    patches = lengths.vision_tokens * v.spatial_merge_size**2
    t_full = lengths.prompt_tokens + Tr
    n_mb = r_mb * patches
    score = (2 * r_mb * t_full * x.hidden_size * b
             + max(layer_temp(m, r_mb, t_full, t_full, pm, tp),
                   block_temp(m, n_mb, pm, patches, tp) + 2 * n_mb * v.hidden_size * b)
             ) + r_mb * s.logits_row * (t_full * (F32 + b) + Tr * 2 * F32)
    train = (saved_activations(m, Pass(r_mb, t_full, t_full, n_mb, patches), pm, tp)
             + BWD_FACTOR * max(layer_temp(m, r_mb, t_full, t_full, pm, tp), block_temp(m, n_mb, pm, patches, tp))
             + one_layer_saved(m, r_mb, t_full, t_full, n_mb, pm, tp)) \
        + r_mb * s.logits_row * (t_full * (2 * F32 + b) + Tr * 2 * F32)
    return {"rollout": s.engine_tmp, "score": score if cfg.rl.uses_reference else 0.0, "train": train,
            "update": 2 * s.counts.total * F32 / mesh.devices}  # the fp32 AdamW temporaries over the shard


def gathered_weights(s: Sizes, mesh: PlanMesh) -> float:
    """Bytes of FSDP-gathered weights the training's backward holds beyond its own shard: XLA issues every
    layer's all-gather ahead of its use, so the compiled program holds the whole tp-shard of the weights at
    once. The forwards do not (``layers.rematerialise`` passes each layer's params through an optimization
    barrier with its input: measured in CPU AOT compiles of Qwen2.5-VL-3B on 8 devices, the prefix
    forward's temp grew 0.17 GiB per decoder layer without it, 0.006 with it); a remat'd backward
    recomputes from saved inputs that are there from the start, which the barrier cannot order (its
    prefix vjp: 29.9 GiB temp either way). GPU schedulers may hold fewer (an upper bound there)."""
    return 0.0 if mesh.fsdp == 1 else s.compute * (mesh.fsdp - 1)


def prefix_rows_total(cfg: Config) -> int:
    """Prefix rows of a step: one per prompt with prefix sharing, else one per answer."""
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    return B if cfg.run.prefix_sharing else B * G


def prefix_rows(cfg: Config, mesh: PlanMesh) -> int:
    """Prefix rows per device."""
    return math.ceil(prefix_rows_total(cfg) / mesh.batch_shards)


def _rollplex_activations(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel,
                          s: Sizes) -> dict:
    """The rollplex layout's boundary state and per-phase working sets (module doc), by name."""
    m = cfg.model
    x, v, b = m.text, m.vision, dtype_bytes(m)
    Tp, Tv, Tr, tp = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens, mesh.tp
    patches = Tv * v.spatial_merge_size**2
    Bp = prefix_rows(cfg, mesh)
    vision_in_prefix = not cfg.optim.freeze_vision
    nv = Bp * patches if vision_in_prefix else 0
    residuals = cfg.run.actor_prefix == "residuals"
    # The residual path keeps the vjp residuals of the first mini-batch's prefix rows and runs their vjp once
    # after the micro-batches; the recompute path recomputes each micro-batch's own prefix rows.
    res_rows = math.ceil(Bp / cfg.rl.mini_batches)
    n_ans = cfg.rollout.group_size if cfg.run.prefix_sharing else 1
    mb_rows = math.ceil(max(1, cfg.rl.micro_batch // n_ans) / mesh.batch_shards)
    bwd_rows = res_rows if residuals else mb_rows
    nb = bwd_rows * patches if vision_in_prefix else 0
    prefix_fwd_tmp = (2 * Bp * Tp * x.hidden_size * b
                      + max(layer_temp(m, Bp, Tp, Tp, pm, tp),
                            block_temp(m, nv, pm, patches, tp) + 2 * nv * v.hidden_size * b))
    r_s = s.r_mb  # answer rows per micro-batch per device
    # scoring: the fp32 logits and one fp32 temporary per logit (log-softmax fused; measured with aot)
    suffix_score = (2 * r_s * Tr * x.hidden_size * b + layer_temp(m, r_s, Tr, Tp + Tr, pm, tp)) \
        + r_s * s.logits_row * Tr * 2 * F32
    suffix_train = (saved_activations(m, Pass(r_s, Tr, Tp + Tr), pm, tp)
                    + BWD_FACTOR * layer_temp(m, r_s, Tr, Tp + Tr, pm, tp)
                    + one_layer_saved(m, r_s, Tr, Tp + Tr, 0, pm, tp)) \
        + r_s * s.logits_row * Tr * (2 * F32 + b + 2 * F32)
    # The prefix vjp holds a text layer's backward working set and a vision block's together (measured with
    # aot at scale_cpu: its temp is about the sum of the two, not the larger one).
    prefix_bwd = (BWD_FACTOR * (layer_temp(m, bwd_rows, Tp, Tp, pm, tp) + block_temp(m, nb, pm, patches, tp))
                  + one_layer_saved(m, bwd_rows, Tp, Tp, nb, pm, tp) + backward_carry(m, bwd_rows * Tp, nb, tp))
    recompute_saved = 0.0 if residuals else saved_activations(m, Pass(mb_rows, Tp, Tp, nb, patches), pm, tp)
    kv_row = x.num_hidden_layers * Tp * 2 * _kv_heads(m, tp) * x.head_dim * b + x.vocab_size * F32
    one_kv = Bp * kv_row
    gathered = gathered_weights(s, mesh)
    return {
        "one_kv": one_kv,
        "prefix_res": prefix_residual_bytes(m, res_rows, Tp, Tv, pm, tp=tp, vision=vision_in_prefix)
        if residuals else 0.0,
        "rollout": s.engine_tmp + prefix_fwd_tmp,
        "score": suffix_score if cfg.rl.uses_reference else 0.0,
        # the boundary cotangents accumulated over the micro-batches (residual path: its rows' k, v, last)
        "train": recompute_saved + max(suffix_train, prefix_bwd) + (res_rows * kv_row if residuals else 0.0)
        + s.compute + gathered,
        "emb": 0.0 if vision_in_prefix else Bp * Tv * x.hidden_size * b,
    }


def rollplex(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes, policy: str) -> dict:
    """{phase: {class: bytes}} of what our runtime does under the config and optimizer ``policy``."""
    a = _rollplex_activations(cfg, lengths, mesh, pm, s)
    offload = policy == "offload"
    chunks = cfg.memory.optimizer_chunks
    rp = _zeros()
    for p in PHASES:
        c = rp[p]
        c.update(compute_weights=s.compute, ref_weights=s.ref, rollout_weights=s.rebuilt,
                 other=s.other_rollplex + a["emb"])
        on = (not offload) or p == "update"
        c["master_weights"] = (s.master / chunks if offload else s.master) if on else 0.0
        c["optimizer_state"] = (s.moments / chunks if offload else s.moments) if on else 0.0
    rp["rollout"]["rollout_kv"] = s.rollout_kv
    ref_kv = a["one_kv"] if cfg.rl.uses_reference else 0.0
    for p in ("rollout", "score", "train"):
        rp[p]["boundary_kv"] = a["one_kv"] + (ref_kv if p != "train" else 0.0)  # the reference's ends with scoring
        rp[p]["prefix_residuals"] = a["prefix_res"]
    for p in ("train", "update"):
        rp[p]["gradients"] = s.compute
    for p in ("rollout", "score", "train"):
        rp[p]["activations"] = a[p]
    # the clipped gradients + AdamW temporaries: one chunk's when offloaded, the whole shard's when resident
    rp["update"]["activations"] = s.compute + 2 * s.counts.total * F32 / mesh.devices / (chunks if offload else 1)
    return rp


def _assumptions(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes,
                 policy: str) -> list[str]:
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    patches = Tv * cfg.model.vision.spatial_merge_size**2
    actor_how = ("keeps its vjp residuals (no weights: the params are passed to the prefix vjp again) for the "
                 "first mini-batch's prefix rows" if cfg.run.actor_prefix == "residuals"
                 else "is recomputed in the update, micro-batch by micro-batch (only its boundary KV is kept)")
    offload, chunks, c = policy == "offload", cfg.memory.optimizer_chunks, s.classification
    return [
        pm.describe(),
        f"lengths per row: prompt {Tp} tokens ({Tv} of them vision, {patches} patches), answer {Tr} tokens; "
        + lengths.source,
        f"devices {mesh.devices}: training fsdp {mesh.fsdp} x tp {mesh.tp} x dp {mesh.dp} (batch over "
        f"{mesh.batch_shards} shards; tp splits attention heads and MLP widths, the residual stream is whole on "
        f"every device of a tp group); rollout {mesh.rollout_replicas} replicas at tp {mesh.rollout_tp}, "
        f"{s.rows_roll} sequences each"
        + ("; HYPOTHETICAL: the runtime's training mesh has no data-parallel axis beyond fsdp (dp > 1 is planned, "
           "not run: --plan_devices above --train_fsdp x --train_tp)" if mesh.dp > 1 else ""),
        "compute weights, gradients and reference weights sharded over fsdp*tp; fp32 master weights and Adam "
        "moments over all devices (distributed optimizer / ZeRO-1)",
        f"micro-batch: {cfg.rl.micro_batch} rows globally -> {s.r_mb} per device (scoring and training run one "
        "micro-batch per program, in both schedules)",
        f"rollout KV cache: {s.rows_roll} sequences x {Tp + Tr} tokens per engine replica, no prompt sharing "
        "inside the engine (an upper bound for vLLM's prefix caching); naive colocation keeps it allocated in "
        "every phase, rollplex only during the rollout",
        f"rollplex: {'one prefix per prompt' if cfg.run.prefix_sharing else 'one prefix per answer'} "
        f"({prefix_rows(cfg, mesh)} prefix rows per device); actor prefix {actor_how}; reference boundary KV "
        "freed after scoring, actor boundary KV after training"
        + ("; reference off (no KL in the objective and no --log_kl)" if not cfg.rl.uses_reference else ""),
        f"rollplex optimizer state: {policy}" + (f" (host memory outside update; one chunk of 1/{chunks} on "
                                                  "the device during update)" if offload else ""),
        WEIGHT_SHARING_RULE + f" ({c['layout']} layout: "
        f"{', '.join(f'{k} {v:.1%}' for k, v in c['fractions'].items())} of the engine's bytes)",
        "naive colocation: per-sample inputs and prefixes (each prompt's patches repeated for its G answers), "
        "no boundary state, full-sequence scoring and training, a full rollout copy of the weights",
    ]


def _details(cfg: Config, lengths: Lengths, mesh: PlanMesh, s: Sizes) -> dict:
    return {
        "prefix_rows_per_device": prefix_rows(cfg, mesh),
        "answers_per_prefix": cfg.rollout.group_size if cfg.run.prefix_sharing else 1,
        "micro_rows_per_device": s.r_mb, "rollout_rows_per_replica": s.rows_roll,
        "batch_shards": mesh.batch_shards, "data_parallel": mesh.dp, "optimizer_chunks": cfg.memory.optimizer_chunks,
        # torch-side figures (the rollout engine's working set), not visible to JAX's live-array count:
        "engine_activation_bytes": int(s.engine_tmp), "rollout_kv_bytes": int(s.rollout_kv),
    }


def build_plan(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, policy: str) -> Plan:
    """Both layouts under an explicit optimizer ``policy`` ('resident' or 'offload') for rollplex."""
    s = shared_sizes(cfg, lengths, mesh, pm)
    weight_sharing = {
        "status": "classified",
        "rule": WEIGHT_SHARING_RULE,
        "train_shards": mesh.weight_shards,
        "rollout_tp": mesh.rollout_tp,
        "rebuilt_bytes_per_device": int(s.rebuilt),
        "rebuilt_fraction_of_rollout_shard": round(s.rebuilt / s.rollout_copy, 4) if s.rollout_copy else 0.0,
        "naive_copy_bytes_per_device": int(s.rollout_copy),
        "floor_bytes_per_device": s.classification["floor_bytes_per_device"],
        "data_parallel": mesh.dp, "hypothetical": mesh.dp > 1,  # weights replicated over dp: planned, not run
        "classification": s.classification,
    }
    phases = {"naive_colocation": naive_colocation(cfg, lengths, mesh, pm, s),
              "rollplex": rollplex(cfg, lengths, mesh, pm, s, policy)}
    layouts = {name: {p: {c: int(math.ceil(v)) for c, v in ph[p].items()} for p in PHASES}
               for name, ph in phases.items()}
    return Plan(layouts=layouts, devices=mesh.devices, lengths=lengths, programs=pm,
                optimizer_policy=policy, budget_bytes=cfg.memory.budget_bytes, params=s.counts,
                weight_sharing=weight_sharing, assumptions=tuple(_assumptions(cfg, lengths, mesh, pm, s, policy)),
                details=_details(cfg, lengths, mesh, s))
