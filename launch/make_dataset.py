"""Write a synthetic visual-task dataset (PNGs + data.jsonl) for the tiny demo.

  python -m launch.make_dataset --task=colour --n=512 --out=DIR [--seed=0] [--image_size=56]

The directory is what `--dataset=DIR/data.jsonl` reads (rows {"images", "prompt", "answer"}).
"""

import collections
import json

from absl import app, flags

from rollplex_jax.data.synthetic import TASKS, write_dataset

_TASK = flags.DEFINE_enum("task", None, list(TASKS), "Synthetic task.", required=True)
_N = flags.DEFINE_integer("n", None, "Number of examples.", lower_bound=1, required=True)
_OUT = flags.DEFINE_string("out", None, "Output directory (created if absent).", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "Seed: same seed, same dataset.", lower_bound=0)
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 56, "Image side in pixels.", lower_bound=28)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    path = write_dataset(_TASK.value, _N.value, _OUT.value, _SEED.value, image_size=_IMAGE_SIZE.value)
    answers = collections.Counter()
    with open(path) as f:
        for line in f:
            answers[json.loads(line)["answer"]] += 1
    summary = ", ".join(f"{a}={c}" for a, c in sorted(answers.items()))
    print(f"wrote {path}: {_N.value} examples of task {_TASK.value!r} ({_IMAGE_SIZE.value}x{_IMAGE_SIZE.value} "
          f"images in {_OUT.value}/images, seed {_SEED.value}); answers: {summary}")


if __name__ == "__main__":
    app.run(main)
