"""Qwen2.5-VL forward passes: ``full``, and the ``prefix``/``suffix`` split the project rests on.

``prefix`` runs the vision tower and the prompt tokens and returns every layer's
boundary KV (post-rotary keys and values of the prompt) with the prompt mask and
the text position where the response starts. ``suffix`` runs response tokens
[B, N, T] that attend to that boundary KV (shared by the N responses of a prompt,
never copied N times) and causally to themselves. For the same tokens,
``suffix(prefix(prompt), response)`` equals ``full(prompt ++ response)`` up to
float summation order (tested at 1e-5 in fp32).

Host-side preparation (M-RoPE index, vision layout, token-count checks) lives in
``prepare_inputs``; the forward functions are pure and jit-able. How they compute (attention kernel,
its block, rematerialisation) is ``ProgramConfig`` (``prog=``, default = the run's default).

Layers are unrolled, each decoder layer and vision block checkpointed by ``prog.remat``, not scanned.
A scan needs the weights stacked [L, ...]; our parameters are a flat dict of per-layer HF-named arrays
(checkpoint IO, the sharding rules by logical axes and the rollout engines' zero-copy per-layer views rely
on it), and stacking inside a program would copy every layer's weights into it. Measured (2026-12, this
2-core CPU, ``jit(value_and_grad(full_forward))`` trace + compile, text width 256, T 1024, remat
``layer``): 2.5 s at 2 layers, 4.2 s at 8, 17.0 s at 36 (0.46 s a layer); 36 text layers + 32 vision
blocks (3B's depth) 28.8 s; 64 layers extrapolate to ~31 s. A scan over stacked weights stays at
1.6-3.0 s at any depth. Accepted: each program compiles once per run (minutes at most), not per step.
Caveat, measured: XLA's CPU pipeline removes the optimization barriers of ``jax.checkpoint`` before its
last CSE pass, which merges (part of) the recomputation back into the forward: on CPU, per-layer remat
of unrolled layers saves less memory than it would on a GPU, whose pipeline removes the barriers only
after scheduling (8 layers, width 256, T 4096: temp 701 MiB without remat, 645 with ``layer`` by
default on CPU, 230 with ``layer`` and 418 with ``dots`` under
``XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander``, which keeps the barriers: use it to check
remat memory on CPU). At 36 layers, T 1024, with that flag: 140 MiB (``layer``), 363 (``dots``), 713
(``none``). The recomputation still costs time on CPU (demo model gradient: +19% FLOPs with ``layer``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from rollplex_jax.config import ModelConfig, ProgramConfig
from rollplex_jax.config.shapes import Buckets, pow2
from rollplex_jax.models.attention import KVSource
from rollplex_jax.models.family import family_of
from rollplex_jax.models.vl import packing as P
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.layers import constrain_kv, layer_params, rematerialise
from rollplex_jax.models.vl.text import (
    LayerInputs,
    decoder_layer,
    embed,
    embed_vision,
    final_norm,
    lm_logits,
)
from rollplex_jax.models.vl.vision_chunks import gather_slots


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """A batch of (left- or right-padded) token rows with their images/videos.

    input_ids, attention_mask: [B, T]; token_types: [B, T] 0 text / 1 image pad / 2 video pad;
    positions: [3, B, T] M-RoPE index;
    next_position: [B] text position after each row's last real token;
    pixel_values: [N, patch_dim] patches of all images (batch order) then all videos, or None;
    layout: ``VisionLayout.arrays()`` of the same grids, or None;
    packing: the rows' real tokens packed into fewer rows (``packing.Packing``), which the decoder then runs
      on instead of the padded arrays (outputs are returned in the padded layout), or None;
    vision_slots: [S] the row of each vision token (batch order, padded) in the embeddings the programs are
      given (the buffer of ``vision_chunks.py``; pixel_values and layout are then None), or None.
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    token_types: jax.Array
    positions: jax.Array
    next_position: jax.Array
    pixel_values: jax.Array | None = None
    layout: dict | None = None
    packing: P.Packing | None = None
    vision_slots: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixState:
    """Boundary state of B prompts: k, v [L, B, Tp, K, d], mask [B, Tp], next_position [B]."""

    k: jax.Array
    v: jax.Array
    mask: jax.Array
    next_position: jax.Array


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How ``prepare_inputs`` lays rows out beyond their tokens and images.

    ``vision_region`` [B, T]: where placeholders may be (None: everywhere; the prompt part of prompt ++ answer
    rows, since a sampled answer may contain the pad ids as plain tokens). ``groups``: the data-parallel degree
    (``fsdp``) the vision tower's patches are split over; its layout is then group-local where the items allow
    (``rope.group_layout``: every window gather within a device). ``pack``: the decoder runs on the rows' real
    tokens packed into fewer rows of the same length (``packing.py``) where that saves a row. ``buckets``
    (``--shape_buckets``): shape-stable inputs: the vision patches padded to a bucket (``_vision``; one group),
    and with ``pack`` the rows always packed, into a power-of-two count of rows of T or of a longer bucket up to
    ``pack_cap``, whichever runs fewer slots (``packing.pack_layout``)."""

    vision_region: np.ndarray | None = None
    groups: int = 1
    pack: bool = False
    buckets: Buckets | None = None
    pack_cap: int = 0  # the longest packed row with buckets (``--max_prompt_len`` + ``--max_new_tokens``)
    # the vision tokens' rows in an embeddings buffer encoded apart (``vision_chunks.Chunks.slots``): no vision
    # inputs then, the programs take the buffer as their vision embeddings
    vision_slots: np.ndarray | None = None


def prepare_inputs(
    cfg: ModelConfig,
    input_ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
    pixel_values: np.ndarray | None = None,
    image_grid_thw: np.ndarray | None = None,
    video_grid_thw: np.ndarray | None = None,
    second_per_grid_ts: np.ndarray | None = None,
    opts: InputOptions = InputOptions(),
) -> ModelInputs:
    """Checks token/grid consistency and computes positions and the vision layout (host side).

    ``pixel_values`` holds the patches of every image (in batch order) followed by those of
    every video, matching ``image_grid_thw`` then ``video_grid_thw``; ``second_per_grid_ts`` [n_videos] the
    videos' seconds per temporal grid step (M-RoPE time scale; None: 1.0 each). ``opts``: placeholder region,
    vision groups and packing (``InputOptions``).
    """
    input_ids = np.asarray(input_ids)
    attention_mask = np.ones_like(input_ids) if attention_mask is None else np.asarray(attention_mask)
    merge = cfg.vision.spatial_merge_size**2
    types = rope.token_types(input_ids, cfg, opts.vision_region)
    types[attention_mask == 0] = rope.TEXT
    grids = [g for g in (image_grid_thw, video_grid_thw) if g is not None and len(g)]
    grids = np.concatenate(grids).astype(np.int64) if grids else np.zeros((0, 3), np.int64)
    for kind, code, g in (("image", rope.IMAGE, image_grid_thw), ("video", rope.VIDEO, video_grid_thw)):
        n_tok = int((types == code).sum())
        n_feat = 0 if g is None else int(np.prod(np.asarray(g), axis=-1).sum()) // merge
        if n_tok != n_feat:
            raise ValueError(f"{kind} features and {kind} tokens do not match: {n_tok} {kind}-pad tokens in "
                             f"input_ids but the grids give {n_feat}; expand each {kind} to t*h*w/{merge} pads")
    if len(grids):
        n_patches = int(np.prod(grids, axis=-1).sum())
        if pixel_values is None or pixel_values.shape != (n_patches, cfg.vision.patch_dim):
            got = None if pixel_values is None else tuple(pixel_values.shape)
            raise ValueError(f"pixel_values has shape {got}, the grids need ({n_patches}, {cfg.vision.patch_dim})")
    n_videos = 0 if video_grid_thw is None else len(video_grid_thw)
    if second_per_grid_ts is not None and np.shape(second_per_grid_ts) != (n_videos,):
        raise ValueError(f"second_per_grid_ts has shape {np.shape(second_per_grid_ts)} for {n_videos} videos: give "
                         "one value per video_grid_thw row (seconds per temporal grid step), or None")
    positions, next_pos = rope.get_rope_index(input_ids, attention_mask, cfg, image_grid_thw, video_grid_thw,
                                              second_per_grid_ts, types)
    pixel_values, layout = _vision(cfg, grids, pixel_values, opts) if opts.vision_slots is None else (None, None)
    packed = P.pack_layout(attention_mask, opts.groups, stable=opts.buckets is not None,
                           row_lengths=_row_lengths(opts, attention_mask.shape[1])) if opts.pack else None
    return ModelInputs(
        input_ids=P.to_device(input_ids, np.int32),
        attention_mask=P.to_device(attention_mask, np.int32),
        token_types=P.to_device(types, np.int32),
        positions=P.to_device(positions),
        next_position=P.to_device(next_pos),
        pixel_values=None if layout is None else P.to_device(pixel_values, np.float32),
        layout=None if layout is None else {k: P.to_device(v) for k, v in layout.items()},
        packing=None if packed is None else P.pack(input_ids, types, np.asarray(positions), packed),
        vision_slots=None if opts.vision_slots is None else P.to_device(opts.vision_slots, np.int32),
    )


def _row_lengths(opts: InputOptions, t: int) -> list[int]:
    """The packed row lengths beside T the shape buckets offer: every bucket in (T, ``opts.pack_cap``]."""
    return [] if opts.buckets is None else opts.buckets.between(t + 1, opts.pack_cap)


def _vision(cfg: ModelConfig, grids: np.ndarray, pixel_values, opts: InputOptions):
    """(pixel_values, ``vision_forward``'s layout arrays) of the batch's items, or (None, None) without any. With
    ``opts.buckets`` the patches are padded with zero patches to a power of two merge units and the segment
    gathers to power-of-two counts and lengths (``rope.pad_layout``), in one group: what the programs see then
    depends on a few powers of two only. The window count is tied to the unit count (at least units / (window / 2)
    windows, more only when the items need it): a batch's patch count and windows vary together with its images,
    and each new combination compiles every prefix program again (measured, ``launch.bench_shapes``, WORKSPACE.md
    "Shape-stable batches"); the padded windows cost at most twice the window attention's slots. The longest frame
    is not tied to the units (a floor of units / 2 saved 3 of 34 compiles in the bench but multiplied the
    full-frame attention of a batch of 16 small images by 64): frames x frame length stays within 2x of the
    units per frame."""
    if not len(grids):
        return None, None
    layout = rope.vision_layout(grids, cfg.vision)
    if opts.buckets is None:
        return pixel_values, layout.arrays(opts.groups)
    unit = cfg.vision.spatial_merge_size**2
    units, window = pow2(len(layout.window_index)), cfg.vision.merger_window**2
    windows = max(pow2(len(layout.window_gather)), units // max(1, window // 2))  # windows half full on average
    frame = pow2(layout.frame_gather.shape[1], cap=units)
    layout = rope.pad_layout(layout, units, windows, window, pow2(len(layout.frame_gather)), frame, unit)
    pad = np.zeros((units * unit - len(pixel_values), pixel_values.shape[1]), pixel_values.dtype)
    return np.concatenate([pixel_values, pad]), rope.single_group(layout)


def encode_vision(params: dict, cfg: ModelConfig, inputs: ModelInputs, *,
                  prog: ProgramConfig = ProgramConfig()) -> jax.Array | None:
    """The vision tower over the batch's images/videos: [n_vision_tokens, embed_width], or None without any."""
    if inputs.pixel_values is None:
        return None
    return family_of(cfg).vision_forward()(params, cfg.vision, inputs.pixel_values, inputs.layout, prog=prog)


def _layer_fn(cfg: ModelConfig, prog: ProgramConfig, i: int, p, h, inp: LayerInputs, prefix):
    """Layer i, with the prefix's boundary KV (whole [L, ...] arrays: sliced here, inside the checkpoint,
    so a remat'd layer keeps no slice of its own as a residual)."""
    extra = [] if prefix is None else [KVSource(prefix.k[i], prefix.v[i], prefix.mask)]
    return decoder_layer(p, i, h, inp, extra, cfg.text, prog=prog)


def _decoder(params, cfg: ModelConfig, h, inp: LayerInputs, prefix: PrefixState | None, prog: ProgramConfig,
             deepstack: list | None = None):
    """Runs all layers on h [B, N, T, D] (``inp``: rotation, tokens' validity [B, N, T] and packed rows' segment
    ids; attending to ``prefix``'s KV if given); returns final-normed h, per-layer outputs and (k, v).
    ``deepstack`` (Qwen3-VL, ``text.embed_vision``): [B, N, T, D] added to the output of layer k after it
    is recorded (transformers records the layer's own output). Unrolled, one checkpoint per layer (module
    docstring: why not a scan)."""
    hidden, kvs = [], []
    for i in range(cfg.text.num_hidden_layers):
        layer = rematerialise(functools.partial(_layer_fn, cfg, prog, i), prog.remat)
        h, kv = layer(layer_params(params, f"model.layers.{i}."), h, inp, prefix)
        hidden.append(h)
        kvs.append(kv)
        if deepstack and i < len(deepstack):
            h = h + deepstack[i].astype(h.dtype)
    return final_norm(params, h, cfg.text), hidden, kvs


def _rows_forward(params: dict, cfg: ModelConfig, inputs: ModelInputs, vision_embeds, prog: ProgramConfig):
    """Causal decoder over whole rows (vision tokens scattered in): final-normed h [B, T, D],
    per-layer outputs and per-layer (k, v), each with a singleton response axis dropped; over the packed rows
    ([P, T, ...]) when ``inputs.packing`` is set (``_to_rows`` brings an output back to the padded layout)."""
    if vision_embeds is None:
        vision_embeds = encode_vision(params, cfg, inputs, prog=prog)
    elif inputs.vision_slots is not None:  # a buffer of chunks' embeddings: the batch's tokens in batch order
        vision_embeds = gather_slots(vision_embeds, inputs.vision_slots)
    pk = inputs.packing
    src = inputs if pk is None else pk
    index = None if pk is None else pk.vision_index
    h, deepstack = embed_vision(params, cfg, src.input_ids, vision_embeds, src.token_types, index)
    h, deepstack = h[:, None], [x[:, None] for x in deepstack]
    cos, sin = rope.mrope_cos_sin(src.positions, cfg.text, h.dtype)
    if pk is None:
        valid, segments = inputs.attention_mask[:, None].astype(bool), None  # [B, 1, T]; left padding
    else:
        segments = pk.segments[:, None]  # [P, 1, T]
        valid = segments >= 0
    h, hidden, kvs = _decoder(params, cfg, h, LayerInputs(cos[:, None], sin[:, None], valid, segments), None, prog,
                              deepstack)
    return h[:, 0], [x[:, 0] for x in hidden], [(k[:, 0], v[:, 0]) for k, v in kvs]


def _to_rows(inputs: ModelInputs, x: jax.Array, window=None) -> jax.Array:
    """An output of ``_rows_forward`` [B or P, T, ...] in the padded layout [B, T, ...] (positions
    [start, start + length) only for ``window=(start, length)``)."""
    if inputs.packing is not None:
        return P.unpack_rows(x, inputs.packing, window)
    return x if window is None else jax.lax.dynamic_slice_in_dim(x, window[0], window[1], axis=1)


def full_forward(params: dict, cfg: ModelConfig, inputs: ModelInputs, vision_embeds=None,
                 return_hidden: bool = False, *, prog: ProgramConfig = ProgramConfig(), logits_window=None):
    """Plain causal forward over whole rows. Returns fp32 logits [B, T, V] (and per-layer hidden).

    ``logits_window=(start, length)``: the logits of positions [start, start + length) only ([B, length, V];
    ``start`` may be traced, ``length`` static): the vocabulary projection of the other positions (a prompt's
    thousands of tokens x V floats) is never computed."""
    h, hidden, _ = _rows_forward(params, cfg, inputs, vision_embeds, prog)
    logits = lm_logits(params, _to_rows(inputs, h, logits_window), cfg)
    return (logits, [_to_rows(inputs, x) for x in hidden]) if return_hidden else logits


def prefix_forward(params: dict, cfg: ModelConfig, inputs: ModelInputs, vision_embeds=None, *,
                   prog: ProgramConfig = ProgramConfig()):
    """Prompt rows -> (PrefixState, fp32 logits [B, V] at each row's last real token)."""
    h, _, kvs = _rows_forward(params, cfg, inputs, vision_embeds, prog)
    b, t = inputs.input_ids.shape
    last = t - 1 - jnp.argmax(inputs.attention_mask[:, ::-1], axis=1)
    if inputs.packing is None:
        h_last = h[jnp.arange(b), last]
    else:
        h_last = h.reshape(-1, h.shape[-1])[inputs.packing.unpack[jnp.arange(b), last]]
    last_logits = lm_logits(params, h_last, cfg)
    state = PrefixState(
        k=jnp.stack([constrain_kv(_to_rows(inputs, k)) for k, _ in kvs]),
        v=jnp.stack([constrain_kv(_to_rows(inputs, v)) for _, v in kvs]),
        mask=inputs.attention_mask.astype(bool),
        next_position=inputs.next_position,
    )
    return state, last_logits


def suffix_forward(params: dict, cfg: ModelConfig, state: PrefixState, response_ids: jax.Array,
                   response_mask: jax.Array, *, prog: ProgramConfig = ProgramConfig()) -> jax.Array:
    """Responses [B, N, Tr] (right-padded) over a shared prefix -> fp32 logits [B, N, Tr, V].

    Logit t predicts response token t+1; the first response token is predicted by the
    prefix's ``last_logits``. Every layer attends to the prefix's KV [B, Tp, K, d] (no N axis,
    masked by ``state.mask`` [B, Tp]) and causally to the responses' own keys, in one softmax.
    """
    b, n, t = response_ids.shape
    h = embed(params, cfg, response_ids, None)
    pos = rope.text_positions(state.next_position, t)[:, :, None, :]  # [3, B, 1, Tr]
    cos, sin = rope.mrope_cos_sin(pos, cfg.text, h.dtype)
    h, _, _ = _decoder(params, cfg, h, LayerInputs(cos, sin, response_mask.astype(bool)), state, prog)
    return lm_logits(params, h, cfg)


def gather_logprobs(logits: jax.Array, token_ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Log-probs of ``token_ids`` under ``logits`` [..., V] (log-softmax, picked), 0 where ``mask`` is 0. The
    programs pass logits already divided by the rollout's temperature (``programs.actor.Spec``)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, token_ids[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(mask > 0, picked, 0.0)


def predicting_logits(last_logits: jax.Array, suffix_logits: jax.Array) -> jax.Array:
    """The logits [B, N, Tr, V] that predict each response token over a shared prefix: token 0 by the prefix's
    last logits [B, V] (shared by the N answers), token t by suffix logit t-1."""
    b, n, _, v = suffix_logits.shape
    first = jnp.broadcast_to(last_logits[:, None, None, :], (b, n, 1, v))
    return jnp.concatenate([first, suffix_logits[:, :, :-1]], axis=2)


def suffix_logprobs(last_logits: jax.Array, suffix_logits: jax.Array, response_ids: jax.Array,
                    response_mask: jax.Array) -> jax.Array:
    """Log-probs [B, N, Tr] of each response token over a shared prefix (0 at padding), under its
    ``predicting_logits``."""
    return gather_logprobs(predicting_logits(last_logits, suffix_logits), response_ids, response_mask)
