"""How many XLA programs a step compiled, for how long, and why a late step compiled at all.

Why a module: a new input shape is a new XLA program, and a run whose batches keep bringing new shapes spends its
steps compiling (/work/shared/SHAPES.md: 1.8-3.5 s per step of compiles on the tiny model's mixed images, minutes
per step at 7B). Each step reports

- ``perf/compiles``: XLA backend compilations during the step; programs loaded from the persistent cache
  (``compile_cache.py``) are not compilations and are counted apart, in ``perf/compile_cache_hits``;
- ``timing_s/compile``: seconds spent in those compilations (summed over threads: the rollplex schedule compiles
  its prefix programs while the main thread decodes, so it can exceed the step's wall time).

From step ``LATE_STEP`` of a process on, a step that compiles logs one warning naming the programs and, where JAX
can say it, the argument whose shape changed.

How (jax 0.10): ``jax.monitoring`` duration event ``/jax/core/compile/backend_compile_duration`` (``fun_name``:
``jit(f)``) spans ``compiler.compile_or_get_cached``, a persistent-cache load included; a load records
``/jax/compilation_cache/cache_hits`` inside that span, in the same thread, which is how a load is told apart.
The listeners are registered once per process and feed the ``Window`` objects open at the time, under a lock
(compiles happen in any thread). The reason of a late compile comes from JAX's own logs, turned on only while a
late window is open: ``jax_explain_cache_misses`` (``jax._src.interpreters.partial_eval``: "TRACING CACHE MISS ...
for f ... * at x, now f32[2,5] and before f32[2,3]") and ``jax_log_compiles`` (``jax._src.interpreters.pxla``:
"Compiling jit(f) with global shapes and types (...)", the fallback when no explanation comes). A
``logging.Filter`` on JAX's loggers takes those records and drops them, so JAX's compile logs never reach the
console; other records pass. Neither option is part of JAX's tracing context, so turning them on and off
retraces nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as py_logging
import re
import threading

import jax
from absl import logging
from jax import monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # jax._src.compiler.compile_or_get_cached, inside that span

# Steps 1-3 of a process may compile legitimately: step 1 its programs, the next ones programs of a path a step
# first takes then (measured: configs/tiny_cpu.flags' step 2 compiles 2, a scoring program's first trace and a
# reshape; step 3 none). A compile from the 4th step on is most likely a shape that changes from batch to batch.
LATE_STEP = 4

# JAX's compile-time log lines (WARNING while jax_log_compiles / jax_explain_cache_misses are on), by logger.
_JAX_LOGGERS = ("jax._src.interpreters.partial_eval", "jax._src.interpreters.pxla", "jax._src.dispatch",
                "jax._src.compiler", "jax._src.compilation_cache")
_COMPILE_LOGS = ("TRACING CACHE MISS", "Compiling ", "Finished ", "Persistent compilation cache hit",
                 "PERSISTENT COMPILATION CACHE MISS", "Not writing persistent cache entry", "Writing ")
_EXPLAINED_FN = re.compile(r"^\s+(?:for|never seen function:)\s+(\S+)", re.M)


@dataclasses.dataclass(frozen=True)
class Compile:
    """One XLA compilation: the program (``jit(f)``), its seconds, and why it happened ('' when JAX did not say)."""

    program: str
    seconds: float
    why: str = ""


class Window:
    """The compilations of one step (or any block): filled by the listeners while open (``watch``)."""

    def __init__(self, step: int, nth: int):
        self.step, self.nth = step, nth
        self.compiles: list[Compile] = []
        self.cache_hits = 0

    @property
    def late(self) -> bool:
        """Whether this is a step that should not compile any more (the ``nth`` step of the process)."""
        return self.nth >= LATE_STEP

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.compiles)

    def metrics(self) -> dict[str, float]:
        """``perf/compiles``, ``perf/compile_cache_hits`` and ``timing_s/compile`` of the window."""
        return {"perf/compiles": float(len(self.compiles)), "perf/compile_cache_hits": float(self.cache_hits),
                "timing_s/compile": self.seconds}

    def summary(self) -> str:
        """``N XLA programs compiled in X s, M loaded from the persistent cache``."""
        return (f"{len(self.compiles)} XLA programs compiled in {self.seconds:.1f} s, {self.cache_hits} loaded from "
                "the persistent compilation cache")

    def warning(self) -> str | None:
        """The one-line warning of a late step that compiled; None otherwise."""
        if not (self.late and self.compiles):
            return None
        groups: dict[str, list[str]] = {}  # program -> its compiles' reasons, in order
        for c in self.compiles:
            groups.setdefault(c.program, []).append(c.why)
        named = "; ".join(_named(program, whys) for program, whys in list(groups.items())[:6])
        more = f"; and {len(groups) - 6} more programs" if len(groups) > 6 else ""
        return (f"step {self.step} compiled {len(self.compiles)} XLA program(s) in {self.seconds:.2f} s: "
                f"{named}{more}. A shape that changes between batches recompiles every step "
                "(perf/compiles, timing_s/compile).")


class _Listener:
    """Process-wide: the jax.monitoring callbacks (registered once; JAX cannot forget them) and the open windows."""

    def __init__(self):
        self.lock = threading.Lock()
        self.windows: list[Window] = []
        self.explaining = 0  # open windows that asked for JAX's reasons
        self.saved: dict[str, bool] = {}
        self.local = threading.local()  # per thread: a cache hit seen in the current span, pending reasons
        self.filter = _CaptureFilter(self)
        monitoring.register_event_listener(self.on_event)
        monitoring.register_event_duration_secs_listener(self.on_duration)

    def on_event(self, event: str, **_) -> None:
        if event == CACHE_HIT:
            self.local.hit = True

    def on_duration(self, event: str, seconds: float, **kwargs) -> None:
        if event != BACKEND_COMPILE:
            return
        program = str(kwargs.get("fun_name", "?"))
        hit, self.local.hit = getattr(self.local, "hit", False), False
        why = "" if hit else self.take_reason(program)
        with self.lock:
            for w in self.windows:
                if hit:
                    w.cache_hits += 1
                else:
                    w.compiles.append(Compile(program, seconds, why))

    # --- JAX's reasons (only while a late window is open) ------------------------------------------
    def note(self, record: py_logging.LogRecord) -> None:
        """Keeps a JAX compile log line of this thread for the compile event that follows it."""
        local = self.local
        if not hasattr(local, "explained"):
            local.explained, local.shapes = [], {}
        msg = record.getMessage()
        if msg.startswith("TRACING CACHE MISS"):
            local.explained.append(msg)
        elif msg.startswith("Compiling ") and len(record.args or ()) >= 2:
            local.shapes[str(record.args[0])] = _shapes(record.args[1])

    def take_reason(self, program: str) -> str:
        """Why ``program`` (``jit(f)``) compiled, from this thread's pending log lines; clears them."""
        local = self.local
        explained, shapes = getattr(local, "explained", []), getattr(local, "shapes", {})
        local.explained, local.shapes = [], {}
        name = program[4:-1] if program.startswith("jit(") and program.endswith(")") else program
        for msg in explained:
            m = _EXPLAINED_FN.search(msg)
            if m and m.group(1) == name:
                return _explanation(msg)
        return shapes.get(program, "")

    def open(self, window: Window, explain: bool) -> None:
        with self.lock:
            self.windows.append(window)
            if explain:
                self.explaining += 1
                if self.explaining == 1:
                    self._capture(True)

    def close(self, window: Window, explain: bool) -> None:
        with self.lock:
            self.windows.remove(window)
            if explain:
                self.explaining -= 1
                if self.explaining == 0:
                    self._capture(False)

    def _capture(self, on: bool) -> None:
        """JAX's compile logs on (captured by the filter, never printed) or back as they were."""
        options = ("jax_explain_cache_misses", "jax_log_compiles")
        if on:
            self.saved = {o: bool(getattr(jax.config, o)) for o in options}
            self.filter.show = any(self.saved.values())  # the user asked for JAX's logs: they still see them
        for o in options:
            jax.config.update(o, True if on else self.saved.get(o, False))
        for name in _JAX_LOGGERS:
            (py_logging.getLogger(name).addFilter if on else py_logging.getLogger(name).removeFilter)(self.filter)


