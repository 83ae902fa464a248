"""The platform the programs are built for: the backend present, or a compile target (``compiling_for``).

Some choices depend on the platform a program will run on, not on the machine that traces it: the attention
block (``attention.cache_block``: cut to the CPU's cache on CPU only), the cuDNN kernel (GPU only), XLA options
(``layers.compiler_options``: a CPU-only pass switch that the GPU compiler refuses) and the dtype stand-ins of a
CPU memory compile (``memory/aot.py``). They read ``platform()``; an ahead-of-time compile for another platform
(``launch.plan --compile --target=h100``: XLA's GPU compiler on a CPU machine, ``memory/targets.py``) builds and
lowers its programs inside ``compiling_for("gpu")``, so they are the programs that platform runs.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("rollplex_target_platform", default=None)


def platform() -> str:
    """``cpu``, ``gpu`` or ``tpu``: the compile target in context, else the default backend."""
    return _TARGET.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(target: str):
    """Builds and lowers programs for ``target`` (``cpu``, ``gpu`` or ``tpu``) inside the block."""
    token = _TARGET.set(target)
    try:
        yield
    finally:
        _TARGET.reset(token)
