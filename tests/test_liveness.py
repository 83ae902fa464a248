"""The lost-process check (rollplex_jax/parallel/liveness.py) on a key-value store in a dict and a hand-moved clock:
who is lost, when, and what the error says. The real thing (two processes, a SIGKILL, --resume) is in
tests/test_multiprocess.py."""

from __future__ import annotations

import pytest

from rollplex_jax.parallel import liveness
from rollplex_jax.parallel.liveness import Liveness


class Store:
    """jax.distributed's client as Liveness uses it: key_value_set / key_value_dir_get; ``down`` raises."""

    def __init__(self):
        self.kv, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if self.down:
            raise RuntimeError("UNAVAILABLE")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _live(store, clock, me=0, n=3, heartbeat=10.0, step_timeout=0.0):
    return Liveness(store, me, n, heartbeat_s=heartbeat, step_timeout_s=step_timeout, clock=clock,
                    checkpoint=lambda: "The last checkpoint is step 4 in /w/checkpoints")


def test_a_peer_that_stops_beating_is_lost_after_the_timeout_and_named():
    store, clock = Store(), Clock()
    a, b, c = (_live(store, clock, me=i) for i in range(3))
    store.kv["rollplex/host/2"] = "node7"
    for _ in range(3):  # everyone beats
        clock.t += 2
        for x in (a, b, c):
            x.poll()
    a.progress(5)
    # process 2 dies; its last beat (t=106) is seen at the next poll (t=108); 10 s after that is not over 10 s
    for _ in range(6):
        clock.t += 2
        a.poll(), b.poll()
    assert a.check() is None
    clock.t += 0.5
    msg = a.check()
    assert msg.startswith("error: [process 0] process 2 (node7) of 3 stopped beating for over 10 s")
    assert "during step 6" in msg and f"exit code {liveness.EXIT_LOST}" in msg
    assert "The last checkpoint is step 4 in /w/checkpoints" in msg and "--resume" in msg
    assert b.check() is not None and "process 2" in b.check()


def test_done_processes_are_not_lost_and_the_store_going_silent_loses_process_0():
    store, clock = Store(), Clock()
    a, b = _live(store, clock, me=0, n=2), _live(store, clock, me=1, n=2)
    a.poll(), b.poll()
    a.finish()
    b.poll()
    clock.t += 60
    b.poll()
    assert b.check() is None  # process 0 said done
    store.down = True  # the coordination service (process 0) is gone
    with pytest.raises(RuntimeError):
        b.poll()
    clock.t += 10.5
    assert "process 0, which hosts jax.distributed's coordination service, is lost" in b.check()


def test_a_hung_step_is_reported_with_the_main_threads_stack():
    store, clock = Store(), Clock()
    a, b = _live(store, clock, me=0, n=2, step_timeout=30), _live(store, clock, me=1, n=2, step_timeout=30)
    for _ in range(20):  # both beat, but no step finishes for 40 s
        clock.t += 2
        a.poll(), b.poll()
    msg = a.check()
    assert "step 1 has not finished 40 s after the previous one (--step_timeout_s=30)" in msg
    assert "where the main thread is" in msg and "test_a_hung_step" in msg
    a.progress(1)
    assert a.check() is None


def test_off_for_one_process_or_no_timeouts():
    assert Liveness.start(0, 1, heartbeat_s=60, step_timeout_s=3600, checkpoint=str) is None
    assert Liveness.start(0, 2, heartbeat_s=0, step_timeout_s=0, checkpoint=str) is None


def test_await_verdict_waits_only_for_a_lost_peer(monkeypatch):
    live = _live(Store(), Clock(), n=2, heartbeat=0.5)
    waited = []
    monkeypatch.setattr(live._stop, "wait", lambda s: waited.append(s))
    live.await_verdict(ValueError("bad reward"))
    assert waited == []
    live.await_verdict(RuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer [127.0.0.1]:4"))
    assert waited == [0.5 + 2 * liveness.interval_for(0.5)]
