"""The rollplex layout: what our runtime holds on one device, phase by phase and class by class.

``rollplex(cfg, lengths, mesh, programs, sizes, policy)``; the figures' definitions are in the ``layouts``
module doc, the row counts in ``rows``, the per-layer formulas in ``activations``, the shards and gathered
weights in ``shards``. Each phase's figure is that of its fullest moment, each class at its largest in it,
except ``train`` with several mini-batches, whose two moments differ in what they hold:

- the first mini-batch (``train_first``): the actor boundary state and (residual path) the kept residuals,
  the suffix micro-batches' and the prefix vjp's working sets and the boundary cotangents, the inputs of
  the rows the prefix programs took;
- a later one (``train_later``, recomputing its prefix under the updated params): no boundary state, the
  recomputing gradient program's working set, the inputs of every row subset the step cached by then.

The train phase is the larger of the two (a meter's snapshot sees one moment, not a mix of both).
"""

from __future__ import annotations

import math

from rollplex_jax.config import Config, ModelConfig
from rollplex_jax.config.shapes import ChunkSpec, planned_micro_batch, vision_chunk_sizes, vision_chunk_spec
from rollplex_jax.memory.classes import CLASSES, PHASES
from rollplex_jax.memory.planner import rows
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
from rollplex_jax.memory.planner.sizes import Sizes
from rollplex_jax.memory.planner.types import F32, Lengths, PlanMesh, ProgramModel, dtype_bytes, split_dim
from rollplex_jax.models.vl.vision_chunks import slot_count


def prefix_rows(cfg: Config, mesh: PlanMesh) -> float:
    """Prefix rows per device (all of the step's, as the prefix forward and the reference take them)."""
    return rows.per_device(rows.prefix_rows_total(cfg), mesh)


def vision_chunks(cfg: Config, lengths: Lengths) -> ChunkSpec | None:
    """The run's vision chunks (``shapes.vision_chunk_spec``), settings left to the data resolved from the
    planner's lengths (every row at its most vision tokens, one frame each: an upper bound), or None (no vision
    tokens, or the tower inside the prefix programs)."""
    if not lengths.vision_tokens:
        return None
    t = lengths.vision_tokens
    return vision_chunk_spec(cfg, vision_chunk_sizes(cfg, t, t, t) if cfg.data.vision_chunk_units == 0 else None)


