"""Step-time simulator: predict each phase's time and the step time of serial, rollplex and disaggregated.

``simulate(cfg, hw, lengths, devices)`` -> ``Simulation`` (per schedule: phases in seconds, step time,
spans for a Gantt chart). Reuses the planner's ``Lengths``, ``_Mesh``, ``param_counts`` and
``ProgramModel``. Hardware: ``rollplex_jax.hardware`` (presets and the CPU probe; its docstring lists
the datasheet numbers, efficiency factors and the probes that measure this CPU).

Cost of a program (per device): t = F / (peak x mfu) + E / ew_bw + A / att_bw + ops x op_overhead + comm
(a backward's E + A at ``hw.backward_bw`` where the preset measures one: the CPU preset), with
- F: matmul FLOPs. Forward per text token 2 x (linear params of the decoder layers) + attention
  4 H d tk_avg per layer (causal self part averaged: tk_avg = keys before it + t/2), lm head 2 D V per
  token whose logits are needed; per vision patch the patch embedding 2 x patch_dim x Dv, 2 x (linear
  params of a block) x depth + 4 dv s (s: patches it attends: the window, full-attention blocks the
  image); merger 2 x its params per merged token. Backward = 2 x forward FLOPs (1 x for the patch
  embedding: no input gradient); ``remat='layer'`` adds one forward.
- E, A: elementwise and attention-score bytes. Flash programs (GPU at scale): per token per layer
  (10 D + 4 F) x dtype bytes (norms, residuals, SwiGLU, rotary), per patch per block (10 dv + 4 Fv) x b
  + the pixels read (patch_dim x 4 B), A = 0; backward FLASH_EW_BWD x forward. Dense programs (today's
  JAX programs, the CPU preset): the bytes XLA's cost_analysis() counts, DENSE_* constants below
  (measured by compiling the real programs; tests/test_simulator.py checks them within 20%).
- input assembly (host, ``hw.host_copy_bw`` > 0 only: CPU): the patch bytes of the rows scored (B x G
  serial / disaggregated / overlap_only, B with prefix sharing) / host_copy_bw, on the critical path.
- ops: kernels per layer (forward 16, backward 2x), per vision block 16, x micro-batches.
- comm (training): TP all-reduces 4 (tp-1)/tp x tokens x D x b per layer forward (x2 backward) over
  NVLink; FSDP all-gather of the weights per forward and backward, reduce-scatter of gradients.

Phases:
- rollout (engine replicas of ``rollout_tp`` devices, rows = B G / replicas, waves of ``max_batch``):
  prefill = prefill_fixed + F_prefill / (rollout_tp x peak x mfu_prefill); engine vision = images x
  (engine_image_s + patches x engine_patch_s) where the patch cost is measured (CPU), else images x
  engine_image_s + its FLOPs / (rollout_tp x peak x mfu_prefill) + bytes / ew_bw;
  decode = waves x Tr_max x max(step floor, weight bytes / rollout_tp / (hbm x decode_bw_eff))
           + rows x Tr_mean x (KV bytes read per token at mean context + F per token / peak)
  i.e. the batch steps until its LONGEST answer (Tr_max) while the KV reads and FLOPs follow the
  tokens actually generated (Tr_mean per answer).
- reference: serial = full forward over B G rows of Tp + Tr_max tokens (padded), vision per row;
  rollplex = prefix forward over B' rows (B with prefix sharing, B G without) of Tp tokens + suffix
  forward over B G rows of Tr_max tokens attending Tp + Tr_max keys.
- actor: serial = forward + backward over B G full rows; rollplex = prefix forward (+ vision) over B'
  rows (overlapped), then suffix forward + backward and the prefix backward (2 x its forward).
- update: memory-bound: per trainable param on its shard 4 (fp32 master r/w if bf16) + 16 (two Adam
  moments r/w) + 2b (grad read, param write) bytes / hbm; offload adds 3 x 4 x 2 bytes over the host
  link (master + moments in and out); + ops per parameter tensor.
- weight sync: serial / disaggregated: the engine gets a full copy (P b / rollout_tp per device) each
  step, over NVLink (colocated: reshard) or the network (disaggregated: train pool -> rollout pool);
  rollplex: only the rebuilt part (planner's rule max(0, P/rollout_tp - P/(fsdp tp)) b per device).
- host: ``hw.host_step_s`` per step (rewards, scheduling, barriers) + input assembly (above).

Schedules:
- serial: host + input assembly + sync + rollout + reference(full) + actor(full fwd+bwd) + update.
- rollplex: host + sync(rebuilt) + overlap(rollout, prefix) + ref suffix + actor suffix/prefix bwd +
  update; ``overlap_only`` = no prefix sharing, ``sharing_only`` = no overlap (prefix after decode).
- overlap (``overlap_stage``): the prefix programs run at (1 - decode_util) of their speed during the
  decode (they get the compute the decode leaves idle) and the decode is slowed by ``interference`` x
  the co-running time; what is left of the prefix after the decode runs at full speed. Critical-path
  saving = T_prefill_decode + T_prefix - stage = min(T_prefix - decode slowdown, ~T_decode) (the
  paper's bound; the prefill runs before the prefix programs start: they need the whole device).
- disaggregated: the paper's baseline, synchronous on-policy: rollout on ``split`` x D devices, training
  (reference + actor, full sequences, no prefix sharing) on the rest, weight transfer over the network
  each step, NOT pipelined (the pools idle alternately): step = host + rollout(D_r) + transfer +
  reference(D_t) + actor(D_t) + update(D_t).
"""

