"""vLLM backend tests (run by `make test-vllm` in .venv-vllm, never by the main venv's `make test`).

The environment must be set before vLLM or JAX is imported: vLLM in-process (no engine
subprocess), a 1 GiB CPU KV cache, JAX on CPU with one device (the engine binds device-0 buffers).
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

_NOTES: list[str] = []


@pytest.fixture
def note():
    """``note(line)``: a line shown in the terminal summary (sharing report, parity scores)."""
    return _NOTES.append


def pytest_terminal_summary(terminalreporter):
    if _NOTES:
        terminalreporter.section("vLLM engine measurements")
        for line in _NOTES:
            terminalreporter.write_line(line)
