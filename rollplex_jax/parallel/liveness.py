"""A lost process ends the whole job in bounded time, with an error naming it, instead of a hang in a collective.

Why: in a multi-process run every step is full of collectives (gradient sums, gathers, checkpoint saves). When one
process dies (SIGKILL, the kernel's OOM killer, a node lost) the others block in the next collective; gloo and NCCL
do not notice a dead peer. Measured here (jax 0.10.2, two processes x 2 CPU devices, dp 2 x fsdp 2, tiny_cpu,
process 1 SIGKILLed during step 3): process 0 blocked until jax.distributed's own heartbeat check (default 100 s)
aborted it 80 s later with a C++ fatal error and a core-style stack (exit -6). On a GPU cluster an NCCL
collective waits for torch's / XLA's own timeouts, or forever.

How (``Liveness``, started by ``launch.main`` in a multi-process run):
- each process writes a counter under ``rollplex/alive/<process>`` in jax.distributed's key-value store every
  ``interval`` seconds (a daemon thread; JAX and torch release the GIL in their kernels and collectives, so it runs
  while the main thread waits in one), and reads everyone's;
- a peer whose counter has not changed for ``--heartbeat_timeout_s`` (local monotonic time since this process last
  saw it change: no clock is compared across hosts) is lost; so is process 0 when the store itself has not
  answered for that long (it hosts the coordination service);
- a step that has not finished ``--step_timeout_s`` after the previous one (or after the start) is a hang even
  when every process still beats (a deadlock, a stuck kernel): the error prints where the main thread is;
- a collective may also fail on its own when its peer's socket closes (gloo on CPU: "Connection closed by peer",
  measured here when the peer died during an all-gather); ``launch.main`` then waits for the heartbeat verdict
  (``await_verdict``, at most ``--heartbeat_timeout_s`` + 2 beats) so that this case too ends naming the process;
- on either, the process prints one error paragraph (who was lost, at which step, the last checkpoint and the
  ``--resume`` command's flag) and leaves with exit code ``EXIT_LOST`` (75, EX_TEMPFAIL: a restart can succeed)
  through ``os._exit``: no checkpoint is attempted (it is itself a collective with the lost process), the last
  periodic checkpoint is what ``--resume`` continues from, exactly (tests/test_multiprocess.py).
- A process that finishes writes ``done`` and is never reported lost; jax.distributed's own heartbeat timeout is
  set to 3x ``--heartbeat_timeout_s`` (at least 30 s; ``launch.main.start_distributed``), so this check answers
  first and JAX's abort stays a backstop: JAX's service declared the killed process dead 0.5-0.8 of its timeout
  after the kill (measured: 80 s at its default 100, 12 s at 20), this check 1-1.2 of ours.

Process 0 is different: it hosts jax.distributed's coordination service, and when it dies every other process's
JAX client aborts at once by itself (measured: 0.3 s after a SIGKILL of process 0, exit -6, "Failed to send RPC to
coordination service ... the leader task ... died"), before this check can speak; the bound holds, the message is
JAX's.

Limits: a process whose threads are all frozen (SIGSTOP, a kernel holding the GIL for minutes) is reported lost
although it may wake up; the judge is a Python thread, so a main thread holding the GIL delays this process's own
verdict too (``memory.meter`` waits for arrays with ``block_until_ready``, which releases it, before reading a
buffer pointer, which does not). Uses jax.distributed's client (``jax._src.distributed.global_state.client``:
key_value_set / key_value_dir_get, jax 0.10), an internal API: ``Liveness.start`` says so and does nothing if
it is missing.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable

from rollplex_jax.parallel.threads import stack_of

EXIT_LOST = 75  # EX_TEMPFAIL (sysexits.h): a peer was lost or a step hung; restarting with --resume can succeed
PREFIX = "rollplex/alive/"
HOSTS = "rollplex/host/"
DONE = "done"
# How a collective reports a peer that went away (gloo on CPU, NCCL, jax.distributed's service): an error with one
# of these waits for the heartbeat verdict (``Liveness.await_verdict``) so that the exit names the lost process.
PEER_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Gloo", "NCCL", "UNAVAILABLE")


def interval_for(timeout_s: float) -> float:
    """Seconds between beats and checks: a fifth of the timeout, within [0.5, 5] s."""
    return min(5.0, max(0.5, timeout_s / 5))


def lost_peers(last_change: dict[int, float], done: set[int], now: float, timeout_s: float) -> list[int]:
    """The processes (not done) whose beat has not changed for more than ``timeout_s`` (times: this host's clock)."""
    return sorted(p for p, t in last_change.items() if p not in done and now - t > timeout_s)


class Liveness:
    """Beats, watches the peers and the step clock, and ends the process when one is lost (module doc).

    ``progress(step)``: call when a step finishes (``step`` = steps done); ``finish()``: before a clean exit.
    ``checkpoint()`` returns the sentence about the last checkpoint (called only on failure)."""

    def __init__(self, client, me: int, n: int, *, heartbeat_s: float, step_timeout_s: float,
                 checkpoint: Callable[[], str], exit_fn: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.me, self.n = client, me, n
        self.heartbeat_s, self.step_timeout_s = heartbeat_s, step_timeout_s
        self.checkpoint, self.exit_fn, self.clock = checkpoint, exit_fn, clock
        self.interval = interval_for(heartbeat_s)
        start = clock()
        self.step, self.step_since = 0, start
        self.last_change = {p: start for p in range(n) if p != me}
        self.seen: dict[int, str] = {}
        self.done: set[int] = set()
        self.hosts: dict[int, str] = {}
        self.store_ok = start
        self._stop = threading.Event()
        self._beats = 0

    @classmethod
    def start(cls, me: int, n: int, *, heartbeat_s: float, step_timeout_s: float,
              checkpoint: Callable[[], str]) -> Liveness | None:
        """Starts the beat and the judge for this process of a running jax.distributed job; None for one process,
        both timeouts 0, or a jax without the client (a warning says so)."""
        if n < 2 or (heartbeat_s <= 0 and step_timeout_s <= 0):
            return None
        try:
            from jax._src import distributed as jd

            client = jd.global_state.client
        except (ImportError, AttributeError):
            client = None
        if client is None or not hasattr(client, "key_value_dir_get"):
            print(f"[process {me}] warning: no jax.distributed key-value client: a lost process is not detected "
                  "(--heartbeat_timeout_s, --step_timeout_s off)", file=sys.stderr)
            return None
        live = cls(client, me, n, heartbeat_s=heartbeat_s, step_timeout_s=step_timeout_s, checkpoint=checkpoint)
        try:
            client.key_value_set(f"{HOSTS}{me}", socket.gethostname(), True)
        except Exception:  # noqa: BLE001 -- a name is a courtesy; the beat decides
            pass
        for target, name in ((live._beat_loop, "liveness-beat"), (live._judge_loop, "liveness-judge")):
            threading.Thread(target=target, name=name, daemon=True).start()
        return live

    def await_verdict(self, error: BaseException) -> None:
        """After ``error`` in the main thread: if it reads as a collective that lost its peer (gloo's "Connection
        closed by peer", NCCL, an unavailable service), waits up to ``--heartbeat_timeout_s`` + 2 beats for the judge,
        which then ends the process naming who was lost; otherwise (or with no verdict) returns at once / then."""
        text = f"{type(error).__name__}: {error}"
        if self.heartbeat_s <= 0 or not any(m in text for m in PEER_FAILURES):
            return
        print(f"[process {self.me}] a collective failed ({text.splitlines()[0][:200]}); waiting up to "
              f"{self.heartbeat_s + 2 * self.interval:.0f} s for the heartbeats to say which process was lost",
              file=sys.stderr, flush=True)
        self._stop.wait(self.heartbeat_s + 2 * self.interval)

    def progress(self, step: int) -> None:
        self.step, self.step_since = step, self.clock()

    def finish(self) -> None:
        """This process is done: peers stop watching it, and it stops judging."""
        self._stop.set()
        try:
            self.client.key_value_set(f"{PREFIX}{self.me}", DONE, True)
        except Exception:  # noqa: BLE001 -- exiting anyway
            pass

    def poll(self) -> None:
        """One beat and one read of everyone's beats (the beat thread's body)."""
        self._beats += 1
        self.client.key_value_set(f"{PREFIX}{self.me}", str(self._beats), True)
        now = self.clock()
        for key, value in self.client.key_value_dir_get(PREFIX):
            p = int(key.rsplit("/", 1)[-1])
            if p == self.me or p not in self.last_change:
                continue
            if value == DONE:
                self.done.add(p)
            elif self.seen.get(p) != value:
                self.seen[p], self.last_change[p] = value, now
        self.store_ok = now

    def verdict(self, lost: list[int], store_silent_s: float | None, hung_s: float | None) -> str:
        """The error paragraph: who was lost (or that this step hung), what happens, how to continue."""
        hosts, step = self.hosts, self.step

        def name(p: int) -> str:
            return f"process {p}" + (f" ({hosts[p]})" if p in hosts else "")

        if store_silent_s is not None:
            what = (f"{name(0)}, which hosts jax.distributed's coordination service, is lost: the service has not "
                    f"answered for {store_silent_s:.0f} s (--heartbeat_timeout_s={self.heartbeat_s:g})")
        elif lost:
            what = (f"{', '.join(name(p) for p in lost)} of {self.n} stopped beating for over {self.heartbeat_s:g} s "
                    "(--heartbeat_timeout_s): it died (killed, out of memory, node lost) or is frozen")
        else:
            what = (f"step {step + 1} has not finished {hung_s:.0f} s after the previous one (--step_timeout_s="
                    f"{self.step_timeout_s:g}) although every process still beats: a hang in a collective or a kernel")
        return (f"error: [process {self.me}] {what}. This process stops during step {step + 1} instead of waiting in "
                f"a collective (exit code {EXIT_LOST}); no checkpoint is written now. {self.checkpoint()}; restart "
                "every process with the same flags and --resume to continue from it exactly.")

    def check(self) -> str | None:
        """The error paragraph if a peer is lost or the step hangs, else None (the judge thread's body)."""
        now = self.clock()
        silent = now - self.store_ok
        store_lost = self.heartbeat_s > 0 and self.me != 0 and silent > self.heartbeat_s
        lost = lost_peers(self.last_change, self.done, now, self.heartbeat_s) if self.heartbeat_s > 0 else []
        hung = now - self.step_since
        if not (store_lost or lost or (self.step_timeout_s > 0 and hung > self.step_timeout_s)):
            return None
        if not store_lost and not lost:
            where = stack_of(threading.main_thread())
            return self.verdict([], None, hung) + f"\nwhere the main thread is (innermost last):\n{where}"
        self._read_hosts()
        return self.verdict(lost, silent if store_lost else None, None)

    def _read_hosts(self) -> None:
        try:
            self.hosts = {int(k.rsplit("/", 1)[-1]): v for k, v in self.client.key_value_dir_get(HOSTS)}
        except Exception:  # noqa: BLE001 -- the store may be what was lost
            pass

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 -- the store not answering is judged by its silence (check)
                pass

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval):
            message = self.check()
            if message is not None and not self._stop.is_set():
                print(message, file=sys.stderr, flush=True)
                sys.stdout.flush()
                self.exit_fn(EXIT_LOST)
                return
