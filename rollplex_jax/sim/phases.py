"""Seconds of each phase of one RL step: rollout, reference, actor, update, weight sync, host work.

Every function takes the step's ``Setup`` (config, hardware, lengths, mesh, program model and the
figures derived from them) and the pool of devices it runs on; ``schedules`` places the phases on a
timeline. Costs of the programs come from ``costs``.

- rollout (engine replicas of ``rollout_tp`` devices, or one per process where a process drives several devices at
  rollout TP 1 (``engine_replicas``), rows = B G / replicas, waves of ``max_batch``; the
  prefill and the engine's vision run once per prompt, B / replicas, not per answer):
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
- dp all-reduce (``dp_allreduce``; training mesh dp > 1): the gradients summed over dp once per optimizer step,
  ``cfg.rl.mini_batches`` per RL step: t = mini_batches x 2 (dp-1)/dp x P_t / (fsdp tp) x b / link_bw
  (``costs.dp_allreduce_bytes``; ZeRO-1 moves the same bytes as a reduce-scatter + all-gather). dp is the
  mesh's outer axis (``parallel/mesh.py``): a dp group's members are fsdp x tp devices apart, so the group
  stays in a node (NVLink, ``hw.intra_bw``) only if dp x fsdp x tp <= ``hw.devices_per_node``, else it
  crosses the network (``hw.inter_bw``); with ``--dp_placement=within`` a dp group is dp consecutive devices, in a
  node when dp divides the node's devices (the fsdp / tp collectives then cross nodes: still timed over NVLink
  here, as every fsdp x tp collective is). Not overlapped with the backward: a conservative bound (XLA may
  overlap the reduction with the backward's last layers). Today's programs reduce in every gradient
  program call (each micro-batch's ``grad`` / ``suffix_grads`` returns dp-replicated gradients: XLA's HLO
  at dp 2 has an all-reduce of every gradient per call), i.e. more often than this once per optimizer step
  that Megatron-style accumulation does; the compiled costs (``--simulate --compile``) hold those
  reductions in the actor's collective bytes, and replace this phase (``sim/compiled.py``).
- update: memory-bound: per trainable param on its optimizer shard (P_t / (fsdp tp), / dp too with
  ZeRO-1: ``PlanMesh.optimizer_shards``) 4 (fp32 master r/w if bf16) + 16 (two Adam moments r/w) + 2b
  (grad read, param write) bytes / hbm; offload adds 3 x 4 x 2 bytes over the host link (master +
  moments in and out); + ops per parameter tensor; once per optimizer step (``cfg.rl.mini_batches`` per
  RL step, as ``step/rl_step._train`` updates).
- weight sync: serial / disaggregated: the engine gets a full copy (P b / rollout_tp per device) each
  step, over NVLink (colocated: reshard) or the network (disaggregated: train pool -> rollout pool);
  rollplex: the engine reads aligned and view tensors in place (DLPack views of the actor's compute
  weights) and refills only its own (rebuilt: fused qkv / gate_up, resharded, padded) buffers, as the
  per-tensor classification counts them (``sharing.plan_sharing`` via ``planner.sharing_classification``;
  its report's ``extra_bytes_per_device`` R and ``remote_bytes_per_device`` R_remote, each the largest of
  any device). The part of R held in the device's own training shard is copied on the device, which
  reads and writes each byte at HBM bandwidth; the rest comes from the other devices of the training
  fsdp x tp group, over NVLink when that group fits in a node (``hw.devices_per_node``), else the network:
    t_sync = 2 (R - R_remote) / hbm_bw + R_remote / link_bw
  (taking both maxima, an upper bound on the slowest device's time). In one process driving every device
  (``cfg.mesh.processes`` 1) the runtime refills these buffers right after the update on a side thread
  (``WeightPublisher.refill``), so the sync runs beside the next step's host work and the rollout waits only for
  what it does not hide; with several processes (one per device: ``launch.plan``'s default, the SLURM layout on
  GPUs) the engine reads an all-gathered copy inside the bind, before every rollout, on the critical path (until
  2026-12-07 the simulator hid it whenever the devices fit a node, whatever the processes). Until issue 16 this was
  max(0, P/rollout_tp - P/(fsdp tp)) b / intra_bw, which is 0 whenever the TPs match although vLLM's
  fused tensors are rebuilt every step.
- input assembly (host, ``hw.host_copy_bw`` > 0 only: CPU): the patch bytes of the rows scored (B x G
  serial / disaggregated / overlap_only, B with prefix sharing) / host_copy_bw, on the critical path.
- host: ``hw.host_step_s`` per step (rewards, scheduling, barriers) + input assembly (above).
"""

