"""A deadline on the rollout: a decode that hangs ends its step with an error instead of stalling the run.

Why: a rollout engine can hang (a deadlocked decode, a stuck collective, an engine waiting on a dead worker)
and nothing else in the run would notice: the step waits forever and the job burns its allocation. verl and
EasyR1 have no such deadline (their NCCL watchdog fires only inside a collective); agent-lightning, built on
verl, bounds a rollout at 1800 s, torch.distributed's default process-group timeout. ``--rollout_timeout_s``
(``RolloutConfig.rollout_timeout_s``, default 1800; 0 = no deadline) bounds each ``generate`` call.

How: ``TimedEngine`` wraps the engine that ``run.setup.make_engine`` builds (every other attribute and call is
the engine's own). ``generate`` runs in a worker thread while the caller waits at most the deadline; past it,
``RolloutTimeoutError`` names the engine, the deadline and the flag, and carries the worker's Python stack (where
the decode is stuck). ``Runner`` adds the step; ``launch.main`` prints it, writes a checkpoint of the last
finished step (the failed step had not updated anything yet: the rollout comes before the update) and exits 1.

Limits (documented, not hidden):
- Python cannot stop a thread: the hung ``generate`` keeps running. From then on the engine is left alone
  (``bind`` / ``refill`` / ``release`` do nothing, so that a lock or a view the hung decode holds cannot hang or
  fail the caller too), and every later ``generate`` raises at once: the process must end, and ``launch.main``
  ends it with ``os._exit`` (the worker is a daemon thread; the interpreter would not wait for it anyway). In a
  notebook, build a new runner with ``resume=True`` in a fresh process.
- A decode stuck in C code that holds the GIL stalls every thread, the deadline included.
- Only ``generate`` is bounded; an engine's start (weights loaded, CUDA graphs captured) is not.
- The worker thread starts with the caller's CUDA device (CUDA's current device is per thread) and with torch's
  thread count (torch copies the process-wide setting into each new thread); grad mode is per thread too: the
  engines turn it off themselves.
"""

from __future__ import annotations

import contextlib
import sys
import threading

from rollplex_jax.parallel.threads import stack_of

_OWN = ("inner", "timeout_s", "name", "_stuck")


class RolloutTimeoutError(RuntimeError):
    """A ``generate`` call did not return within ``--rollout_timeout_s``; ``stack``: where its thread is."""

    def __init__(self, engine: str, timeout_s: float, sequences: int, *, where: str = "a rollout", stack: str = ""):
        self.engine, self.timeout_s, self.sequences, self.where, self.stack = engine, timeout_s, sequences, where, stack
        super().__init__(
            f"{where}: the rollout engine ({engine}) did not return from generate within --rollout_timeout_s="
            f"{timeout_s:g} s ({sequences} sequences). A hung decode cannot be stopped (its thread is abandoned), so "
            "the run stops. Raise --rollout_timeout_s if a rollout is legitimately this slow (0 = no deadline).")

    def at(self, where: str) -> RolloutTimeoutError:
        """The same error, located (``"step 3"``)."""
        return RolloutTimeoutError(self.engine, self.timeout_s, self.sequences, where=where, stack=self.stack)


@contextlib.contextmanager
def located(where: str):
    """A ``RolloutTimeoutError`` out of the block names ``where`` it struck (``"step 3"``)."""
    try:
        yield
    except RolloutTimeoutError as e:
        raise e.at(where) from None


class TimedEngine:
    """The rollout engine ``inner`` with a deadline of ``timeout_s`` seconds on each ``generate`` (module docstring).

    Args:
      inner: the engine (``rollplex_contract.batch.Engine``).
      timeout_s: the deadline (> 0; ``make_engine`` does not wrap an engine without one).
      name: the engine as the user chose it, for messages (``"--engine=hf"``).
    """

    def __init__(self, inner, timeout_s: float, name: str):
        if not timeout_s > 0:
            raise ValueError(f"TimedEngine needs a deadline > 0 s, got {timeout_s!r}")
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "timeout_s", float(timeout_s))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "_stuck", None)  # the worker thread of a generate that timed out

    @property
    def stuck(self) -> bool:
        """Whether a ``generate`` timed out (its thread may still run; the engine is no longer used)."""
        return self._stuck is not None

    def generate(self, prompts, n: int, sampling):
        """``inner.generate(prompts, n, sampling)``, or ``RolloutTimeoutError`` past the deadline."""
        sequences = prompts.batch_size * n
        if self._stuck is not None:
            raise RolloutTimeoutError(self.name, self.timeout_s, sequences, where="an earlier rollout")
        box: dict = {}
        done = threading.Event()
        device = _cuda_device()

        def work():
            try:
                if device is not None:
                    import torch

                    torch.cuda.set_device(device)
                box["out"] = self.inner.generate(prompts, n, sampling)
            except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
                box["error"] = e
            finally:
                done.set()

        worker = threading.Thread(target=work, name="rollout-generate", daemon=True)
        worker.start()
        if not done.wait(self.timeout_s):
            object.__setattr__(self, "_stuck", worker)
            raise RolloutTimeoutError(self.name, self.timeout_s, sequences, stack=stack_of(worker))
        if "error" in box:
            raise box["error"]
        return box["out"]

    # After a timeout the hung decode may hold the engine's locks and views: leave the engine alone.
    def bind(self, *args, **kwargs) -> None:
        if self._stuck is None:
            self.inner.bind(*args, **kwargs)

    def refill(self, *args, **kwargs) -> int:
        return 0 if self._stuck is not None else self.inner.refill(*args, **kwargs)

    def release(self) -> None:
        if self._stuck is None:
            self.inner.release()

    def __getattr__(self, name):  # everything else is the engine's (layout, sharing_report, share_prefill, ...)
        if name in _OWN:  # not set yet (during __init__, or an unpickled copy): not the engine's
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in _OWN:
            raise AttributeError(f"TimedEngine.{name} is set once, at construction")
        setattr(self.inner, name, value)


def _cuda_device() -> int | None:
    """The caller's current CUDA device when torch has initialised CUDA, else None (nothing to carry over)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()

