"""Programs of the Rollplex schedule: prefix work that may run while the rollout decodes, and suffixes.

The loss is the serial one (``actor.objective``) computed through the split: the prompt's boundary
KV comes from a *prefix* program, the answers' log-probs from a *suffix* program that attends to it.
The actor's prefix either keeps its autograd residuals (``jax.vjp`` inside jit) or keeps only the
boundary KV and is recomputed inside the update (``--actor_prefix=recompute``). Either way the
gradient is the full gradient: suffix gradients plus ``prefix_vjp(d boundary KV)``, which reaches the
decoder's prompt positions, the merger and the vision tower.

Every log-prob is of ``softmax(logits / T)`` at the rollout's temperature (``actor.Spec``), the prefix's last
logits (which predict each answer's first token) included. Every suffix program runs one micro-batch: answers
``[size, n, Tr]`` (``actor.Answers``) of prefix rows ``[p0, p0 + size)`` of a boundary (``BoundaryRows``); the
boundary's rows are taken inside the program (no host copy), so a micro-batch costs its own rows: by
``dynamic_slice``, or on a mesh whose ``fsdp`` axis splits the rows by a one-hot contraction (``_take_rows``:
XLA partitions a dynamic slice of a split axis at a traced offset by gathering the whole array on every
device, measured at Qwen2.5-VL-32B on fsdp 4 x tp 8: the scoring program held all 32 prompts' boundary KV,
6 GiB per device; the contraction reads each device's own rows and sums the micro-batch's over fsdp, exactly:
one product by 1 and zeros). Cotangents of the boundary are accumulated over the micro-batches of a mini-batch
and the prefix's vjp runs once, at the end.

No weights in the saved state: ``jax.vjp`` keeps every linear weight among its residuals (the
backward of ``x @ W`` reads ``W``) and a jit output never aliases a non-donated input, so returning the
vjp would copy the weights. ``ResidualPrefix`` returns only the residuals that are not parameters
(found by identity while tracing) and ``prefix_vjp`` takes the params again to rebuild the vjp.

| program (``SplitPrograms``) | donates         | notes                                                      |
|-----------------------------|-----------------|------------------------------------------------------------|
| ``vision``                  | nothing         | frozen vision tower: encoded once, shared by actor and ref |
| ``prefix``                  | nothing         | (k, v, last) of prompt rows: reference; actor without vjp  |
| ``actor_prefix``            | nothing         | (k, v, last, residuals without weights) under theta_k      |
| ``suffix_logp``             | nothing         | a micro-batch's answer log-probs given a boundary state    |
| ``suffix_grads``            | nothing         | a micro-batch's loss -> grads w.r.t. params and boundary   |
| ``add_cotangent``           | the accumulator | adds a micro-batch's boundary cotangents at its rows       |
| ``prefix_vjp``              | nothing         | params + residuals + boundary cotangents -> prefix grads   |
| ``grads_recompute``         | nothing         | a micro-batch's gradient with its prefix recomputed inside |
| ``vision_into``             | the buffer      | a vision chunk encoded into the batch's embeddings buffer  |
| ``vision_grads``            | the accumulator | adds a vision chunk's tower gradient (buffer's cotangent)  |

With chunked vision (``models/vl/vision_chunks.py``, the default under shape buckets) the tower runs
apart, in fixed-shape chunks, into one embeddings buffer: the prefix programs take the buffer (``emb``) and
their inputs' ``vision_slots``; the actor's prefix vjp and ``grads_recompute`` also return the buffer's
cotangent, which ``vision_grads`` takes through the tower chunk by chunk (its forward recomputed: one more
vision forward per chunk, no vision residuals held between the programs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, ProgramConfig, RlConfig
from rollplex_jax.models.vl.layers import compiler_options, fsdp_size
from rollplex_jax.models.vl.model import (
    ModelInputs,
    PrefixState,
    encode_vision,
    gather_logprobs,
    predicting_logits,
    prefix_forward,
    suffix_forward,
)
from rollplex_jax.models.vl.vision_chunks import constrain_buffer, read_chunk, write_chunk
from rollplex_jax.parallel.mesh import constrain_like_params
from rollplex_jax.programs.actor import Answers, Spec, objective


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BoundaryRows:
    """A prefix program's outputs for prefix rows, as the suffix programs take them: k, v [L, B, Tp, K, d] (every
    layer's boundary KV), last [B, V] (raw logits at each row's last prompt token), mask [B, Tp] (the rows' key
    mask), next_pos [B] (the text position where the answers start)."""

    k: jax.Array
    v: jax.Array
    last: jax.Array
    mask: jax.Array
    next_pos: jax.Array

    def state(self) -> PrefixState:
        return PrefixState(self.k, self.v, self.mask, self.next_pos)


def _prefix(cfg: ModelConfig, prog: ProgramConfig, params, inputs: ModelInputs, vision_embeds):
    """(k, v, last_logits) of the prompts; the vision tower runs inside unless embeds are given."""
    state, last = prefix_forward(params, cfg, inputs, vision_embeds=vision_embeds, prog=prog)
    return state.k, state.v, last


def _signature(tree) -> tuple:
    """Hashable structure + shapes + dtypes of a pytree (the key of one trace of a program)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


