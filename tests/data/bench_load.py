"""Time and memory of ``load_dataset`` on a 100k-row image dataset (a benchmark for issue 17, not a test).

    .venv/bin/python -m tests.data.bench_load --out=/tmp/bench100k --rows=100000 --images=300
    .venv/bin/python -m tests.data.bench_load --out=/tmp/bench100k_distinct --rows=100000 --images=100000

Writes (once; reused when present) ``images`` distinct 56 px synthetic PNGs and a JSONL of ``rows`` rows over
them (row i -> image i % images, the three tasks' prompts), then, in this process, times ``load_dataset``
(TinyTokenizer, the demo's limits), and one batch of 16 through ``collate``. Prints one JSON line: seconds,
RSS before/after the load and its peak (VmHWM reset before loading), the bytes the eager path's pixels
would have held.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from rollplex_jax.config import VisionConfig
from rollplex_jax.data import dataset as D
from rollplex_jax.data.synthetic import PROMPTS, TASKS, make_example
from rollplex_jax.data.tokenizer import TinyTokenizer


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def write(out: str, rows: int, images: int) -> str:
    path = os.path.join(out, f"data_{rows}_{images}.jsonl")
    if os.path.exists(path):
        return path
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(images):
        name = os.path.join(out, "images", f"{i:06d}.png")
        if not os.path.exists(name):
            make_example(TASKS[i % 3], rng)[0].save(name)
    with open(path + ".tmp", "w") as f:
        for i in range(rows):
            task = TASKS[(i % images) % 3]
            f.write(json.dumps({"images": [f"images/{i % images:06d}.png"], "prompt": PROMPTS[task],
                                "answer": "red"}) + "\n")
    os.replace(path + ".tmp", path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--images", type=int, default=300)
    a = ap.parse_args()
    path = write(a.out, a.rows, a.images)
    tok, vision = TinyTokenizer(), VisionConfig()
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS
    t0 = time.perf_counter()
    ds, rep = D.load_dataset(path, tok, vision, D.LoadOptions(min_pixels=3136, max_pixels=3136, max_prompt_len=64),
                             log=lambda m: None)
    load_s = time.perf_counter() - t0
    after, peak = _status_mib("VmRSS"), _status_mib("VmHWM")
    t0 = time.perf_counter()
    p = D.collate(ds[np.arange(0, len(ds), len(ds) // 16)[:16]], tok.pad_id)
    batch_s = time.perf_counter() - t0
    print(json.dumps({"rows": a.rows, "distinct_images": a.images, "kept": rep.kept, "load_s": round(load_s, 2),
                      "rss_before_mib": round(before, 1), "rss_after_load_mib": round(after, 1),
                      "load_peak_rss_mib": round(peak, 1), "held_by_load_mib": round(after - before, 1),
                      "eager_pixels_would_be_mib": round(rep.kept * 16 * vision.patch_dim * 4 / 2**20, 1),
                      "batch16_collate_s": round(batch_s, 3),
                      "batch_pixel_mib": round(p.pixel_values.nbytes / 2**20, 2)}))


if __name__ == "__main__":
    main()
