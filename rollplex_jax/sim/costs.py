"""What one program costs: FLOPs, bytes, kernel launches and communication, and their time on a device.

Cost of a program (per device): t = F / (peak x mfu) + E / ew_bw + A / att_bw + ops x op_overhead + comm
(a backward's E + A at ``hw.backward_bw`` where the preset measures one: the CPU preset; with a
measured ``bw_curve`` one rate for all the bytes of a call, ``Hardware.bytes_rate``), with
- F: matmul FLOPs. Forward per text token 2 x (linear params of the decoder layers) + attention
  4 H d tk per layer, lm head 2 D V per token whose logits are needed; tk = keys before the call + the
  call's own: flash kernels skip the masked half of the causal part (tk = past + t/2 on average), dense
  programs compute every score, masked ones too (tk = past + t); per vision patch the patch embedding
  2 x patch_dim x Dv, 2 x (linear params of a block) x depth + 4 dv s (s: patches it attends: the window,
  full-attention blocks the image); merger 2 x its params per merged token. Backward = 2 x forward FLOPs
  (1 x for the patch embedding: no input gradient); ``remat='layer'`` adds one forward. These are the
  dot_general FLOPs of the real dense programs, exactly (tests/test_simulator.py); XLA's own count adds
  the elementwise work (4-7% more at bench_cpu's shapes), which the time model covers by its bytes.
- E, A: elementwise and attention-score bytes. Flash programs (GPU at scale): per token per layer
  (10 D + 4 F) x dtype bytes (norms, residuals, SwiGLU, rotary), per patch per block (10 dv + 4 Fv) x b
  + the pixels read (patch_dim x 4 B), A = 0; backward FLASH_EW_BWD x forward. Dense programs (``--attention=dense
  --remat=none``, the CPU preset): the bytes XLA's cost_analysis() counts, DENSE_* constants below
  (measured by compiling the real programs; tests/test_simulator.py holds them within 15% of XLA on the
  full-sequence programs, within a factor of 2 on the split ones: at their few rows XLA fuses otherwise).
  The actor's prefix with saved residuals also writes them (``planner.prefix_residual_bytes``).
- ops: kernels per layer (forward 16, backward 2x), per vision block 16, x micro-batches.
- comm (training): TP all-reduces 4 (tp-1)/tp x tokens x D x b per layer forward (x2 backward) over
  NVLink; FSDP all-gather of the weights per forward and backward, reduce-scatter of gradients. The gradient
  sum over dp (``dp_allreduce_bytes``: params replicated over dp, the batch split over it) is a phase of its
  own (``phases.dp_allreduce``), per optimizer step: a ring all-reduce moves 2 (dp-1)/dp x the device's
  gradient shard (P_t / (fsdp tp) x b, P_t trainable params); with ZeRO-1 (``--optimizer_shard``) a
  reduce-scatter of the gradients + an all-gather of the updated compute weights over dp, the same bytes.
"""

from __future__ import annotations

import dataclasses

from rollplex_jax.config import CPU_BLOCK_BYTES, Config
from rollplex_jax.memory.planner import PlanMesh, ProgramModel
from rollplex_jax.sim.hardware import Hardware

OPS_PER_LAYER = 16
# Elementwise bytes of the DENSE program model (the programs with --attention=dense --remat=none, as XLA
# compiles them on CPU): the bytes XLA's cost_analysis() counts ("bytes accessed": every fusion's operands
# and outputs), measured
# 2026-11-30 on the demo model (fp32) by compiling the real programs (prefix_forward, actor._logprobs,
# their jax.grad, vision_forward) at several shapes and separating the parts that scale with the
# attention score count from the rest (tokens / patches held fixed):
# - text attention, per [head, query, key] score element and layer: forward 32 B, backward 56 B;
# - vision attention, per score element: forward 16 B, backward 56 B;
# - the rest, per token and layer: 2.8 x (10 D + 4 F) x dtype bytes; per patch and block 2.1 x
#   (10 Dv + 4 Fv) x dtype bytes, plus the patch embedding's pixel read (patch_dim x 4 B, fp32 pixels);
# - backward of the rest: 3.3 x its forward's bytes.
# Together these reproduce cost_analysis() of bench_cpu's full-sequence programs within 5% (0.96-1.00, 2026-12);
# the split (rollplex) programs run few rows (B prompts), where XLA fuses otherwise and counts more bytes than
# this linear model (0.56-0.85 of XLA; the vision tower's bytes per 256-patch image are 8.2 MB at 1-4 images,
# 5.5 MB at 8, 4.9 MB at 32): tests/test_simulator.py holds those within a factor of 2.
# The flash model (GPU at scale: fused kernels) keeps the bytes fused kernels touch: (10 D + 4 F) b per
# token and layer, no score tensors.
DENSE_TEXT_ATT_FWD, DENSE_VIS_ATT_FWD, DENSE_ATT_BWD = 32, 16, 56
DENSE_TEXT_EW, DENSE_VIS_EW, DENSE_EW_BWD = 2.8, 2.1, 3.3
FLASH_EW_BWD = 20 / 21  # flash: backward elementwise bytes / forward's (unchanged since the first model)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


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
    """Seconds of ``c`` on one device of ``hw`` (module doc); ``comm_bw`` defaults to NVLink."""
    rate = hw.bytes_rate(c.ew_bytes, backward)
    if rate:  # measured per working set (CPU): the call's elementwise bytes at their working set's rate; the
        # attention scores at a cache-sized block's (the CPU blockwise block fits CPU_BLOCK_BYTES: attention.py)
        mem = c.ew_bytes / rate + c.att_bytes / hw.bytes_rate(min(c.att_bytes, CPU_BLOCK_BYTES) or 1.0, backward)
    elif backward and hw.backward_bw:
        mem = (c.ew_bytes + c.att_bytes) / hw.backward_bw
    else:
        mem = c.ew_bytes / hw.ew_bw + c.att_bytes / hw.att_bw
    return (c.flops / (hw.flops(dtype) * mfu) + mem + c.ops * hw.op_overhead_s
            + c.comm_bytes / (comm_bw or hw.intra_bw))


