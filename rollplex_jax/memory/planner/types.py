"""The planner's inputs and its result: lengths, program model, mesh, parameter counts, ``Plan``.

Everything the formulas (``activations``) and the layouts (``layouts``) read besides the config, kept
in one place so that the simulator (``rollplex_jax.sim``) can reuse the same lengths, mesh and
program model:

- ``Lengths``: tokens per row (prompt, its vision tokens, answer), the config's worst case by default.
- ``ProgramModel``: how the programs use memory. The attention kernel (``dense`` materialises
  [heads, Tq, Tk] scores, ``flash`` is a memory-efficient kernel) and activation checkpointing
  (``none`` / ``layer``). ``DENSE_PROGRAMS`` (dense, none) are the dense oracle programs
  (``--attention=dense --remat=none``); ``DEFAULT_PROGRAMS`` (flash, layer) are the defaults and what the
  paper's stack (Megatron-Core with FlashAttention and activation recompute, vLLM) does; every plan lists
  which it used in its assumptions. ``plan(programs=None)`` (the default) plans the run's own programs
  (``ProgramModel.of(cfg.programs)``), which is what ``rollplex_jax.memory.meter`` measures.
- ``PlanMesh``: mesh and sharding of the training mesh that runs (``D`` = devices = ``mesh.train_dp *
  mesh.train_fsdp * mesh.train_tp``; another count is refused, naming ``--train_dp``: the planner plans no
  data parallelism the runtime does not run):
  - data-parallel replicas ``dp = D / (fsdp * tp)`` (``--train_dp``); the batch is split over ``D / tp``
    shards (dp x fsdp: FSDP shards the batch as well as the params); tensor parallelism splits the attention
    heads and MLP widths (and their activations) over ``tp``, the residual stream is whole on every device of
    a tp group, as the programs lay it out (no sequence parallelism; ``activations.tp_widths``);
  - compute weights (``cfg.model.dtype``), gradients (same dtype as the params), reference weights, fp32
    master weights (only when the dtype is not float32) and Adam's two fp32 moments: each parameter's
    shard on the fsdp x tp mesh (``shards``: a dimension a mesh axis does not divide stays whole; the
    optimizer state has the params' layout), replicated over dp, except master weights and moments, which are
    also / dp with the optimizer state sharded over dp (ZeRO-1, ``--optimizer_shard``); the reference is
    skipped entirely when it is not used (``cfg.rl.uses_reference``: no KL in the objective and no
    ``--log_kl``); moments cover trainable params only (not the vision tower with ``--freeze_vision``);
  - the rollout engine runs ``D / rollout_tp`` replicas; each decodes
    ``rows = min(B * G / (D / rollout_tp), rollout.max_batch)`` sequences at once.
- ``ParamCounts`` / ``param_counts``: the real model's parameter counts (``params.param_shapes``).
- ``Plan``: per-device bytes per layout, phase and buffer class, and what they assume.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from rollplex_jax.config import Config, ModelConfig
from rollplex_jax.config.shapes import pow2, step_shapes
from rollplex_jax.memory.classes import PHASES

LAYOUTS = ("naive_colocation", "rollplex")
ATTENTIONS = ("dense", "flash")
REMATS = ("none", "layer", "dots")
KiB, MiB, GiB = 2**10, 2**20, 2**30
F32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def dtype_bytes(model: ModelConfig) -> int:
    """Bytes per element of the model's compute dtype."""
    return DTYPE_BYTES[model.dtype]


