"""Write a synthetic visual-task dataset (PNGs or mp4 clips + data.jsonl) for the tiny demo family, or a
geometry3k-shaped parquet of images of mixed sizes (issue 30's shape benchmark, launch/bench_shapes.py).

  python -m launch.make_dataset --task=colour --n=512 --out=DIR [--seed=0] [--image_size=56]
  python -m launch.make_dataset --task=video_count --n=512 --out=DIR [--video_frames=8]
  python -m launch.make_dataset --task=mixed_count --out=DIR [--n=256] [--fixed_size=250] [--seed=0]

The directory is what `--dataset=DIR/data.jsonl` reads (rows {"images" or "videos", "prompt", "answer"}); for
mixed_count, `--dataset=DIR/train.parquet --answer_key=reward_model.ground_truth` (verl's layout,
rollplex_jax/data/synthetic_mixed.py): each image 80-420 px wide and high, or with --fixed_size every image that
size square (the same rows, questions and answers).
"""

import collections
import json

import pyarrow.parquet as pq
from absl import app, flags

from rollplex_jax.data import synthetic_mixed
from rollplex_jax.data.synthetic import TASKS, write_dataset

MIXED = "mixed_count"  # the parquet task (synthetic_mixed.py)
_TASK = flags.DEFINE_enum("task", None, [*TASKS, MIXED], "Synthetic task.", required=True)
_N = flags.DEFINE_integer("n", 256, "Number of examples.", lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "Output directory (created if absent).", required=True)
_SEED = flags.DEFINE_integer("seed", 0, "Seed: same seed, same dataset.", lower_bound=0)
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 56, "Image (or video frame) side in pixels.", lower_bound=28)
_FRAMES = flags.DEFINE_integer("video_frames", 8, "video_count: frames per clip at 2 fps (even, >= 8).",
                               lower_bound=8)
_FIXED = flags.DEFINE_integer("fixed_size", 0, "mixed_count: every image this many px square (the same rows, "
                              "questions and answers); 0 = each image 80-420 px wide and high.", lower_bound=0)


def _summary(answers: collections.Counter) -> str:
    return ", ".join(f"{a}={c}" for a, c in sorted(answers.items()))


def _write_mixed() -> None:
    path = synthetic_mixed.write_parquet(f"{_OUT.value}/train.parquet", _N.value, _SEED.value, _FIXED.value)
    table = pq.read_table(path, columns=["reward_model", "extra_info"]).to_pylist()
    answers = collections.Counter(r["reward_model"]["ground_truth"] for r in table)
    widths = [r["extra_info"]["width"] for r in table]
    heights = [r["extra_info"]["height"] for r in table]
    print(f"wrote {path}: {_N.value} rows of task {MIXED!r} (seed {_SEED.value}; images {min(widths)}-{max(widths)} "
          f"px wide, {min(heights)}-{max(heights)} px high); answers: {_summary(answers)}")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    if _TASK.value == MIXED:
        return _write_mixed()
    path = write_dataset(_TASK.value, _N.value, _OUT.value, _SEED.value, image_size=_IMAGE_SIZE.value,
                         video_frames=_FRAMES.value)
    answers = collections.Counter()
    with open(path) as f:
        for line in f:
            answers[json.loads(line)["answer"]] += 1
    side = f"{_IMAGE_SIZE.value}x{_IMAGE_SIZE.value}"
    media = (f"{_FRAMES.value}-frame {side} mp4 clips in {_OUT.value}/videos" if _TASK.value == "video_count"
             else f"{side} images in {_OUT.value}/images")
    print(f"wrote {path}: {_N.value} examples of task {_TASK.value!r} ({media}, seed {_SEED.value}); "
          f"answers: {_summary(answers)}")


if __name__ == "__main__":
    app.run(main)
