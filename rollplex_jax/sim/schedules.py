"""The schedules: phases placed on lanes of one step's timeline, and ``simulate()``.

Schedules:
- serial: host + input assembly + sync + rollout + reference(full) + actor(full fwd+bwd) + dp all-reduce +
  update.
- rollplex: host + sync(rebuilt buffers) + overlap(rollout, prefix) + ref suffix + actor suffix/prefix bwd +
  dp all-reduce + update; ``overlap_only`` = no prefix sharing, ``sharing_only`` = no overlap (prefix after
  decode).
- dp all-reduce (``phases.dp_allreduce``): the gradients summed over the training mesh's dp once per optimizer
  step, after the backward and before the update, not overlapped with either (a conservative bound).
- overlap (``overlap_stage``): the prefix programs run at (1 - decode_util) of their speed during the
  decode (they get the compute the decode leaves idle) and the decode is slowed by ``interference`` x
  the co-running time; what is left of the prefix after the decode runs at full speed. Critical-path
  saving = T_prefill_decode + T_prefix - stage = min(T_prefix - decode slowdown, ~T_decode) (the
  paper's bound; the prefill runs before the prefix programs start: they need the whole device).
  With ``hw.overlap_window == 'rollout'`` (CPU: the prefix programs are dispatched before the engine's
  prefill) the window is the whole rollout.
- disaggregated: the paper's baseline, synchronous on-policy: rollout on ``split`` x D devices, training
  (reference + actor, full sequences, no prefix sharing) on the rest, weight transfer over the network
  each step, NOT pipelined (the pools idle alternately): step = host + rollout(D_r) + transfer +
  reference(D_t) + actor(D_t) + dp all-reduce(D_t) + update(D_t). The training pool keeps the run's dp
  semantics: the run's tp, its fsdp (lowered to the largest divisor of D_t / tp that fits, when the pool is
  smaller than one fsdp x tp group) and dp = D_t / (fsdp tp) over the rest, the params replicated over dp and
  the optimizer state sharded over it with ``--optimizer_shard`` (as ``PlanMesh.of``'s mesh); its dp
  all-reduce goes over the network when the pool's dp x fsdp x tp devices exceed a node.
"""

from __future__ import annotations

import dataclasses
import math

from rollplex_jax.config import Config
from rollplex_jax.memory.planner import Lengths, PlanMesh, ProgramModel
from rollplex_jax.sim.compiled import Applied
from rollplex_jax.sim.hardware import Hardware
from rollplex_jax.sim.phases import (
    DpReduce,
    Setup,
    WeightSync,
    dp_allreduce,
    engine_replicas,
    input_prep,
    rollout,
    training,
    update,
    weight_sync,
)

SCHEDULES = ("serial", "rollplex", "overlap_only", "sharing_only", "disaggregated")
PHASES = ("host", "input_prep", "weight_sync", "prefill", "decode", "vision", "ref_prefix", "actor_prefix", "reference",
          "actor_fwd", "actor_bwd", "dp_allreduce", "update")
PREFIX_PHASES = ("vision", "actor_prefix", "ref_prefix")


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
    sources: dict = dataclasses.field(default_factory=dict)  # {schedule: {phase: "compiled"}}; others modelled

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
            "sources": {n: {p: self.sources.get(n, {}).get(p, "model") for p, v in s.phases.items() if v}
                        for n, s in self.schedules.items()},
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


@dataclasses.dataclass
class _Timeline:
    spans: list = dataclasses.field(default_factory=list)

    def add(self, lane: str, phase: str, dur: float, start: float) -> float:
        """A span of ``dur`` seconds on ``lane`` from ``start`` (none if empty); returns its end."""
        if dur > 0:
            self.spans.append((lane, phase, start, start + dur))
        return start + dur


def _overlapped_prefix(tl: _Timeline, ph: dict, t: float, t_roll_vis: float, hw: Hardware) -> tuple[float, float]:
    """The prefix programs beside the decode (or the whole rollout): (end of the stage, decode slowdown)."""
    pre = sum(ph[p] for p in PREFIX_PHASES)
    window = ph["decode"]
    if hw.overlap_window == "rollout":  # the prefix programs are dispatched before the engine's prefill
        t -= ph["prefill"] + t_roll_vis
        window += ph["prefill"] + t_roll_vis
    stage, slow = overlap_stage(pre, window, hw.decode_util, hw.interference)
    tl.add("rollout", "decode", ph["decode"] + slow, t + window - ph["decode"])
    s, stretch = t, min(1 / max(1 - hw.decode_util, 1e-9), stage / pre)  # drawn at the shared rate
    for p in PREFIX_PHASES:
        s = tl.add("prefix", p, ph[p] * stretch, s)
    return t + stage, slow


