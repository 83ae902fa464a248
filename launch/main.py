"""Train a VLM with GRPO: python -m launch.main --flagfile=configs/tiny_cpu.flags [--workdir=DIR]

Entry point only: flags -> Config -> rollplex_jax.run.runner. Writes metrics.jsonl, run_summary.json,
plots/, TensorBoard events and checkpoints under --workdir (ARCHITECTURE.md "Run outputs").
"""

import json
import os
import signal
import sys
import traceback

from absl import app, flags, logging

from launch import flags as launch_flags


def define_distributed_flags() -> None:
    """Process-level flags (not part of the run's config: they say where this process sits in the job)."""
    flags.DEFINE_string("coordinator_address", None, "host:port of process 0's jax.distributed coordination service "
                        "(with --num_processes and --process_id; under SLURM `srun` all three are auto-detected)")
    flags.DEFINE_integer("num_processes", None, "number of processes of this jax.distributed job")
    flags.DEFINE_integer("process_id", None, "this process's index in the job, 0 .. num_processes - 1")
    flags.DEFINE_float("heartbeat_timeout_s", 60.0, "multi-process: a process whose heartbeat (every few s, through "
                       "jax.distributed's key-value store) is absent this long is lost; every other process then exits "
                       "(code 75) with an error naming it instead of waiting in a collective; 0 = off "
                       "(rollplex_jax/parallel/liveness.py; jax.distributed's own heartbeat: 3x this)",
                       lower_bound=0)
    flags.DEFINE_float("step_timeout_s", 3600.0, "multi-process: a step not finished this long after the previous one "
                       "(the first: after the start, compilation included) ends every process (code 75) with where "
                       "it hangs; 0 = off", lower_bound=0)


def start_distributed(fv) -> tuple[int, int]:
    """Starts jax.distributed when the flags say so or a SLURM step with several tasks runs this process
    (rollplex_jax/parallel/distributed.py); (process index, count). Must run before anything touches JAX devices."""
    from rollplex_jax.parallel import distributed

    try:
        spec = distributed.detect(fv.coordinator_address, fv.num_processes, fv.process_id)
    except distributed.DistributedError as e:
        raise app.UsageError(str(e)) from None
    beat = fv.heartbeat_timeout_s
    return distributed.initialize(spec, heartbeat_timeout_s=int(max(3 * beat, 30)) if beat else 100)


def start_liveness(fv, cfg, index: int, count: int):
    """The lost-process check of a multi-process run (``parallel.liveness``; None for one process)."""
    from rollplex_jax.parallel.liveness import Liveness
    from rollplex_jax.run.checkpoint import committed_steps

    directory = os.path.abspath(os.path.join(cfg.run.workdir, "checkpoints"))

    def last_checkpoint() -> str:
        steps = committed_steps(cfg.run.workdir)
        return f"The last checkpoint is step {steps[-1]} in {directory}" if steps else \
            f"No checkpoint in {directory} yet (--checkpoint_every)"

    return Liveness.start(index, count, heartbeat_s=fv.heartbeat_timeout_s, step_timeout_s=fv.step_timeout_s,
                          checkpoint=last_checkpoint)


def _report_failure(e: BaseException) -> None:
    """A rollout timeout in one paragraph (its hung thread's stack, not the caller's); anything else traced."""
    from rollplex_jax.run.watchdog import RolloutTimeoutError

    if not isinstance(e, RolloutTimeoutError):
        traceback.print_exc()
        return
    print(f"error: {e}", file=sys.stderr)
    if e.stack:
        print(f"where the rollout thread is stuck (innermost last):\n{e.stack}", file=sys.stderr)


def _close_after_failure(runner) -> None:
    """A checkpoint of the last finished step (``Runner.save_after_failure``), then the outputs closed; an error in
    either is printed, never raised (the process must still exit)."""
    for what in (lambda: print(runner.save_after_failure(), file=sys.stderr), runner.close):
        try:
            what()
        except Exception:  # noqa: BLE001
            traceback.print_exc()


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from rollplex_jax.parallel.distributed import colocate_with_torch

    colocate_with_torch()
    index, count = start_distributed(flags.FLAGS)
    cfg = launch_flags.config_from_flags(flags.FLAGS)
    live = start_liveness(flags.FLAGS, cfg, index, count)
    logging.set_verbosity(logging.WARNING)  # orbax/absl INFO lines would drown the progress bar
    from rollplex_jax.config import ConfigError
    from rollplex_jax.data.dataset import DataError
    from rollplex_jax.data.tokenizer import TokenizerError
    from rollplex_jax.models.vl.hf_checkpoint import CheckpointError
    from rollplex_jax.run.runner import Runner

    try:
        runner = Runner(cfg)
    except ConfigError as e:
        raise app.UsageError(str(e)) from None
    except (DataError, CheckpointError, TokenizerError) as e:  # bad input: say what and where, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    # SLURM (and most schedulers) send SIGTERM before killing: finish the step in flight, write a final
    # checkpoint (waiting for any save in progress), exit 0; `--resume` continues from it.
    signal.signal(signal.SIGTERM, lambda signum, frame: runner.request_stop())
    try:
        for _ in runner.run():
            if live is not None:
                live.progress(runner.step)
        if runner.stop_requested:
            record = runner.preempt()
            print(f"SIGTERM: stopped after step {record['steps_done']}, checkpoint saved; rerun with --resume",
                  file=sys.stderr)
            print(json.dumps(record))
        else:
            summary = runner.finish()
            keys = ("steps_done", "reward/first10_mean", "reward/last20_mean", "eval/greedy_accuracy",
                    "params_sha256", "wall_s")
            print(json.dumps({k: summary.get(k) for k in keys}))
    except (Exception, KeyboardInterrupt) as e:
        # The error may be a rollout past --rollout_timeout_s or a reward call past its timeout
        # (--reward_failure=raise): their threads still run, and the interpreter would join a reward thread at exit
        # for as long as it hangs. Report, checkpoint the last finished step, close the outputs, and leave without
        # waiting (as below).
        _report_failure(e)
        if live is not None:  # a collective that lost its peer: let the heartbeats name it (exits 75 if so)
            live.await_verdict(e)
        _close_after_failure(runner)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if live is not None:
        live.finish()
    sys.stdout.flush()
    sys.stderr.flush()
    # Outputs are written and closed. A user reward function that hung past its timeout still holds a
    # thread that the interpreter would wait for at exit: leave without waiting.
    os._exit(0)


if __name__ == "__main__":
    launch_flags.define_flags()
    define_distributed_flags()
    app.run(main)
