"""``python -m launch.main`` whose rollout hangs: the transformers engine's ``generate`` blocks forever from its
``--hang_at_call``-th call on (a real ``HFEngine``, every earlier call real). For tests/reliability/test_faults.py:

    python -m tests.reliability.hang_rollout --hang_at_call=2 --flagfile=configs/tiny_cpu.flags ...
"""

import itertools
import threading

from absl import app, flags

from launch import flags as launch_flags
from launch import main as launch_main
from rollout_torch.hf_engine import HFEngine


def _hang_from(n: int) -> None:
    real, calls = HFEngine.generate, itertools.count(1)

    def generate(self, prompts, k, sampling):
        if next(calls) >= n:
            threading.Event().wait()  # never set: a decode that never returns
        return real(self, prompts, k, sampling)

    HFEngine.generate = generate


def main(argv):
    _hang_from(flags.FLAGS.hang_at_call)
    launch_main.main(argv)


if __name__ == "__main__":
    flags.DEFINE_integer("hang_at_call", 2, "the first generate call that blocks forever (1-based)")
    launch_flags.define_flags()
    launch_main.define_distributed_flags()
    app.run(main)