def build_schedule(name: str, phases: dict, overlap: bool, hw: Hardware, sync_beside_host: bool = False
                   ) -> Schedule:
    """The step's critical path and lanes from each phase's seconds (``overlap``: prefix beside the decode;
    ``sync_beside_host``: the weight sync is the previous update's refill, on a side thread that runs beside the
    step's host work and input assembly, the rollout waiting for whichever ends last)."""
    ph = {p: phases.get(p, 0.0) for p in PHASES}
    tl = _Timeline()
    t = tl.add("host", "host", ph["host"], 0.0)
    t = tl.add("host", "input_prep", ph["input_prep"], t)
    t = max(t, tl.add("weights", "weight_sync", ph["weight_sync"], 0.0)) if sync_beside_host else \
        tl.add("weights", "weight_sync", ph["weight_sync"], t)
    t = tl.add("rollout", "prefill", ph["prefill"], t)
    t_roll_vis = phases.get("engine_vision", 0.0)
    t = tl.add("rollout", "engine vision", t_roll_vis, t)
    if overlap and sum(ph[p] for p in PREFIX_PHASES) > 0:
        t, ph["decode_slowdown"] = _overlapped_prefix(tl, ph, t, t_roll_vis, hw)
    else:
        t = tl.add("rollout", "decode", ph["decode"], t)
        if name == "disaggregated":
            t = tl.add("weights", "transfer", phases.get("transfer", 0.0), t)
        for p in PREFIX_PHASES:
            t = tl.add("prefix", p, ph[p], t)
    t = tl.add("reference", "reference", ph["reference"], t)
    t = tl.add("actor", "actor_fwd", ph["actor_fwd"], t)
    t = tl.add("actor", "actor_bwd", ph["actor_bwd"], t)
    t = tl.add("update", "dp_allreduce", ph["dp_allreduce"], t)
    t = tl.add("update", "update", ph["update"], t)
    ph["engine_vision"] = t_roll_vis
    if "transfer" in phases:
        ph["transfer"] = phases["transfer"]
    return Schedule(name, ph, t, tl.spans)


def pool_mesh(s: Setup, d_t: int) -> PlanMesh:
    """The disaggregated training pool's mesh on ``d_t`` devices (module doc): the run's tp; its fsdp, or the largest
    divisor of d_t / tp below it; dp over the rest, with ZeRO-1 over that dp as the run's ``--optimizer_shard``
    says (``MeshConfig.zero_dp``'s rule)."""
    m, n = s.mesh, d_t // s.mesh.tp
    fsdp = max(f for f in range(1, min(m.fsdp, n) + 1) if n % f == 0)
    dp = n // fsdp
    return PlanMesh(d_t, fsdp, m.tp, m.rollout_tp, run_dp=dp,
                    zero_dp=dp > 1 and s.cfg.mesh.optimizer_shard != "none")


def _disaggregated(s: Setup, split: float, sync: WeightSync, applied: Applied
                   ) -> tuple[Schedule, tuple[int, int], PlanMesh, DpReduce, list[str]]:
    """The disaggregated baseline: (schedule, (rollout pool, training pool) devices, the training pool's mesh, its
    dp all-reduce, notes); ``applied``: the compiled costs (its phases scaled by the serial compile's ratios where
    there is one)."""
    mesh, hw, D, notes = s.mesh, s.hw, s.mesh.devices, []
    d_r = max(mesh.rollout_tp, int(round(D * split / mesh.rollout_tp)) * mesh.rollout_tp)
    d_t = D - d_r
    if d_t < mesh.tp:  # too few devices to split: pools of rollout_tp + tp devices (more than D)
        d_t = mesh.tp
        notes.append(f"disaggregated: {D} devices cannot be split; modelled with {d_r} + {d_t} devices")
    if d_t % mesh.tp:
        raise ValueError(f"disaggregated: training pool of {d_t} devices is not a multiple of train_tp={mesh.tp}")
    train_mesh = pool_mesh(s, d_t)
    dp = dp_allreduce(s, train_mesh)
    r_pf, r_vis, r_dec = rollout(s, d_r)
    model = {"update": update(s, train_mesh), "dp_allreduce": dp.seconds,
             **training(s, d_t, False, False, train_mesh)}
    train = applied.times("disaggregated", model, d_t, False, False)
    sched = build_schedule("disaggregated", {
        "host": hw.host_step_s, "input_prep": input_prep(s, s.rows), "prefill": r_pf, "engine_vision": r_vis,
        "decode": r_dec, "transfer": sync.transfer_s, **train}, False, hw)
    sched.notes = (f"rollout pool {d_r} devices, training pool {d_t} (dp {train_mesh.dp} x fsdp {train_mesh.fsdp} x "
                   f"tp {train_mesh.tp}); synchronous, not pipelined")
    return sched, (d_r, d_t), train_mesh, dp, notes


