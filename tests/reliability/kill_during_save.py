"""Test-only wrapper around ``launch.main``: SIGKILLs the process right after the save of step N has started.

    python -m tests.reliability.kill_during_save N --flagfile=... [launch.main flags]

The fault lives here, not in the library: ``Runner.save`` is wrapped before ``launch.main`` runs, so the
asynchronous orbax save of step N is in flight when the process dies (tests/reliability/test_resume.py).
"""

import os
import signal
import sys

from absl import app

from launch import flags as launch_flags
from launch import main as launch_main
from rollplex_jax.run.runner import Runner


def kill_during_save(step: int) -> None:
    """Makes every Runner's ``save`` of ``step`` SIGKILL the process once the save is started."""
    save = Runner.save

    def save_then_die(self):
        save(self)
        if self.step == step:
            os.kill(os.getpid(), signal.SIGKILL)

    Runner.save = save_then_die


if __name__ == "__main__":
    kill_during_save(int(sys.argv.pop(1)))
    launch_flags.define_flags()
    launch_main.define_distributed_flags()
    app.run(launch_main.main)
