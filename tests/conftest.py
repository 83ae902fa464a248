"""Test-wide setup. The Makefile sets XLA_FLAGS for 4 fake CPU devices; keep that default
here too so `pytest` run by hand sees the same devices (it must be set before JAX starts)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
