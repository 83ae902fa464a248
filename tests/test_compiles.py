"""run/compiles.py and run/compile_cache.py in one process: the per-step compile count (a new shape is one
compilation with its seconds, the same shape none, another thread's counts too, a persistent-cache load is not
one), the late-step warning (names the program and the argument whose shape changed, JAX's own compile logs kept
off the console), and the cache directory switched within a process (``use``: JAX would keep its first one)."""

import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.run import compile_cache, compiles


@pytest.fixture
def cache_dir():
    """Sets the process's compilation cache for the test (a function of a directory, '' = none), then restores it."""
    before = jax.config.jax_compilation_cache_dir
    yield compile_cache.use
    compile_cache.use(before or "")


def test_a_new_shape_is_one_compile_the_same_shape_none(cache_dir):
    cache_dir("")
    f = jax.jit(lambda x: x * 3.0 + 1.0)
    x, y = jnp.ones(5), jnp.ones(6)  # the inputs exist before: creating them compiles too
    with compiles.watch(1) as first:
        f(x).block_until_ready()
    assert first.metrics()["perf/compiles"] == 1 and first.metrics()["timing_s/compile"] > 0
    assert [c.program for c in first.compiles] == ["jit(<lambda>)"]
    with compiles.watch(2) as again:
        f(x).block_until_ready()
    assert again.metrics() == {"perf/compiles": 0.0, "perf/compile_cache_hits": 0.0, "timing_s/compile": 0.0}
    with compiles.watch(3) as other_thread:  # the rollplex schedule compiles its prefix programs off the main thread
        t = threading.Thread(target=lambda: f(y).block_until_ready())
        t.start()
        t.join()
    assert other_thread.metrics()["perf/compiles"] == 1


def test_a_program_loaded_from_the_persistent_cache_is_not_a_compile(cache_dir, tmp_path):
    cache_dir(str(tmp_path / "xla"))
    x = jnp.ones(7)

    def program():  # a new function object each time: JAX's in-memory caches miss, the persistent cache hits
        return jax.jit(lambda v: jnp.sin(v) * 5.0)

    with compiles.watch(1) as cold:
        program()(x).block_until_ready()
    with compiles.watch(2) as warm:
        program()(x).block_until_ready()
    assert (cold.metrics()["perf/compiles"], cold.metrics()["perf/compile_cache_hits"]) == (1, 0)
    assert (warm.metrics()["perf/compiles"], warm.metrics()["perf/compile_cache_hits"]) == (0, 1)
    assert warm.metrics()["timing_s/compile"] == 0.0


def test_the_cache_directory_can_change_within_a_process(cache_dir, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    cache_dir(str(a))
    jax.jit(lambda v: v - 11.0)(jnp.ones(3)).block_until_ready()
    n_a = len(os.listdir(a))
    assert n_a >= 1
    cache_dir(str(b))  # JAX alone would keep writing to a (its cache is opened once per process)
    jax.jit(lambda v: v - 12.0)(jnp.ones(3)).block_until_ready()
    assert len(os.listdir(a)) == n_a and len(os.listdir(b)) >= 1
    cache_dir("")  # none: nothing written anywhere
    jax.jit(lambda v: v - 13.0)(jnp.ones(3)).block_until_ready()
    assert len(os.listdir(a)) == n_a and jax.config.jax_compilation_cache_dir is None


def _late_compile(step: int, nth: int, f, *args):
    with compiles.watch(step, nth=nth) as window:
        f(*args).block_until_ready()
    return window, compiles.warn_if_late(window)


def test_a_late_step_that_compiles_warns_naming_the_program_and_the_shape(cache_dir, caplog, capfd):
    cache_dir("")

    def grows(tokens, scale):
        return tokens.sum() * scale

    f = jax.jit(grows)
    x4, x9, s = jnp.ones((2, 4)), jnp.ones((2, 9)), jnp.float32(2.0)
    window, line = _late_compile(3, 3, f, x4, s)  # an early step: no warning (and JAX's logs stay off)
    assert line is None and window.compiles[0].why == ""
    capfd.readouterr()
    with caplog.at_level(logging.WARNING):
        window, line = _late_compile(17, compiles.LATE_STEP, f, x9, s)
    assert line is not None and "step 17 compiled 1 XLA program(s)" in line and "jit(grows)" in line
    assert "at tokens, now f32[2,9] and before f32[2,4]" in line
    assert line in caplog.text and "\n" not in line
    err = capfd.readouterr().err
    assert "TRACING CACHE MISS" not in err and "Finished XLA compilation" not in err  # JAX's logs were captured
    assert not jax.config.jax_log_compiles and not jax.config.jax_explain_cache_misses  # and turned off again


def test_without_jax_s_explanation_the_warning_names_the_argument_shapes(cache_dir):
    cache_dir("")
    host = np.arange(21, dtype=np.int32).reshape(3, 7)
    window, line = _late_compile(9, 9, lambda a: jnp.asarray(a), host)  # an eager transfer: JAX explains nothing
    assert window.compiles and "int32[3,7]" in line