def _dp_line(mesh: PlanMesh, dp: DpReduce, hw: Hardware, what: str, placement: str) -> str:
    """The assumption line of a training mesh's gradient sum over dp."""
    if mesh.dp == 1:
        return f"{what}: dp 1, no gradient sum over dp"
    bw = hw.intra_bw if dp.link == "NVLink" else hw.inter_bw
    zero = ("ZeRO-1: a reduce-scatter of the gradients + an all-gather of the updated compute weights, the same "
            "bytes" if mesh.optimizer_shards > 1 else "a ring all-reduce")
    span = f"dp {mesh.dp} (--dp_placement=within: consecutive devices)" if placement == "within" else \
        f"dp x fsdp x tp = {mesh.dp * mesh.weight_shards} devices"
    return (f"{what}: gradients summed over dp {mesh.dp} once per optimizer step (x{dp.per_step} per RL step: "
            f"--mini_batches), {zero}: 2 (dp-1)/dp x the gradient shard (trainable params / (fsdp {mesh.fsdp} x tp "
            f"{mesh.tp})) = {dp.bytes_per_device / 1e9:.3g} GB per device over {dp.link} ({bw / 1e9:.0f} GB/s; {span} "
            f"{'<=' if dp.link == 'NVLink' else '>'} {hw.devices_per_node} per node): "
            f"{dp.seconds:.3g} s per step, not overlapped with the backward (a conservative bound; XLA may overlap "
            "it)")


def _assumptions(s: Setup, sync: WeightSync, pools: tuple[int, int], dps: tuple[DpReduce, PlanMesh, DpReduce],
                 notes: list[str]) -> list[str]:
    """The lines the report prints under the table; ``dps``: the run's dp all-reduce, the disaggregated training
    pool's mesh and its dp all-reduce."""
    hw, dt, mesh, lengths = s.hw, s.dt, s.mesh, s.lengths
    dp, pool, pool_dp = dps
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    return [
        f"hardware {hw.name}: {hw.source}",
        f"peak {hw.flops(dt) / 1e12:.3g} TFLOP/s ({dt}), HBM {hw.hbm_bw / 1e9:.0f} GB/s, NVLink {hw.intra_bw / 1e9:.0f}"
        f" GB/s, network {hw.inter_bw / 1e9:.0f} GB/s per device; MFU prefill {hw.mfu_prefill}, forward "
        f"{hw.mfu_forward}, backward {hw.mfu_backward}; decode at {hw.decode_bw_eff} of HBM bandwidth with a "
        f"{hw.decode_step_floor_s * 1e3:.2f} ms per-step floor",
        f"overlap: decode keeps {hw.decode_util:.2f} of the compute busy (the prefix runs at the rest); interference:"
        f" decode slowed by {hw.interference:.2f} x the co-running time",
        f"lengths: prompt {Tp} ({Tv} vision tokens = {s.patches} patches), answers mean {s.response_mean:g} / max "
        f"{Tr}: decode steps = max (the batch runs until its longest answer), KV reads and FLOPs = mean; "
        "scoring/training pad to max",
        s.pm.describe(),
        f"devices {mesh.devices}: training dp {mesh.dp} x fsdp {mesh.fsdp} x tp {mesh.tp} (params over fsdp x tp, "
        f"replicated over dp; optimizer state over {mesh.optimizer_shards * mesh.weight_shards} devices), rollout tp "
        f"{mesh.rollout_tp} ({engine_replicas(s.cfg, mesh.devices, mesh.rollout_tp)} engine(s) decoding)",
        _dp_line(mesh, dp, hw, "dp all-reduce", s.cfg.mesh.dp_placement),
        f"weight sync per step: serial/disaggregated a full engine copy ({sync.full_copy_bytes / 1e9:.2f} GB per "
        f"device; NVLink colocated, network disaggregated); rollplex refills only the engine-owned (rebuilt) "
        f"buffers of the per-tensor classification ({sync.layout} layout: {sync.rebuilt_bytes / 1e9:.2f} GB per "
        f"device, {sync.remote_bytes / 1e9:.2f} GB of it from other devices over {sync.link}, the rest copied "
        "on the device at HBM bandwidth, read + write), "
        + ("after the update on a side thread, beside the next step's host work (one process: "
           "WeightPublisher.refill)" if sync.after_update else "inside the bind before the rollout (several processes: "
           "the engine reads an all-gathered copy, a collective that is not moved off the critical path)"),
        f"disaggregated: {pools[0]} rollout + {pools[1]} training devices (training dp {pool.dp} x fsdp {pool.fsdp} "
        f"x tp {pool.tp}), synchronous on-policy, not pipelined",
        _dp_line(pool, pool_dp, hw, "disaggregated dp all-reduce", s.cfg.mesh.dp_placement),
        f"host work {hw.host_step_s} s per step" + (f"; input assembly on the critical path at "
                                                     f"{hw.host_copy_bw / 1e9:.2g} GB/s (patch bytes of the rows "
                                                     "scored: B x G serial, B' rollplex)" if hw.host_copy_bw
                                                     else "; input assembly off the critical path"),
        *notes,
    ]