from __future__ import annotations

import dataclasses
import math

from rollplex_jax.config import Config
from rollplex_jax.hardware import Hardware
from rollplex_jax.planner import (
    CURRENT_PROGRAMS,
    DEFAULT_PROGRAMS,
    Lengths,
    ProgramModel,
    param_counts,
)
from rollplex_jax.planner import (
    PlanMesh as _Mesh,
)

SCHEDULES = ("serial", "rollplex", "overlap_only", "sharing_only", "disaggregated")
PHASES = ("host", "input_prep", "weight_sync", "prefill", "decode", "vision", "ref_prefix", "actor_prefix", "reference",
          "actor_fwd", "actor_bwd", "update")
OPS_PER_LAYER = 16
# Elementwise bytes of the DENSE program model (today's JAX programs, as XLA compiles them on CPU): the
# bytes XLA's cost_analysis() counts ("bytes accessed": every fusion's operands and outputs), measured
# 2026-11-30 on the demo model (fp32) by compiling the real programs (prefix_forward, actor._logprobs,
# their jax.grad, vision_forward) at several shapes and separating the parts that scale with the
# attention score count from the rest (tokens / patches held fixed):
# - text attention, per [head, query, key] score element and layer: forward 32 B, backward 56 B;
# - vision attention, per score element: forward 16 B, backward 56 B;
# - the rest, per token and layer: 2.8 x (10 D + 4 F) x dtype bytes; per patch and block 2.1 x
#   (10 Dv + 4 Fv) x dtype bytes, plus the patch embedding's pixel read (patch_dim x 4 B, fp32 pixels);
# - backward of the rest: 3.3 x its forward's bytes.
# Together these reproduce cost_analysis() of every bench_cpu program within ~15% (tests/test_simulator.py).
# The flash model (GPU at scale: fused kernels) keeps the bytes fused kernels touch: (10 D + 4 F) b per
# token and layer, no score tensors.
DENSE_TEXT_ATT_FWD, DENSE_VIS_ATT_FWD, DENSE_ATT_BWD = 32, 16, 56
DENSE_TEXT_EW, DENSE_VIS_EW, DENSE_EW_BWD = 2.8, 2.1, 3.3
FLASH_EW_BWD = 20 / 21  # flash: backward elementwise bytes / forward's (unchanged since the first model)
_B = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float = 0.0  # matmul FLOPs
    ew_bytes: float = 0.0  # elementwise bytes (norms, activations, residuals, ...) at hw.ew_bw
    ops: float = 0.0
    comm_bytes: float = 0.0
    att_bytes: float = 0.0  # dense attention score bytes (softmax-class traffic) at hw.att_bw
    embed_flops: float = 0.0  # part of ``flops`` whose input needs no gradient (patch embedding): bwd 1x
    att_elems: float = 0.0  # dense attention score elements (sets the backward's score bytes)

    def __add__(self, o: Cost) -> Cost:
        return Cost(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o), strict=True)))

    def scale(self, k: float, ops: float | None = None) -> Cost:
        out = Cost(*(a * k for a in dataclasses.astuple(self)))
        return out if ops is None else dataclasses.replace(out, ops=self.ops * ops)


def time_of(c: Cost, hw: Hardware, dtype: str, mfu: float, comm_bw: float | None = None,
            backward: bool = False) -> float:
    rate = hw.bytes_rate(c.ew_bytes + c.att_bytes, backward)
    if rate:  # measured per working set (CPU): one rate for all the bytes of this call
        mem = (c.ew_bytes + c.att_bytes) / rate
    elif backward and hw.backward_bw:
        mem = (c.ew_bytes + c.att_bytes) / hw.backward_bw
    else:
        mem = c.ew_bytes / hw.ew_bw + c.att_bytes / hw.att_bw
    return (c.flops / (hw.flops(dtype) * mfu) + mem + c.ops * hw.op_overhead_s
            + c.comm_bytes / (comm_bw or hw.intra_bw))


