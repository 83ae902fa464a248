"""What XLA counts for a compiled program (``cost_analysis``: FLOPs, transcendentals, bytes accessed), per
program and per serial phase, so a phase's time can be reported beside its FLOPs as a rate.

``program_costs(jitted, *args)`` lowers and compiles ``jitted`` for ``args`` (arrays or
``jax.ShapeDtypeStruct``s; nothing runs; jit's cache makes a second call for the same shapes cheap) and
returns its ``ProgramCost``.

Caveat (XLA's counting): the body of a ``while`` loop is counted ONCE, not once per trip, and the
blockwise attention kernel is ``fori_loop``s (with trip counts that depend on the block index: causal
masks). ``ProgramCost.while_loops`` says how many loops the compiled program has: with any, its FLOPs are a
lower bound. Measured: 32 vision frames of 1024 patches, dense attention 4.63 GFLOP, blockwise 0.075
(one block's body). ``serial_phase_costs`` therefore counts each phase on its programs built with
``attention="dense"`` (the same computation, no loops): those are the model's FLOPs, the numerator of a
rate, whatever kernel the timed run used (the blockwise backward also recomputes the scores: more work
than counted). Rematerialised work is counted (the HLO is the optimised one).
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """XLA's counts for one execution of a compiled program (or a sum over several)."""

    flops: float
    transcendentals: float
    bytes_accessed: float
    while_loops: int  # loops in the compiled HLO: > 0 means the counts are lower bounds

    def __add__(self, other: ProgramCost) -> ProgramCost:
        return ProgramCost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                           self.bytes_accessed + other.bytes_accessed, self.while_loops + other.while_loops)


ZERO = ProgramCost(0.0, 0.0, 0.0, 0)


def program_costs(jitted, *args, **kwargs) -> ProgramCost:
    """``jitted`` (a ``jax.jit`` function, or anything with ``.lower``) compiled for ``args``: XLA's counts.

    Example: ``program_costs(programs.grad, params, mb.inputs, mb.prompt_len, answers).flops``.
    """
    compiled = jitted.lower(*args, **kwargs).compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per module
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    loops = len(re.findall(r"\bwhile\(", compiled.as_text()))
    return ProgramCost(flops=float(analysis.get("flops", 0.0)),
                       transcendentals=float(analysis.get("transcendentals", 0.0)),
                       bytes_accessed=float(analysis.get("bytes accessed", 0.0)), while_loops=loops)


def serial_phase_costs(model, rl, optim, prog, params, ref_params, mbs, weights, advantages, old_logp=None,
                       ref_logp=None) -> dict[str, ProgramCost]:
    """XLA's counts of the serial schedule's phases on one step's micro-batches, summed over them:
    ``reference`` (``ref_logprobs`` on ``ref_params``) and ``actor`` (``grad``, loss fwd + bwd), each counted
    on its program built with dense attention (module docstring: complete counts, no loops).

    Args:
      model, rl, optim, prog: the run's ``ModelConfig``, ``RlConfig``, ``OptimConfig``, ``ProgramConfig``.
      params, ref_params: actor and reference params (arrays or ShapeDtypeStructs).
      mbs: ``programs.sequences.micro_batches`` of the step (``SerialOps.mbs``).
      weights: token weights [B*G, Tr] of all rows (one mini-batch); advantages [B*G]; old_logp, ref_logp:
        [B*G, Tr] or None, sliced per micro-batch as ``SerialOps.grads`` does.
    """
    from rollplex_jax.programs.actor import Answers, make_programs  # here: actor imports nothing of this module

    # temperature 1: dividing the logits by another one adds one elementwise op over [rows, Tr, V], no matmul
    dense = make_programs(model, rl, optim, 1, prog=dataclasses.replace(prog, attention="dense"), temperature=1.0)
    out = {"reference": ZERO, "actor": ZERO}
    for mb in mbs:
        r = mb.rows
        out["reference"] += program_costs(dense.ref_logprobs, ref_params, mb.inputs, mb.prompt_len,
                                          mb.response_ids, mb.response_mask)
        old = None if old_logp is None else old_logp[r]
        ref = None if ref_logp is None else ref_logp[r]
        answers = Answers(ids=mb.response_ids, weights=jnp.asarray(weights)[r], advantages=advantages[r], old=old,
                          ref=ref)
        out["actor"] += program_costs(dense.grad, params, mb.inputs, mb.prompt_len, answers)
    return out