class _CaptureFilter(py_logging.Filter):
    """On JAX's loggers while a late window is open: takes JAX's compile log lines (not emitted, unless the user had
    turned those logs on); lets every other record through."""

    def __init__(self, listener: _Listener):
        super().__init__()
        self.listener, self.show = listener, False

    def filter(self, record: py_logging.LogRecord) -> bool:
        if record.levelno == py_logging.WARNING and str(record.msg).startswith(_COMPILE_LOGS):
            self.listener.note(record)
            return self.show
        return True


def _named(program: str, whys: list[str]) -> str:
    """``jit(f) x3 (why; why)``: a program, how often it compiled, its first distinct reasons."""
    reasons = list(dict.fromkeys(w for w in whys if w))
    text = program + (f" x{len(whys)}" if len(whys) > 1 else "")
    return text + (f" ({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''})" if reasons else "")


def _shapes(avals) -> str:
    """The argument shapes of a "Compiling" log line; of many arguments (params first, the batch last) the last 6."""
    shapes = [_short(a) for a in avals]
    if len(shapes) <= 8:
        return "arguments " + ", ".join(shapes)
    return f"{len(shapes)} arguments, the last 6: " + ", ".join(shapes[-6:])


def _short(aval) -> str:
    """``float32[2,5]`` of a ShapedArray (its str_short), else its str."""
    return aval.str_short() if hasattr(aval, "str_short") else str(aval)


def _explanation(msg: str) -> str:
    """The changed arguments of a "TRACING CACHE MISS" message, on one line."""
    if "never seen function" in msg:
        again = "defined on the same line" in msg  # JAX: "maybe the function is being re-defined repeatedly"
        return "a function not traced before" + (" (one like it was: re-created on each call?)" if again else "")
    diffs = [line.strip()[2:] for line in msg.splitlines() if line.strip().startswith("* ")]
    if diffs:
        return ", ".join(diffs[:4]) + (f", and {len(diffs) - 4} more" if len(diffs) > 4 else "")
    lines = [line.strip() for line in msg.splitlines()[1:] if line.strip()]
    return lines[-1] if lines else ""


_LOCK = threading.Lock()
_LISTENER: _Listener | None = None


def _listener() -> _Listener:
    """The process's listener, registered with jax.monitoring on first use (not at import)."""
    global _LISTENER
    with _LOCK:
        if _LISTENER is None:
            _LISTENER = _Listener()
        return _LISTENER


@contextlib.contextmanager
def watch(step: int, *, nth: int | None = None):
    """Counts the XLA compilations (in every thread) while the block runs; yields the ``Window``.

    Args:
      step: the step's number, as metrics.jsonl has it (for the warning).
      nth: which step of this process it is (default ``step``): a resumed run's first step compiles everything, so
        lateness counts from the process's first step. From ``LATE_STEP`` on JAX's reasons are collected.
    """
    window = Window(step, step if nth is None else nth)
    listener = _listener()
    listener.open(window, window.late)
    try:
        yield window
    finally:
        listener.close(window, window.late)


def warn_if_late(window: Window) -> str | None:
    """Logs the window's warning (absl ``logging.warning``) when a late step compiled; returns it."""
    line = window.warning()
    if line:
        logging.warning(line)
    return line