def _text_linear(cfg: Config) -> float:
    x = cfg.model.text
    D, F, H, K, d = x.hidden_size, x.intermediate_size, x.num_attention_heads, x.num_key_value_heads, x.head_dim
    return D * (H * d) * 2 + D * (K * d) * 2 + 3 * D * F  # q, o, k, v, gate/up/down per layer


def _vision_linear_block(cfg: Config) -> float:
    v = cfg.model.vision
    return 4 * v.hidden_size**2 + 3 * v.hidden_size * v.intermediate_size


def text_forward(cfg: Config, rows: float, t: float, past: float, logits_tokens: float, pm: ProgramModel,
                 saved: bool = False) -> Cost:
    """Decoder forward over rows x t tokens attending ``past`` earlier keys + causal self (whole model).
    ``saved`` is kept for callers (the dense model's backward bytes include what the forward saves)."""
    x, b = cfg.model.text, _B[cfg.model.dtype]
    L, D, F, H, d, V = (x.num_hidden_layers, x.hidden_size, x.intermediate_size, x.num_attention_heads,
                        x.head_dim, x.vocab_size)
    tok = rows * t
    flops = tok * L * (2 * _text_linear(cfg) + 4 * H * d * (past + t / 2)) + rows * logits_tokens * 2 * D * V
    ew = tok * L * (10 * D + 4 * F) * b + rows * logits_tokens * V * 4 * 3
    att = 0.0
    if pm.attention == "dense":
        ew = tok * L * (10 * D + 4 * F) * b * DENSE_TEXT_EW + rows * logits_tokens * V * 4 * 3
        att = rows * L * H * t * (past + t)
    return Cost(flops, ew, L * OPS_PER_LAYER + 8, att_bytes=att * DENSE_TEXT_ATT_FWD, att_elems=att)