from __future__ import annotations

import dataclasses
import math

from rollplex_jax.config import Config
from rollplex_jax.config.shapes import planned_micro_batch
from rollplex_jax.memory.planner import (
    DEFAULT_PROGRAMS,
    DENSE_PROGRAMS,
    Lengths,
    ParamCounts,
    PlanMesh,
    ProgramModel,
    param_counts,
    prefix_residual_bytes,
    sharing_classification,
)
from rollplex_jax.sim.costs import (
    DTYPE_BYTES,
    Cost,
    backward_of,
    comm_bytes,
    dp_allreduce_bytes,
    n_tensors,
    text_forward_cost,
    time_of,
    vision_forward_cost,
)
from rollplex_jax.sim.hardware import Hardware


@dataclasses.dataclass(frozen=True)
class Setup:
    """One simulated step: its inputs and the figures every phase reads."""

    cfg: Config
    hw: Hardware
    lengths: Lengths
    mesh: PlanMesh
    pm: ProgramModel
    counts: ParamCounts
    response_mean: float  # Tm: mean answer tokens (<= the max, lengths.response_tokens)

    @classmethod
    def of(cls, cfg: Config, hw: Hardware, lengths: Lengths | None, devices: int | None,
           response_mean: float | None, programs: ProgramModel | None) -> Setup:
        lengths = lengths or Lengths.from_config(cfg)
        pm = programs or (DENSE_PROGRAMS if hw.default_programs == "dense" else ProgramModel.of(cfg.programs))
        Tr = lengths.response_tokens
        return cls(cfg, hw, lengths, PlanMesh.of(cfg, devices), pm, param_counts(cfg),
                   min(Tr, response_mean if response_mean else Tr))

    @property
    def dt(self) -> str:
        return self.cfg.model.dtype

    @property
    def b(self) -> int:
        return DTYPE_BYTES[self.cfg.model.dtype]

    @property
    def rows(self) -> int:
        """Answers per step: B x G."""
        return self.cfg.rl.batch_prompts * self.cfg.rollout.group_size

    @property
    def patches(self) -> int:
        """Patches per prompt (one image / video)."""
        return self.lengths.vision_tokens * self.cfg.model.vision.spatial_merge_size**2

    @property
    def text_params(self) -> int:
        return self.counts.total - self.counts.vision

    @property
    def use_ref(self) -> bool:
        return self.cfg.rl.uses_reference


