"""The training phases' seconds from the programs XLA compiled, in place of the cost model
(``launch.plan --simulate --compile [--target=h100]``).

``memory.aot.compiled_memory`` compiles one step's programs (for a GPU target with XLA's GPU compiler, no GPU
needed) and ``Compiled.step_costs()`` gives, per device and per simulator phase (vision, actor_prefix,
ref_prefix, reference, actor, update), the FLOPs, bytes moved, kernels and collective bytes read from each
program's optimized HLO (``programs/hlo_cost.py``: every loop trip counted) times its runs per step. A phase
with such costs takes

    t = FLOPs / (peak x mfu) + bytes / ew_bw + kernels x op_overhead + collective bytes / link

on the simulator's hardware: the FLOPs and bytes are the compiler's, the rates and efficiencies (peak, mfu, the
achieved bandwidth, the per-kernel overhead, the link) stay the preset's assumptions. The compiled actor
program computes the forward and the backward in one (``suffix_grads``, ``prefix_vjp``, ``grads_recompute``,
``vision_grads``), timed at the backward's mfu and split into the timeline's actor_fwd / actor_bwd in the
model's proportion. Its collective bytes hold the gradient sums over dp (GSPMD reduces each gradient program's
output over dp), so a compiled actor sets the modelled ``dp_allreduce`` phase to 0 (not counted twice). Which
schedule takes which compile: the Rollplex programs (the run's prefix sharing) feed
``rollplex`` and ``sharing_only`` with prefix sharing, ``overlap_only`` without; the serial programs feed
``serial``. A schedule whose own programs were not compiled but whose family was (``disaggregated``: the serial
programs on another pool and mesh; ``overlap_only``: the split programs with a prefix per answer) takes the
model's seconds scaled per phase by its family's compiled / modelled ratio, so that every speedup compares
figures of one kind. The rollout (the torch engine) stays modelled. ``Simulation.sources`` says, per schedule and
phase, which figures are compiled, scaled or modelled.
"""

from __future__ import annotations

from rollplex_jax.config import Config
from rollplex_jax.sim.costs import Cost
from rollplex_jax.sim.phases import Setup, training_costs

FORWARD = ("vision", "actor_prefix", "ref_prefix", "reference")  # timed at the forward mfu; actor, update apart


def seconds(s: Setup, c: dict, mfu: float) -> float:
    """Seconds of compiled costs ``c`` (``Compiled.step_costs()[phase]``) on one device of ``s.hw``."""
    hw = s.hw
    link = hw.intra_bw if s.mesh.weight_shards <= hw.devices_per_node else hw.inter_bw
    return (c["flops"] / (hw.flops(s.dt) * mfu) + c["bytes"] / hw.ew_bw + c["kernels"] * hw.op_overhead_s
            + c["comm_bytes"] / link)


def compiled_phases(s: Setup, costs: dict[str, dict], model: dict[str, float]) -> dict[str, float]:
    """{timeline phase: seconds} for the phases ``costs`` has (the rest stay ``model``'s)."""
    hw, out = s.hw, {}
    for phase in FORWARD:
        if phase in costs:
            out[phase] = seconds(s, costs[phase], hw.mfu_forward)
    if "actor" in costs:
        t = seconds(s, costs["actor"], hw.mfu_backward)
        fwd, bwd = model.get("actor_fwd", 0.0), model.get("actor_bwd", 0.0)
        share = fwd / (fwd + bwd) if fwd + bwd > 0 else 0.0
        out["actor_fwd"], out["actor_bwd"] = t * share, t * (1 - share)
        out["dp_allreduce"] = 0.0  # in the compiled gradient programs' collectives (module doc)
    if "update" in costs:  # memory-bound AdamW: its bytes at the achieved bandwidth
        out["update"] = seconds(s, costs["update"], hw.mfu_backward)
    return out


def compare(s: Setup, costs: dict[str, dict], n_dev: int, sharing: bool, split: bool) -> dict[str, dict]:
    """Per phase, the cost model's FLOPs and bytes (``phases.training_costs``, one device) beside the compiled
    ones: where the model and the compiler disagree, and by how much."""
    model = {k: sum((w.total for w in works), Cost()) for k, works in training_costs(s, n_dev, sharing, split).items()}
    model["actor"] = model.pop("actor_fwd", Cost()) + model.pop("actor_bwd", Cost())
    out = {}
    for phase, c in costs.items():
        m = model.get(phase)
        if m is None:
            continue
        mb = m.ew_bytes + m.att_bytes
        out[phase] = {"model_flops": m.flops, "compiled_flops": c["flops"], "model_bytes": mb,
                      "compiled_bytes": c["bytes"], "compiled_kernels": c["kernels"],
                      "compiled_comm_bytes": c["comm_bytes"], "flops_ratio": c["flops"] / m.flops if m.flops else None,
                      "bytes_ratio": c["bytes"] / mb if mb else None, "programs": c["programs"]}
    return out


def runs_key(cfg: Config, schedule: str) -> str | None:
    """The compile whose programs ``schedule`` runs: the Rollplex programs (with the run's prefix sharing), the
    serial ones, or None."""
    if schedule == "serial":
        return "serial"
    if schedule in ("rollplex", "sharing_only"):
        return "rollplex" if cfg.run.prefix_sharing else None
    return "rollplex" if schedule == "overlap_only" and not cfg.run.prefix_sharing else None


class Applied:
    """The compiled costs as the schedules take them (module doc): exact or scaled by the family's ratio (the
    simulated mesh is the compiled one: ``PlanMesh.of`` refuses another device count); records ``sources`` and
    the model-vs-compiled counts."""

    def __init__(self, s: Setup, compiled: dict | None):
        self.s = s
        self.compiled = compiled or {}
        self.sources: dict[str, dict[str, str]] = {}
        self.comparison: dict[str, dict] = {}
        self.ratios: dict[str, dict[str, float]] = {}

    def times(self, name: str, times: dict, n_dev: int, sharing: bool, split: bool) -> dict:
        """``times`` (the model's seconds per phase, the update's included) with the compiled ones applied."""
        key, family = runs_key(self.s.cfg, name), "rollplex" if split else "serial"
        if key is not None and key in self.compiled:
            got = compiled_phases(self.s, self.compiled[key], times)
            self.ratios[key] = {p: got[p] / times[p] for p in got if times.get(p)}
            self.sources[name] = dict.fromkeys(got, "compiled")
            self.comparison.setdefault(key, compare(self.s, self.compiled[key], n_dev, sharing, split))
            return {**times, **got}
        ratio = self.ratios.get(family, {})
        if ratio:
            self.sources[name] = {p: "scaled" for p in times if p in ratio and times[p]}
            return {p: t * ratio.get(p, 1.0) for p, t in times.items()}
        return times
