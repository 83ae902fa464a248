"""Analytic per-device memory of one RL step, per phase and buffer class, from a ``Config`` alone.

``plan(cfg, lengths, devices)`` predicts the bytes each buffer class of ``memory_classes.CLASSES``
occupies on one device in each phase of ``memory_classes.PHASES`` (rollout, score, train, update),
for two layouts:

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
  and master weights are resident, or (``cfg.memory.optimizer_policy == 'offload'``) in host memory
  outside ``update`` and streamed through the device one chunk of 1/``cfg.memory.optimizer_chunks`` at
  a time during ``update``; the engine's KV cache exists only during the rollout; the rollout engine
  reads the actor's compute weights (no copy) except for a rebuilt part (see ASSUMPTION below).

Mesh and sharding (``D`` = devices, ``--plan_devices``, default ``mesh.train_fsdp * mesh.train_tp``):
- data-parallel replicas ``dp = D / (fsdp * tp)``; the batch is split over ``D / tp`` shards (FSDP
  shards the batch as well as the params); activations are further divided by ``tp`` (tensor
  parallelism with sequence parallelism: heads, MLP columns and the residual stream are all split);
- compute weights (``cfg.model.dtype``), gradients (same dtype as the params) and reference weights
  are sharded over ``fsdp * tp``; the reference is skipped entirely when ``cfg.rl.kl_mode == 'off'``;
- fp32 master weights (only when the dtype is not float32) and Adam's two fp32 moments are sharded
  over all ``D`` devices (distributed optimizer / ZeRO-1, as Megatron's distributed optimizer);
  moments cover trainable params only (not the vision tower with ``--freeze_vision``);
- the rollout engine runs ``D / rollout_tp`` replicas; each decodes
  ``rows = min(B * G / (D / rollout_tp), rollout.max_batch)`` sequences at once.

Sizes (P params, b = dtype bytes, L decoder layers, K kv heads, d head dim, V vocabulary,
Tp / Tv / Tr prompt / vision / answer tokens per row from ``Lengths``, kv heads per device
``max(1, ceil(K / tp))``):
- rollout KV per device = rows x (Tp + Tr) x L x 2 x K_dev(rollout_tp) x d x b (no prompt sharing
  inside the engine: an upper bound for vLLM's prefix caching);
- boundary KV per device = (actor + reference) [L, B', Tp, K_dev(tp), d] x 2 (k, v) x b + the last
  logits [B', V] fp32, B' = B (prefix sharing) or B * G, rows divided over the D / tp batch shards;
- rollout weights: naive = P x b / rollout_tp (a full second copy);
  rollplex: the engine-owned (rebuilt) bytes of the per-tensor classification (``sharing.py``, the
  largest of any device); aligned and view tensors alias the actor's compute weights. (Before issue 7
  this was assumed to be ``max(0, P / rollout_tp - P / (fsdp * tp)) x b``, the part not held locally:
  ``remote_bytes_per_device`` of the classification, a lower bound for an engine that takes split pieces.)

Prefix residuals (the pytree ``jax.vjp`` returns from the actor prefix program), per device: the
saved activations of the prefix forward over B'/(D/tp) prompt rows, divided by tp, plus a copy of
every linear weight the backward reads (jit outputs never alias non-donated inputs in JAX: measured
on CPU, the returned weights are fresh buffers), divided by fsdp*tp, plus the patches (cast to the
dtype). Per decoder layer over r rows of t tokens (attending tk keys), per element counts read from
the program's jaxpr (``tests/launch/test_plan.py`` checks the total against ``jax.eval_shape`` of
``programs.split._actor_prefix_residuals`` within 15%):
  r t [5 D b + 2 D 4 (fp32 norm inputs) + 4 x 4 (norm statistics) + 4 d b (rotary tables)
       + 6 F b (SwiGLU) + (H + 2 K) d b (rotated q, k and v)]
  + attention: dense: r H t tk (2 x 4 + b + 1) (fp32 scores and probs, cast probs, mask) + 2 r H t 4;
               flash: r H t 4 (log-sum-exp);
per vision block over n patches (width dv, MLP Fv, hv heads of dh): the same pattern
  n [5 dv b + 2 dv 4 + 4 x 4 + 2 dh 4 + 3 dv b + 6 Fv b] + dense (attention gathered per segment: a
  window, or one image at full-attention blocks; g segments padded to s patches, square images
  assumed): hv g s^2 (2 x 4 + b + 1) + 2 hv g s 4 + 3 g s hv dh b (gathered q, k, v); flash: hv n 4;
plus the final norm / last-token logits input, the vision merger (5 [n/4, 4 dv] tensors) and the
index arrays. With per-layer activation checkpointing (``remat='layer'``) only each layer's and
block's input ([r, t, D] and [n, dv] in the dtype), the rotary tables and masks are saved.

Activations (phase-local temporaries of the largest program in a phase), per device:
- ``layer_temp(r, t, tk)`` = r t (3 F + (H + 2 K) d + 3 D) b + attention (dense: r H t tk (8 + b);
  flash: r H t 4 + r t H d 4), a vision block likewise; a backward step holds one more such working set beside
  the saved activations, which it frees layer by layer (BWD_FACTOR = 1, calibrated against XLA's buffer
  assignment of the tiny demo's programs: tests/test_memory.py, planned vs measured within 15%);
- rollout: the engine's decode temporaries (rows x V fp32 logits and sampling probs) or one prefill
  chunk (``ProgramModel.prefill_chunk`` tokens through a layer, plus one prompt's vision encoder),
  whichever is larger; rollplex adds the prefix programs' working set running beside it (one layer
  of the prefix forward over the prompt rows, and two residual streams);
- score: the reference forward over one micro-batch: naive over full sequences (vision tower per
  row, fp32 logits [rows, Tp + Tr, V/tp] and their log-softmax), rollplex the suffix only
  (logits over Tr);
- train: forward + backward over one micro-batch of ``cfg.rl.micro_batch`` rows (global, i.e.
  ceil(micro_batch / (D / tp)) rows per device): saved activations (the residual formula above,
  no weight copy inside one program), the backward's layer working set, the fp32 logits, their
  cotangent and log-softmax, and one gradient-sized buffer (the micro-batch's gradient before it
  is added to the accumulator, or the suffix and prefix parts before they are added); rollplex:
  the suffix over Tr tokens attending Tp + Tr keys, the prefix vjp over the prompt rows and the
  boundary-KV cotangents (with ``--actor_prefix=recompute``, also the recomputed prefix's saved
  activations);
- update: the clipped gradients (a copy) and the fp32 AdamW temporaries (cast gradients and the
  update) over the optimizer shard: all of it at once (naive), one chunk at a time (rollplex).
- other: the prompts' inputs (fp32 patches, ids, masks, positions) and the rollouts; naive keeps
  per-sample inputs (each prompt's patches repeated for its G answers, as the serial schedule's
  micro-batches are built up front).

Programs (``ProgramModel``): the attention kernel (``dense`` materialises [heads, Tq, Tk] scores,
``flash`` is a memory-efficient kernel) and activation checkpointing (``none`` / ``layer``).
``CURRENT_PROGRAMS`` (dense, none) are today's JAX programs (the calibrated case);
``DEFAULT_PROGRAMS`` (flash, layer) are what a GPU run at scale needs and what the paper's stack
(Megatron-Core with FlashAttention and activation recompute, vLLM) does; every plan lists which
it used in its assumptions.

To compare a plan with the memory today's programs measure (``rollplex_jax.memory``), pass
``programs=CURRENT_PROGRAMS``: at scale they keep every residual (no activation is recomputed) and
materialise attention scores, which is why the default plans the programs a GPU run needs.

Naive colocation vs the paper's "about 165 GiB per GPU" (Qwen2.5-VL-32B, 32 x H800): with
``configs/qwen2_5_vl_32b_h800x32.flags`` this planner gives about 86 GiB (dense attention with
per-layer recompute: about 100 GiB). The numbers are not tuned to match; the gap is in assumptions
the paper does not state: we shard the fp32 master weights and Adam moments over all 32 GPUs
(distributed optimizer; sharded over the TP group only they are 46.7 GiB instead of 11.7: +35 GiB),
keep gradients in bf16 (Megatron's fp32 main-grad buffers: +7.8 GiB), count the rollout KV cache of
exactly the sequences a replica decodes (vLLM reserves a pool of gpu_memory_utilization x HBM),
train on one sequence per GPU per micro-batch with a memory-efficient attention kernel and per-layer
recompute, and our naive layout by definition holds no boundary KV (the paper's co-residence count
includes it).

Everything here is a pure function of the config (and the lengths, device count and program
model): the runtime calls ``choose_optimizer_policy`` with the same inputs to decide whether to
offload the optimizer state, or to refuse to start naming the smallest budget that fits.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

from rollplex_jax.config import Config, ModelConfig
from rollplex_jax.memory_classes import CLASSES, PHASES

LAYOUTS = ("naive_colocation", "rollplex")
ATTENTIONS = ("dense", "flash")
REMATS = ("none", "layer")
KiB, MiB, GiB = 2**10, 2**20, 2**30
_F32 = 4
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
# Layer working sets a backward step holds beside the saved activations (see the module doc).
BWD_FACTOR = 1

WEIGHT_SHARING_RULE = (
    "rollout weights: per-tensor classification (rollplex_jax/sharing.py) of the engine's tensors against the "
    "training shards on each device (rank r of rollout replica j on training device j*rollout_tp + r): aligned "
    "and view tensors alias the actor's compute weights, rebuilt ones (fused, resharded, padded) are "
    "engine-owned buffers; rollout_weights = the largest rebuilt bytes of any device")


def sharing_classification(cfg: Config) -> dict:
    """The weight-sharing classification of the config's train mesh and rollout TP (vLLM's layout for
    --engine=vllm or rollout_tp > 1, else the transformers engine's), without the per-device list."""
    return copy.deepcopy(_classification(cfg.model, cfg.mesh, cfg.rollout.engine))


