"""The Rollplex schedule's scoring and gradients (``step_ops.Ops``): prefix once per prompt, suffixes in micro-batches.

Units: *prefix rows* (a prompt with ``--prefix_sharing``, one answer's copy of it without) with ``n``
answers each (G, or 1). What runs when:

- ``dispatch`` (before the decode with ``--overlap``): the frozen vision tower (``--freeze_vision``), the
  actor prefix under theta_k and the reference prefix, asynchronously. With ``--actor_prefix=residuals``
  the actor prefix keeps its vjp residuals (weights excluded: ``split.ResidualPrefix``) for the first
  mini-batch's prefix rows only (later mini-batches run under other params and recompute); the other
  rows' actor boundary KV (for old log-probs) comes from the plain prefix program. Boundary states carry
  the params version they were computed under (``Boundary``): a consumer at another version raises
  ``StaleBoundaryError``.
- Chunked vision (shape buckets, ``models/vl/vision_chunks.py``): the tower runs apart, chunk by chunk, into
  one embeddings buffer per params (``_encode``: actor; reference unless ``--freeze_vision``); the prefix programs
  take the buffer, and the buffer's cotangent goes back through the tower chunk by chunk (``_vision_grads``).
- scoring (``ref_logp``, ``logp``): the suffix over each micro-batch of answers (``answer_blocks``).
- ``grads`` of a mini-batch: per micro-batch of ``--micro_batch`` answers, or of as many as
  ``--micro_batch_tokens`` holds (``sequences.StepShapes``; whole prefix rows, or one row's answers in chunks when
  that is < n), accumulated exactly (token weights are the mini-batch's, sliced). Residual path: suffix
  gradients, the boundary cotangents accumulated over the micro-batches, then one prefix vjp. Recompute path:
  each micro-batch's prefix recomputed for its own prompt rows inside its gradient program.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np

from rollplex_contract.batch import Prompts, Rollouts
from rollplex_jax.config import Config
from rollplex_jax.config.shapes import step_shapes, vision_chunk_spec
from rollplex_jax.models.vl.model import ModelInputs, prepare_inputs
from rollplex_jax.models.vl.packing import to_device
from rollplex_jax.models.vl.vision_chunks import Chunks, VisionInputs, plan_chunks, slot_count
from rollplex_jax.programs.sequences import (
    answer_blocks,
    input_options,
    mini_batch_rows,
    pad_prompts,
    repeat_rows,
    row_slots,
    select_rows,
    vision_token_rows,
)
from rollplex_jax.programs.split import BoundaryRows
from rollplex_jax.step.ops import Targets
from rollplex_jax.trace import Tracer

_PATCH_EMBED = "visual.patch_embed.proj.weight"  # the tower's first weight: its dtype is its output's (both families)


class StaleBoundaryError(RuntimeError):
    """A boundary state computed under one params version was handed to a consumer at another."""


@dataclasses.dataclass
class Boundary:
    """Prefix outputs of prefix rows [q0, q0 + B') under one params version (``arrays``: k, v [L, B', Tp, K, d],
    last [B', V], the rows' key mask [B', Tp] and next text position [B'])."""

    version: int
    arrays: BoundaryRows | None
    q0: int = 0

    @property
    def rows(self) -> range:
        return range(self.q0, self.q0 + int(self.arrays.last.shape[0]))

    def check(self, version: int, consumer: str) -> None:
        if self.version != version:
            raise StaleBoundaryError(f"{consumer}: boundary state was computed under params version {self.version} "
                                     f"but the consumer runs at version {version}; recompute the prefix")


def _boundary(version: int, out, inputs: ModelInputs, q0: int) -> Boundary:
    arrays = BoundaryRows(out[0], out[1], out[2], inputs.attention_mask.astype(bool), inputs.next_position)
    return Boundary(version, arrays, q0)


class RollplexOps:
    """Prefix/suffix scoring and gradients; the prefix programs may run during the decode.

    Life of its state: ``dispatch`` -> ``wait_prefix`` -> ``set_rollouts`` -> ``ref_logp`` -> ``after_ref``
    (reference boundary freed) -> ``grads`` of the first mini-batch -> ``after_grads`` (actor boundary and
    residuals freed) -> later mini-batches recompute -> ``drop``.
    """

    def __init__(self, cfg: Config, split, accumulate, state, prompts: Prompts, tracer: Tracer, step: int):
        self.cfg, self.sp, self.accumulate, self.tracer, self.step = cfg, split, accumulate, tracer, step
        self.version = step  # theta_k's params version: step k starts from version k (``rl_step._train``)
        g = cfg.rollout.group_size
        self.n = g if cfg.run.prefix_sharing else 1  # answers per prefix row
        self.shapes = step_shapes(cfg)
        prompts = pad_prompts(prompts, self.shapes.prefix_len(prompts.input_ids.shape[1]))
        self.micro = cfg.rl.micro_batch  # answers per suffix micro-batch (``set_rollouts``: the token budget's)
        self.rows = prompts if cfg.run.prefix_sharing else repeat_rows(cfg.model, prompts, g)
        self.n_rows = self.rows.batch_size
        self.minis = [(r.start // self.n, r.stop // self.n)
                      for r in mini_batch_rows(self.n_rows * self.n, cfg.rl.mini_batches)]
        self.chunks, self.vins = _chunks(cfg, self.rows)  # vision chunks (or None: the tower inside the prefix)
        self.frozen = cfg.optim.freeze_vision
        self.inputs = self._prepare(0, self.n_rows)
        self.state = state
        self.residuals = cfg.run.actor_prefix == "residuals"
        self.use_ref = cfg.rl.uses_reference
        self.emb = None  # frozen vision tower's embeddings (--freeze_vision) of all prefix rows
        self.actor: list[Boundary] = []  # covering all prefix rows, in order
        self.ref: Boundary | None = None
        self.kept = self.meta = None  # the residual part's vjp residuals (weights excluded) and their layout
        self.resp = self.rmask = None  # answers [prefix rows, n, Tr] (host)
        self._cache: dict[tuple[int, int], tuple] = {}
        self._dispatch_t0 = 0.0
        self._ready: tuple[threading.Thread, list[float]] | None = None  # the prefix's watcher and its end time
        self.on_live = None  # memory meter hook (``step_ops.Ops``)

    # --- host inputs -----------------------------------------------------------------------------------
    def _prepare(self, p0: int, p1: int) -> ModelInputs:
        r = self.rows if (p0, p1) == (0, self.n_rows) else select_rows(self.cfg.model, self.rows, range(p0, p1))
        opts = input_options(self.cfg)
        if self.chunks is not None:  # the rows' vision tokens' rows in the chunks' embeddings buffer
            slots = self.chunks.slots[vision_token_rows(self.cfg.model, self.rows, range(p0, p1))]
            size = slot_count(self.chunks.buffer, p1 - p0, r.input_ids.shape[1])
            opts = dataclasses.replace(opts, vision_slots=np.pad(slots, (0, size - len(slots))))
        return prepare_inputs(self.cfg.model, r.input_ids, r.attention_mask, r.pixel_values, r.image_grid_thw,
                              r.video_grid_thw, r.second_per_grid_ts, opts)

    def _part(self, p0: int, p1: int):
        """(inputs, frozen vision embeds) of prefix rows [p0, p1)."""
        if (p0, p1) == (0, self.n_rows):
            return self.inputs, self.emb
        if (p0, p1) not in self._cache:
            emb = None
            if self.chunks is not None:  # the whole buffer: the inputs' vision_slots pick the rows' tokens
                emb = self.emb
            elif self.emb is not None:
                emb = self.emb[to_device(vision_token_rows(self.cfg.model, self.rows, range(p0, p1)))]
            self._cache[(p0, p1)] = (self._prepare(p0, p1), emb)
        return self._cache[(p0, p1)]

    # --- prefix ----------------------------------------------------------------------------------------
    def dispatch(self) -> RollplexOps:
        """Asynchronously dispatches vision (if frozen), actor prefix and reference prefix under theta_k."""
        self._dispatch_t0 = self.tracer.now()
        p = self.state.params
        if self.chunks is not None:
            self.emb = self._encode(p)
        else:
            self.emb = self.sp.vision(p, self.inputs) if self.frozen else None
        first = self.minis[0] if self.residuals else (0, self.n_rows)
        parts = [first] + ([(first[1], self.n_rows)] if first[1] < self.n_rows else [])
        self.actor = []
        for q0, q1 in parts:
            inputs, emb = self._part(q0, q1)
            if self.residuals and q0 == 0:
                out = self.sp.actor_prefix(p, inputs, emb)
                self.kept, self.meta = out[3], self.sp.actor_prefix.meta(p, inputs, emb)
            else:
                out = self.sp.prefix(p, inputs, emb)
            self.actor.append(_boundary(self.version, out, inputs, q0))
        if self.use_ref:
            rp = self.state.ref_params
            emb = self._encode(rp) if self.chunks is not None and not self.frozen else self.emb
            self.ref = _boundary(self.version, self.sp.prefix(rp, self.inputs, emb), self.inputs, 0)
        self._ready = self._watch(self._prefix_outputs())
        return self

    def _encode(self, params):
        """The batch's vision embeddings buffer under ``params``: each chunk encoded, placed at its rows."""
        buf = self.sp.new_buffer((*self.chunks.shape, self.cfg.model.vision.embed_width), params[_PATCH_EMBED].dtype)
        for vin, off in zip(self.vins, self.chunks.offsets, strict=True):
            buf = self.sp.vision_into(params, vin, buf, off)
        return buf

    def _vision_grads(self, params, d_buffer, acc):
        """``acc`` plus the vision tower's gradient from the buffer's cotangent, chunk by chunk."""
        if self.chunks is None or self.frozen or d_buffer is None:
            return acc
        for vin, off in zip(self.vins, self.chunks.offsets, strict=True):
            acc = self.sp.vision_grads(acc, params, vin, d_buffer, off)
        return acc

    def _prefix_outputs(self):
        return [(b.arrays.k, b.arrays.last) for b in self.actor], None if self.ref is None else self.ref.arrays.last

    def _watch(self, outputs) -> tuple[threading.Thread, list[float]]:
        """A thread that notes when ``outputs`` are ready: while the decode holds the main thread, this is when the
        prefix programs really end (the trace's hidden vs exposed prefix time), not when the step looks."""
        end: list[float] = []

        def wait():
            jax.block_until_ready(outputs)  # releases the GIL while XLA computes
            end.append(self.tracer.now())

        t = threading.Thread(target=wait, name="prefix-ready", daemon=True)
        t.start()
        return t, end

    def wait_prefix(self) -> None:
        """Blocks until the prefix work is done; records its span (dispatch -> ready, as the watcher saw it)."""
        jax.block_until_ready(self._prefix_outputs())
        end = self.tracer.now()
        if self._ready is not None:
            thread, seen = self._ready
            thread.join()
            end, self._ready = (seen[0] if seen else end), None
        self.tracer.add("JAX prefix", "prefix", self.step, self._dispatch_t0, end)

    def set_rollouts(self, rollouts: Rollouts) -> None:
        b, g, tr = rollouts.response_ids.shape
        shape = (b * g // self.n, self.n, tr)
        self.resp = rollouts.response_ids.reshape(shape).astype(np.int32)
        self.rmask = rollouts.mask.reshape(shape) > 0
        self.micro = self.shapes.answers(self.rows.input_ids.shape[1], tr, self.n)

    # --- scoring ---------------------------------------------------------------------------------------
    def _scores(self, params, parts: list[Boundary], consumer: str):
        """Answer log-probs [B*G, Tr] under ``params`` given boundary ``parts``, one micro-batch at a time."""
        out = []
        for blk in answer_blocks(0, self.n_rows, self.n, self.micro):
            b = next(x for x in parts if blk.p0 in x.rows)
            b.check(self.version, consumer)
            lp = self.sp.suffix_logp(blk.p1 - blk.p0, params, b.arrays, blk.p0 - b.q0, self.resp[blk.index],
                                     self.rmask[blk.index])
            out.append(lp.reshape(-1, lp.shape[-1]))
        return jnp.concatenate(out)

    def ref_logp(self):
        with self.tracer.span("JAX suffix", "reference", self.step):
            return jax.block_until_ready(self._scores(self.state.ref_params, [self.ref], "reference suffix"))

    def logp(self, params):
        return self._scores(params, self.actor, "actor suffix")

    # --- gradients ---------------------------------------------------------------------------------------
    def grads(self, params, rows: slice, targets: Targets, version):
        """Gradient of the loss on answer rows ``rows`` (a mini-batch: whole prefix rows), micro-batch by
        micro-batch. Only the first mini-batch (params still theta_k) may use the precomputed prefix."""
        m0, m1 = rows.start // self.n, rows.stop // self.n
        t = targets.reshaped((m1 - m0, self.n), (self.n_rows, self.n))
        res = self.actor[0] if self.actor and self.kept is not None else None
        use_res = version == self.version and res is not None and (m0, m1) == (res.q0, res.rows.stop)
        acc, parts, ct, d_emb = None, [], None, None
        emb = None  # chunked vision, recomputed prefix: the buffer under ``params`` (theta_k's, or encoded again)
        if self.chunks is not None and not use_res:
            emb = self.emb if version == self.version or self.frozen else self._encode(params)
        for blk in answer_blocks(m0, m1, self.n, self.micro):
            ans = t.answers(to_device(self.resp[blk.index]), (slice(blk.p0 - m0, blk.p1 - m0),
                                                                 slice(blk.a0, blk.a1)), blk.index)
            if use_res:
                res.check(version, "actor update")
                g, cts, m = self.sp.suffix_grads(blk.p1 - blk.p0, params, res.arrays, blk.p0 - res.q0, ans)
                ct = tuple(jnp.zeros_like(x) for x in (res.arrays.k, res.arrays.v, res.arrays.last)) if ct is None \
                    else ct
                ct = self.sp.add_cotangent(ct, cts, blk.p0 - res.q0)
            else:
                inputs, part_emb = self._part(blk.p0, blk.p1)
                g, m, d = self.sp.grads_recompute(params, inputs, part_emb if emb is None else emb, ans)
                d_emb = d if d_emb is None else d_emb + d
            acc = g if acc is None else self.accumulate(acc, g)
            parts.append(m)
        if use_res:
            g_prefix, d_emb = self.sp.prefix_vjp(self.meta, params, self.kept, *ct)
            if self.on_live is not None:  # the fullest point: cotangents, the prefix's gradient, the sum so far
                self.on_live({**self.live(), "activations": (ct, g_prefix, d_emb), "gradients": acc})
            acc = self.accumulate(acc, g_prefix)
        return self._vision_grads(params, d_emb, acc), parts

    def slots(self) -> np.ndarray:
        """The prefix rows' (``sequences.row_slots``) plus the answers' (right-padded [rows, n, Tr], never packed)."""
        answers = np.array([int(self.rmask.sum()), self.rmask.size, self.rmask.size], np.int64)
        return row_slots(self.inputs) + answers

    # --- lifetimes ------------------------------------------------------------------------------------------
    def live(self) -> dict:
        """The boundary state and residuals still held, by buffer class."""
        kv = [(b.arrays.k, b.arrays.v, b.arrays.last) for b in [*self.actor, self.ref] if b is not None]
        return {"boundary_kv": kv or None, "prefix_residuals": self.kept,
                "other": (self.inputs, self.emb, self.vins, list(self._cache.values()))}

    def after_ref(self) -> None:
        """The reference boundary's last consumer (the reference suffix) is done: free it."""
        self.ref = None

    def after_grads(self) -> None:
        """The actor boundary's last consumer (the first mini-batch's gradient) is done: free it and the
        residuals; later mini-batches recompute the prefix under their own params."""
        self.actor, self.kept = [], None

    def drop(self) -> None:
        """Ends the life of the boundary state and residuals (their buffers are freed)."""
        self.actor, self.ref, self.kept, self.emb = [], None, None, None
        self._cache.clear()


def _chunks(cfg: Config, rows) -> tuple[Chunks | None, list[VisionInputs]]:
    """The prefix rows' vision chunks and their device inputs, or (None, []) without chunked vision (off, or no
    images or videos in the batch)."""
    spec = vision_chunk_spec(cfg)
    grids = [g for g in (rows.image_grid_thw, rows.video_grid_thw) if g is not None and len(g)]
    if spec is None or not grids:
        return None, []
    chunks = plan_chunks(np.concatenate(grids), rows.pixel_values, spec, cfg.model.vision)
    return chunks, [VisionInputs(to_device(c["pixel_values"]), {k: to_device(v) for k, v in c["layout"].items()})
                    for c in chunks.inputs]