def simulate(cfg: Config, hw: Hardware, lengths: Lengths | None = None, devices: int | None = None, *,
             response_mean: float | None = None, programs: ProgramModel | None = None,
             disagg_split: float = 0.5, compiled: dict | None = None) -> Simulation:
    """Each phase's seconds and the step time of every schedule in ``SCHEDULES`` (module docs).

    Args:
      cfg: the run's config (model, batch, mesh, engine, schedule switches).
      hw: the device (``hardware.preset``).
      lengths: tokens per row (default ``Lengths.from_config(cfg)``).
      devices: devices to simulate: None / 0 or the training mesh's (train_dp x train_fsdp x train_tp); another
        count raises ``ValueError`` (``PlanMesh.of``: the mesh that runs is simulated).
      response_mean: mean answer tokens (None: the max); decode steps follow the max.
      programs: the program model (None: the preset's default, dense on CPU, flash + remat on GPUs).
      disagg_split: the fraction of the devices in the disaggregated rollout pool.
      compiled: {"rollplex" and / or "serial": ``Compiled.step_costs()``}: those programs' compiled costs
        replace the model's for the schedules that run them (``sim/compiled.py``) on the compiled mesh.
    Returns:
      The ``Simulation``: schedules with phases, step time and timeline spans; assumptions; details.
    """
    s = Setup.of(cfg, hw, lengths, devices, response_mean, programs)
    D, B = s.mesh.devices, cfg.rl.batch_prompts
    sync = weight_sync(s)
    t_pf, t_vis, t_dec = rollout(s, D)
    dp = dp_allreduce(s, s.mesh)
    base = {"host": hw.host_step_s, "prefill": t_pf, "engine_vision": t_vis, "decode": t_dec,
            "update": update(s, s.mesh), "dp_allreduce": dp.seconds}
    applied = Applied(s, compiled)

    def train(name: str, sharing: bool, split: bool) -> dict:
        model = {"update": base["update"], "dp_allreduce": dp.seconds, **training(s, D, sharing, split)}
        return applied.times(name, model, D, sharing, split)

    scheds = {"serial": build_schedule("serial", {**base, "input_prep": input_prep(s, s.rows),
                                                  "weight_sync": sync.serial_s, **train("serial", False, False)},
                                       False, hw)}
    for name, sharing, overlap in (("rollplex", True, True), ("overlap_only", False, True),
                                   ("sharing_only", True, False)):
        scheds[name] = build_schedule(name, {**base, "input_prep": input_prep(s, B if sharing else s.rows),
                                             "weight_sync": sync.rollplex_s, **train(name, sharing, True)},
                                      overlap, hw, sync_beside_host=sync.after_update)
    scheds["disaggregated"], pools, pool, pool_dp, notes = _disaggregated(s, disagg_split, sync, applied)
    details = {"rollout_rows_per_replica": math.ceil(s.rows / engine_replicas(s.cfg, D, s.mesh.rollout_tp)),
               "params": s.counts.total, "disagg_pools": list(pools),
               "dp_allreduce": {"run": dataclasses.asdict(dp), "disaggregated": dataclasses.asdict(pool_dp)},
               "weight_sync": {"layout": sync.layout, "rebuilt_bytes_per_device": int(sync.rebuilt_bytes),
                               "remote_bytes_per_device": int(sync.remote_bytes), "remote_link": sync.link}}
    if compiled:
        details["compiled_vs_model"] = applied.comparison
        notes.append("compiled: " + ("; ".join(f"{n}: {', '.join(f'{p} ({k})' for p, k in ps.items())}"
                                               for n, ps in applied.sources.items())
                                     or "none applied (neither a rollplex nor a serial compile)")
                     + "; compiled = timed on the compiled programs' FLOPs, bytes, kernels and collectives, scaled = "
                     "the model's seconds x the compiled / model ratio of the same phase of the family's compiled "
                     "schedule (sim/compiled.py); every other phase from the cost model")
    return Simulation(scheds, hw, s.lengths, D, s.response_mean, s.pm,
                      _assumptions(s, sync, pools, (dp, pool, pool_dp), notes), details, applied.sources)