@functools.lru_cache(maxsize=8)
def _classification(model: ModelConfig, mesh, engine: str) -> dict:
    from rollplex_jax import sharing

    rep = sharing.plan_sharing(model, mesh, engine=engine).report()
    per = rep.pop("per_device")
    rep["per_device_max"] = {k: max(d["bytes"][k] for d in per) for k in sharing.KINDS}
    return rep


class BudgetError(ValueError):
    """No optimizer policy fits the per-device budget; the message names the smallest budget that fits."""


def human_bytes(n: float, round_up: bool = False) -> str:
    """Bytes as GiB / MiB / KiB / B with two decimals (``round_up``: never below the exact value)."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            x = n / size
            x = math.ceil(x * 100 - 1e-9) / 100 if round_up else x
            return f"{x:.2f} {unit}"
    return f"{int(math.ceil(n))} B"


@dataclasses.dataclass(frozen=True)
class ProgramModel:
    """How the programs use memory: attention kernel and activation checkpointing."""

    attention: str = "flash"
    remat: str = "layer"
    prefill_chunk: int = 8192  # tokens the rollout engine prefills per step (vLLM chunked prefill)

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: one of {', '.join(ATTENTIONS)}")
        if self.remat not in REMATS:
            raise ValueError(f"remat={self.remat!r}: one of {', '.join(REMATS)}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be >= 1")

    def describe(self) -> str:
        att = ("flash attention (memory-efficient kernel: O(T) attention state per layer)" if self.attention == "flash"
               else "dense attention (fp32 [heads, Tq, Tk] scores materialised, as today's JAX programs)")
        rem = ("per-layer activation checkpointing (only each decoder layer's / vision block's input is saved; "
               "one layer is recomputed in the backward)" if self.remat == "layer"
               else "no activation checkpointing (every residual of the forward is saved, as today's JAX programs)")
        return f"programs: {att}; {rem}"


CURRENT_PROGRAMS = ProgramModel(attention="dense", remat="none")
DEFAULT_PROGRAMS = ProgramModel(attention="flash", remat="layer")


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Tokens per row: prompt (vision tokens included), vision tokens of the prompt, answer."""

    prompt_tokens: int
    vision_tokens: int
    response_tokens: int
    source: str = "given"

    def __post_init__(self):
        if self.prompt_tokens < 1 or self.response_tokens < 1:
            raise ValueError(f"prompt_tokens={self.prompt_tokens}, response_tokens={self.response_tokens}: "
                             "both must be >= 1")
        if not 0 <= self.vision_tokens <= self.prompt_tokens:
            raise ValueError(f"vision_tokens={self.vision_tokens} must be in [0, prompt_tokens="
                             f"{self.prompt_tokens}] (vision tokens are part of the prompt)")

    @classmethod
    def from_config(cls, cfg: Config, *, prompt_tokens: int | None = None, vision_tokens: int | None = None,
                    response_tokens: int | None = None, video_frames: int = 0) -> Lengths:
        """Worst-case lengths of the config, each overridable (``None`` = from the config).

        prompt = ``data.max_prompt_len`` (rows are padded to the longest prompt); answer =
        ``rollout.max_new_tokens``; vision = the largest image ``data.max_pixels`` admits
        (max_pixels / (patch * merge)^2 merged tokens), or with ``video_frames`` > 0 a video of that
        many frames at max_pixels per frame (ceil(frames / temporal_patch) x that), capped at the prompt.
        """
        v = cfg.model.vision
        p = prompt_tokens if prompt_tokens is not None else cfg.data.max_prompt_len
        r = response_tokens if response_tokens is not None else cfg.rollout.max_new_tokens
        source = []
        if vision_tokens is None:
            per_frame = cfg.data.max_pixels // (v.patch_size * v.spatial_merge_size) ** 2
            frames = math.ceil(video_frames / v.temporal_patch_size) if video_frames > 0 else 1
            vision_tokens = min(per_frame * frames, p)
            what = f"a {video_frames}-frame video" if video_frames > 0 else "one image"
            source.append(f"vision tokens = {what} at max_pixels={cfg.data.max_pixels} -> "
                          f"{per_frame * frames} merged tokens" + (f", capped at the prompt ({p})"
                                                                   if per_frame * frames > p else ""))
        source.append(f"prompt tokens = {'--plan_prompt_tokens' if prompt_tokens is not None else 'max_prompt_len'}"
                      f" ({p}), answer tokens = "
                      f"{'--plan_response_tokens' if response_tokens is not None else 'max_new_tokens'} ({r})")
        return cls(prompt_tokens=p, vision_tokens=vision_tokens, response_tokens=r, source="; ".join(source))


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    vision: int
    linear: int  # weights the backward reads (2-D linear weights, the lm head / tied embedding)
    trainable: int