@dataclasses.dataclass(frozen=True)
class ProgramModel:
    """How the programs use memory: attention kernel and activation checkpointing."""

    attention: str = "flash"
    remat: str = "layer"
    prefill_chunk: int = 8192  # tokens the rollout engine prefills per step (vLLM chunked prefill)
    # whose compiler's buffers: "gpu" (calibrated against XLA's GPU compile of the programs, ``launch.plan
    # --compile --target=h100``; the default) or "cpu" (against the CPU meter and CPU compile: what a run on CPU
    # holds; ``memory.policy`` plans a run for its own backend). Where they differ: ``PLATFORM_NOTES``.
    platform: str = "gpu"

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention={self.attention!r}: one of {', '.join(ATTENTIONS)}")
        if self.remat not in REMATS:
            raise ValueError(f"remat={self.remat!r}: one of {', '.join(REMATS)}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={self.prefill_chunk}: must be >= 1")
        if self.platform not in PLATFORMS:
            raise ValueError(f"platform={self.platform!r}: one of {', '.join(PLATFORMS)}")

    @classmethod
    def of(cls, programs, platform: str = "gpu") -> ProgramModel:
        """The model of the programs a ``config.ProgramConfig`` builds: blockwise (and cuDNN, which falls back to
        it) attention is ``flash`` (O(T) state per layer), ``dense`` is dense; remat as configured; compiled for
        ``platform`` (a backend or target name: cpu is the CPU's calibration, any other the GPU's; a TPU is
        planned as a GPU)."""
        return cls(attention="dense" if programs.attention == "dense" else "flash", remat=programs.remat,
                   platform="cpu" if platform == "cpu" else "gpu")

    @property
    def gpu(self) -> bool:
        return self.platform == "gpu"

    def describe(self) -> str:
        att = ("flash attention (memory-efficient kernel: O(T) attention state per layer)" if self.attention == "flash"
               else "dense attention (fp32 [heads, Tq, Tk] scores materialised: --attention=dense)")
        rem = {"layer": "per-layer activation checkpointing (only each decoder layer's / vision block's input is "
                        "saved; one layer is recomputed in the backward)",
               "dots": "per-layer checkpointing that saves the weight matmuls' outputs (planned as no remat: an "
                       "upper bound)",
               "none": "no activation checkpointing (every residual of the forward is saved)"}[self.remat]
        return f"programs: {att}; {rem}; buffers as XLA's {self.platform.upper()} compiler assigns them"


PLATFORMS = ("gpu", "cpu")
# What XLA's GPU compiler does differently from its CPU one, as the planner counts it (measured on the 3B, 7B and
# 32B flagfiles' programs: WORKSPACE.md, "GPU-true memory without a GPU"):
PLATFORM_NOTES = (
    "the optimizer's programs (clip, AdamW chunk) have no temporaries on GPU (fused in place; CPU: two fp32 "
    "copies of the chunk)",
    "the log-probs over the vocabulary hold fp32 logits and their 16-bit originals on GPU (CPU: two fp32 copies); "
    "their gradient two of each (CPU: four fp32 and a 16-bit)",
    "a remat'd backward carries one 16-bit copy of each decoder layer's input stream on GPU and none of the vision "
    "blocks' beyond their saved inputs (CPU: an fp32 and a 16-bit copy per layer, two fp32 per block)",
)
DENSE_PROGRAMS = ProgramModel(attention="dense", remat="none")  # --attention=dense --remat=none: the oracle
DEFAULT_PROGRAMS = ProgramModel(attention="flash", remat="layer")  # the default ProgramConfig


@dataclasses.dataclass(frozen=True)
class Lengths:
    """Tokens per row: prompt (vision tokens included), vision tokens of the prompt, answer."""

    prompt_tokens: int
    vision_tokens: int
    response_tokens: int
    source: str = "given"
    # prompts one prefix row of ``prompt_tokens`` slots holds: > 1 where shape buckets pad the rows past the
    # longest prompt and packing fills them (``bucketed``); the prefix programs then run fewer rows (``rows.packed``)
    prompts_per_row: int = 1

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
        return cls(prompt_tokens=p, vision_tokens=vision_tokens, response_tokens=r,
                   source="; ".join(source)).bucketed(cfg)

    def bucketed(self, cfg: Config) -> Lengths:
        """The lengths the run's programs hold under ``--shape_buckets`` (``config/shapes.py``): the prompt
        rounded up to its bucket (at most ``max_prompt_len``), the vision tokens to a power of two (the model
        pads a batch's merge units to one, ``models/vl/model._vision``), at most what the prompt holds
        beside its two vision markers (a 1280-token image in a 2048-token prompt: 2046, not 2048), and with
        ``--packing`` the prompts a padded prefix row holds (``packing.pack_layout(stable=True)`` packs the
        prompts of a group into power-of-two rows); unchanged with buckets off."""
        if cfg.programs.buckets is None:
            return self
        p = max(self.prompt_tokens, step_shapes(cfg).prompt_len(self.prompt_tokens))
        v = max(self.vision_tokens, min(pow2(self.vision_tokens), p - 2)) if self.vision_tokens else 0
        k = p // self.prompt_tokens if cfg.programs.packing else 1
        if (p, v, k) == (self.prompt_tokens, self.vision_tokens, 1):
            return self
        return dataclasses.replace(self, prompt_tokens=p, vision_tokens=v, prompts_per_row=k,
                                   source=f"{self.source}; shape buckets: {p} prompt tokens, {v} vision tokens"
                                          + (f", {k} prompts packed per prefix row" if k > 1 else ""))


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    vision: int
    linear: int  # weights the backward reads (2-D linear weights, the lm head / tied embedding)
    trainable: int


