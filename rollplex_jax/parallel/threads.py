"""How many CPU threads the torch rollout takes by default, so that it and XLA do not oversubscribe the cores.

With the Rollplex schedule (``--overlap``) the prefix programs run on XLA's CPU thread pool while torch
decodes in the main thread. Left to their defaults each takes every core: on 2 cores, 448x448 images,
the rollout went from 0.38 s alone to 2.29 s beside the prefix and overlap alone ran at 0.51x serial.

What can be partitioned:

- XLA's CPU pool is sized from the process's CPU affinity when the backend initialises and cannot be
  resized later (jax-ml/jax#1539, #6790); ``--xla_cpu_multi_thread_eigen=false`` and
  ``intra_op_parallelism_threads`` change nothing measurable here (ENVIRONMENT.md). Shrinking it for
  the run (affinity at start) would slow every XLA phase of every step, serial's too: XLA keeps all cores.
- torch's intra-op thread count (``torch.set_num_threads``, process-global; the decode runs in the main
  thread) is the lever. It could change per phase (all cores alone, fewer beside the prefix), but the
  decode is not faster on all cores even alone: its OpenMP team meets at a barrier after every small
  op, and one preempted member (an XLA thread, the host's other work) stalls all of them. Measured on
  2 cores (WORKSPACE.md, issue 19): serial's rollout 0.10 s on 1 thread vs 0.6-6 s on torch's default 2.

So by default (``--torch_threads=0``) a rollout engine that computes on the CPU gets
``default_torch_threads(cores)`` threads for the whole run (``run_setup.make_engine``, set before the
engine is built); an explicit
``--torch_threads=N`` is kept. On a GPU the two sides are separate streams and torch's CPU threads are
left as they are.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask), as XLA counts them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_torch_threads(cores: int) -> int:
    """torch threads of a CPU rollout on ``cores`` CPUs when ``--torch_threads`` is not given: half, at least one.

    XLA's pool (all cores, fixed at start) shares the rest while the prefix overlaps the decode; beyond
    2 cores (not measured here) half keeps torch's OpenMP team from outnumbering what XLA leaves free.
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return max(1, cores // 2)


def stack_of(thread: threading.Thread, frames: int = 12) -> str:
    """The innermost ``frames`` frames of ``thread``'s Python stack ('' when it has none): where a hung thread is
    (``run.watchdog`` for a rollout, ``parallel.liveness`` for the main thread of a hung step)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return ""
    return "".join(traceback.format_stack(frame)[-frames:])