@functools.lru_cache(maxsize=32)
def _param_counts(model: ModelConfig, freeze_vision: bool) -> ParamCounts:
    from rollplex_jax.models.qwen2_5_vl.params import count_params, param_shapes

    shapes = param_shapes(model)
    vision = {k: s for k, s in shapes.items() if k.startswith("visual.")}
    linear = {k: s for k, s in shapes.items() if len(s.shape) == 2
              and (k != "model.embed_tokens.weight" or model.tie_word_embeddings)}
    total = count_params(shapes)
    return ParamCounts(total=total, vision=count_params(vision), linear=count_params(linear),
                       trainable=total - (count_params(vision) if freeze_vision else 0))


def param_counts(cfg: Config) -> ParamCounts:
    """Parameter counts of the real model (``params.param_shapes``)."""
    return _param_counts(cfg.model, cfg.optim.freeze_vision)


@dataclasses.dataclass(frozen=True)
class _Mesh:
    devices: int
    fsdp: int
    tp: int
    rollout_tp: int

    @classmethod
    def of(cls, cfg: Config, devices: int | None) -> _Mesh:
        m = cfg.mesh
        d = devices or m.train_devices
        if d < 1 or d % m.train_devices:
            raise ValueError(f"devices={d} must be a positive multiple of train_fsdp*train_tp={m.train_devices}")
        if d % m.rollout_tp:
            raise ValueError(f"devices={d} must be a multiple of rollout_tp={m.rollout_tp}")
        return cls(d, m.train_fsdp, m.train_tp, m.rollout_tp)

    @property
    def weight_shards(self) -> int:
        return self.fsdp * self.tp

    @property
    def dp(self) -> int:
        return self.devices // self.weight_shards

    @property
    def batch_shards(self) -> int:
        return self.devices // self.tp

    @property
    def rollout_replicas(self) -> int:
        return self.devices // self.rollout_tp


