"""How to split one GPU between XLA and the torch rollout engine, from a plan (issue 31, item 7).

JAX and the engine share every device (Rollplex colocates them). Left to their defaults they do not fit
together: JAX preallocates 75% of the card at its first use and vLLM claims ``gpu_memory_utilization`` (its
default 0.9) of the whole card at start. From the plan's Rollplex layout (per device):

- JAX's peak: the largest phase's JAX-side bytes (``Plan.jax_bytes``: without the engine's KV cache, working
  set and own weight buffers). ``XLA_PYTHON_CLIENT_MEM_FRACTION`` = that over the card's memory, plus
  ``SLACK`` for the allocator, rounded up to a hundredth; with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` JAX takes
  memory as the programs need it, and the fraction is its ceiling.
- vLLM's ``gpu_memory_utilization``: vLLM sizes its KV pool at start as utilization x card minus what it holds
  when it profiles: its weights, loaded as its own full copy at its TP degree (our engine rebinds them to the
  actor's buffers afterwards) and its activations. To get the plan's KV cache the utilization is (that copy
  + the planned KV cache + the engine's working set) over the card, plus ``SLACK``, rounded up. After binding
  the engine holds less: its rebuilt weights, the KV cache and its working set (``torch_peak_bytes``).
- They fit when JAX's fraction and the engine's peak fit the card together (``fits``), and when vLLM's start
  (its utilization) fits beside what JAX holds before the first step (weights, reference, optimizer state:
  ``jax_at_start_bytes``).

Not in these figures: CUDA contexts (about 0.5 GiB per process per library), NCCL buffers, cuBLAS / cuDNN
workspaces (``SLACK`` is meant to cover them; unmeasured without a GPU).
"""

from __future__ import annotations

import math

from rollplex_jax.memory.classes import PHASES
from rollplex_jax.memory.planner.types import Plan

SLACK = 0.05  # of the card, for each of XLA and the engine: allocator fragmentation, contexts, workspaces
_AT_START = ("compute_weights", "ref_weights", "master_weights", "optimizer_state")


def _up(x: float) -> float:
    return min(1.0, math.ceil(x * 100 - 1e-9) / 100)


def memory_fractions(plan: Plan, hbm_bytes: int, layout: str = "rollplex") -> dict:
    """XLA's memory fraction and vLLM's ``gpu_memory_utilization`` for ``plan`` on a card of ``hbm_bytes``
    (module doc), with the figures they come from."""
    jax_peak = max(plan.jax_bytes(layout, p) for p in PHASES)
    rollout = plan.layouts[layout]["rollout"]
    act, kv = plan.details["engine_activation_bytes"], plan.details["rollout_kv_bytes"]
    torch_peak = int(rollout.get("rollout_weights", 0) + kv + act)
    at_profile = plan.weight_sharing["naive_copy_bytes_per_device"] + kv + act
    xla = _up(jax_peak / hbm_bytes + SLACK)
    vllm = _up(at_profile / hbm_bytes + SLACK)
    at_start = int(sum(rollout.get(c, 0) for c in _AT_START))
    return {
        "hbm_bytes": int(hbm_bytes), "jax_peak_bytes": int(jax_peak), "torch_peak_bytes": torch_peak,
        "jax_at_start_bytes": at_start, "vllm_profiled_bytes": int(at_profile),
        "xla_python_client_mem_fraction": xla, "vllm_gpu_memory_utilization": vllm,
        "fits": xla * hbm_bytes + torch_peak <= hbm_bytes and at_start + vllm * hbm_bytes <= hbm_bytes,
        "env": f"XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION={xla:.2f}",
        "slack": SLACK,
    }