def engine_replicas(cfg: Config, n_dev: int, rollout_tp: int) -> int:
    """Engines decoding on ``n_dev`` devices: one per ``rollout_tp`` devices, except that at rollout TP 1 a
    process driving several devices (``--process_devices`` > 1) runs one engine, on its first device."""
    if rollout_tp == 1 and cfg.mesh.process_devices > 1:
        return max(1, n_dev // cfg.mesh.process_devices)
    return max(1, n_dev // rollout_tp)


def rollout(s: Setup, n_dev: int) -> tuple[float, float, float]:
    """(prefill, vision in the engine, decode) seconds on a pool of n_dev devices. The engines prefill and
    vision-encode each prompt once for its G answers (HF: ``hf_decode``; vLLM: its prefix cache, reset per bind),
    then decode every answer over its own copy of the prompt's KV."""
    cfg, hw, x, dt, b = s.cfg, s.hw, s.cfg.model.text, s.dt, s.b
    Tp, Tv, Tr, Tm, n_img = (s.lengths.prompt_tokens, s.lengths.vision_tokens, s.lengths.response_tokens,
                             s.response_mean, s.patches)
    replicas = engine_replicas(cfg, n_dev, s.mesh.rollout_tp)
    rows = math.ceil(s.rows / replicas)
    prompts = math.ceil(cfg.rl.batch_prompts / replicas)
    waves = math.ceil(rows / cfg.rollout.max_batch)
    rtp = s.mesh.rollout_tp
    pf = text_forward_cost(cfg, prompts, Tp, 0, 1, DEFAULT_PROGRAMS)  # engines use flash kernels
    vis = vision_forward_cost(cfg, prompts if Tv else 0, n_img, DEFAULT_PROGRAMS)
    t_pf = hw.prefill_fixed_s * waves + pf.flops / (rtp * hw.flops(dt) * hw.mfu_prefill) \
        + pf.ew_bytes / rtp / hw.ew_bw
    t_vis = (prompts if Tv else 0) * hw.engine_image_s
    if hw.engine_patch_s:  # measured per patch (CPU probe): replaces the FLOP / byte estimate
        t_vis += (prompts if Tv else 0) * n_img * hw.engine_patch_s
    else:
        t_vis += vis.flops / (rtp * hw.flops(dt) * hw.mfu_prefill) + vis.ew_bytes / rtp / hw.ew_bw
    kv_tok = x.num_hidden_layers * 2 * max(1, math.ceil(x.num_key_value_heads / rtp)) * x.head_dim * b
    w_step = max(hw.decode_step_floor_s, s.text_params * b / rtp / (hw.hbm_bw * hw.decode_bw_eff))
    per_tok = kv_tok * (Tp + Tm / 2) / (hw.hbm_bw * hw.decode_bw_eff) \
        + (2 * s.text_params / rtp) / (hw.flops(dt) * hw.mfu_prefill)
    t_dec = waves * Tr * w_step + rows * Tm * per_tok
    return t_pf, t_vis, t_dec


def _tp_time(s: Setup, c: Cost, tp: int, mfu: float, backward: bool = False) -> float:
    """Seconds of ``c`` on one device of a TP group: tp divides its compute and bytes."""
    return time_of(Cost(c.flops / tp, c.ew_bytes / tp, c.ops, c.comm_bytes, c.att_bytes / tp), s.hw, s.dt, mfu,
                   backward=backward)


@dataclasses.dataclass(frozen=True)
class Work:
    """Part of a phase on one device: ``calls`` program calls of ``cost`` each (a call's bytes set the byte rate
    on a measured curve), timed at the forward or, ``backward``, the backward efficiency and byte rate."""

    cost: Cost
    calls: int = 1
    backward: bool = False

    @property
    def total(self) -> Cost:
        return self.cost.scale(self.calls)


def serial_costs(s: Setup, n_dev: int, tm: PlanMesh) -> dict[str, tuple[Work, ...]]:
    """Reference and actor work over full sequences, one micro-batch per program call (serial schedule)."""
    cfg, pm = s.cfg, s.pm
    Tp, Tv, Tr = s.lengths.prompt_tokens, s.lengths.vision_tokens, s.lengths.response_tokens
    n_mb = max(1, math.ceil(s.rows / min(planned_micro_batch(cfg), s.rows)))
    rows_mb = s.rows / n_mb / (n_dev // tm.tp)  # rows per device per micro-batch
    t_full = Tp + Tr
    fwd = text_forward_cost(cfg, rows_mb, t_full, 0, Tr, pm) \
        + vision_forward_cost(cfg, rows_mb if Tv else 0, s.patches, pm)
    fwd = dataclasses.replace(fwd, comm_bytes=comm_bytes(cfg, tm, rows_mb * t_full, s.counts.total, 1))
    return {"reference": (Work(fwd, n_mb),) if s.use_ref else (), "actor_fwd": (Work(fwd, n_mb),),
            "actor_bwd": (Work(backward_of(fwd, pm, cfg), n_mb, backward=True),)}


def rollplex_costs(s: Setup, n_dev: int, sharing: bool, tm: PlanMesh) -> dict[str, tuple[Work, ...]]:
    """Prefix (vision, actor, reference), suffix and backward work of the split programs, with one prefix per
    prompt (``sharing``) or one per answer.

    The vision tower runs once per prefix program: with ``--freeze_vision`` one shared encoding (``vision``);
    otherwise inside the actor's prefix (``vision``) and again inside the reference's, on its own weights
    (``ref_prefix``). The actor's prefix with ``--actor_prefix=residuals`` also writes its vjp residuals
    (``planner.prefix_residual_bytes``), which its backward reads."""
    cfg, pm = s.cfg, s.pm
    Tp, Tv, Tr = s.lengths.prompt_tokens, s.lengths.vision_tokens, s.lengths.response_tokens
    bs = n_dev // tm.tp
    rows_p = (cfg.rl.batch_prompts if sharing else s.rows) / bs
    vis_in = not cfg.optim.freeze_vision
    vis = vision_forward_cost(cfg, rows_p if Tv else 0, s.patches, pm)
    pre = text_forward_cost(cfg, rows_p, Tp, 0, 1, pm)  # the actor's and the reference's prefix
    pre = dataclasses.replace(pre, comm_bytes=comm_bytes(cfg, tm, rows_p * Tp, s.text_params, 1))
    rows_s = s.rows / bs
    suf = text_forward_cost(cfg, rows_s, Tr, Tp, Tr, pm)
    suf = dataclasses.replace(suf, comm_bytes=comm_bytes(cfg, tm, rows_s * Tr, s.text_params, 1))
    trained = pre + (vis if vis_in else Cost())  # what the actor's gradient flows through
    pre_bwd = backward_of(trained, pm, cfg).scale(1.0, ops=0)
    actor_pre, extra = pre, ()
    if cfg.run.actor_prefix == "residuals":
        saved = prefix_residual_bytes(cfg.model, rows_p, Tp, Tv, pm, tp=tm.tp, vision=vis_in) * tm.tp
        actor_pre = dataclasses.replace(pre, ew_bytes=pre.ew_bytes + saved)
    else:  # the training recomputes each micro-batch's prefix rows (all prompts once)
        extra = (Work(trained),)
    return {"vision": (Work(vis),) if Tv else (), "actor_prefix": (Work(actor_pre),),
            "ref_prefix": (Work(pre + (vis if vis_in else Cost())),) if s.use_ref else (),
            "reference": (Work(suf),) if s.use_ref else (), "actor_fwd": (Work(suf),),
            "actor_bwd": (Work(backward_of(suf, pm, cfg) + pre_bwd, backward=True), *extra)}


def training_costs(s: Setup, n_dev: int, sharing: bool, split: bool, tm: PlanMesh | None = None
                   ) -> dict[str, tuple[Work, ...]]:
    """Reference / actor work per phase on a pool of n_dev devices (the training mesh scaled, or ``tm``): the
    split (rollplex) programs or the full-sequence (serial) ones."""
    tm = tm or dataclasses.replace(s.mesh, devices=n_dev)
    return rollplex_costs(s, n_dev, sharing, tm) if split else serial_costs(s, n_dev, tm)


def training(s: Setup, n_dev: int, sharing: bool, split: bool, tm: PlanMesh | None = None) -> dict:
    """Seconds of each reference / actor phase (``training_costs`` timed on one device of the TP group)."""
    tm = tm or dataclasses.replace(s.mesh, devices=n_dev)
    mfu = {False: s.hw.mfu_forward, True: s.hw.mfu_backward}
    return {phase: sum((w.calls * _tp_time(s, w.cost, tm.tp, mfu[w.backward], w.backward) for w in works), 0.0)
            for phase, works in training_costs(s, n_dev, sharing, split, tm).items()}


@dataclasses.dataclass(frozen=True)
class DpReduce:
    """The gradient sum over dp of one step on a training mesh (module doc)."""

    dp: int
    bytes_per_device: float  # one reduction (ring: 2 (dp-1)/dp x the gradient shard)
    per_step: int  # reductions per RL step: one per optimizer step (mini-batch)
    link: str  # NVLink (the dp group fits a node) or network
    seconds: float  # per RL step


def dp_allreduce(s: Setup, tm: PlanMesh) -> DpReduce:
    """Seconds of the gradient sums over dp of one step on training mesh ``tm`` (module doc)."""
    hw, n = s.hw, s.cfg.rl.mini_batches
    if s.cfg.mesh.dp_placement == "within":  # a dp group is dp consecutive devices
        in_node = tm.dp <= hw.devices_per_node and hw.devices_per_node % tm.dp == 0
    else:  # dp outer: members fsdp x tp devices apart
        in_node = tm.dp * tm.weight_shards <= hw.devices_per_node
    nbytes = dp_allreduce_bytes(s.cfg, tm, s.counts.trainable)
    return DpReduce(tm.dp, nbytes, n, "NVLink" if in_node else "network",
                    n * nbytes / (hw.intra_bw if in_node else hw.inter_bw))


def update(s: Setup, tm: PlanMesh) -> float:
    """Seconds of the optimizer update on training mesh ``tm``: its state sharded over fsdp x tp, and over dp too
    with ZeRO-1 (module doc)."""
    hw, dt, b = s.hw, s.dt, s.b
    shard = s.counts.trainable / (tm.weight_shards * tm.optimizer_shards)
    master = 8 if dt != "float32" else 0
    byts = shard * (master + 16 + 4 + 2 * b if dt == "float32" else master + 16 + 2 * b)
    t = byts / (hw.hbm_bw * 0.8) + hw.op_overhead_s * 6 * n_tensors(s.cfg)
    if s.cfg.memory.optimizer_policy == "offload":
        t += shard * (4 * 3 if dt != "float32" else 8) * 2 / hw.host_bw
    return s.cfg.rl.mini_batches * t


def input_prep(s: Setup, rows: float) -> float:
    """Host-side assembly of ``rows`` model-input rows (their patches gathered and put on the device), when
    it is on the critical path (``hw.host_copy_bw`` > 0: today's runtime on CPU)."""
    if not s.hw.host_copy_bw or not s.lengths.vision_tokens:
        return 0.0
    return rows * s.patches * s.cfg.model.vision.patch_dim * 4 / s.hw.host_copy_bw


@dataclasses.dataclass(frozen=True)
class WeightSync:
    """Bytes the engine's weights need per device each step, and the seconds that takes per schedule."""

    full_copy_bytes: float  # a full engine shard, P b / rollout_tp: serial and disaggregated
    rebuilt_bytes: float  # rollplex: engine-owned buffers refilled each step (largest of any device)
    remote_bytes: float  # the part of them not in the device's own training shard (largest of any device)
    layout: str  # the engine's tensor layout the classification used (hf / vllm / tp)
    link: str  # where the remote part comes from: NVLink or network
    serial_s: float  # colocated full copy over NVLink
    rollplex_s: float
    transfer_s: float  # disaggregated: the full copy over the network
    after_update: bool  # rollplex's refill runs after the update, beside the next step's host work (one process)


def weight_sync(s: Setup) -> WeightSync:
    """Weight sync of each schedule; rollplex's from the per-tensor sharing classification (module doc)."""
    P, b, mesh, hw = s.counts.total, s.b, s.mesh, s.hw
    c = sharing_classification(s.cfg)
    rebuilt, remote = c["extra_bytes_per_device"], c["remote_bytes_per_device"]
    in_node = mesh.weight_shards <= hw.devices_per_node
    link_bw = hw.intra_bw if in_node else hw.inter_bw
    full_copy = P * b / mesh.rollout_tp
    return WeightSync(full_copy, rebuilt, remote, c["layout"], "NVLink" if in_node else "network",
                      serial_s=full_copy / hw.intra_bw,
                      rollplex_s=2 * max(0, rebuilt - remote) / hw.hbm_bw + remote / link_bw,
                      transfer_s=full_copy / hw.inter_bw if mesh.devices > 1 else 0.0,
                      after_update=s.cfg.mesh.processes == 1)