def chunk_count(cfg: Config, ch: ChunkSpec, lengths: Lengths) -> int:
    """Chunks of a step's prefix rows, each one image of the lengths' most vision tokens (whole images to a
    full-attention row of ``ch.frame`` units, rows to a part, ``ch.groups`` parts to a chunk)."""
    per_part = max(1, ch.frame // min(lengths.vision_tokens, ch.frame)) * (ch.units // ch.frame)
    return min(ch.buffer // ch.chunk_units, math.ceil(rows.prefix_rows_total(cfg) / per_part / ch.groups))


def _chunk_sets(cfg: Config, ch: ChunkSpec | None, lengths: Lengths, pm: ProgramModel, tp: int) -> dict:
    """Chunked vision's bytes on a device: the embeddings buffer (split over the batch shards, ``ch.groups``:
    ``vision_chunks.write_chunk``), the chunks' inputs
    (host-built, whole on the first device like the other inputs; one image of the lengths' most vision tokens
    per prefix row, packed as ``vision_chunks`` packs them: whole images to a full-attention row, rows to a part,
    ``ch.groups`` parts to a chunk), and over one part (a chunk's parts are split over the fsdp devices) the
    encoding program's working set (``vision_into``) and the tower gradient's (``vision_grads``: its forward's
    saved activations, a block's backward and the remat carry)."""
    if ch is None:
        return dict.fromkeys(("buffer", "inputs", "encode", "grads"), 0.0)
    m = cfg.model
    v, b = m.vision, dtype_bytes(m)
    unit = v.spatial_merge_size**2
    n, frame = ch.units * unit, ch.frame * unit
    fwd = Pass(0, 0, 0, n, frame)
    n_chunks = chunk_count(cfg, ch, lengths)
    # the chunk's pixels are the program's input: in an fp32 model their cast to the dtype copies nothing
    no_cast = n * v.patch_dim * b if b == F32 else 0.0
    grads = (saved_activations(m, fwd, pm, tp, text_const=False) - no_cast
             + BWD_FACTOR * block_temp(m, n, pm, frame, tp)
             + one_layer_saved(m, 0, 0, 0, n, pm, tp) + backward_carry(m, 0, n, tp, pm.gpu))
    return {"buffer": ch.buffer * v.embed_width * b / ch.groups,
            "inputs": n_chunks * ch.groups * (n * (v.patch_dim * F32 + 2 * 4) + ch.units * 8 + ch.windows * 4),
            "encode": block_temp(m, n, pm, frame, tp) + 2 * n * v.hidden_size * b,
            "grads": 0.0 if cfg.optim.freeze_vision else grads}


def _slots_gather(cfg: Config, ch: ChunkSpec | None, prompt_rows: float, Tp: int) -> float:
    """Bytes of a prefix program's gathered vision tokens of ``prompt_rows`` rows (all of the step's: the slots
    are global), as many as ``vision_chunks.slot_count`` gives, twice on a mesh (the shards' gathers and their
    sum)."""
    if ch is None:
        return 0.0
    copies = 2 if ch.groups > 1 else 1
    return slot_count(ch.buffer, prompt_rows, Tp) * cfg.model.vision.embed_width * dtype_bytes(cfg.model) * copies


def _kv_row(m: ModelConfig, Tp: int, tp: int) -> float:
    """Boundary state of one prefix row on a device: k and v [L, Tp, K, d] (kv heads split over tp where it
    divides them) in the dtype, and the last logits [V] in fp32 (the vocabulary split likewise)."""
    x = m.text
    return (x.num_hidden_layers * Tp * 2 * split_dim(x.num_key_value_heads, tp) * x.head_dim * dtype_bytes(m)
            + split_dim(x.vocab_size, tp) * F32)


def _prefix_backward(m: ModelConfig, r: float, Tp: int, patches: float, pm: ProgramModel, tp: int,
                     lengths: Lengths) -> float:
    """Working set of the prefix's backward over r prompts (``rows.packed`` text rows) and their patches: a text
    layer's and a vision block's together (measured with aot at scale_cpu: its temp is about the sum of the
    two, not the larger one), what the recomputed layer saves, and the per-layer carry."""
    n, t = r * patches, rows.packed(r, lengths)
    return (BWD_FACTOR * (layer_temp(m, t, Tp, Tp, pm, tp) + block_temp(m, n, pm, patches, tp))
            + one_layer_saved(m, t, Tp, Tp, n, pm, tp) + backward_carry(m, t * Tp, n, tp, pm.gpu))


def _working_sets(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes) -> dict:
    """Boundary state, residuals and each phase's (or train moment's) working set, by name (bytes)."""
    m = cfg.model
    x, v, b = m.text, m.vision, dtype_bytes(m)
    Tp, Tv, Tr, tp = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens, mesh.tp
    ch = vision_chunks(cfg, lengths)
    cs = _chunk_sets(cfg, ch, lengths, pm, tp)
    vision_in_prefix = not cfg.optim.freeze_vision and ch is None
    patches_row = Tv * v.spatial_merge_size**2
    patches = patches_row if vision_in_prefix else 0
    Bp, nv = prefix_rows(cfg, mesh), prefix_rows(cfg, mesh) * patches
    residuals = cfg.run.actor_prefix == "residuals"
    # The residual path keeps the vjp residuals of the first mini-batch's prefix rows and runs their vjp once
    # after the micro-batches; the recompute path recomputes each micro-batch's own prefix rows.
    parts = [rows.per_device(p1 - p0, mesh) for p0, p1 in rows.actor_parts(cfg)]
    res_rows = parts[0]
    mb_rows = rows.per_device(max(1, planned_micro_batch(cfg) // rows.answers_per_row(cfg)), mesh)
    Bt, mb_t = rows.packed(Bp, lengths), rows.packed(mb_rows, lengths)  # the text rows the prefix programs run
    prefix_fwd = (2 * Bt * Tp * x.hidden_size * b
                  + max(layer_temp(m, Bt, Tp, Tp, pm, tp), block_temp(m, nv, pm, Tv * v.spatial_merge_size**2, tp)
                        + 2 * nv * v.hidden_size * b))
    # chunked vision: the prefix programs gather every prefix row's tokens out of the split buffer, whole on each
    # device (``vision_chunks.gather_slots``: each shard's rows, then their sum over the shards: two copies)
    prefix_fwd = max(prefix_fwd, _slots_gather(cfg, ch, rows.prefix_rows_total(cfg), Tp))
    r_s = rows.micro_batch_rows(cfg, mesh)  # answer rows per micro-batch per device
    # scoring: the fp32 logits and one fp32 temporary per logit (log-softmax fused; measured with aot on CPU), or
    # their 16-bit originals (GPU); the gradient: four fp32 and a 16-bit copy (CPU), two of each (GPU)
    score_logit, train_logit = (F32 + b, 2 * F32 + 2 * b) if pm.gpu else (2 * F32, 2 * F32 + b + 2 * F32)
    score_layers = 2 * r_s * Tr * x.hidden_size * b + layer_temp(m, r_s, Tr, Tp + Tr, pm, tp)
    score_logits = r_s * s.logits_row * Tr * score_logit
    # on GPU the logits' moment holds nothing else (the 3B suffix_logp's temp is exactly its logits): the larger
    # of the layers' moment (with the gathered weights) and the logits'; on CPU both together (measured with aot)
    suffix_score = (max(score_layers + s.gathered.text_forward, score_logits) if pm.gpu
                    else score_layers + score_logits + s.gathered.text_forward)
    suffix_train = (saved_activations(m, Pass(r_s, Tr, Tp + Tr), pm, tp)
                    + BWD_FACTOR * layer_temp(m, r_s, Tr, Tp + Tr, pm, tp)
                    + one_layer_saved(m, r_s, Tr, Tp + Tr, 0, pm, tp)
                    + r_s * s.logits_row * Tr * train_logit)
    recompute = (saved_activations(m, Pass(mb_t, Tp, Tp, mb_rows * patches, patches or None), pm, tp)
                 + max(suffix_train, _prefix_backward(m, mb_rows, Tp, patches, pm, tp, lengths)))
    kv_row = _kv_row(m, Tp, tp)
    # every gradient program also holds one gradient-sized buffer (the micro-batch's, or the prefix part's,
    # before it is added to the accumulator) and the FSDP-gathered weights (``shards``)
    grad_extra = s.compute + s.gathered.all
    # the boundary cotangents accumulated over the micro-batches (residual path: its rows' k, v, last)
    first = (max(suffix_train, _prefix_backward(m, res_rows, Tp, patches, pm, tp, lengths)) + res_rows * kv_row
             if residuals else recompute)
    # the actor suffix's log-probs: the reference's (scoring), and theta_k's for the old log-probs of several
    # mini-batches (the meter counts that program's temp in the score phase wherever it runs)
    suffix_logp = cfg.rl.uses_reference or cfg.rl.mini_batches > 1
    d_emb = 0.0 if cfg.optim.freeze_vision else cs["buffer"]
    return {
        "actor_kv": sum(parts) * kv_row,
        "ref_kv": Bp * kv_row if cfg.rl.uses_reference else 0.0,
        "prefix_res": prefix_residual_bytes(m, res_rows, Tp, Tv, pm, tp=tp, vision=vision_in_prefix,
                                            text_rows=rows.packed(res_rows, lengths))
        if residuals else 0.0,
        "rollout": s.engine_tmp + max(prefix_fwd, cs["encode"]) + s.gathered.forward,
        "score": suffix_score if suffix_logp else 0.0,
        # chunked vision: the buffer's cotangent beside each, then the tower's gradient chunk by chunk; a later
        # mini-batch also holds its buffer encoded again under its params
        "train_first": max(first, cs["grads"]) + d_emb + grad_extra,
        "train_later": max(recompute, cs["grads"]) + 2 * d_emb + grad_extra
        if residuals and cfg.rl.mini_batches > 1 else None,
        "emb": 0.0 if vision_in_prefix or ch is not None else Bp * Tv * x.hidden_size * b,
        "chunks": cs,
        "pixels": rows.prefix_rows_total(cfg) * patches_row * v.patch_dim * F32,  # in the inputs (``Sizes``)
    }


def rollplex(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes, policy: str) -> dict:
    """{phase: {class: bytes}} of what our runtime does under the config and optimizer ``policy``."""
    a = _working_sets(cfg, lengths, mesh, pm, s)
    offload = policy == "offload"
    chunks = cfg.memory.optimizer_chunks
    at_dispatch, by_the_end = rows.input_copies(cfg)
    copies = {"rollout": at_dispatch, "score": at_dispatch, "train": by_the_end, "update": by_the_end}
    cs = a["chunks"]
    # chunked vision: the inputs hold no pixels (the chunks do, once), and the buffer is shared by every part;
    # during the rollout the reference's own buffer (unless frozen) lives until its prefix has run
    inputs = s.inputs_rollplex - (a["pixels"] if cs["buffer"] else 0.0)
    held = cs["buffer"] + cs["inputs"]
    ref_buffer = cs["buffer"] if cfg.rl.uses_reference and not cfg.optim.freeze_vision else 0.0

    def other(n: float, p: str) -> float:
        return (inputs + a["emb"]) * n + s.rollouts + held + (ref_buffer if p == "rollout" else 0.0)

    rp = {p: dict.fromkeys(CLASSES, 0.0) for p in PHASES}
    for p in PHASES:
        c = rp[p]
        # several processes (one per device on GPUs): each engine's copy of the split weights is all-gathered
        # before the rollout and freed after it (multihost.ReplicatedCopy); one process keeps its engine's rebuilt
        # buffers between steps (refilled after each update)
        engine = s.rebuilt if cfg.mesh.processes == 1 or p == "rollout" else 0.0
        c.update(compute_weights=s.compute, ref_weights=s.ref, rollout_weights=engine, other=other(copies[p], p))
        on = (not offload) or p == "update"
        c["master_weights"] = (s.master / chunks if offload else s.master) if on else 0.0
        c["optimizer_state"] = (s.moments / chunks if offload else s.moments) if on else 0.0
    rp["rollout"]["rollout_kv"] = s.rollout_kv
    for p in ("rollout", "score", "train"):
        rp[p]["boundary_kv"] = a["actor_kv"] + (a["ref_kv"] if p != "train" else 0.0)  # the reference's: to scoring
        rp[p]["prefix_residuals"] = a["prefix_res"]
    rp["rollout"]["activations"], rp["score"]["activations"] = a["rollout"], a["score"]
    rp["train"].update(gradients=s.compute, activations=a["train_first"])
    if a["train_later"] is not None:  # the train phase's two moments (module doc): the fuller one
        first = dict(rp["train"], other=other(at_dispatch, "train"))
        later = dict(rp["train"], boundary_kv=0.0, prefix_residuals=0.0, activations=a["train_later"])
        rp["train"] = max(first, later, key=lambda c: sum(c.values()))
    rp["update"]["gradients"] = 2 * s.compute  # the accumulated gradients and their clipped copy
    # the fp32 AdamW temporaries: one chunk's when offloaded, the whole shard's when resident (CPU; none on GPU)
    rp["update"]["activations"] = 0.0 if pm.gpu else 2 * s.opt_elems * F32 / (chunks if offload else 1)
    return rp