# --- per-layer formulas (bytes, whole layer: callers divide by tp) ------------------------------------------


def _b(model: ModelConfig) -> int:
    return _DTYPE_BYTES[model.dtype]


def _layer_saved(m: ModelConfig, r: int, t: int, tk: int, pm: ProgramModel) -> float:
    """Saved activations of one decoder layer over r rows of t tokens attending tk keys (no remat)."""
    x, b = m.text, _b(m)
    dd, f, h, k, d = x.hidden_size, x.intermediate_size, x.num_attention_heads, x.num_key_value_heads, x.head_dim
    per_token = 5 * dd * b + 2 * dd * _F32 + 4 * _F32 + 4 * d * b + 6 * f * b + (2 * k + h) * d * b
    att = r * h * t * tk * (2 * _F32 + b + 1) + 2 * r * h * t * _F32 if pm.attention == "dense" else r * h * t * _F32
    return r * t * per_token + att + 2 * dd * b


def _segments(m: ModelConfig, n: int, per_image: int | None, full: bool) -> tuple[float, float]:
    """(segments, padded patches per segment) of one vision block over n patches of images of
    ``per_image`` patches (square grids assumed): full-attention blocks attend within each image, the
    others within windows of ``window_size`` px, padded to the largest window (vision.py)."""
    v = m.vision
    per_image = per_image or n
    images = n / per_image
    if full:
        return images, per_image
    unit = v.spatial_merge_size**2
    side = max(1, round(math.sqrt(per_image / unit)))  # merge units per side
    win = v.merger_window
    return images * math.ceil(side / win) ** 2, min(win, side) ** 2 * unit


def _block_saved(m: ModelConfig, n: int, pm: ProgramModel, per_image: int | None = None,
                 full: bool = False) -> float:
    """Saved activations of one vision block over n patches (no remat)."""
    v, b = m.vision, _b(m)
    dv, fv, hv, dh = v.hidden_size, v.intermediate_size, v.num_heads, v.head_dim
    per_patch = 5 * dv * b + 2 * dv * _F32 + 4 * _F32 + 2 * dh * _F32 + 3 * dv * b + 6 * fv * b
    if pm.attention == "dense":  # gathered per segment: q, k, v copies, scores/probs, row statistics
        segs, size = _segments(m, n, per_image, full)
        slots = segs * size
        att = hv * segs * size * size * (2 * _F32 + b + 1) + 2 * hv * slots * _F32 + 3 * slots * hv * dh * b
    else:
        att = hv * n * _F32
    return n * per_patch + att + 2 * dv * b


def _blocks_saved(m: ModelConfig, n: int, pm: ProgramModel, per_image: int | None) -> float:
    v = m.vision
    full = sum(1 for i in range(v.depth) if i in v.fullatt_block_indexes)
    return (full * _block_saved(m, n, pm, per_image, True)
            + (v.depth - full) * _block_saved(m, n, pm, per_image, False))


def _text_const(m: ModelConfig, r: int, t: int, vision: bool) -> float:
    """Final norm, last-token hidden state, index arrays (+ the vision scatter mask and indices)."""
    dd, b = m.text.hidden_size, _b(m)
    out = r * t * (dd * b + dd * _F32 + 2 * _F32) + r * dd * b + r * 2 * 4 + dd * b
    if vision:
        out += r * t * dd + r * t * 4
    return out