class ResidualPrefix:
    """The actor prefix under ``jax.vjp``: ``(k, v, last, kept)`` where ``kept`` are the vjp's residuals that
    are not parameters. ``meta(params, inputs, emb)`` gives what ``prefix_vjp`` needs to rebuild the vjp:
    the residuals' tree structure and, per residual leaf, the parameter it is (or None), recorded when the
    program was traced for those shapes."""

    def __init__(self, cfg: ModelConfig, prog: ProgramConfig = ProgramConfig()):
        self.cfg, self.prog = cfg, prog
        self._meta: dict = {}
        self.program = jax.jit(self._run, compiler_options=compiler_options(prog.remat))

    def _run(self, params, inputs, emb):
        if inputs.vision_slots is None:  # vision inside (or frozen embeddings): the params' cotangent only
            (k, v, last), vjp = jax.vjp(lambda p: _prefix(self.cfg, self.prog, p, inputs, emb), params)
        else:  # chunked vision: the embeddings' cotangent too (``vision_grads`` takes it to the tower)
            (k, v, last), vjp = jax.vjp(lambda p, e: _prefix(self.cfg, self.prog, p, inputs, e), params, emb)
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        by_id = {id(a): name for name, a in params.items()}
        names = tuple(by_id.get(id(leaf)) for leaf in leaves)
        self._meta[_signature((params, inputs, emb))] = (treedef, names)
        return k, v, last, [leaf for leaf, name in zip(leaves, names, strict=True) if name is None]

    def __call__(self, params, inputs, emb):
        return self.program(params, inputs, emb)

    def meta(self, params, inputs, emb):
        return self._meta[_signature((params, inputs, emb))]

    def lower(self, *args):
        return self.program.lower(*args)

    def wrapped(self, wrap) -> ResidualPrefix:
        """The same program (and recorded layouts) with ``wrap`` around the jitted call (memory tracking)."""
        out = object.__new__(ResidualPrefix)
        out.cfg, out.prog, out._meta, out.program = self.cfg, self.prog, self._meta, wrap(self.program)
        return out


def _prefix_vjp(cfg, meta, params, kept, gk, gv, glast):
    """(the prefix's gradient w.r.t. params, w.r.t. the vision embeddings' buffer or None) from its boundary
    cotangents; the vjp rebuilt from ``kept`` and the params (``meta``: static, see ``ResidualPrefix``)."""
    treedef, names = meta
    it = iter(kept)
    leaves = [params[name] if name is not None else next(it) for name in names]
    cts = jax.tree_util.tree_unflatten(treedef, leaves)((gk, gv, glast))
    return constrain_like_params(cts[0], cfg), (constrain_buffer(cts[1]) if len(cts) > 1 else None)


def _one_hot(size: int, p0, rows: int, dtype) -> jax.Array:
    """[size, rows]: 1 where column == p0 + row."""
    return (jnp.arange(rows)[None, :] == p0 + jnp.arange(size)[:, None]).astype(dtype)


def _take_rows(a, p0, size: int):
    """Rows [p0, p0 + size) of k or v [L, B, Tp, K, d] (see the module doc)."""
    if fsdp_size() == 1:
        return jax.lax.dynamic_slice_in_dim(a, p0, size, axis=1)
    return jnp.einsum("sb,lbtkd->lstkd", _one_hot(size, p0, a.shape[1], a.dtype), a,
                      precision=jax.lax.Precision.HIGHEST)