def vision_forward(cfg: Config, images: float, patches_per_image: float, pm: ProgramModel, saved: bool = False,
                   per_call_images: float | None = None) -> Cost:
    """Vision tower over ``images`` images of n patches (``per_call_images`` and ``saved`` are kept for
    callers; attention is per window / per image in every program model)."""
    if images <= 0 or patches_per_image <= 0:
        return Cost()
    v, b = cfg.model.vision, _B[cfg.model.dtype]
    n = patches_per_image
    total = images * n
    # Windowed blocks attend within a window, full-attention blocks within the image (both program
    # models: today's programs gather each segment and attend densely within it, vision.py).
    win = (v.window_size // v.patch_size) ** 2
    full = len(v.fullatt_block_indexes)
    s = (full * n + (v.depth - full) * min(n, win)) / v.depth
    unit = v.spatial_merge_size**2
    mm = v.hidden_size * unit
    embed = total * 2 * v.patch_dim * v.hidden_size  # patch embedding (a Conv3d with stride = kernel)
    flops = total * v.depth * (2 * _vision_linear_block(cfg) + 4 * v.hidden_size * s) \
        + (total / unit) * 2 * (mm * mm + mm * v.out_hidden_size) + embed
    ew = total * v.depth * (10 * v.hidden_size + 4 * v.intermediate_size) * b + total * v.patch_dim * 4
    att = 0.0
    if pm.attention == "dense":
        ew = total * v.depth * (10 * v.hidden_size + 4 * v.intermediate_size) * b * DENSE_VIS_EW \
            + total * v.patch_dim * 4
        att = total * v.depth * v.num_heads * s
    return Cost(flops, ew, v.depth * OPS_PER_LAYER + 8, att_bytes=att * DENSE_VIS_ATT_FWD, embed_flops=embed,
                att_elems=att)


def backward_of(fwd: Cost, pm: ProgramModel, cfg: Config) -> Cost:
    """Backward: 2x forward FLOPs (1x for the patch embedding: no input gradient) and 2x ops; bytes: dense
    programs DENSE_EW_BWD x the forward's elementwise bytes and DENSE_ATT_BWD bytes per score element
    (module constants), flash FLASH_EW_BWD x the forward's bytes; remat='layer' recomputes the forward once."""
    extra = fwd if pm.remat == "layer" else Cost()
    if pm.attention == "dense":
        ew, att = fwd.ew_bytes * DENSE_EW_BWD, fwd.att_elems * DENSE_ATT_BWD
    else:
        ew, att = fwd.ew_bytes * FLASH_EW_BWD, 0.0
    return Cost(2 * fwd.flops - fwd.embed_flops, ew, 2 * fwd.ops, 2 * fwd.comm_bytes, att) + extra


def _comm(cfg: Config, mesh: _Mesh, tokens_dev: float, weights: float, passes: int) -> float:
    """Per device TP all-reduce bytes and FSDP weight gathers of ``passes`` passes (fwd = 1, bwd = 2)."""
    x, b = cfg.model.text, _B[cfg.model.dtype]
    tp_bytes = 0.0 if mesh.tp == 1 else 4 * (mesh.tp - 1) / mesh.tp * tokens_dev * x.hidden_size * b \
        * x.num_hidden_layers
    fsdp_bytes = 0.0 if mesh.fsdp == 1 else weights * b / mesh.tp * (mesh.fsdp - 1) / mesh.fsdp
    return passes * (tp_bytes + fsdp_bytes)


@dataclasses.dataclass
class Schedule:
    name: str
    phases: dict  # {phase: seconds of work}
    step_s: float
    spans: list  # [(lane, name, start, end)]
    notes: str = ""


@dataclasses.dataclass
class Simulation:
    schedules: dict
    hardware: Hardware
    lengths: Lengths
    devices: int
    response_mean: float
    programs: ProgramModel
    assumptions: list
    details: dict

    def speedup(self, a: str, b: str) -> float:
        return self.schedules[b].step_s / self.schedules[a].step_s

    def to_dict(self) -> dict:
        return {
            "hardware": {k: v for k, v in self.hardware.to_dict().items()},
            "devices": self.devices, "lengths": dataclasses.asdict(self.lengths),
            "response_mean": self.response_mean, "programs": dataclasses.asdict(self.programs),
            "schedules": {n: {"step_s": s.step_s, "phases_s": s.phases, "notes": s.notes}
                          for n, s in self.schedules.items()},
            "speedup": {"rollplex_over_serial": self.speedup("rollplex", "serial"),
                        "rollplex_over_disaggregated": self.speedup("rollplex", "disaggregated"),
                        "overlap_only_over_serial": self.speedup("overlap_only", "serial"),
                        "sharing_only_over_serial": self.speedup("sharing_only", "serial")},
            "assumptions": self.assumptions, "details": self.details,
        }


def overlap_stage(t_prefix: float, t_decode: float, decode_util: float, interference: float) -> tuple[float, float]:
    """(stage time, decode slowdown) of running the prefix work beside the decode (module doc).

    The prefix progresses at (1 - decode_util) of its standalone speed while the decode runs; the decode
    is slowed by ``interference`` x (time both run). Saving = t_prefix + t_decode - stage, which is at most
    min(t_prefix, t_decode) and at least 0 (never worse than running them one after the other)."""
    if t_prefix <= 0 or t_decode <= 0:
        return t_prefix + t_decode, 0.0
    rate = max(1e-9, 1.0 - decode_util)
    # co-running time c: the prefix finishes within the (slowed) decode if t_prefix / rate <= decode'
    slowed = t_decode * (1 + interference)
    if t_prefix / rate <= slowed:
        c = t_prefix / rate
        stage = t_decode + interference * c
        slowdown = interference * c
    else:
        stage = slowed + (t_prefix - slowed * rate)
        slowdown = interference * t_decode
    stage = min(stage, t_prefix + t_decode)  # never worse than serialising them
    return stage, slowdown


def simulate(cfg: Config, hw: Hardware, lengths: Lengths | None = None, devices: int | None = None, *,
             response_mean: float | None = None, programs: ProgramModel | None = None,
             disagg_split: float = 0.5) -> Simulation:
    lengths = lengths or Lengths.from_config(cfg)
    mesh = _Mesh.of(cfg, devices)
    pm = programs or (CURRENT_PROGRAMS if hw.default_programs == "dense" else DEFAULT_PROGRAMS)
    m, x, v = cfg.model, cfg.model.text, cfg.model.vision
    dt, b = m.dtype, _B[m.dtype]
    counts = param_counts(cfg)
    P = counts.total
    D = mesh.devices
    B, G = cfg.rl.batch_prompts, cfg.rollout.group_size
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    Tm = min(Tr, response_mean if response_mean else Tr)
    unit = v.spatial_merge_size**2
    n_img = Tv * unit  # patches per prompt (one image / video)
    use_ref = cfg.rl.kl_mode != "off"
    text_P = P - counts.vision
    notes = []

    def rollout(n_dev: int) -> tuple[float, float, float]:
        """(prefill, vision in the engine, decode) seconds on a pool of n_dev devices."""
        replicas = max(1, n_dev // mesh.rollout_tp)
        rows = math.ceil(B * G / replicas)
        waves = math.ceil(rows / cfg.rollout.max_batch)
        rtp = mesh.rollout_tp
        pf = text_forward(cfg, rows, Tp, 0, 1, DEFAULT_PROGRAMS)  # engines use flash kernels
        vis = vision_forward(cfg, rows if Tv else 0, n_img, DEFAULT_PROGRAMS)
        t_pf = hw.prefill_fixed_s * waves + pf.flops / (rtp * hw.flops(dt) * hw.mfu_prefill) \
            + pf.ew_bytes / rtp / hw.ew_bw
        t_vis = (rows if Tv else 0) * hw.engine_image_s
        if hw.engine_patch_s:  # measured per patch (CPU probe): replaces the FLOP / byte estimate
            t_vis += (rows if Tv else 0) * n_img * hw.engine_patch_s
        else:
            t_vis += vis.flops / (rtp * hw.flops(dt) * hw.mfu_prefill) + vis.ew_bytes / rtp / hw.ew_bw
        kv_tok = x.num_hidden_layers * 2 * max(1, math.ceil(x.num_key_value_heads / rtp)) * x.head_dim * b
        w_step = max(hw.decode_step_floor_s, text_P * b / rtp / (hw.hbm_bw * hw.decode_bw_eff))
        per_tok = kv_tok * (Tp + Tm / 2) / (hw.hbm_bw * hw.decode_bw_eff) \
            + (2 * text_P / rtp) / (hw.flops(dt) * hw.mfu_prefill)
        t_dec = waves * Tr * w_step + rows * Tm * per_tok
        return t_pf, t_vis, t_dec

    def training(n_dev: int, sharing: bool, split: bool, tm: _Mesh | None = None) -> dict:
        """Seconds of reference / actor work on a pool of n_dev devices (the training mesh scaled)."""
        tm = tm or dataclasses.replace(mesh, devices=n_dev)

        def tt(c: Cost, _hw, _dt, mfu: float, backward: bool = False) -> float:  # tp divides compute and bytes
            return time_of(Cost(c.flops / tm.tp, c.ew_bytes / tm.tp, c.ops, c.comm_bytes, c.att_bytes / tm.tp), hw, dt,
                           mfu, backward=backward)
        bs = n_dev // tm.tp
        n_mb = max(1, math.ceil(B * G / min(cfg.rl.micro_batch, B * G)))
        rows_mb = B * G / n_mb / bs  # rows per device per micro-batch
        out = {}
        if not split:
            t_full = Tp + Tr
            fwd = text_forward(cfg, rows_mb, t_full, 0, Tr, pm) + vision_forward(cfg, rows_mb if Tv else 0, n_img, pm)
            fwd_s = text_forward(cfg, rows_mb, t_full, 0, Tr, pm, saved=True) \
                + vision_forward(cfg, rows_mb if Tv else 0, n_img, pm, saved=True)
            fwd = dataclasses.replace(fwd, comm_bytes=_comm(cfg, tm, rows_mb * t_full, P, 1))
            fwd_s = dataclasses.replace(fwd_s, comm_bytes=fwd.comm_bytes)
            out["reference"] = n_mb * tt(fwd, hw, dt, hw.mfu_forward) if use_ref else 0.0
            out["actor_fwd"] = n_mb * tt(fwd_s, hw, dt, hw.mfu_forward)
            out["actor_bwd"] = n_mb * tt(backward_of(fwd_s, pm, cfg), hw, dt, hw.mfu_backward, True)
            return out
        rows_p = (B if sharing else B * G) / bs
        vis_in = not cfg.optim.freeze_vision
        vis = vision_forward(cfg, rows_p if Tv else 0, n_img, pm, saved=vis_in)
        a_pre = text_forward(cfg, rows_p, Tp, 0, 1, pm, saved=True)
        a_pre = dataclasses.replace(a_pre, comm_bytes=_comm(cfg, tm, rows_p * Tp, text_P, 1))
        r_pre = dataclasses.replace(text_forward(cfg, rows_p, Tp, 0, 1, pm), comm_bytes=a_pre.comm_bytes)
        rows_s = B * G / bs
        suf = text_forward(cfg, rows_s, Tr, Tp, Tr, pm)
        suf = dataclasses.replace(suf, comm_bytes=_comm(cfg, tm, rows_s * Tr, text_P, 1))
        suf_s = dataclasses.replace(text_forward(cfg, rows_s, Tr, Tp, Tr, pm, saved=True), comm_bytes=suf.comm_bytes)
        out["vision"] = tt(vis, hw, dt, hw.mfu_forward)
        out["actor_prefix"] = tt(a_pre, hw, dt, hw.mfu_forward)
        out["ref_prefix"] = tt(r_pre, hw, dt, hw.mfu_forward) if use_ref else 0.0
        out["reference"] = tt(suf, hw, dt, hw.mfu_forward) if use_ref else 0.0
        out["actor_fwd"] = tt(suf_s, hw, dt, hw.mfu_forward)
        pre_bwd = backward_of(a_pre + (vis if vis_in else Cost()), pm, cfg)
        out["actor_bwd"] = tt(backward_of(suf_s, pm, cfg) + pre_bwd.scale(1.0, ops=0), hw, dt, hw.mfu_backward,
                              True)
        return out

    def update(n_dev: int) -> float:
        shard = counts.trainable / n_dev
        master = 8 if dt != "float32" else 0
        byts = shard * (master + 16 + 4 + 2 * b if dt == "float32" else master + 16 + 2 * b)
        t = byts / (hw.hbm_bw * 0.8) + hw.op_overhead_s * 6 * _n_tensors(cfg)
        if cfg.memory.optimizer_policy == "offload":
            t += shard * (4 * 3 if dt != "float32" else 8) * 2 / hw.host_bw
        return t

    rebuilt = max(0.0, P / mesh.rollout_tp - P / mesh.weight_shards) * b
    full_copy = P * b / mesh.rollout_tp
    sync_coloc = full_copy / hw.intra_bw
    sync_rollplex = rebuilt / hw.intra_bw
    scheds = {}

    t_pf, t_vis, t_dec = rollout(D)
    upd = update(D)

    def build(name: str, phases: dict, overlap: bool) -> Schedule:
        ph = {p: phases.get(p, 0.0) for p in PHASES}
        spans, t = [], 0.0

        def lane(lane_name, phase, dur, start):
            if dur > 0:
                spans.append((lane_name, phase, start, start + dur))
            return start + dur

        t = lane("host", "host", ph["host"], t)
        t = lane("host", "input_prep", ph["input_prep"], t)
        t = lane("weights", "weight_sync", ph["weight_sync"], t)
        t = lane("rollout", "prefill", ph["prefill"], t)
        t_roll_vis = phases.get("engine_vision", 0.0)
        t = lane("rollout", "engine vision", t_roll_vis, t)
        pre = ph["vision"] + ph["actor_prefix"] + ph["ref_prefix"]
        if overlap and pre > 0:
            window = ph["decode"]
            if hw.overlap_window == "rollout":  # the prefix programs are dispatched before the engine's prefill
                t -= ph["prefill"] + t_roll_vis
                window += ph["prefill"] + t_roll_vis
            stage, slow = overlap_stage(pre, window, hw.decode_util, hw.interference)
            lane("rollout", "decode", ph["decode"] + slow, t + window - ph["decode"])
            s, stretch = t, min(1 / max(1 - hw.decode_util, 1e-9), stage / pre)  # drawn at the shared rate
            for p in ("vision", "actor_prefix", "ref_prefix"):
                s = lane("prefix", p, ph[p] * stretch, s)
            t = t + stage
            ph["decode_slowdown"] = slow
        else:
            t = lane("rollout", "decode", ph["decode"], t)
            if name == "disaggregated":
                t = lane("weights", "transfer", phases.get("transfer", 0.0), t)
            for p in ("vision", "actor_prefix", "ref_prefix"):
                t = lane("prefix", p, ph[p], t)
        t = lane("reference", "reference", ph["reference"], t)
        t = lane("actor", "actor_fwd", ph["actor_fwd"], t)
        t = lane("actor", "actor_bwd", ph["actor_bwd"], t)
        t = lane("update", "update", ph["update"], t)
        ph["engine_vision"] = t_roll_vis
        if "transfer" in phases:
            ph["transfer"] = phases["transfer"]
        return Schedule(name, ph, t, spans)

    def input_prep(rows: float) -> float:
        """Host-side assembly of ``rows`` model-input rows (their patches gathered and put on the device), when
        it is on the critical path (``hw.host_copy_bw`` > 0: today's runtime on CPU)."""
        if not hw.host_copy_bw or not Tv:
            return 0.0
        return rows * n_img * v.patch_dim * 4 / hw.host_copy_bw

    base = {"host": hw.host_step_s, "prefill": t_pf, "engine_vision": t_vis, "decode": t_dec, "update": upd}
    scheds["serial"] = build("serial", {**base, "input_prep": input_prep(B * G), "weight_sync": sync_coloc,
                                        **training(D, False, False)}, False)
    for name, sharing, overlap in (("rollplex", True, True), ("overlap_only", False, True),
                                   ("sharing_only", True, False)):
        scheds[name] = build(name, {**base, "input_prep": input_prep(B if sharing else B * G),
                                    "weight_sync": sync_rollplex, **training(D, sharing, True)}, overlap)
    # disaggregated: pools of split x D (rollout) and the rest (training)
    d_r = max(mesh.rollout_tp, int(round(D * disagg_split / mesh.rollout_tp)) * mesh.rollout_tp)
    d_t = D - d_r
    if d_t < mesh.tp:  # too few devices to split: pools of rollout_tp + tp devices (more than D)
        d_t = mesh.tp
        notes.append(f"disaggregated: {D} devices cannot be split; modelled with {d_r} + {d_t} devices")
    if d_t % mesh.tp:
        raise ValueError(f"disaggregated: training pool of {d_t} devices is not a multiple of train_tp={mesh.tp}")
    if d_t % mesh.weight_shards:  # fewer devices than one fsdp x tp group: shrink fsdp to fit the pool
        notes.append(f"disaggregated: training pool of {d_t} devices runs fsdp {d_t // mesh.tp} x tp {mesh.tp}")
    train_mesh = _Mesh(d_t, max(1, min(mesh.fsdp, d_t // mesh.tp)), mesh.tp, mesh.rollout_tp)
    r_pf, r_vis, r_dec = rollout(d_r)
    transfer = full_copy / hw.inter_bw if D > 1 else 0.0
    scheds["disaggregated"] = build("disaggregated", {
        "host": hw.host_step_s, "input_prep": input_prep(B * G), "prefill": r_pf, "engine_vision": r_vis,
        "decode": r_dec, "transfer": transfer,
        "update": update(d_t), **training(d_t, False, False, train_mesh)}, False)
    scheds["disaggregated"].notes = f"rollout pool {d_r} devices, training pool {d_t}; synchronous, not pipelined"

    assumptions = [
        f"hardware {hw.name}: {hw.source}",
        f"peak {hw.flops(dt) / 1e12:.3g} TFLOP/s ({dt}), HBM {hw.hbm_bw / 1e9:.0f} GB/s, NVLink {hw.intra_bw / 1e9:.0f}"
        f" GB/s, network {hw.inter_bw / 1e9:.0f} GB/s per device; MFU prefill {hw.mfu_prefill}, forward "
        f"{hw.mfu_forward}, backward {hw.mfu_backward}; decode at {hw.decode_bw_eff} of HBM bandwidth with a "
        f"{hw.decode_step_floor_s * 1e3:.2f} ms per-step floor",
        f"overlap: decode keeps {hw.decode_util:.2f} of the compute busy (the prefix runs at the rest); interference:"
        f" decode slowed by {hw.interference:.2f} x the co-running time",
        f"lengths: prompt {Tp} ({Tv} vision tokens = {n_img} patches), answers mean {Tm:g} / max {Tr}: decode steps"
        " = max (the batch runs until its longest answer), KV reads and FLOPs = mean; scoring/training pad to max",
        pm.describe(),
        f"devices {D}: training fsdp {mesh.fsdp} x tp {mesh.tp}, rollout tp {mesh.rollout_tp} "
        f"({D // mesh.rollout_tp} replicas)",
        f"weight sync per step: serial/disaggregated a full engine copy ({full_copy / 1e9:.2f} GB per device; "
        f"NVLink colocated, network disaggregated), rollplex only the rebuilt part ({rebuilt / 1e9:.2f} GB, planner)",
        f"disaggregated: {d_r} rollout + {d_t} training devices, synchronous on-policy, not pipelined",
        f"host work {hw.host_step_s} s per step" + (f"; input assembly on the critical path at "
                                                     f"{hw.host_copy_bw / 1e9:.2g} GB/s (patch bytes of the rows "
                                                     "scored: B x G serial, B' rollplex)" if hw.host_copy_bw
                                                     else "; input assembly off the critical path"),
        *notes,
    ]
    details = {"rollout_rows_per_replica": math.ceil(B * G / max(1, D // mesh.rollout_tp)),
               "params": P, "disagg_pools": [d_r, d_t]}
    return Simulation(scheds, hw, lengths, D, Tm, pm, assumptions, details)


def _n_tensors(cfg: Config) -> int:
    return 12 * cfg.model.text.num_hidden_layers + 12 * cfg.model.vision.depth + 6


# --- reporting ---------------------------------------------------------------------------------------------

TABLE_SCHEDULES = SCHEDULES


def table(sim: Simulation) -> str:
    names = TABLE_SCHEDULES
    keys = [*PHASES[:4], "engine_vision", *PHASES[4:], "transfer", "decode_slowdown"]
    w = 16
    lines = [f"{'phase (s)':<{w}}" + "".join(f"{n:>15}" for n in names)]
    for k in keys:
        vals = [sim.schedules[n].phases.get(k, 0.0) for n in names]
        if any(vals):
            lines.append(f"{k:<{w}}" + "".join(f"{val:>15.4g}" for val in vals))
    lines.append(f"{'STEP (critical)':<{w}}" + "".join(f"{sim.schedules[n].step_s:>15.4g}" for n in names))
    lines += ["", f"speedup rollplex / serial:        {sim.speedup('rollplex', 'serial'):.3f}x",
              f"speedup rollplex / disaggregated: {sim.speedup('rollplex', 'disaggregated'):.3f}x",
              f"speedup overlap_only / serial:    {sim.speedup('overlap_only', 'serial'):.3f}x",
              f"speedup sharing_only / serial:    {sim.speedup('sharing_only', 'serial'):.3f}x",
              "", "assumptions:"]
    lines += [f"  {i}. {a}" for i, a in enumerate(sim.assumptions, 1)]
    return "\n".join(lines)


def plot(sim: Simulation, path: str, schedules=("serial", "rollplex", "disaggregated")) -> None:
    """Gantt chart of each schedule's simulated step, one panel per schedule, same time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in schedules if n in sim.schedules]
    lanes = ["host", "weights", "rollout", "prefix", "reference", "actor", "update"]
    phases = sorted({s[1] for n in names for s in sim.schedules[n].spans})
    cmap = plt.get_cmap("tab20")
    colors = {p: cmap(i % 20) for i, p in enumerate(phases)}
    tmax = max(sim.schedules[n].step_s for n in names)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.9 * len(names) + 0.8), sharex=True)
    for ax, n in zip(axes, names, strict=True):
        sch = sim.schedules[n]
        for lane_name, ph, s, e in sch.spans:
            y = lanes.index(lane_name)
            ax.barh(y, e - s, left=s, color=colors[ph], edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{n}: step {sch.step_s:.3g} s", fontsize=9, loc="left")
        ax.set_xlim(0, tmax * 1.02)
    axes[-1].set_xlabel("simulated time in one RL step (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in phases]
    fig.legend(handles, phases, loc="center right", fontsize=7)
    fig.suptitle(f"simulated step on {sim.devices} x {sim.hardware.name}", fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.85, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sweep(cfg: Config, hw: Hardware, lengths: Lengths, devices: int | None = None, *,
          response_mean: float | None = None, programs: ProgramModel | None = None,
          factors=(0.5, 2.0)) -> list[dict]:
    """Rollplex/serial speedup when one assumption is scaled by each factor; sorted by the largest move."""
    base_sim = simulate(cfg, hw, lengths, devices, response_mean=response_mean, programs=programs)
    base = base_sim.speedup("rollplex", "serial")
    rm = base_sim.response_mean
    knobs = {
        "decode efficiency (decode_bw_eff, step floor / f)": lambda f: dict(
            hw=hw.replace(decode_bw_eff=min(1.0, hw.decode_bw_eff * f),
                          decode_step_floor_s=hw.decode_step_floor_s / f)),
        "interference factor": lambda f: dict(hw=hw.replace(interference=hw.interference * f)),
        "decode compute share (decode_util)": lambda f: dict(hw=hw.replace(decode_util=min(0.95, hw.decode_util * f))),
        "training MFU": lambda f: dict(hw=hw.replace(mfu_forward=min(1, hw.mfu_forward * f),
                                                     mfu_backward=min(1, hw.mfu_backward * f))),
        "response length (mean and max)": lambda f: dict(
            lengths=dataclasses.replace(lengths, response_tokens=max(1, round(lengths.response_tokens * f))),
            response_mean=max(1.0, rm * f)),
        "vision tokens": lambda f: dict(lengths=_scale_vision(lengths, f)),
    }
    out = []
    for name, mk in knobs.items():
        row = {"assumption": name, "base": base}
        for f in factors:
            kw = {"hw": hw, "lengths": lengths, "response_mean": response_mean, **mk(f)}
            s = simulate(cfg, kw["hw"], kw["lengths"], devices, response_mean=kw["response_mean"], programs=programs)
            row[f"x{f:g}"] = s.speedup("rollplex", "serial")
        row["range"] = max(row[f"x{f:g}"] for f in factors) - min(row[f"x{f:g}"] for f in factors)
        out.append(row)
    return sorted(out, key=lambda r: -r["range"])


def _scale_vision(lengths: Lengths, f: float) -> Lengths:
    tv = max(0, round(lengths.vision_tokens * f))
    text = lengths.prompt_tokens - lengths.vision_tokens
    return dataclasses.replace(lengths, vision_tokens=tv, prompt_tokens=max(1, text + tv))


def sweep_table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k.startswith("x")]
    lines = [f"{'assumption':<52}{'base':>8}" + "".join(f"{k:>8}" for k in keys) + f"{'range':>8}"]
    for r in rows:
        lines.append(f"{r['assumption']:<52}{r['base']:>8.3f}" + "".join(f"{r[k]:>8.3f}" for k in keys)
                     + f"{r['range']:>8.3f}")
    return "\n".join(lines)