def _vision_const(m: ModelConfig, n: int) -> float:
    """Merger (norm + 5 [n/4, 4 dv] tensors), patches cast to the dtype, window index arrays."""
    v, b = m.vision, _b(m)
    dv, unit = v.hidden_size, v.spatial_merge_size**2
    return (n * (dv * b + dv * _F32 + 2 * _F32) + 5 * (n // unit) * unit * dv * b + n * v.patch_dim * b
            + 2 * (n // unit) * 4 + dv * b)


def saved_activations(m: ModelConfig, r: int, t: int, tk: int, n: int, pm: ProgramModel,
                      text_const: bool = True, per_image: int | None = None) -> float:
    """Saved activations of a forward (for its backward) over r rows x t tokens (tk keys) and n patches,
    whole model, not sharded."""
    L, dd, d, b = m.text.num_hidden_layers, m.text.hidden_size, m.text.head_dim, _b(m)
    v = m.vision
    if pm.remat == "none":
        out = L * _layer_saved(m, r, t, tk, pm)
        if n:
            out += _blocks_saved(m, n, pm, per_image or (n // r if r else None))
    else:  # layer inputs, rotary tables and masks once
        out = L * r * t * dd * b + 2 * r * t * d * b + (r * t * tk if pm.attention == "dense" else 0)
        if n:
            out += v.depth * n * v.hidden_size * b + 2 * n * v.head_dim * _F32
    if text_const:
        out += _text_const(m, r, t, vision=n > 0)
    if n:
        out += _vision_const(m, n)
    return out


def _one_layer_saved(m: ModelConfig, r: int, t: int, tk: int, n: int, pm: ProgramModel) -> float:
    """What one recomputed layer/block saves during the backward under remat (0 without remat)."""
    if pm.remat == "none":
        return 0.0
    full = ProgramModel(pm.attention, "none", pm.prefill_chunk)
    return max(_layer_saved(m, r, t, tk, full), _block_saved(m, n, full, n // r if r else None, True) if n else 0.0)


def _layer_temp(m: ModelConfig, r: int, t: int, tk: int, pm: ProgramModel) -> float:
    """Transient working set of one decoder layer's forward."""
    x, b = m.text, _b(m)
    dd, f, h, k, d = x.hidden_size, x.intermediate_size, x.num_attention_heads, x.num_key_value_heads, x.head_dim
    att = r * h * t * tk * (2 * _F32 + b) if pm.attention == "dense" else r * h * t * _F32 + r * t * h * d * _F32
    return r * t * (3 * f + (h + 2 * k) * d + 3 * dd) * b + att


def _block_temp(m: ModelConfig, n: int, pm: ProgramModel, segment: int | None = None) -> float:
    """Transient working set of one vision block's forward over n patches, attending within segments of
    ``segment`` patches (one image at full-attention blocks, the largest case; default: all n)."""
    if n <= 0:
        return 0.0
    v, b = m.vision, _b(m)
    dv, fv, hv = v.hidden_size, v.intermediate_size, v.num_heads
    s = n if segment is None else min(segment, n)
    att = hv * n * s * (2 * _F32 + b) if pm.attention == "dense" else hv * n * _F32 + n * dv * _F32
    return n * (3 * fv + 6 * dv) * b + att


def prefix_residual_bytes(m: ModelConfig, rows: int, prompt_tokens: int, vision_tokens: int,
                          pm: ProgramModel = CURRENT_PROGRAMS, *, tp: int = 1, weight_shards: int = 1,
                          vision: bool = True) -> float:
    """Bytes of the actor prefix's vjp residuals on one device: saved activations of ``rows`` prompts
    (divided by tp), a copy of the linear weights the backward reads (divided by ``weight_shards``)."""
    unit = m.vision.spatial_merge_size**2
    vision = vision and vision_tokens > 0  # no patches: the vision tower does not run
    n = rows * vision_tokens * unit if vision else 0
    acts = saved_activations(m, rows, prompt_tokens, prompt_tokens, n, pm)
    return acts / tp + weight_copy_bytes(m, vision) / weight_shards


def weight_copy_bytes(m: ModelConfig, vision: bool = True) -> int:
    """Bytes of the linear weights a prefix backward reads (returned as fresh buffers in the residuals)."""
    return (_param_counts(m, False).linear - (0 if vision else _vision_linear(m))) * _b(m)


def _vision_linear(m: ModelConfig) -> int:
    v = m.vision
    dv, fv, mm = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    return v.depth * (4 * dv * dv + 3 * fv * dv) + mm * mm + m.text.hidden_size * mm


# --- the plan ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes per layout, phase and buffer class, and what they assume."""

    layouts: dict  # {layout: {phase: {class: bytes}}}
    devices: int
    lengths: Lengths
    programs: ProgramModel
    optimizer_policy: str  # the rollplex layout's
    budget_bytes: int
    params: ParamCounts
    weight_sharing: dict
    assumptions: tuple[str, ...]
    details: dict

    def peak(self, layout: str, phase: str) -> int:
        return int(sum(self.layouts[layout][phase].values()))

    def peak_bytes(self, layout: str) -> int:
        return max(self.peak(layout, p) for p in PHASES)

    def peak_phase(self, layout: str) -> str:
        return max(PHASES, key=lambda p: self.peak(layout, p))

    def fits(self, layout: str, budget_bytes: int | None = None) -> bool | None:
        budget = self.budget_bytes if budget_bytes is None else budget_bytes
        return None if not budget else self.peak_bytes(layout) <= budget

    def to_dict(self) -> dict:
        layouts = {}
        for name, phases in self.layouts.items():
            layouts[name] = {
                "phases": {p: {c: int(v) for c, v in phases[p].items()} for p in PHASES},
                "peaks": {p: self.peak(name, p) for p in PHASES},
                "peak_bytes": self.peak_bytes(name),
                "peak_gib": round(self.peak_bytes(name) / GiB, 3),
                "peak_phase": self.peak_phase(name),
                "fits": self.fits(name),
            }
        return {
            "devices": self.devices,
            "lengths": dataclasses.asdict(self.lengths),
            "programs": dataclasses.asdict(self.programs),
            "params": dataclasses.asdict(self.params),
            "optimizer_policy": self.optimizer_policy,
            "budget_bytes": self.budget_bytes,
            "layouts": layouts,
            "weight_sharing": self.weight_sharing,
            "assumptions": list(self.assumptions),
            "details": self.details,
        }


def _zeros() -> dict:
    return {p: {c: 0.0 for c in CLASSES} for p in PHASES}


def _resolve_policy(cfg: Config, lengths: Lengths, mesh: _Mesh, pm: ProgramModel, policy: str | None) -> str:
    policy = policy or cfg.memory.optimizer_policy
    if policy != "auto":
        return policy
    budget = cfg.memory.budget_bytes
    if not budget:
        return "resident"
    try:
        return choose_optimizer_policy(cfg, lengths, mesh.devices, budget, programs=pm)
    except BudgetError:
        return "offload"  # the plan shows it does not fit; offload is the closest


def plan(cfg: Config, lengths: Lengths | None = None, devices: int | None = None, *,
         programs: ProgramModel = DEFAULT_PROGRAMS, optimizer_policy: str | None = None) -> Plan:
    """Per-device bytes of every buffer class in every phase, for both layouts (see the module doc).

    ``devices`` = None/0: train_fsdp * train_tp. ``optimizer_policy`` overrides the config's for the
    rollplex layout ('auto' resolves against ``cfg.memory.hbm_budget``, no budget -> resident).
    """
    lengths = lengths or Lengths.from_config(cfg)
    mesh = _Mesh.of(cfg, devices)
    policy = _resolve_policy(cfg, lengths, mesh, programs, optimizer_policy)
    m, pm = cfg.model, programs
    x, v = m.text, m.vision
    b, counts = _b(m), param_counts(cfg)
    P, D = counts.total, mesh.devices
    L, K, d, V = x.num_hidden_layers, x.num_key_value_heads, x.head_dim, x.vocab_size
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    unit = v.spatial_merge_size**2
    patches = Tv * unit  # per prompt row
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    use_ref = cfg.rl.kl_mode != "off"
    tp, bs = mesh.tp, mesh.batch_shards

    # Persistent state.
    compute = P * b / mesh.weight_shards
    grads = compute
    ref = compute if use_ref else 0.0
    master = P * _F32 / D if m.dtype != "float32" else 0.0
    moments = 2 * counts.trainable * _F32 / D
    rollout_copy = P * b / mesh.rollout_tp
    classification = sharing_classification(cfg)
    rebuilt = classification["extra_bytes_per_device"]

    # Rollout engine: KV cache and decode/prefill temporaries (same engine in both layouts).
    rows_roll = min(math.ceil(B * G / mesh.rollout_replicas), cfg.rollout.max_batch)
    kv_dev = lambda deg: max(1, math.ceil(K / deg))  # noqa: E731
    rollout_kv = rows_roll * (Tp + Tr) * L * 2 * kv_dev(mesh.rollout_tp) * d * b
    decode_tmp = rows_roll * V * 2 * _F32 + rows_roll * (3 * x.intermediate_size + 3 * x.hidden_size) * b / \
        mesh.rollout_tp
    chunk = min(pm.prefill_chunk, rows_roll * Tp)  # tokens of one prefill step: chunk / Tp prompts of Tp tokens
    prefill_tmp = (_layer_temp(m, chunk / min(chunk, Tp), min(chunk, Tp), Tp, pm)
                   + 2 * chunk * x.hidden_size * b
                   + _block_temp(m, patches, pm) + 2 * patches * v.hidden_size * b) / mesh.rollout_tp
    engine_tmp = max(decode_tmp, prefill_tmp)

    # Inputs and rollouts ("other").
    prompts_dev = math.ceil(B / bs)
    rows_dev = math.ceil(B * G / bs)
    rollouts_b = rows_dev * Tr * 4 * 3
    other_rollplex = prompts_dev * (patches * v.patch_dim * _F32 + Tp * 4 * 6) + rollouts_b
    other_naive = rows_dev * (patches * v.patch_dim * _F32 + (Tp + Tr) * 4 * 6) + rollouts_b

    # Micro-batch rows per device for scoring/training.
    r_mb = math.ceil(min(cfg.rl.micro_batch, B * G) / bs)
    logits_row = V / tp  # vocab-parallel logits per token

    # --- naive colocation ---
    t_full = Tp + Tr
    n_mb = r_mb * patches
    naive_score = (2 * r_mb * t_full * x.hidden_size * b
                   + max(_layer_temp(m, r_mb, t_full, t_full, pm),
                         _block_temp(m, n_mb, pm, patches) + 2 * n_mb * v.hidden_size * b)
                   ) / tp + r_mb * logits_row * (t_full * (_F32 + b) + Tr * 2 * _F32)
    naive_train = (saved_activations(m, r_mb, t_full, t_full, n_mb, pm, per_image=patches)
                   + BWD_FACTOR * max(_layer_temp(m, r_mb, t_full, t_full, pm), _block_temp(m, n_mb, pm, patches))
                   + _one_layer_saved(m, r_mb, t_full, t_full, n_mb, pm)) / tp \
        + r_mb * logits_row * (t_full * (2 * _F32 + b) + Tr * 2 * _F32) + grads
    naive_update = grads + 2 * P * _F32 / D
    naive = _zeros()
    for p in PHASES:
        c = naive[p]
        c.update(compute_weights=compute, master_weights=master, optimizer_state=moments, ref_weights=ref,
                 rollout_weights=rollout_copy, rollout_kv=rollout_kv, gradients=grads, other=other_naive)
    naive["rollout"]["activations"] = engine_tmp
    naive["score"]["activations"] = naive_score if use_ref else 0.0
    naive["train"]["activations"] = naive_train
    naive["update"]["activations"] = naive_update

    # --- rollplex ---
    sharing = cfg.run.prefix_sharing
    n_per_prompt = G if sharing else 1
    Bp = math.ceil((B if sharing else B * G) / bs)  # prefix rows per device
    n_prefix = Bp * patches
    vision_in_prefix = not cfg.optim.freeze_vision
    nv = n_prefix if vision_in_prefix else 0
    one_kv = L * Bp * Tp * 2 * kv_dev(tp) * d * b + Bp * V * _F32
    residuals = cfg.run.actor_prefix == "residuals"
    prefix_res = prefix_residual_bytes(m, Bp, Tp, Tv, pm, tp=tp, weight_shards=mesh.weight_shards,
                                       vision=vision_in_prefix) if residuals else 0.0
    prefix_fwd_tmp = (2 * Bp * Tp * x.hidden_size * b
                      + max(_layer_temp(m, Bp, Tp, Tp, pm),
                            _block_temp(m, nv, pm, patches) + 2 * nv * v.hidden_size * b)) / tp
    r_s = r_mb  # answer rows per micro-batch per device
    suffix_score = (2 * r_s * Tr * x.hidden_size * b + _layer_temp(m, r_s, Tr, Tp + Tr, pm)) / tp \
        + r_s * logits_row * Tr * (_F32 + b + 2 * _F32)
    suffix_train = (saved_activations(m, r_s, Tr, Tp + Tr, 0, pm)
                    + BWD_FACTOR * _layer_temp(m, r_s, Tr, Tp + Tr, pm)
                    + _one_layer_saved(m, r_s, Tr, Tp + Tr, 0, pm)) / tp \
        + r_s * logits_row * Tr * (2 * _F32 + b + 2 * _F32)
    prefix_bwd = (BWD_FACTOR * max(_layer_temp(m, Bp, Tp, Tp, pm), _block_temp(m, nv, pm, patches))
                  + _one_layer_saved(m, Bp, Tp, Tp, nv, pm)) / tp
    recompute_saved = 0.0 if residuals else saved_activations(m, Bp, Tp, Tp, nv, pm, per_image=patches) / tp
    rollplex_train = recompute_saved + max(suffix_train, prefix_bwd) + one_kv + grads
    emb = 0.0 if vision_in_prefix else Bp * Tv * x.hidden_size * b
    offload = policy == "offload"
    chunks = cfg.memory.optimizer_chunks
    rp = _zeros()
    for p in PHASES:
        c = rp[p]
        c.update(compute_weights=compute, ref_weights=ref, rollout_weights=rebuilt, other=other_rollplex + emb)
        on = (not offload) or p == "update"
        c["master_weights"] = (master / chunks if offload else master) if on else 0.0
        c["optimizer_state"] = (moments / chunks if offload else moments) if on else 0.0
    rp["rollout"]["rollout_kv"] = rollout_kv
    ref_kv = one_kv if use_ref else 0.0
    for p in ("rollout", "score", "train"):
        rp[p]["boundary_kv"] = one_kv + (ref_kv if p != "train" else 0.0)  # the reference's ends with scoring
        rp[p]["prefix_residuals"] = prefix_res
    for p in ("train", "update"):
        rp[p]["gradients"] = grads
    rp["rollout"]["activations"] = engine_tmp + prefix_fwd_tmp
    rp["score"]["activations"] = suffix_score if use_ref else 0.0
    rp["train"]["activations"] = rollplex_train
    rp["update"]["activations"] = grads + 2 * P * _F32 / D / (chunks if offload else 1)  # resident: one chunk

    actor_how = ("keeps its vjp residuals (incl. a copy of the linear weights: jit outputs never alias "
                 "non-donated inputs)" if residuals else "is recomputed in the update (only its boundary KV is kept)")
    assumptions = [
        pm.describe() + (" [calibrated against jax.eval_shape of today's programs]" if pm == CURRENT_PROGRAMS
                         else " [not today's JAX programs, which are dense and keep every residual: "
                              "--plan_attention=dense --plan_remat=none plans those]"),
        f"lengths per row: prompt {Tp} tokens ({Tv} of them vision, {patches} patches), answer {Tr} tokens; "
        + lengths.source,
        f"devices {D}: training fsdp {mesh.fsdp} x tp {tp} x dp {mesh.dp} (batch over {bs} shards, activations "
        f"also split over tp: sequence parallelism); rollout {mesh.rollout_replicas} replicas at tp "
        f"{mesh.rollout_tp}, {rows_roll} sequences each",
        "compute weights, gradients and reference weights sharded over fsdp*tp; fp32 master weights and Adam "
        "moments over all devices (distributed optimizer / ZeRO-1)",
        f"micro-batch: {cfg.rl.micro_batch} rows globally -> {r_mb} per device (scoring and training run one "
        "micro-batch per program; today's rollplex suffix programs take a whole mini-batch per call)",
        f"rollout KV cache: {rows_roll} sequences x {Tp + Tr} tokens per engine replica, no prompt sharing "
        "inside the engine (an upper bound for vLLM's prefix caching); naive colocation keeps it allocated in "
        "every phase, rollplex only during the rollout",
        f"rollplex: {'one prefix per prompt' if sharing else 'one prefix per answer'} ({Bp} prefix rows per "
        f"device); actor prefix {actor_how}; reference boundary KV freed after scoring, actor boundary KV after "
        "training"
        + ("; reference off (--kl_mode=off)" if not use_ref else ""),
        f"rollplex optimizer state: {policy}" + (f" (host memory outside update; one chunk of 1/{chunks} on "
                                                  "the device during update)" if offload else ""),
        WEIGHT_SHARING_RULE + f" ({classification['layout']} layout: "
        f"{', '.join(f'{k} {v:.1%}' for k, v in classification['fractions'].items())} of the engine's bytes)",
        "naive colocation: per-sample inputs and prefixes (each prompt's patches repeated for its G answers), "
        "no boundary state, full-sequence scoring and training, a full rollout copy of the weights",
    ]
    weight_sharing = {
        "status": "classified",
        "rule": WEIGHT_SHARING_RULE,
        "train_shards": mesh.weight_shards,
        "rollout_tp": mesh.rollout_tp,
        "rebuilt_bytes_per_device": int(rebuilt),
        "rebuilt_fraction_of_rollout_shard": round(rebuilt / rollout_copy, 4) if rollout_copy else 0.0,
        "naive_copy_bytes_per_device": int(rollout_copy),
        "classification": classification,
    }
    details = {
        "prefix_rows_per_device": Bp, "answers_per_prefix": n_per_prompt, "micro_rows_per_device": r_mb,
        "rollout_rows_per_replica": rows_roll, "batch_shards": bs, "data_parallel": mesh.dp,
        "optimizer_chunks": chunks,
        # torch-side figures (the rollout engine's working set), not visible to JAX's live-array count:
        "engine_activation_bytes": int(engine_tmp), "rollout_kv_bytes": int(rollout_kv),
        "prefix_residuals_weight_copy_bytes": int(weight_copy_bytes(m, vision_in_prefix and Tv > 0)
                                                  / mesh.weight_shards) if residuals else 0,
    }
    layouts = {name: {p: {c: int(math.ceil(v)) for c, v in phases[p].items()} for p in PHASES}
               for name, phases in (("naive_colocation", naive), ("rollplex", rp))}
    return Plan(layouts=layouts, devices=D, lengths=lengths, programs=pm,
                optimizer_policy=policy, budget_bytes=cfg.memory.budget_bytes, params=counts,
                weight_sharing=weight_sharing, assumptions=tuple(assumptions), details=details)


@dataclasses.dataclass(frozen=True)
class Budget:
    bytes: int
    policy: str


def smallest_budget(cfg: Config, lengths: Lengths | None = None, devices: int | None = None, *,
                    programs: ProgramModel = DEFAULT_PROGRAMS) -> Budget:
    """The smallest per-device budget the rollplex layout fits in, with the policy that achieves it
    (resident when it is as small: no host transfers)."""
    peaks = {pol: plan(cfg, lengths, devices, programs=programs, optimizer_policy=pol).peak_bytes("rollplex")
             for pol in ("resident", "offload")}
    best = "resident" if peaks["resident"] <= peaks["offload"] else "offload"
    return Budget(peaks[best], best)


def choose_optimizer_policy(cfg: Config, lengths: Lengths | None, devices: int | None, budget_bytes: int, *,
                            programs: ProgramModel = DEFAULT_PROGRAMS) -> str:
    """'resident' if the rollplex plan fits ``budget_bytes`` with the optimizer state resident, else
    'offload' if it fits offloaded, else ``BudgetError`` naming the smallest budget that fits.
    ``budget_bytes`` = 0: no budget -> 'resident'. (Ignores ``cfg.memory.optimizer_policy``.)"""
    if not budget_bytes:
        return "resident"
    peaks = {}
    for pol in ("resident", "offload"):
        p = plan(cfg, lengths, devices, programs=programs, optimizer_policy=pol)
        peaks[pol] = (p.peak_bytes("rollplex"), p.peak_phase("rollplex"))
        if peaks[pol][0] <= budget_bytes:
            return pol
    best = min(peaks, key=lambda k: peaks[k][0])
    need, phase = peaks[best]
    raise BudgetError(
        f"the run does not fit a per-device budget of {human_bytes(budget_bytes)}: the smallest budget that fits "
        f"is {human_bytes(need, round_up=True)} (--hbm_budget={human_bytes(need, round_up=True).replace(' ', '')} "
        f"--optimizer_policy={best}; peak in the {phase} phase); resident optimizer state needs "
        f"{human_bytes(peaks['resident'][0], round_up=True)}. Lower --batch_prompts, --micro_batch or the lengths, "
        "or add devices (see python -m launch.plan)")