def _add_rows(a, x, p0):
    """a [L, B, Tp, K, d] with x [L, size, Tp, K, d] added at rows [p0, p0 + size): ``_take_rows``' transpose."""
    if fsdp_size() == 1:
        cur = jax.lax.dynamic_slice_in_dim(a, p0, x.shape[1], axis=1)
        return jax.lax.dynamic_update_slice_in_dim(a, cur + x, p0, axis=1)
    return a + jnp.einsum("sb,lstkd->lbtkd", _one_hot(x.shape[1], p0, a.shape[1], a.dtype), x.astype(a.dtype),
                          precision=jax.lax.Precision.HIGHEST)


def _rows(size: int, p0, rows: BoundaryRows) -> BoundaryRows:
    """Rows [p0, p0 + size) of a boundary: along axis 1 of k, v ([L, B, ...]), axis 0 of the others."""
    return jax.tree.map(lambda a: _take_rows(a, p0, size) if a.ndim == 5
                        else jax.lax.dynamic_slice_in_dim(a, p0, size, axis=0), rows)


def _logp(spec: Spec, params, rows: BoundaryRows, response_ids, response_mask):
    """(answer log-probs, the temperature-scaled logits that predicted them) of [b, n, Tr] answers over their
    prefix rows' boundary."""
    logits = suffix_forward(params, spec.model, rows.state(), response_ids, response_mask, prog=spec.prog)
    pred = predicting_logits(rows.last, logits) / spec.temperature
    return gather_logprobs(pred, response_ids, response_mask), pred


def _suffix_logp(spec: Spec, size: int, params, rows: BoundaryRows, p0, response_ids, response_mask):
    return _logp(spec, params, _rows(size, p0, rows), response_ids, response_mask)[0]


def _suffix_loss(spec: Spec, params, rows: BoundaryRows, answers: Answers):
    """The serial objective (``actor.objective``) on [b, n, Tr] answers over their prefix rows' boundary."""
    logp, pred = _logp(spec, params, rows, answers.ids, answers.weights > 0)
    return objective(spec.rl, logp, pred, answers)


def _suffix_grads(spec: Spec, size: int, params, rows: BoundaryRows, p0, answers: Answers):
    """A micro-batch's suffix gradients w.r.t. params and its rows' boundary (k, v, last)."""
    rows = _rows(size, p0, rows)

    def loss_fn(p, k, v, last):
        return _suffix_loss(spec, p, dataclasses.replace(rows, k=k, v=v, last=last), answers)

    (_, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3), has_aux=True)(
        params, rows.k, rows.v, rows.last)
    return constrain_like_params(grads[0], spec.model), grads[1:], metrics


def _add_cotangent(acc, g, p0):
    """acc (gk, gv, glast) over all prefix rows += a micro-batch's cotangents at rows [p0, p0 + size)."""
    def add(a, x):
        if a.ndim == 5:
            return _add_rows(a, x, p0)
        cur = jax.lax.dynamic_slice_in_dim(a, p0, x.shape[0], axis=0)
        return jax.lax.dynamic_update_slice_in_dim(a, cur + x, p0, axis=0)
    return tuple(add(a, x) for a, x in zip(acc, g, strict=True))


def _grads_recompute(spec: Spec, params, inputs, vision_embeds, answers: Answers):
    """(gradient, metrics, the vision embeddings buffer's cotangent or None) of a micro-batch with its prefix
    forward recomputed inside (``inputs``: its prompt rows; chunked vision: the buffer's cotangent goes on to
    ``vision_grads``)."""
    def loss_fn(p, e):
        k, v, last = _prefix(spec.model, spec.prog, p, inputs, e)
        rows = BoundaryRows(k, v, last, inputs.attention_mask.astype(bool), inputs.next_position)
        return _suffix_loss(spec, p, rows, answers)

    chunked = inputs.vision_slots is not None
    (_, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1) if chunked else 0, has_aux=True)(
        params, vision_embeds)
    grads, d_emb = grads if chunked else (grads, None)
    return constrain_like_params(grads, spec.model), metrics, constrain_buffer(d_emb)


def _vision_part(params) -> tuple[dict, dict]:
    """(the vision tower's params, the others)."""
    vis = {k: v for k, v in params.items() if k.startswith("visual.")}
    return vis, {k: v for k, v in params.items() if k not in vis}


