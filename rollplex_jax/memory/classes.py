"""The buffer classes of an RL step, their producer and last-consumer phases, and their policies.

Shared by the runtime (``rollplex_jax.memory.meter``: measures what is live per phase) and the planner
(``rollplex_jax.memory.planner``: predicts it from a config), so both speak of the same classes and phases.

Phases of one step, in order (both schedules):

| phase     | serial                                        | rollplex                                            |
|-----------|-----------------------------------------------|-----------------------------------------------------|
| rollout   | torch decodes over views of theta_k           | same, while XLA computes vision + actor/ref prefixes |
| score     | reference log-probs over full sequences       | reference suffix over the boundary KV               |
| train     | actor forward/backward over full sequences    | actor suffix forward/backward + prefix vjp          |
| update    | optimizer step                                | same                                                 |

A buffer is resident on the device from its producer phase to its last consumer phase (inclusive),
unless its policy says otherwise: ``offload`` keeps it in host memory (JAX memory kind
``pinned_host``) outside the phases that read or write it; ``recompute`` does not keep it at all.
"""

from __future__ import annotations

import dataclasses

PHASES = ("rollout", "score", "train", "update")
POLICIES = ("resident", "offload", "recompute")


@dataclasses.dataclass(frozen=True)
class BufferClass:
    name: str
    producer: str  # phase that creates it ("persistent": lives across steps)
    last_consumer: str
    policy: str  # default policy
    doc: str

    def live_in(self, phase: str, policy: str | None = None) -> bool:
        """Whether the class occupies device memory during ``phase`` under ``policy``."""
        policy = policy or self.policy
        if policy == "recompute":
            return False
        if self.producer == "persistent":
            return policy == "resident" or phase in self.offload_phases
        i, lo, hi = PHASES.index(phase), PHASES.index(self.producer), PHASES.index(self.last_consumer)
        return lo <= i <= hi

    @property
    def offload_phases(self) -> tuple[str, ...]:
        """Phases in which an offloaded persistent class is brought back to the device."""
        return ("update",) if self.name in ("optimizer_state", "master_weights") else ()


CLASSES = {c.name: c for c in (
    BufferClass("compute_weights", "persistent", "update", "resident",
                "actor params theta_k in the compute dtype; the rollout engine reads them through DLPack views"),
    BufferClass("master_weights", "persistent", "update", "resident",
                "fp32 master copy of the actor params (only when the compute dtype is not fp32)"),
    BufferClass("optimizer_state", "persistent", "update", "resident",
                "Adam first and second moments (fp32) and step counters"),
    BufferClass("ref_weights", "persistent", "score", "resident", "reference params (never donated)"),
    BufferClass("rollout_weights", "persistent", "rollout", "resident",
                "engine-owned weight copies (rebuilt tensors; a full second copy under naive colocation)"),
    BufferClass("rollout_kv", "rollout", "rollout", "resident", "the rollout engine's KV cache while decoding"),
    BufferClass("boundary_kv", "rollout", "train", "resident",
                "prefix KV at the prompt/answer boundary (actor and reference), rollplex only"),
    BufferClass("prefix_residuals", "rollout", "train", "resident",
                "autograd residuals of the actor prefix (jax.vjp), rollplex with --actor_prefix=residuals"),
    BufferClass("gradients", "train", "update", "resident", "accumulated gradients (params' shapes)"),
    BufferClass("activations", "rollout", "update", "resident",
                "phase-local temporaries of the programs running in a phase (XLA temp buffers)"),
    BufferClass("other", "rollout", "update", "resident", "inputs, rollouts and anything not classified"),
)}