@functools.lru_cache(maxsize=32)
def model_param_counts(model: ModelConfig, freeze_vision: bool) -> ParamCounts:
    """Parameter counts of ``model`` (cached: the shapes of a 32B model take a moment to enumerate)."""
    from rollplex_jax.models.vl.params import count_params, param_shapes  # here: no jax at import

    shapes = param_shapes(model)
    vision = {k: s for k, s in shapes.items() if k.startswith("visual.")}
    linear = {k: s for k, s in shapes.items() if len(s.shape) == 2
              and (k != "model.embed_tokens.weight" or model.tie_word_embeddings)}
    total = count_params(shapes)
    return ParamCounts(total=total, vision=count_params(vision), linear=count_params(linear),
                       trainable=total - (count_params(vision) if freeze_vision else 0))


def param_counts(cfg: Config) -> ParamCounts:
    """Parameter counts of the real model (``params.param_shapes``)."""
    return model_param_counts(cfg.model, cfg.optim.freeze_vision)


def split_dim(n: float, degree: int) -> float:
    """Per-device size of a dimension of size ``n`` split over a mesh axis of ``degree`` devices: n / degree, or
    n where the axis does not divide it (``parallel.mesh.partition_spec`` and GSPMD leave such a dimension
    whole: replicated over that axis)."""
    return n // degree if degree > 1 and n % degree == 0 else n


@dataclasses.dataclass(frozen=True)
class PlanMesh:
    """Devices planned for and how training and rollout divide them (see the module doc)."""

    devices: int
    fsdp: int
    tp: int
    rollout_tp: int
    run_dp: int = 1  # the runtime's --train_dp (PlanMesh.of: devices // (fsdp * tp))
    zero_dp: bool = False  # the optimizer state is sharded over dp too (--optimizer_shard; Megatron's distributed one)

    @classmethod
    def of(cls, cfg: Config, devices: int | None) -> PlanMesh:
        """The training mesh of ``cfg``; ``devices`` (None / 0: the mesh's) must be its device count."""
        m = cfg.mesh
        d = devices or m.train_devices
        if d != m.train_devices:
            raise ValueError(
                f"devices={d} (--plan_devices) differs from the training mesh (dp {m.train_dp} x fsdp "
                f"{m.train_fsdp} x tp {m.train_tp} = {m.train_devices} devices): the planner plans the mesh that runs; "
                + (f"set --train_dp={d // (m.train_fsdp * m.train_tp)} (or --train_fsdp) for {d} devices"
                   if d > 0 and d % (m.train_fsdp * m.train_tp) == 0 else
                   f"set --train_dp / --train_fsdp / --train_tp to a mesh of {d} devices"))
        if d % m.rollout_tp:
            raise ValueError(f"devices={d} must be a multiple of rollout_tp={m.rollout_tp}")
        return cls(d, m.train_fsdp, m.train_tp, m.rollout_tp, m.train_dp, m.zero_dp)

    @property
    def optimizer_shards(self) -> int:
        """The dp groups the optimizer state is sharded over: the runtime's dp with ZeRO-1, else none."""
        return self.run_dp if self.zero_dp else 1

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

    def jax_bytes(self, layout: str, phase: str) -> int:
        """The phase's planned bytes that JAX holds: without the torch engine's KV cache, working set and
        own (rebuilt) weight buffers (what ``memory.MemoryMeter`` measures on CPU and ``aot.compiled_memory``
        compiles)."""
        classes = self.layouts[layout][phase]
        torch_side = (classes.get("rollout_kv", 0) + classes.get("rollout_weights", 0)  # engine-owned (torch)
                      + (self.details["engine_activation_bytes"] if phase == "rollout" else 0))
        return int(sum(classes.values()) - torch_side)

    def metered_bytes(self, layout: str, phase: str) -> int:
        """The phase's planned bytes that ``memory.MemoryMeter`` measures: the JAX-side bytes and the torch
        engine's own (rebuilt) weight buffers, which the meter counts as ``rollout_weights``; without the
        engine's KV cache and working set (torch allocates them inside ``generate``, unseen on CPU)."""
        return self.jax_bytes(layout, phase) + int(self.layouts[layout][phase].get("rollout_weights", 0))

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
