"""What a step needs when several processes form one JAX job (jax.distributed; ``distributed.py`` starts it).

Every process runs the same program on the same global mesh, and the same host code: the same prompts
(the sampler is seeded), the same step. Only the rollout is split: process p decodes prompts
``share(B, p, n)`` with its own engine on its own devices; the rollouts and their rewards are then
gathered so every process holds the whole batch again (the sampling of each answer is seeded by its
global prompt index, so the split does not change the answers). Outputs (metrics, summary, plots) are
written by process 0; checkpoints collectively (orbax).

With one process every function here is the identity (no collective is issued).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from rollplex_contract.batch import Rollouts
from rollplex_jax.rl.rewards import RewardScores

FINISH = ("stop", "length")


@dataclasses.dataclass(frozen=True)
class Processes:
    index: int = 0
    count: int = 1

    @classmethod
    def current(cls) -> Processes:
        return cls(jax.process_index(), jax.process_count())

    @property
    def many(self) -> bool:
        return self.count > 1

    @property
    def writer(self) -> bool:
        """Whether this process writes the run's files (process 0)."""
        return self.index == 0

    def decode_share(self, n: int, rollout_tp: int = 1) -> slice:
        """The share of ``n`` prompts this process's engine decodes: per process at rollout TP 1, else per TP group
        of ``rollout_tp`` consecutive processes (every rank of a group decodes the group's share together)."""
        return share(n, self.index // rollout_tp, self.count // rollout_tp)

    def keeps_rollouts(self, rollout_tp: int = 1) -> bool:
        """Whether this process's decoded rows go into the gathered batch: a TP group's first rank speaks for it
        (its ranks decode the same answers)."""
        return self.index % rollout_tp == 0


def share(n: int, index: int, count: int) -> slice:
    """Contiguous share of ``n`` items for process ``index`` of ``count`` (sizes differ by at most one)."""
    edges = np.linspace(0, n, count + 1).round().astype(int)
    return slice(int(edges[index]), int(edges[index + 1]))


def allgather_rows(x: np.ndarray, procs: Processes) -> np.ndarray:
    """Concatenates every process's ``x`` along dim 0 in process order (shapes may differ in dim 0 only)."""
    if not procs.many:
        return x
    from jax.experimental import multihost_utils

    x = np.asarray(x)
    counts = multihost_utils.process_allgather(np.array([x.shape[0]], np.int64)).reshape(-1)
    pad = np.zeros((int(counts.max()) - x.shape[0], *x.shape[1:]), x.dtype)
    out = multihost_utils.process_allgather(np.concatenate([x, pad]))  # [count, max, ...]
    return np.concatenate([out[i, :int(c)] for i, c in enumerate(counts)])


def allgather_strings(strings: list[str], procs: Processes) -> list[str]:
    """Every process's ``strings`` concatenated in process order (UTF-8 bytes all-gathered with their lengths)."""
    if not procs.many:
        return list(strings)
    blobs = [s.encode() for s in strings]
    if not allgather_rows(np.array([len(blobs)], np.int64), procs).sum():  # no empty collectives below
        return []
    sizes = allgather_rows(np.array([len(b) for b in blobs], np.int64), procs)
    data = allgather_rows(np.frombuffer(b"".join(blobs), np.uint8), procs).tobytes() if sizes.sum() else b""
    ends = np.cumsum(sizes)
    return [data[e - n:e].decode() for e, n in zip(ends.tolist(), sizes.tolist(), strict=True)]


def first_rows(ro: Rollouts, scores: RewardScores, n: int) -> tuple[Rollouts, RewardScores]:
    """The first ``n`` prompts' rollouts and scores (0: a TP rank's empty contribution to the gathers)."""
    g = ro.response_ids.shape[1]
    return (Rollouts(response_ids=ro.response_ids[:n], lengths=ro.lengths[:n], logprobs=ro.logprobs[:n],
                     finish_reasons=ro.finish_reasons[:n], prefill_tokens=ro.prefill_tokens if n else 0),
            RewardScores(scores.overall[:n * g], {k: v[:n * g] for k, v in scores.parts.items()},
                         scores.failures if n else 0))


def gather_scores(scores: RewardScores, procs: Processes) -> RewardScores:
    """The whole batch's reward scores from each process's share (parts: the union of every process's names, 0
    where a process had none of that part), failures summed."""
    if not procs.many:
        return scores
    names = sorted(set(allgather_strings(sorted(scores.parts), procs)))
    zeros = np.zeros_like(scores.overall)
    cols = allgather_rows(np.stack([scores.overall, *(scores.parts.get(k, zeros) for k in names)], -1), procs)
    failures = int(allgather_rows(np.array([scores.failures], np.int64), procs).sum())
    return RewardScores(cols[:, 0], {k: cols[:, i + 1] for i, k in enumerate(names)}, failures)


def gather_rollouts(ro: Rollouts, max_new_tokens: int, pad_id: int, procs: Processes) -> Rollouts:
    """The whole batch's rollouts from each process's share (answers padded to ``max_new_tokens`` first,
    then trimmed to the longest)."""
    if not procs.many:
        return ro
    b, g, t = ro.response_ids.shape
    pad = max_new_tokens - t
    ids = np.pad(ro.response_ids, ((0, 0), (0, 0), (0, pad)), constant_values=pad_id)
    logp = np.pad(ro.logprobs, ((0, 0), (0, 0), (0, pad)))
    reasons = np.array([[FINISH.index(r) for r in row] for row in ro.finish_reasons], np.int32).reshape(b, g)
    ids, logp, lengths, reasons = (allgather_rows(a, procs) for a in (ids, logp, ro.lengths, reasons))
    prefilled = allgather_rows(np.array([ro.prefill_tokens], np.int64), procs)
    t_max = max(int(lengths.max()), 1)
    return Rollouts(response_ids=ids[..., :t_max], lengths=lengths, logprobs=logp[..., :t_max],
                    finish_reasons=[[FINISH[r] for r in row] for row in reasons.tolist()],
                    prefill_tokens=int(prefilled.sum()) if (prefilled >= 0).all() else -1)


def any_process(flag: bool, procs: Processes) -> bool:
    """True when ``flag`` is true in any process (e.g. a stop request that reached only some of them)."""
    if not procs.many:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.array([int(flag)], np.int32)).max())


