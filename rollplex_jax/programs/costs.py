"""What XLA counts for a compiled program (``cost_analysis``: FLOPs, transcendentals, bytes accessed) and the
matmul FLOPs of the traced program, per program and per serial phase, so a phase's time can be reported beside
its FLOPs as a rate and the step-time simulator's counts can be checked against the programs that run.

``program_costs(jitted, *args)`` traces, lowers and compiles ``jitted`` for ``args`` (arrays or
``jax.ShapeDtypeStruct``s; nothing runs; jit's cache makes a second call for the same shapes cheap) and
returns its ``ProgramCost``.

XLA's ``flops`` are every floating-point operation of the optimised HLO: the matmuls (2 per multiply-add)
and the elementwise work (norms, softmax, activations, the loss; about 1 per element per operation).
``matmul_flops`` are the matmuls alone, counted on the program's jaxpr (each ``dot_general``: 2 x output
elements x contracted size; a convolution likewise), the part the simulator times at the matmul rate
(``rollplex_jax/sim/costs.py``: it times elementwise work by its bytes instead). XLA's total is never below
it (tests/test_simulator.py).

Caveat (XLA's counting): the body of a ``while`` loop is counted ONCE, not once per trip, and the
blockwise attention kernel is ``fori_loop``s (with trip counts that depend on the block index: causal
masks). ``ProgramCost.while_loops`` says how many loops the compiled program has: with any, its FLOPs are a
lower bound (``matmul_flops`` too: a loop body's matmuls are counted once; a ``scan``'s once per step).
Measured: 32 vision frames of 1024 patches, dense attention 4.63 GFLOP, blockwise 0.075
(one block's body). ``serial_phase_costs`` therefore counts each phase on its programs built with
``attention="dense"`` (the same computation, no loops): those are the model's FLOPs, the numerator of a
rate, whatever kernel the timed run used (the blockwise backward also recomputes the scores: more work
than counted). Rematerialised work is counted by XLA (the HLO is the optimised one), not by ``matmul_flops``.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax.numpy as jnp

from rollplex_jax.config import ModelConfig, OptimConfig, ProgramConfig, RlConfig


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """XLA's counts for one execution of a compiled program (or a sum over several), and its matmul FLOPs."""

    flops: float
    transcendentals: float
    bytes_accessed: float
    while_loops: int  # loops in the compiled HLO: > 0 means the counts are lower bounds
    matmul_flops: float = 0.0  # dot_general / convolution FLOPs of the traced program (module doc)

    def __add__(self, other: ProgramCost) -> ProgramCost:
        return ProgramCost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                           self.bytes_accessed + other.bytes_accessed, self.while_loops + other.while_loops,
                           self.matmul_flops + other.matmul_flops)


ZERO = ProgramCost(0.0, 0.0, 0.0, 0)


def _sub_jaxprs(value):
    """The jaxprs held by an equation's parameter (pjit, remat, custom_jvp/vjp, cond branches, loop bodies)."""
    if hasattr(value, "eqns"):
        return [value]
    if hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
        return [value.jaxpr]
    if isinstance(value, (tuple, list)):
        return [j for v in value for j in _sub_jaxprs(v)]
    return []


def _eqn_matmul_flops(eqn) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (lhs_contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in lhs_contract)
    if name == "conv_general_dilated":  # per output element: one multiply-add per kernel input element
        rhs, spec = eqn.invars[1].aval.shape, eqn.params["dimension_numbers"].rhs_spec
        return 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[i] for i in spec[1:])
    return 0.0


def jaxpr_matmul_flops(jaxpr) -> float:
    """FLOPs of every ``dot_general`` and convolution in ``jaxpr`` and the jaxprs it calls (a ``scan`` body
    times its length; any other body once)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        total += _eqn_matmul_flops(eqn)
        trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            total += trips * sum(jaxpr_matmul_flops(j) for j in _sub_jaxprs(value))
    return total


def program_costs(jitted, *args, **kwargs) -> ProgramCost:
    """``jitted`` (a ``jax.jit`` function) compiled for ``args``: XLA's counts and the traced matmul FLOPs.

    Example: ``program_costs(programs.grad, params, mb.inputs, mb.prompt_len, answers).flops``.
    """
    traced = jitted.trace(*args, **kwargs)
    compiled = traced.lower().compile()
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older jax: one dict per module
        analysis = analysis[0] if analysis else {}
    analysis = analysis or {}
    loops = len(re.findall(r"\bwhile\(", compiled.as_text()))
    return ProgramCost(flops=float(analysis.get("flops", 0.0)),
                       transcendentals=float(analysis.get("transcendentals", 0.0)),
                       bytes_accessed=float(analysis.get("bytes accessed", 0.0)), while_loops=loops,
                       matmul_flops=jaxpr_matmul_flops(traced.jaxpr.jaxpr))


@dataclasses.dataclass(frozen=True)
class PhasePrograms:
    """What builds a run's serial programs: its model, RL, optimizer and program configs."""

    model: ModelConfig
    rl: RlConfig
    optim: OptimConfig
    prog: ProgramConfig

    @classmethod
    def of(cls, cfg) -> PhasePrograms:
        """From a run's ``Config``."""
        return cls(cfg.model, cfg.rl, cfg.optim, cfg.programs)


def serial_phase_costs(ctx: PhasePrograms, params, ref_params, mbs, weights, advantages, old_logp=None,
                       ref_logp=None) -> dict[str, ProgramCost]:
    """XLA's counts of the serial schedule's phases on one step's micro-batches, summed over them:
    ``reference`` (``ref_logprobs`` on ``ref_params``) and ``actor`` (``grad``, loss fwd + bwd), each counted
    on its program built with dense attention (module docstring: complete counts, no loops).

    Args:
      ctx: the run's configs (``PhasePrograms.of(cfg)``).
      params, ref_params: actor and reference params (arrays or ShapeDtypeStructs).
      mbs: ``programs.sequences.micro_batches`` of the step (``SerialOps.mbs``).
      weights: token weights [B*G, Tr] of all rows (one mini-batch); advantages [B*G]; old_logp, ref_logp:
        [B*G, Tr] or None, sliced per micro-batch as ``SerialOps.grads`` does.
    """
    from rollplex_jax.programs.actor import Answers, make_programs  # here: actor imports nothing of this module

    # temperature 1: dividing the logits by another one adds one elementwise op over [rows, Tr, V], no matmul
    dense = make_programs(ctx.model, ctx.rl, ctx.optim, 1, prog=dataclasses.replace(ctx.prog, attention="dense"),
                          temperature=1.0)
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