def text_linear(cfg: Config) -> float:
    """Linear parameters of one decoder layer."""
    x = cfg.model.text
    D, F, H, K, d = x.hidden_size, x.intermediate_size, x.num_attention_heads, x.num_key_value_heads, x.head_dim
    return D * (H * d) * 2 + D * (K * d) * 2 + 3 * D * F  # q, o, k, v, gate/up/down per layer


def _vision_linear_block(cfg: Config) -> float:
    v = cfg.model.vision
    return 4 * v.hidden_size**2 + 3 * v.hidden_size * v.intermediate_size


def text_forward_cost(cfg: Config, rows: float, t: float, past: float, logits_tokens: float,
                      pm: ProgramModel) -> Cost:
    """Decoder forward over rows x t tokens attending ``past`` earlier keys + causal self (whole model)."""
    x, b = cfg.model.text, DTYPE_BYTES[cfg.model.dtype]
    L, D, F, H, d, V = (x.num_hidden_layers, x.hidden_size, x.intermediate_size, x.num_attention_heads,
                        x.head_dim, x.vocab_size)
    tok = rows * t
    keys = past + (t if pm.attention == "dense" else t / 2)  # dense: the masked scores are computed too
    flops = tok * L * (2 * text_linear(cfg) + 4 * H * d * keys) + rows * logits_tokens * 2 * D * V
    ew = tok * L * (10 * D + 4 * F) * b + rows * logits_tokens * V * 4 * 3
    att = 0.0
    if pm.attention == "dense":
        ew = tok * L * (10 * D + 4 * F) * b * DENSE_TEXT_EW + rows * logits_tokens * V * 4 * 3
        att = rows * L * H * t * (past + t)
    return Cost(flops, ew, L * OPS_PER_LAYER + 8, att_bytes=att * DENSE_TEXT_ATT_FWD, att_elems=att)


def vision_forward_cost(cfg: Config, images: float, patches_per_image: float, pm: ProgramModel) -> Cost:
    """Vision tower over ``images`` images of n patches (attention per window / per image in every program
    model)."""
    if images <= 0 or patches_per_image <= 0:
        return Cost()
    v, b = cfg.model.vision, DTYPE_BYTES[cfg.model.dtype]
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


def comm_bytes(cfg: Config, mesh: PlanMesh, tokens_dev: float, weights: float, passes: int) -> float:
    """Per device TP all-reduce bytes and FSDP weight gathers of ``passes`` passes (fwd = 1, bwd = 2)."""
    x, b = cfg.model.text, DTYPE_BYTES[cfg.model.dtype]
    tp_bytes = 0.0 if mesh.tp == 1 else 4 * (mesh.tp - 1) / mesh.tp * tokens_dev * x.hidden_size * b \
        * x.num_hidden_layers
    fsdp_bytes = 0.0 if mesh.fsdp == 1 else weights * b / mesh.tp * (mesh.fsdp - 1) / mesh.fsdp
    return passes * (tp_bytes + fsdp_bytes)


def dp_allreduce_bytes(cfg: Config, mesh: PlanMesh, trainable: float) -> float:
    """Per device bytes of one gradient sum over dp (ring all-reduce, or ZeRO-1's reduce-scatter + all-gather):
    2 (dp-1)/dp x the device's gradient shard, ``trainable`` / (fsdp x tp) params at the compute dtype; 0 at dp 1."""
    if mesh.dp == 1:
        return 0.0
    return 2 * (mesh.dp - 1) / mesh.dp * trainable / mesh.weight_shards * DTYPE_BYTES[cfg.model.dtype]


def n_tensors(cfg: Config) -> int:
    """Parameter tensors the optimizer update touches (one kernel group each)."""
    return 12 * cfg.model.text.num_hidden_layers + 12 * cfg.model.vision.depth + 6
