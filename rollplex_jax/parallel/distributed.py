"""Multi-process JAX: find out whether this process is one of several, and start `jax.distributed`.

`detect()` is pure (reads only the mapping it is given): explicit `--coordinator_address/--num_processes/
--process_id` win; otherwise a SLURM job step (`srun`) with more than one task is recognised from its
environment. `initialize(spec)` then starts JAX's multi-controller runtime (gloo collectives on CPU).

Gotchas this module handles (jax 0.10):
- `jax.distributed.initialize` left to its own SLURM detection sets `local_device_ids=[SLURM_LOCALID]`,
  i.e. with one task per node each process would drive GPU 0 only. We resolve everything ourselves and pass
  `cluster_detection_method="deactivate"`: a process sees all its local devices, except with one task per GPU
  (several tasks on a node, its GPUs visible to each: `slurm_local_devices`), where task SLURM_LOCALID drives
  GPU SLURM_LOCALID.
- Inside an `sbatch` script (the batch step) SLURM_NTASKS is the allocation's task count although only one
  process runs there; only `srun` steps count (SLURM_STEP_NUM_TASKS / SLURM_STEP_ID), so a single-process run
  started from the batch script is not mistaken for process 0 of N (it would wait for the others forever).
- It must run before anything touches a JAX backend (jax.devices(), any array op).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

# Port used when neither ROLLPLEX_COORDINATOR_PORT nor JAX_COORDINATOR_PORT is set under SLURM:
# _PORT_BASE + (job id * 31 + step id) % _PORT_SPAN, an unprivileged range below Linux's ephemeral ports
# (32768-60999) so that it does not collide with client sockets; all tasks of a step compute the same port.
_PORT_BASE = 20000
_PORT_SPAN = 10000
PORT_ENV = "ROLLPLEX_COORDINATOR_PORT"


class DistributedError(ValueError):
    """Invalid or incomplete multi-process settings (the message names the flag or variable)."""


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
    coordinator_address: str  # "host:port" of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None  # the local devices (GPUs) this process drives; None: all
    source: str = "flags"  # "flags" or "slurm": where the settings came from (for logs)

    def __post_init__(self):
        _check_address(self.coordinator_address, "--coordinator_address")
        if self.num_processes < 1:
            raise DistributedError(f"--num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(f"--process_id must be in [0, --num_processes={self.num_processes}), "
                                   f"got {self.process_id}")
        if self.local_device_ids is not None and (not self.local_device_ids or min(self.local_device_ids) < 0):
            raise DistributedError(f"local_device_ids must be non-negative ids or None, got {self.local_device_ids}")


def _check_address(address: str, name: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedError(f"{name} must be HOST:PORT with a port in 1..65535, got {address!r}")


def _split_top_level(text: str) -> list[str]:
    """Splits on commas outside brackets: 'a[1,2],b' -> ['a[1,2]', 'b']."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistributedError(f"unbalanced ']' in SLURM host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise DistributedError(f"unbalanced '[' in SLURM host list {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range_list(body: str, text: str) -> list[str]:
    out = []
    for item in body.split(","):
        lo, dash, hi = item.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise DistributedError(f"bad range {item!r} in SLURM host list {text!r}")
        if not dash:
            out.append(lo)
            continue
        width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
        if int(hi) < int(lo):
            raise DistributedError(f"descending range {item!r} in SLURM host list {text!r}")
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expands a SLURM host list: 'node[01-03,7],gpu-a[1-2]x' -> node01 node02 node03 node07 gpu-a1x gpu-a2x.

    Several bracket groups in one name give their product ('r[1-2]n[1-2]' -> r1n1 r1n2 r2n1 r2n2), as
    `scontrol show hostnames` does. Zero padding of the lower bound is kept.
    """
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        names = [""]
        for m in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            prefix, body = m.group(1), m.group(2)
            if not prefix and body is None:
                continue
            choices = [prefix] if body is None else [prefix + x for x in _expand_range_list(body, text)]
            names = [n + c for n in names for c in choices]
        hosts.extend(names)
    if not hosts:
        raise DistributedError(f"empty SLURM host list {text!r}")
    return hosts


def _env_int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name, "")
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name}={value!r} is not an integer") from None


def default_port(env: Mapping[str, str]) -> int:
    """The coordinator port for a SLURM step: ROLLPLEX_COORDINATOR_PORT, JAX_COORDINATOR_PORT, or derived from
    SLURM_JOB_ID and SLURM_STEP_ID (so that two steps of one job, or two jobs sharing a node, differ)."""
    for name in (PORT_ENV, "JAX_COORDINATOR_PORT"):
        if env.get(name):
            port = _env_int(env, name)
            if not 0 < port < 65536:
                raise DistributedError(f"{name}={port} is not a port in 1..65535")
            return port
    job = _env_int(env, "SLURM_JOB_ID")
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", "0"))
    step_n = int(step) if step.isdigit() else 0
    return _PORT_BASE + (job * 31 + step_n) % _PORT_SPAN


def detect(coordinator_address: str | None = None, num_processes: int | None = None, process_id: int | None = None,
           env: Mapping[str, str] | None = None) -> DistributedSpec | None:
    """The multi-process settings of this process, or None for a single-process run.

    Explicit arguments (the --coordinator_address/--num_processes/--process_id flags) win and must be given
    all three together (num_processes=1 alone means single process). Otherwise, inside a SLURM `srun` step with
    more than one task: process id SLURM_PROCID, count SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), coordinator the
    first host of SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST) on `default_port(env)`.
    """
    env = os.environ if env is None else env
    given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
             "--process_id": process_id}
    if any(v is not None for v in given.values()):
        if num_processes == 1 and coordinator_address is None and process_id in (None, 0):
            return None
        missing = [k for k, v in given.items() if v is None]
        if missing:
            have = [k for k, v in given.items() if v is not None]
            raise DistributedError(f"{', '.join(have)} given without {', '.join(missing)}: a multi-process run "
                                   "needs all three (or none, to auto-detect SLURM)")
        if num_processes == 1:
            return None
        return DistributedSpec(coordinator_address, int(num_processes), int(process_id), source="flags")

    if not env.get("SLURM_JOB_ID"):
        return None
    # Only an srun step has SLURM_STEP_ID/SLURM_STEP_NUM_TASKS; in the batch script SLURM_NTASKS counts tasks that
    # do not exist (yet), so it is a single process there.
    if "SLURM_STEP_NUM_TASKS" in env:
        ntasks = _env_int(env, "SLURM_STEP_NUM_TASKS")
    elif "SLURM_STEP_ID" in env or "SLURM_STEPID" in env:
        ntasks = _env_int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else 1
    else:
        return None
    if ntasks <= 1:
        return None
    if "SLURM_PROCID" not in env:
        raise DistributedError(f"SLURM step with {ntasks} tasks but SLURM_PROCID is not set")
    procid = _env_int(env, "SLURM_PROCID")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise DistributedError("SLURM step without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: cannot find the "
                               "coordinator host; pass --coordinator_address")
    host = env.get("ROLLPLEX_COORDINATOR_HOST") or expand_hostlist(nodelist)[0]
    address = f"{host}:{default_port(env)}"
    if not 0 <= procid < ntasks:
        raise DistributedError(f"SLURM_PROCID={procid} is not in [0, {ntasks})")
    return DistributedSpec(address, ntasks, procid, slurm_local_devices(env), source="slurm")


def _tasks_on_node(env: Mapping[str, str]) -> int:
    """Tasks of this step on this node: SLURM_STEP_TASKS_PER_NODE (e.g. '8(x2),4') at SLURM_NODEID, else
    SLURM_NTASKS_PER_NODE, else 1."""
    text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts = []
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise DistributedError(f"SLURM tasks per node {text!r}: cannot parse {part!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if counts:
        node = _env_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        return counts[min(node, len(counts) - 1)]
    return _env_int(env, "SLURM_NTASKS_PER_NODE") if env.get("SLURM_NTASKS_PER_NODE") else 1


def slurm_local_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
    """The GPU a SLURM task drives when a node runs one task per GPU (issue 33's layout: every device decodes with
    an engine of its own), or None (the process drives every device it sees: one task per node, a task bound to
    one GPU by ``--gpus-per-task=1``, or no GPUs: CPU jobs).

    With several tasks on the node and its GPUs visible to each (``--gpus-per-node=G --ntasks-per-node=G``, JAX's
    own convention, which keeps the GPUs' peer access), task SLURM_LOCALID drives GPU SLURM_LOCALID; more tasks
    than visible GPUs is refused."""
    tasks = _tasks_on_node(env)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpus = len([g for g in visible.split(",") if g.strip()]) if visible is not None else (
        _env_int(env, "SLURM_GPUS_ON_NODE") if env.get("SLURM_GPUS_ON_NODE") else 0)
    if tasks <= 1 or gpus <= 1:
        return None
    local = _env_int(env, "SLURM_LOCALID")
    if tasks > gpus:
        raise DistributedError(f"{tasks} SLURM tasks on this node share {gpus} GPUs: start one task per GPU "
                               f"(--ntasks-per-node={gpus}) or one per node (--ntasks-per-node=1)")
    return (local,)


_initialized: DistributedSpec | None = None


def initialize(spec: DistributedSpec | None, timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> tuple[int, int]:
    """Starts jax.distributed for `spec` (no-op for None) and returns (jax.process_index(), jax.process_count()).

    Idempotent: a second call with the same spec returns the same; a different spec raises. Must run before any
    JAX computation. `timeout_s` bounds the wait for all processes to connect; `heartbeat_timeout_s` is JAX's
    own: a process silent that long aborts the job (``launch.main`` sets it to 3x ``--heartbeat_timeout_s``, so
    that ``parallel.liveness`` answers first with an error naming the lost process).
    """
    global _initialized
    import jax

    if spec is None:
        return jax.process_index(), jax.process_count()
    if _initialized is not None:
        if _initialized != spec:
            raise DistributedError(f"jax.distributed already initialized with {_initialized}, not {spec}")
        return jax.process_index(), jax.process_count()
    # CPU cross-process collectives: gloo (the default from jax 0.5 on; older versions default to none, where a
    # multi-process CPU computation fails). Only affects the CPU client, harmless on GPU.
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # very old jax without the option
        pass
    kwargs = {}
    if spec.local_device_ids is not None:
        kwargs["local_device_ids"] = list(spec.local_device_ids)
    jax.distributed.initialize(coordinator_address=spec.coordinator_address, num_processes=spec.num_processes,
                               process_id=spec.process_id, cluster_detection_method="deactivate",
                               initialization_timeout=timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s,
                               **kwargs)
    _initialized = spec
    index, count = jax.process_index(), jax.process_count()
    if (index, count) != (spec.process_id, spec.num_processes):
        raise DistributedError(f"jax.distributed reports process {index} of {count}, expected "
                               f"{spec.process_id} of {spec.num_processes}")
    return index, count


def shutdown() -> None:
    """Leaves jax.distributed (if this module started it); lets a process exit without the others' heartbeat
    timeout."""
    global _initialized
    if _initialized is not None:
        import jax

        jax.distributed.shutdown()
        _initialized = None


def colocate_with_torch(environ=os.environ) -> None:
    """JAX and the torch rollout engine share every device: JAX's GPU client must not preallocate 75% of the card
    at its start (its default), or the engine (vLLM's pool, the transformers engine's KV cache) has no room. Sets
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless the user set it (``XLA_PYTHON_CLIENT_MEM_FRACTION`` stays the
    user's: ``python -m launch.plan`` prints the plan's). Before anything touches a JAX backend; no effect on CPU."""
    environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def torch_group(environ=os.environ) -> None:
    """torch.distributed over this job's processes, rank = JAX process index, for vLLM's external launcher
    (``distributed_executor_backend="external_launcher"``: a TP group's ranks are processes of this job, as verl
    runs it). Sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (vLLM reads RANK and LOCAL_RANK) and
    joins the group (gloo on CPU, NCCL on GPU): at the jax coordinator's host, on a port process 0 picks free and
    broadcasts. vLLM reuses an initialized group and forms its TP groups of consecutive ranks (its "external DP"
    dimension takes the rest). LOCAL_RANK: the CUDA ordinal of this process's JAX device on a GPU (one visible GPU
    per process: 0), else SLURM_LOCALID or the process index. Every process must call this together."""
    import socket

    import jax
    import numpy as np
    import torch
    import torch.distributed as dist
    from jax.experimental import multihost_utils

    if dist.is_initialized():
        return
    host = _initialized.coordinator_address.rsplit(":", 1)[0] if _initialized is not None else "127.0.0.1"
    port = 0
    if jax.process_index() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = int(multihost_utils.broadcast_one_to_all(np.array(port, np.int64)))
    device = jax.local_devices()[0]
    local = device.local_hardware_id if device.platform == "gpu" else int(environ.get("SLURM_LOCALID",
                                                                                      jax.process_index()))
    environ.update(RANK=str(jax.process_index()), LOCAL_RANK=str(local), WORLD_SIZE=str(jax.process_count()),
                   MASTER_ADDR=host, MASTER_PORT=str(port))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", init_method="env://",
                            world_size=jax.process_count(), rank=jax.process_index())
