"""The device meshes of a run (``MeshConfig``: part of the configuration tree, ``tree.Config.mesh``)."""

from __future__ import annotations

import dataclasses

from rollplex_jax.config.model import _require

OPTIMIZER_SHARDS = ("auto", "dp", "none")
DP_PLACEMENTS = ("across", "within")  # dp outermost (spans processes / nodes) or innermost (within a node)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Device meshes per role. Training: dp x fsdp x tp over the first dp x fsdp x tp devices: parameters
    sharded over fsdp x tp and replicated over dp, the batch split over dp x fsdp (the reference uses the
    training mesh; several processes form one mesh over all their devices). Rollout: its own TP degree; each
    process's engine decodes its share of the prompts on its first device (``rollout_tp=1``); ``rollout_tp`` > 1:
    vLLM ranks across processes, one device each, a TP group of consecutive processes decoding its share together
    (``run.setup._check_rollout_tp``, ``multihost.RolloutTPCopy``). ``process_devices``:
    the devices each process drives (0: ``launch.main`` resolves the job's own, ``launch.plan`` plans 1, one
    process per device, the layout the SLURM script starts on GPUs)."""

    train_dp: int = 1
    train_fsdp: int = 1
    train_tp: int = 1
    rollout_tp: int = 1
    optimizer_shard: str = "auto"  # dp: master weights and moments sharded over dp too (ZeRO-1); auto: dp if > 1
    dp_placement: str = "across"  # across: a dp group's members are fsdp x tp devices apart (dp spans processes /
    # nodes, fsdp and tp within one: HSDP); within: they are consecutive devices (fsdp x tp spans the processes)
    process_devices: int = 0

    @property
    def rollout_ranks_own_shards(self) -> bool:
        """Each vLLM TP rank (``rollout_tp`` > 1, one process per device) is bound to its own device's training
        shards, every tensor aligned: training TP = rollout TP at fsdp 1, a training tp group being consecutive
        processes as vLLM's TP groups are (``dp_placement`` across, or dp 1). Otherwise a rank reads the params
        resharded onto the rollout's TP layout (``multihost.RolloutTPCopy``)."""
        consecutive = self.dp_placement == "across" or self.train_dp == 1
        return self.rollout_tp > 1 and self.train_tp == self.rollout_tp and self.train_fsdp == 1 and consecutive

    @property
    def processes(self) -> int:
        """Processes of the job (one engine each): the training devices over ``process_devices`` (0 plans 1)."""
        return max(1, self.train_devices // (self.process_devices or 1))

    def __post_init__(self):
        for name in ("train_dp", "train_fsdp", "train_tp", "rollout_tp"):
            _require(getattr(self, name) >= 1, f"mesh.{name}", getattr(self, name), "must be >= 1")
        _require(self.process_devices >= 0, "mesh.process_devices", self.process_devices, "must be >= 0")
        _require(self.optimizer_shard in OPTIMIZER_SHARDS, "mesh.optimizer_shard", self.optimizer_shard,
                 f"one of {', '.join(OPTIMIZER_SHARDS)}")
        _require(self.dp_placement in DP_PLACEMENTS, "mesh.dp_placement", self.dp_placement,
                 f"one of {', '.join(DP_PLACEMENTS)}")

    @property
    def zero_dp(self) -> bool:
        """Whether the optimizer state is sharded over dp (``--optimizer_shard``: dp, or auto with dp > 1)."""
        return self.train_dp > 1 and self.optimizer_shard != "none"

    @property
    def train_devices(self) -> int:
        return self.train_dp * self.train_fsdp * self.train_tp

    @property
    def batch_shards(self) -> int:
        """How many parts the batch is split into: dp x fsdp."""
        return self.train_dp * self.train_fsdp
