"""The paper's baseline as a preset: naive colocation the way its stack runs it (HYPOTHETICAL: planned, not run).

``launch.plan --baseline=megatron_vllm`` plans what the paper's "naive co-residence" count (about 165 GiB
per GPU for Qwen2.5-VL-32B on 32 x H800, PAPER.md) holds, on the paper's stack rather than ours:
Megatron-Core training at tensor parallelism ``tp`` (``--train_tp``) and data parallelism ``dp = devices /
tp`` (its data-parallel replicas hold the same weights; our ``--train_fsdp`` groups become dp), vLLM at
``--rollout_tp``, every role resident in every phase. Our runtime cannot run this stack; the default
planner keeps its own naive layout (``layouts.naive_colocation``: our runtime's sharding, everything
resident), which is smaller. Per device (P params, P_t trainable, b = dtype bytes):

- actor compute weights: P b / tp (bf16, replicated over dp);
- gradients: Megatron's fp32 ``main_grad`` buffer, P 4 / tp (gradient-accumulation fusion adds each
  micro-batch's weight gradients into it: no second, bf16 buffer);
- fp32 master weights P 4 and Adam moments P_t 8: Megatron's distributed optimizer shards them over the
  data-parallel group only, / (tp dp);
- reference weights: P b / tp (when the reference runs);
- the vLLM engine's own weight copy: P b / rollout_tp;
- vLLM's KV pool: ``gpu_memory_utilization`` x HBM minus what vLLM itself holds (its weights and its
  profiled activation peak), preallocated and kept (vLLM sizes its pool this way; a naive count puts no
  engine to sleep). vLLM's part is therefore ``gpu_memory_utilization`` x HBM whatever its TP degree;
- boundary state: the actor's and the reference's prefix KV ([L, Tp, K/tp heads, d] x 2 in the dtype, and
  the last logits [V] in fp32) of every sample, no prefix sharing: B G / dp rows per device (the paper's
  co-residence count names it);
- activations (the paper stack's programs: FlashAttention, per-layer recompute, whatever the run's
  ``--attention`` / ``--remat``): the naive layout's phase-local temporaries (``layouts.naive_activations``:
  full sequences, per-sample prefixes, one micro-batch per program; vLLM's working set in the rollout),
  without Megatron's sequence parallelism (which divides the residual stream's activations by tp: an upper
  bound);
- inputs: one micro-batch's on the device (Megatron pulls micro-batches from its data iterator) and the
  rollouts.

``sweep`` varies each assumption (x0.5 / x2, or to its alternative) and reports how the peak moves,
largest first: which assumption the comparison with the paper's figure hinges on.
"""

from __future__ import annotations

import dataclasses
import math

from rollplex_jax.config import Config
from rollplex_jax.memory.classes import CLASSES, PHASES
from rollplex_jax.memory.planner.layouts import naive_activations
from rollplex_jax.memory.planner.sizes import shared_sizes
from rollplex_jax.memory.planner.types import DEFAULT_PROGRAMS, F32, GiB, Lengths, PlanMesh, ProgramModel, dtype_bytes

BASELINES = ("megatron_vllm",)
PAPER_NAIVE_GIB = 165.0  # "about 165 GiB per GPU" (PAPER.md: Qwen2.5-VL-32B, 32 x H800)
HYPOTHETICAL = ("HYPOTHETICAL: the paper's stack (Megatron-Core training, vLLM rollout), planned, not run: our "
                "runtime trains on an fsdp x tp mesh and has no data-parallel axis that replicates weights")


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the baseline assumes about the paper's stack (each one is varied by ``sweep``)."""

    gpu_memory_utilization: float = 0.9  # vLLM's default, and ROLL's Qwen2.5-VL example (rlvr_math_megatron.yaml)
    hbm_bytes: int = 80 * GiB  # the H800's memory (--hbm_budget when given)
    distributed_optimizer: bool = True  # master weights + moments over the dp group (ROLL: use_distributed_optimizer)
    fp32_main_grad: bool = True  # Megatron's fp32 gradient buffer (else bf16 gradients)
    boundary_kv: str = "per_sample"  # per_sample | per_prompt | none
    reference_resident: bool = True  # its weights (its boundary KV counts whenever the reference runs)
    activation_scale: float = 1.0  # x the naive layout's temporaries (sequence parallelism: about 1/tp of some)
    inputs: str = "micro_batch"  # micro_batch (Megatron) | whole (the step's per-sample inputs on every device)
    rollout_tp: int | None = None  # None: --rollout_tp


