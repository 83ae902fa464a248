"""Prints the resolved Config as JSON, to check a flagfile without starting a run.

  python -m launch.show_config --flagfile=configs/tiny_cpu.flags [--steps=10 ...]
"""

import json

from absl import app, flags

from launch import flags as launch_flags


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    print(json.dumps(launch_flags.config_from_flags(flags.FLAGS).to_dict(), indent=2))


if __name__ == "__main__":
    launch_flags.define_flags()
    flags.adopt_module_key_flags(launch_flags)
    app.run(main)