def host_arrays(tree, procs: Processes):
    """Numpy copies of a pytree of (possibly multi-process sharded) arrays, identical in every process."""
    if not procs.many:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def barrier(name: str, procs: Processes) -> None:
    """Waits until every process reaches ``name``."""
    if procs.many:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class ReplicatedCopy:
    """What a multi-process run's engine reads: each process's engine decodes on its own first device, but the
    training mesh may split the weights over every process's devices. Called with the params before each
    rollout (``sharing.WeightPublisher(gather=...)``), it returns single-device arrays on that device, which the
    engine views zero-copy:

    - a param whose shard on that device is the whole param (replicated over the mesh, or every param of a
      dp-only mesh: one process per device at fsdp 1 x tp 1) is that training shard itself: a view, nothing
      copied (``viewed_bytes``);
    - the others are all-gathered by one XLA program into a replicated copy (the collective runs over the job's
      transport: gloo on CPU, NCCL on GPU), engine-only bytes (``gathered_bytes``, rebuilt).

    Which params are whole depends only on the shardings, the same in every process, so every process issues the
    same gather. The publisher holds the arrays until ``release``."""

    def __init__(self, mesh):
        from jax.sharding import NamedSharding, PartitionSpec

        self._replicate = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, PartitionSpec()))
        self.device = min(mesh.local_devices, key=lambda d: d.id)
        self.gathered_bytes = self.viewed_bytes = 0

    def _local(self, a: jax.Array) -> jax.Array:
        return next(s.data for s in a.addressable_shards if s.device == self.device)

    def __call__(self, params) -> dict:
        whole = {k for k, v in params.items() if self._local(v).shape == v.shape}
        copy = self._replicate({k: v for k, v in params.items() if k not in whole}) if len(whole) < len(params) else {}
        jax.block_until_ready(copy)
        self.gathered_bytes = sum(int(v.nbytes) for v in copy.values())
        self.viewed_bytes = sum(int(params[k].nbytes) for k in whole)
        return {k: self._local(copy[k] if k in copy else v) for k, v in params.items()}


class RolloutTPCopy:
    """What a vLLM TP rank reads when its device's training shards are not its own tensors (``--rollout_tp`` > 1 at
    train TP != rollout TP or fsdp > 1): the params resharded, by one XLA program (all-gathers of fsdp pieces,
    slices of tp ones), onto the rollout's layout: the same devices in process order as a dp' x fsdp 1 x tp
    ``rollout_tp`` mesh (a TP group is consecutive processes), each parameter split over tp as the training rules
    split it and replicated over the rest. Fused tensors whose row groups follow the training TP are regrouped by
    the rollout TP in the same program (``model``: the copy's layout), so every rank tensor is one contiguous slice
    of it. Each device then holds its rank's slices (``copy_bytes``, engine-only, freed at ``release``), not the
    whole model; ``position`` is this device's place in that mesh."""

    def __init__(self, model_cfg, mesh, rollout_tp: int):
        from rollplex_jax.config import MeshConfig
        from rollplex_jax.models.vl.fused import fused_tensors
        from rollplex_jax.parallel import mesh as mesh_lib

        devices = sorted(mesh.devices.flat, key=lambda d: (d.process_index, d.id))
        rollout = mesh_lib.train_mesh(MeshConfig(train_dp=len(devices) // rollout_tp, train_tp=rollout_tp), devices)
        self.model = model_cfg.with_param_layout(rollout_tp, model_cfg.text.vocab_multiple)
        after = fused_tensors(self.model)
        self._regroup = {k: (ft.parts, ft.groups, after[k].groups) for k, ft in fused_tensors(model_cfg).items()
                         if ft.groups != after[k].groups}
        self._shardings = mesh_lib.param_shardings(self.model, rollout)
        self.position = list(rollout.devices.flat).index(jax.local_devices()[0])
        self._copy = None
        self.copy_bytes = 0

    def _layout(self, params: dict) -> dict:
        from rollplex_jax.models.vl.fused import fuse_rows, unfuse_rows

        out = dict(params)
        for k, (parts, before, after) in self._regroup.items():
            out[k] = fuse_rows(unfuse_rows(out[k], parts, before), after)
        return out

    def __call__(self, params) -> dict:
        if self._copy is None:
            self._copy = jax.jit(self._layout, out_shardings={k: self._shardings[k] for k in params})
        out = self._copy(dict(params))
        jax.block_until_ready(out)
        self.copy_bytes = sum(int(s.data.nbytes) for a in out.values() for s in a.addressable_shards)
        return out
