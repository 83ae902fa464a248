"""FLOPs beside phase times in ``launch.bench``: XLA's count of the serial schedule's reference and actor
programs on the bench's last serial step, and the rate each phase ran at.

The counts are ``programs.costs.serial_phase_costs``: the same programs built with dense attention (XLA counts
a ``while`` body once, and the blockwise kernel is loops), on the step's micro-batches (one mini-batch: every
row once). A phase whose rate is far below the others' is where the time goes.
"""

from __future__ import annotations


def serial_phase_rates(runner, phases_s: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{"reference"|"actor": {"gflop", "s", "gflop_per_s"}}`` for the serial ``runner``'s last step (``phases_s``:
    the bench's median seconds per phase); the reference only when the run uses it."""
    import jax.numpy as jnp
    import numpy as np

    from rollplex_jax.data import dataset as data_lib
    from rollplex_jax.programs.costs import PhasePrograms, serial_phase_costs
    from rollplex_jax.programs.sequences import input_options, micro_batches
    from rollplex_jax.rl import losses

    cfg, ro = runner.cfg, runner.last.rollouts
    prompts = data_lib.collate(runner.last_prompts, runner.tokenizer.pad_id)
    b, g, tr = ro.response_ids.shape
    weights = losses.token_weights(jnp.asarray(ro.mask.reshape(b * g, tr)), cfg.rl.loss_agg)
    use_ref = cfg.rl.uses_reference
    state = runner.state
    costs = serial_phase_costs(PhasePrograms.of(cfg), state.params,
                               state.ref_params if use_ref else state.params,
                               micro_batches(cfg.model, prompts, ro, cfg.rl.micro_batch, opts=input_options(cfg)),
                               weights,
                               jnp.zeros(b * g, jnp.float32), None,
                               jnp.zeros((b * g, tr), jnp.float32) if use_ref else None)
    out = {}
    for phase in ("reference", "actor") if use_ref else ("actor",):
        secs = float(phases_s.get(phase, 0.0))
        gflop = costs[phase].flops / 1e9
        out[phase] = {"gflop": gflop, "s": secs, "gflop_per_s": gflop / secs if secs > 0 else float(np.nan)}
    return out
