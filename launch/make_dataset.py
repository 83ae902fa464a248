"""Write a synthetic visual-task dataset (PNGs or mp4 clips + data.jsonl) for the tiny demo family.

  python -m launch.make_dataset --task=colour --n=512 --out=DIR [--seed=0] [--image_size=56]
  python -m launch.make_dataset --task=video_count --n=512 --out=DIR [--video_frames=8]

The directory is what `--dataset=DIR/data.jsonl` reads (rows {"images" or "videos", "prompt", "answer"}).
"""

import collections
import json

from absl import app, flags

from rollplex_jax.data.synthetic import TASKS, write_dataset

_TASK = flags.DEFINE_enum("task", None, list(TASKS), "Synthetic task.", required=True)
_N = flags.DEFINE_integer("n", None, "Number of examples.", lower_bound=1, required=True)
_OUT = flags.DEFINE_string("out", None, "Output directory (created if absent).", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "Seed: same seed, same dataset.", lower_bound=0)
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 56, "Image (or video frame) side in pixels.", lower_bound=28)
_FRAMES = flags.DEFINE_integer("video_frames", 8, "video_count: frames per clip at 2 fps (even, >= 8).",
                               lower_bound=8)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    path = write_dataset(_TASK.value, _N.value, _OUT.value, _SEED.value, image_size=_IMAGE_SIZE.value,
                         video_frames=_FRAMES.value)
    answers = collections.Counter()
    with open(path) as f:
        for line in f:
            answers[json.loads(line)["answer"]] += 1
    summary = ", ".join(f"{a}={c}" for a, c in sorted(answers.items()))
    side = f"{_IMAGE_SIZE.value}x{_IMAGE_SIZE.value}"
    media = (f"{_FRAMES.value}-frame {side} mp4 clips in {_OUT.value}/videos" if _TASK.value == "video_count"
             else f"{side} images in {_OUT.value}/images")
    print(f"wrote {path}: {_N.value} examples of task {_TASK.value!r} ({media}, seed {_SEED.value}); "
          f"answers: {summary}")


if __name__ == "__main__":
    app.run(main)
