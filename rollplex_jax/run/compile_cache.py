"""The persistent XLA compilation cache of a run: programs compiled by one run are loaded from disk by the next.

Why: every run of the same flags compiles the same programs, and compiling is most of a short run's time (one step's
programs of the 7B flagfile take ~4 minutes to compile on this CPU). JAX keeps compiled executables on disk keyed
by the program, its shapes and shardings, the compile options and the jax/jaxlib versions, so a rerun's first step
loads them (``perf/compile_cache_hits``) instead of compiling them (``perf/compiles``). Every program is kept, however
small or quick to compile (JAX's defaults keep only those that took >= 1 s), because a step compiles dozens of small
ones. Only process 0 of a multi-process job writes; every process reads (on other hosts: where the directory is on
a shared filesystem). On a GPU JAX's default also keeps XLA's autotuning results there
(``jax_persistent_cache_enable_xla_caches``). The directory is never pruned (``jax_compilation_cache_max_size``).

Trust: an entry is machine code this process runs. Anyone who can write to the directory can run code in the
process, so the default is per user (``config.default_compilation_cache_dir``: ``$XDG_CACHE_HOME/rollplex_jax/xla``
or ``~/.cache/rollplex_jax/xla``), created accessible to its owner only, and a directory others can write to is
warned about. Delete the directory to clear the cache.

JAX opens its cache once per process, at the first compilation that needs it, and keeps that directory even if
``jax_compilation_cache_dir`` changes later (checked on jax 0.10: ``compilation_cache._initialize_cache``). So
``use`` resets JAX's cache object when the directory changes: a later runner in the same process (a notebook) with
another directory, or none, takes effect from its next compilation. The setting is process-wide: two runners alive in
one process share the directory of the one built last.
"""

from __future__ import annotations

import os
import stat

import jax
from absl import logging
from jax.experimental.compilation_cache import compilation_cache


def use(directory: str) -> None:
    """Compiled programs are kept in (and loaded from) ``directory`` from the next compilation on; '' = none.

    Call before the run's first compilation (``Runner.__init__`` does, first of all) so that all its programs are
    cached; a directory of an earlier runner in the process is replaced.
    """
    want = os.path.abspath(os.path.expanduser(directory)) if directory else None
    if want is not None:
        os.makedirs(want, mode=0o700, exist_ok=True)
        mode = os.stat(want).st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):  # a sticky bit does not help: others can still add entries
            logging.warning("--compilation_cache_dir=%s can be written by other users: anyone who can write there "
                            "can run code in this process (the cache is trusted code). Use a directory of your own.",
                            want)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # keep every program ...
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # ... however small
    if jax.config.jax_compilation_cache_dir != want:
        jax.config.update("jax_compilation_cache_dir", want)
        compilation_cache.reset_cache()  # JAX would keep the directory it opened first (module docstring)