def _vision_grads(cfg: ModelConfig, prog: ProgramConfig, acc, params, vin, d_buffer, offset):
    """``acc`` (a params-shaped gradient, donated) plus the vision tower's gradient from one chunk
    (``vision_chunks.VisionInputs``) and the cotangent of the embeddings buffer at its slot ``offset``
    (``vision_chunks.read_chunk``): the tower's forward recomputed, then its vjp."""
    vis, rest = _vision_part(params)
    d = read_chunk(d_buffer, offset, *vin.layout["window_index"].shape[::-1])
    _, vjp = jax.vjp(lambda v: encode_vision({**rest, **v}, cfg, vin, prog=prog), vis)
    g = vjp(d)[0]
    return constrain_like_params({k: acc[k] + g[k] if k in g else acc[k] for k in acc}, cfg)


def _vision_into(cfg: ModelConfig, prog: ProgramConfig, params, vin, buffer, offset):
    """The embeddings buffer (donated) with one chunk's embeddings under ``params`` written from its slot
    ``offset`` (``vision_chunks.write_chunk``: each batch shard's parts into its own rows)."""
    emb = encode_vision(params, cfg, vin, prog=prog)
    return write_chunk(buffer, emb, offset, vin.layout["window_index"].shape[0])


def _new_buffer(shape: tuple[int, ...], dtype) -> jax.Array:
    """A zero embeddings buffer [slots, groups x units, W], split over the batch shards from the start (a whole
    one, made on one device, would hold it all there)."""
    return constrain_buffer(jnp.zeros(shape, dtype))


@dataclasses.dataclass(frozen=True)
class SplitPrograms:
    vision: Callable
    prefix: Callable  # (params, inputs, emb) -> (k, v, last)
    actor_prefix: ResidualPrefix  # (k, v, last, kept residuals)
    suffix_logp: Callable  # (size, params, rows: BoundaryRows, p0, ids, mask) -> [size, n, Tr]
    suffix_grads: Callable  # (size, params, rows: BoundaryRows, p0, answers: Answers) -> (grads, (gk, gv, glast), m)
    add_cotangent: Callable
    prefix_vjp: Callable  # (meta, params, kept, gk, gv, glast)
    grads_recompute: Callable  # (params, inputs, emb, answers: Answers) -> (grads, metrics, d_emb)
    vision_into: Callable  # (params, vin, buffer, offset) -> buffer (donated) with a vision chunk's embeddings
    vision_grads: Callable  # (acc, params, vin, d_buffer, offset) -> acc (donated) + a chunk's tower gradient
    new_buffer: Callable  # (shape, dtype) -> a zero embeddings buffer, split as ``vision_into`` keeps it


def make_split_programs(cfg: ModelConfig, rl: RlConfig, prog: ProgramConfig = ProgramConfig(), *,
                        temperature: float) -> SplitPrograms:
    """Builds (jits) the Rollplex programs once (``prog``: attention kernel and remat; ``temperature``: the
    rollout's training temperature, ``actor.Spec``: every log-prob is of softmax(logits / T)). ``size`` (prefix
    rows of a micro-batch) and ``meta`` are static: one compilation per micro-batch size, the boundary sliced
    inside."""
    spec = Spec(model=cfg, prog=prog, rl=rl, temperature=temperature)
    jit = functools.partial(jax.jit, compiler_options=compiler_options(prog.remat))
    return SplitPrograms(
        vision=jit(lambda params, inputs: encode_vision(params, cfg, inputs, prog=prog)),
        prefix=jit(functools.partial(_prefix, cfg, prog)),
        actor_prefix=ResidualPrefix(cfg, prog),
        suffix_logp=jit(functools.partial(_suffix_logp, spec), static_argnums=0),
        suffix_grads=jit(functools.partial(_suffix_grads, spec), static_argnums=0),
        add_cotangent=jax.jit(_add_cotangent, donate_argnums=0),
        prefix_vjp=jit(functools.partial(_prefix_vjp, cfg), static_argnums=0),
        grads_recompute=jit(functools.partial(_grads_recompute, spec)),
        vision_into=jit(functools.partial(_vision_into, cfg, prog), donate_argnums=2),
        vision_grads=jit(functools.partial(_vision_grads, cfg, prog), donate_argnums=0),
        new_buffer=jax.jit(_new_buffer, static_argnums=(0, 1)),
    )
