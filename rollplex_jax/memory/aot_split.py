"""The Rollplex schedule's programs for ``aot.compiled_memory``: the prefix programs of the rollout phase, the
suffix's scoring, the train phase's suffix gradients and prefix vjp (or recomputed prefix), at a config's
worst-case shapes (``aot`` module doc).

Vision as the runtime runs it (``step/rollplex_ops.py``): with shape buckets (the default) the tower runs apart
in fixed-shape chunks (``vision_into``, one program per chunk, into the batch's embeddings buffer), the text
programs take the buffer and the rows' ``vision_slots``, and the train phase takes the buffer's cotangent back
through the tower chunk by chunk (``vision_grads``); the chunks are the planner's (``planner.rollplex
.vision_chunks``: one image of the lengths' most vision tokens per prefix row). Without buckets or with
``--vision_chunk_units=-1`` the tower runs inside the prefix programs (or, frozen, in ``vision`` once).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rollplex_jax.config import Config
from rollplex_jax.config.shapes import planned_micro_batch
from rollplex_jax.memory.aot import Abstract, _answers, _Phases, abstract_shard_bytes


class _Vision(NamedTuple):
    """How the prefix programs get their vision: ``slots`` (the buffer's rows; 0: no chunks), the embeddings each
    prefix call takes (``emb``: all P rows, ``emb0``: the first mini-batch's; None: the tower inside), the chunk
    (abstract ``VisionInputs``) and the bytes of the chunks' inputs (every chunk of a step, held on the device)."""

    slots: int
    emb: object
    emb0: object
    chunk: object
    chunk_inputs: int
    chunks: int = 0  # how many (the programs on a chunk run once per chunk)


def _chunked_vision(ph: _Phases, cfg: Config, A: Abstract, sp, lengths, frames: int) -> _Vision | None:
    """Compiles ``vision_into`` for one chunk of the planner's chunks (None when the run keeps the tower inside)."""
    from rollplex_jax.memory.planner import chunk_count, vision_chunks

    ch = vision_chunks(cfg, lengths)
    if ch is None:
        return None
    vin = A.chunk(ch, lengths.prompt_tokens, lengths.vision_tokens, frames)
    dtype = next(x.dtype for k, x in A.params.items() if k.startswith("visual.merger"))
    buf = A.buffer(ch, cfg.model.vision.embed_width, dtype)
    pb, emb = ph.compile(sp.vision_into, A.params, vin, buf, 0)
    n = chunk_count(cfg, ch, lengths)
    ph.add("rollout", "vision_into", pb, {"compute_weights", "emb"}, partial=abstract_shard_bytes(vin), sim="vision",
           runs=n)
    if cfg.rl.uses_reference and not cfg.optim.freeze_vision:  # the reference encodes its own buffer
        ph.count("vision_into (reference)", pb, "ref_prefix", n)
    return _Vision(ch.buffer, emb, emb, vin, n * abstract_shard_bytes(vin), n)


def _vision(ph: _Phases, cfg: Config, A: Abstract, sp, lengths, frames: int, P: int, P0: int):
    """(``_Vision``, the prefix rows' inputs, the first mini-batch's): chunked, frozen tower (``vision`` once) or
    the tower inside the prefix programs."""
    Tp, Tv = lengths.prompt_tokens, lengths.vision_tokens
    ch = _chunked_vision(ph, cfg, A, sp, lengths, frames) if Tv else None
    slots = ch.slots if ch is not None else 0
    inputs = A.inputs(P, Tp, Tv, 0, frames, slots=slots)
    inputs0 = inputs if P0 == P else A.inputs(P0, Tp, Tv, 0, frames, slots=slots)
    if ch is not None:
        return ch, inputs, inputs0
    if cfg.optim.freeze_vision and Tv:
        pb, emb = ph.compile(sp.vision, A.params, inputs)
        ph.add("rollout", "vision", pb, {"compute_weights", "other", "emb"}, sim="vision")
        emb0 = emb if P0 == P else A.array((emb.shape[0] * P0 // P, emb.shape[1]), emb.dtype)
        return _Vision(0, emb, emb0, None, 0), inputs, inputs0
    return _Vision(0, None, None, None, 0), inputs, inputs0


def _rest_emb(A: Abstract, vis: _Vision):
    """The embeddings the later mini-batches' prefix call takes: the whole buffer (chunked), the rest of the rows'
    (frozen tower), or None."""
    if vis.emb is None or vis.slots:
        return vis.emb
    return A.array((vis.emb.shape[0] - vis.emb0.shape[0], vis.emb.shape[1]), vis.emb.dtype)


def rollplex_programs(ph: _Phases, cfg: Config, A: Abstract, progs, lengths, frames: int, base: dict,
                      resident: dict) -> None:
    """The Rollplex schedule: prefix programs during the rollout, suffix micro-batches, one prefix vjp."""
    from rollplex_jax.programs.sequences import answer_blocks
    from rollplex_jax.programs.split import BoundaryRows, make_split_programs

    sp = make_split_programs(cfg.model, cfg.rl, cfg.programs, temperature=cfg.rollout.temperature)
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    n = G if cfg.run.prefix_sharing else 1
    P = B if cfg.run.prefix_sharing else B * G
    res = cfg.run.actor_prefix == "residuals"
    P0 = P // cfg.rl.mini_batches if res else P
    vis, inputs, inputs0 = _vision(ph, cfg, A, sp, lengths, frames, P, P0)
    live = dict(base, **resident, other=abstract_shard_bytes(inputs))
    if vis.emb is not None:
        live["emb"] = abstract_shard_bytes(vis.emb)
    if vis.chunk_inputs:  # every chunk's pixels and layout, on the device for the step (a program takes one)
        live["chunks"] = vis.chunk_inputs
    fn = sp.actor_prefix.program if res else sp.prefix
    pb, out = ph.compile(fn, A.params, inputs0, vis.emb0)
    ph.add("rollout", "actor_prefix", pb, {"compute_weights", "other", "emb", "boundary_kv", "prefix_residuals"},
           sim="actor_prefix")
    boundary = [out[:3]]
    kept = out[3] if res else []
    if P0 < P:
        pb, rest = ph.compile(sp.prefix, A.params, A.inputs(P - P0, Tp, Tv, 0, frames, slots=vis.slots),
                              _rest_emb(A, vis))
        ph.count("prefix (later mini-batches)", pb, "actor_prefix", 1)
        boundary.append(rest)
    live.update(boundary_kv=abstract_shard_bytes(boundary), prefix_residuals=abstract_shard_bytes(kept))
    ref_b = None
    if cfg.rl.uses_reference:
        # chunked and trained tower: the reference's own buffer (encoded by the same program) is its argument
        own = vis.slots and not cfg.optim.freeze_vision
        pb, ref_b = ph.compile(sp.prefix, A.params, inputs, vis.emb)
        ph.add("rollout", "ref_prefix", pb, {"ref_weights", "other", "boundary_kv"} | (set() if own else {"emb"}),
               sim="ref_prefix")
        live["boundary_kv"] += abstract_shard_bytes(ref_b)
    ph.live["rollout"] = dict(live)
    blocks = answer_blocks(0, P, n, planned_micro_batch(cfg))
    blk = blocks[0]
    size, na = blk.p1 - blk.p0, blk.a1 - blk.a0
    mask, pos = A.array((P, Tp), bool), A.array((P,), jnp.int32)
    ids, rmask = A.array((size, na, Tr), jnp.int32), A.array((size, na, Tr), bool)
    if ref_b is not None:
        pb, _ = ph.compile(sp.suffix_logp, size, A.params, BoundaryRows(*ref_b, mask, pos), 0, ids, rmask)
        ph.add("score", "suffix_logp", pb, {"ref_weights", "boundary_kv"}, sim="reference", runs=len(blocks))
    ph.live["score"] = dict(live)
    live["boundary_kv"] = abstract_shard_bytes(boundary)  # the reference's ends with scoring
    first = _FirstPrefix(boundary[0], kept, inputs0, vis)
    first_blocks = len(answer_blocks(0, P0, n, planned_micro_batch(cfg)))
    _rollplex_train(ph, cfg, A, sp, live, first, (size, na, Tr, P0, Tp, Tv, frames), (len(blocks), first_blocks))


class _FirstPrefix(NamedTuple):
    """The first mini-batch's actor prefix as the train phase reads it: its boundary (k, v, last), the vjp residuals
    it kept, its inputs and the run's vision (``_Vision``)."""

    boundary: tuple
    kept: list
    inputs: object
    vision: _Vision


def _rollplex_train(ph: _Phases, cfg: Config, A: Abstract, sp, live: dict, first: _FirstPrefix, dims,
                    blocks: tuple[int, int]) -> None:
    """The train phase's programs: a micro-batch's suffix gradients and the prefix vjp (residual path), or a
    micro-batch's recomputed-prefix gradient; with chunked vision, a chunk's tower gradient from the buffer's
    cotangent (``vision_grads``, after the text programs: their cotangents summed into one buffer). ``blocks``:
    the step's answer micro-batches, and the first mini-batch's (the residual path's)."""
    from rollplex_jax.programs.split import BoundaryRows

    b0, kept, inputs0, vis = first
    size, na, Tr, P0, Tp, Tv, frames = dims
    ids, f32 = A.array((size, na, Tr), jnp.int32), A.array((size, na, Tr), jnp.float32)
    answers = _answers(cfg, A, ids, f32, A.array((size, na), jnp.float32))
    grads = abstract_shard_bytes(A.params)
    live = dict(live, gradients=grads)
    trained = vis.slots and not cfg.optim.freeze_vision
    if trained:
        live["emb_ct"] = abstract_shard_bytes(vis.emb)  # the buffer's cotangent, summed over the text programs
    if cfg.run.actor_prefix == "residuals":
        mask, pos = A.array((P0, Tp), bool), A.array((P0,), jnp.int32)
        pb, (_, cts, _) = ph.compile(sp.suffix_grads, size, A.params, BoundaryRows(*b0, mask, pos), 0, answers)
        ph.add("train", "suffix_grads", pb, {"compute_weights", "boundary_kv"}, sim="actor", runs=blocks[1])
        ct = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)) for x in b0)
        live["cotangents"] = abstract_shard_bytes(ct)
        meta = sp.actor_prefix.meta(A.params, inputs0, vis.emb0)
        pb, _ = ph.compile(sp.prefix_vjp, meta, A.params, kept, *ct)
        ph.add("train", "prefix_vjp", pb, {"compute_weights", "prefix_residuals", "cotangents"}, sim="actor")
    if cfg.run.actor_prefix != "residuals" or cfg.rl.mini_batches > 1:
        inputs = A.inputs(size, Tp, Tv, 0, frames, slots=vis.slots)  # a micro-batch's prefix rows
        emb = vis.emb if vis.slots or vis.emb0 is None else A.array(
            (vis.emb0.shape[0] // P0 * size, vis.emb0.shape[1]), vis.emb0.dtype)
        pb, _ = ph.compile(sp.grads_recompute, A.params, inputs, emb, answers)
        later = blocks[0] - (blocks[1] if cfg.run.actor_prefix == "residuals" else 0)
        ph.add("train", "grads_recompute", pb, {"compute_weights"} | ({"emb"} if vis.slots else set()),
               sim="actor", runs=later)
    if trained:
        # the accumulator has the params' shapes and shardings (the cotangent the buffer's: ``vis.emb``)
        pb, _ = ph.compile(sp.vision_grads, A.params, A.params, vis.chunk, vis.emb, 0)
        ph.add("train", "vision_grads", pb, {"compute_weights", "gradients", "emb_ct"},
               partial=abstract_shard_bytes(vis.chunk), sim="actor", runs=vis.chunks)
    ph.live["train"] = live
