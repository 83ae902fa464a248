"""Test-wide setup. The Makefile sets XLA_FLAGS for 4 fake CPU devices; keep that default
here too so `pytest` run by hand sees the same devices (it must be set before JAX starts).

XDG_CACHE_HOME: a fresh directory per test process (each pytest-xdist worker its own), inherited by the runs the
tests start, so that no test writes to the user's ~/.cache: the runs' default --compilation_cache_dir lands there.
The suite thus runs with the default persistent compilation cache, shared by the runs of one worker (a rerun of the
same flags loads its programs; nothing but compile counts and times depends on it, and the tests that count
compilations use a cache directory of their own or none); removed at exit."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="rollplex_tests_xdg_")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
