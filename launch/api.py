"""Flagfiles from Python (notebooks, scripts, tests): the command line's flags -> ``Config`` -> ``Runner``.

    from launch.api import runner_from_flagfile
    runner = runner_from_flagfile("configs/tiny_cpu.flags", steps=5, workdir="runs/nb", progress=False)

Parses on a fresh ``absl.flags.FlagValues`` (absl's global ``flags.FLAGS`` is not touched), so several
runners can live in one process. Flag parsing stays in ``launch``; the library never imports it.
"""

from __future__ import annotations

import os

from absl import app, flags

from launch import flags as launch_flags
from rollplex_jax.config import Config, ConfigError
from rollplex_jax.run.runner import Runner


def config_from_flagfile(path: str | os.PathLike, **overrides) -> Config:
    """The ``Config`` of ``--flagfile=PATH`` plus ``--name=value`` overrides.

    Booleans become ``--name`` / ``--noname``; a relative ``path`` is looked up in the current directory,
    then the repo root (as ``launch.flags.resolve_path``). Raises ``ConfigError`` naming the bad flag.
    """
    resolved = launch_flags.resolve_path(os.fspath(path))
    if resolved is None:
        where = list(dict.fromkeys([os.getcwd(), str(launch_flags.REPO_ROOT)]))
        raise ConfigError(f"flagfile {os.fspath(path)!r} not found (looked under {', '.join(where)})")
    argv = ["rollplex", f"--flagfile={resolved}"]
    for name, value in overrides.items():
        if isinstance(value, bool):
            argv.append(f"--{name}" if value else f"--no{name}")
        else:
            value = "" if value is None else os.fspath(value) if isinstance(value, os.PathLike) else value
            argv.append(f"--{name}={value}")
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    unknown = [n for n in overrides if n not in fv]
    if unknown:
        raise ConfigError(f"unknown flag(s) {', '.join(unknown)}; see python -m launch.main --helpfull")
    try:
        fv(argv)
        return launch_flags.config_from_flags(fv)
    except (flags.Error, app.UsageError) as e:
        raise ConfigError(str(e)) from None


def runner_from_flagfile(path: str | os.PathLike, *, log=None, **overrides) -> Runner:
    """A runner configured as ``python -m launch.main --flagfile=PATH --name=value ...`` would be.

    Args:
      path: an absl flagfile; a relative path is looked up in the current directory, then the repo root.
      log: receives the runner's log lines (default: stderr).
      **overrides: flag name -> value, applied after the flagfile (``True``/``False`` for booleans).

    ``runner.fork(workdir, **more)`` rebuilds from the same flagfile and overrides plus ``more``.

    Raises:
      ConfigError: the flagfile is missing, a flag is unknown, or a value is invalid (names the flag).
    """
    from rollplex_jax.parallel.distributed import colocate_with_torch

    colocate_with_torch()  # effective while JAX's backend has not started in this process (a fresh kernel)
    cfg = config_from_flagfile(path, **overrides)
    return Runner(cfg, log=log, rebuild=lambda **more: config_from_flagfile(path, **{**overrides, **more}))