def megatron_vllm(cfg: Config, lengths: Lengths | None = None, devices: int | None = None,
                  programs: ProgramModel | None = None, a: Assumptions = Assumptions()) -> dict:
    """{phases, peaks, peak_bytes, ...} of the paper's stack under naive co-residence (module doc).
    ``programs``: default the paper stack's (FlashAttention in Megatron-Core and vLLM, per-layer activation
    recompute: ``DEFAULT_PROGRAMS``), not the run's."""
    lengths = lengths or Lengths.from_config(cfg)
    pm = programs or DEFAULT_PROGRAMS
    D, tp = devices or cfg.mesh.train_devices, cfg.mesh.train_tp
    rtp = a.rollout_tp or cfg.mesh.rollout_tp
    if D % tp or D % rtp:
        raise ValueError(f"devices={D} must be a multiple of --train_tp={tp} and of the rollout TP {rtp}")
    # Megatron: weights over tp only, dp = D / tp replicas; the master weights and moments are set below
    # (opt_shards), the naive update's AdamW temporaries (shared_sizes.opt_elems) taken over a dp shard
    mesh = PlanMesh(D, 1, tp, rtp, run_dp=D // tp, zero_dp=True)
    s = shared_sizes(cfg, lengths, mesh, pm)
    b = dtype_bytes(cfg.model)
    P, dp = s.counts.total, D // tp
    opt_shards = tp * dp if a.distributed_optimizer else tp
    engine_w = P * b / rtp
    ref_on = cfg.rl.uses_reference and a.reference_resident  # its weights; its boundary KV exists when it runs
    act = {p: v * a.activation_scale for p, v in naive_activations(cfg, lengths, mesh, pm, s).items()}
    engine_act = s.engine_tmp * a.activation_scale
    act["rollout"] = engine_act
    resident = dict(
        compute_weights=P * b / tp,
        master_weights=P * F32 / opt_shards if b != F32 else 0.0,
        optimizer_state=2 * s.counts.trainable * F32 / opt_shards,
        gradients=P * (F32 if a.fp32_main_grad else b) / tp,
        ref_weights=P * b / tp if ref_on else 0.0,
        rollout_weights=engine_w,
        rollout_kv=max(0.0, a.gpu_memory_utilization * a.hbm_bytes - engine_w - engine_act),
        boundary_kv=_boundary_kv(cfg, lengths, mesh, a.boundary_kv, cfg.rl.uses_reference),
        other=s.other_naive if a.inputs == "whole" else _micro_batch_inputs(cfg, lengths, mesh, s.r_mb),
    )
    phases = {p: {c: 0.0 for c in CLASSES} for p in PHASES}
    for p in PHASES:
        phases[p].update(resident, activations=act[p])
    phases = {p: {c: int(math.ceil(v)) for c, v in ph.items()} for p, ph in phases.items()}
    peaks = {p: sum(ph.values()) for p, ph in phases.items()}
    peak_phase = max(PHASES, key=peaks.get)
    return {
        "name": "megatron_vllm", "hypothetical": HYPOTHETICAL,
        "mesh": {"devices": D, "tp": tp, "dp": dp, "rollout_tp": rtp, "rollout_replicas": D // rtp,
                 "optimizer_shards": opt_shards},
        "assumption_values": dataclasses.asdict(a), "phases": phases, "peaks": peaks,
        "peak_bytes": peaks[peak_phase], "peak_gib": round(peaks[peak_phase] / GiB, 3), "peak_phase": peak_phase,
        "vllm_bytes": int(engine_w + resident["rollout_kv"] + engine_act),
        "paper_gib": PAPER_NAIVE_GIB, "vs_paper_gib": round(peaks[peak_phase] / GiB - PAPER_NAIVE_GIB, 3),
        "assumptions": assumptions(cfg, lengths, mesh, pm, a, ref_on),
    }


def _boundary_kv(cfg: Config, lengths: Lengths, mesh: PlanMesh, how: str, ref_on: bool) -> float:
    """Actor (+ reference) prefix KV and last logits of the step's rows on one device (heads over tp)."""
    if how == "none":
        return 0.0
    x, b = cfg.model.text, dtype_bytes(cfg.model)
    rows = cfg.rl.batch_prompts * (cfg.rollout.group_size if how == "per_sample" else 1)
    per_device = math.ceil(rows / mesh.batch_shards)
    heads = max(1, math.ceil(x.num_key_value_heads / mesh.tp))
    kv_row = x.num_hidden_layers * lengths.prompt_tokens * 2 * heads * x.head_dim * b + x.vocab_size * F32
    return per_device * kv_row * (2 if ref_on else 1)


def _micro_batch_inputs(cfg: Config, lengths: Lengths, mesh: PlanMesh, r_mb: int) -> float:
    """One micro-batch's inputs on the device (fp32 patches, ids / masks / positions) and the step's rollouts
    of this device's data-parallel rank (ids, log-probs, masks)."""
    v = cfg.model.vision
    patches = lengths.vision_tokens * v.spatial_merge_size**2
    rows = math.ceil(cfg.rl.batch_prompts * cfg.rollout.group_size / mesh.batch_shards)
    Tp, Tr = lengths.prompt_tokens, lengths.response_tokens
    return r_mb * (patches * v.patch_dim * F32 + (Tp + Tr) * 4 * 6) + rows * Tr * 4 * 3


def assumptions(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, a: Assumptions,
                ref_on: bool) -> list[str]:
    """Every assumption of the preset, in words (printed with it)."""
    hbm = a.hbm_bytes / GiB
    opt = (f"distributed optimizer: fp32 master weights and Adam moments over the data-parallel group, / (tp {mesh.tp}"
           f" x dp {mesh.dp})" if a.distributed_optimizer else f"no distributed optimizer: fp32 master weights and "
           f"Adam moments replicated over dp, / tp {mesh.tp}")
    bkv = {"per_sample": "actor and reference boundary KV of every sample (no prefix sharing)",
           "per_prompt": "boundary KV of one prefix per prompt (prefix sharing)",
           "none": "no boundary state (a serial stack holds none)"}[a.boundary_kv]
    return [
        HYPOTHETICAL,
        f"Megatron-Core mesh: tp {mesh.tp} x dp {mesh.dp} = {mesh.devices} devices (--train_fsdp groups become "
        f"data-parallel replicas); vLLM: {mesh.rollout_replicas} replicas at tp {mesh.rollout_tp}",
        "every role resident in every phase (naive co-residence: no offload, no sleep mode, no freeing)",
        f"actor compute weights in {cfg.model.dtype} over tp only (replicated over dp)",
        "gradients: " + ("Megatron's fp32 main_grad buffer over tp" if a.fp32_main_grad
                         else f"{cfg.model.dtype} gradients over tp"),
        opt,
        "reference weights over tp" if ref_on else "reference weights not resident (offloaded, or no reference)",
        f"vLLM's own weight copy at tp {mesh.rollout_tp}; its KV pool = gpu_memory_utilization "
        f"{a.gpu_memory_utilization:g} x HBM {hbm:g} GiB minus its weights and profiled activations (vLLM's "
        "sizing), preallocated and kept; vLLM holds gpu_memory_utilization x HBM whatever its tp",
        bkv + f", {lengths.prompt_tokens} prompt tokens per row, kv heads over tp",
        f"activations: our naive layout's per phase (x{a.activation_scale:g}; full sequences, per-sample prefixes, "
        "one micro-batch per program, no sequence parallelism: Megatron's would shrink them), " + pm.describe(),
        "inputs: " + ("one micro-batch's on the device, and this rank's rollouts" if a.inputs == "micro_batch"
                      else "the step's per-sample inputs whole on every device (our runtime's)"),
    ]


def _variants(a: Assumptions) -> dict[str, list[tuple[str, Assumptions]]]:
    """Per assumption, its alternatives: x0.5 / x2 for a number, the other choices for a switch."""
    r = dataclasses.replace
    return {
        "vLLM gpu_memory_utilization": [("x0.5", r(a, gpu_memory_utilization=a.gpu_memory_utilization * 0.5)),
                                        ("x2 (max 1)", r(a, gpu_memory_utilization=min(
                                            1.0, a.gpu_memory_utilization * 2)))],
        "distributed optimizer": [("off", r(a, distributed_optimizer=not a.distributed_optimizer))],
        "fp32 main_grad buffer": [("bf16 grads", r(a, fp32_main_grad=not a.fp32_main_grad))],
        "boundary KV": [(k, r(a, boundary_kv=k)) for k in ("per_sample", "per_prompt", "none") if k != a.boundary_kv],
        "reference resident": [("off", r(a, reference_resident=not a.reference_resident))],
        "activations": [("x0.5", r(a, activation_scale=a.activation_scale * 0.5)),
                        ("x2", r(a, activation_scale=a.activation_scale * 2))],
        "inputs on the device": [(k, r(a, inputs=k)) for k in ("micro_batch", "whole") if k != a.inputs],
    }


def sweep(cfg: Config, lengths: Lengths | None = None, devices: int | None = None,
          programs: ProgramModel | None = None, a: Assumptions = Assumptions()) -> list[dict]:
    """The peak under each assumption's alternatives (GiB per device), largest move first; plus the rollout TP
    x0.5 / x2 (vLLM's pool absorbs its weights: it moves little)."""
    base = megatron_vllm(cfg, lengths, devices, programs, a)["peak_bytes"] / GiB
    variants = _variants(a)
    rtp = a.rollout_tp or cfg.mesh.rollout_tp
    variants["vLLM rollout tp"] = [(f"tp {t}", dataclasses.replace(a, rollout_tp=t)) for t in (rtp // 2, rtp * 2)
                                   if t >= 1 and (devices or cfg.mesh.train_devices) % t == 0]
    rows = []
    for name, alts in variants.items():
        out = []
        for label, alt in alts:
            g = megatron_vllm(cfg, lengths, devices, programs, alt)["peak_bytes"] / GiB
            out.append({"label": label, "peak_gib": round(g, 3), "delta_gib": round(g - base, 3)})
        if out:
            rows.append({"assumption": name, "base_gib": round(base, 3), "variants": out,
                         "largest_move_gib": max(abs(v["delta_gib"]) for v in out)})
    return sorted(rows, key=lambda row: -row["largest_move_gib"])
