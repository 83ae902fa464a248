"""Synthetic tasks: determinism, balance, the picture matches the answer, dataset files, the launcher."""

import collections
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from rollplex_jax.data.synthetic import (
    ANSWERS,
    BACKGROUND,
    COLOURS,
    IMAGE_TASKS,
    PROMPTS,
    make_example,
    write_dataset,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _draws(task, n, seed):
    rng = np.random.default_rng(seed)
    return [make_example(task, rng) for _ in range(n)]


@pytest.mark.parametrize("task", IMAGE_TASKS)
def test_deterministic_under_seed(task):
    a, b, c = _draws(task, 20, 7), _draws(task, 20, 7), _draws(task, 20, 8)
    for (ia, pa, aa), (ib, pb, ab) in zip(a, b, strict=True):
        assert np.array_equal(np.asarray(ia), np.asarray(ib)) and (pa, aa) == (pb, ab)
    assert any(not np.array_equal(np.asarray(x[0]), np.asarray(y[0])) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("task", IMAGE_TASKS)
def test_balanced_answers_and_constant_prompt(task):
    draws = _draws(task, 2000, 0)
    counts = collections.Counter(a for _, _, a in draws)
    assert set(counts) == set(ANSWERS[task])
    assert all(400 <= c <= 600 for c in counts.values()), counts  # 500 expected, std ~19
    assert {p for _, p, _ in draws} == {PROMPTS[task]}
    assert all(im.size == (56, 56) and im.mode == "RGB" for im, _, _ in draws[:50])


def _foreground(image):
    return np.any(np.asarray(image) != np.asarray(BACKGROUND, np.uint8), axis=-1)


def test_picture_matches_answer():
    for image, _, answer in _draws("colour", 100, 1):
        px = np.asarray(image)[_foreground(image)]
        assert len(px) >= 14 * 14 and (px == np.asarray(COLOURS[answer], np.uint8)).all()
    names = ANSWERS["quadrant"]
    for image, _, answer in _draws("quadrant", 100, 2):
        ys, xs = np.nonzero(_foreground(image))
        q = {(int(y >= 28), int(x >= 28)) for y, x in zip(ys, xs, strict=True)}
        assert len(q) == 1
        (row, col), = q
        assert names[2 * row + col] == answer
    for image, _, answer in _draws("count", 200, 3):
        fg = np.pad(_foreground(image), ((1, 0), (1, 0)))
        corners = fg[1:, 1:] & ~fg[:-1, 1:] & ~fg[1:, :-1]  # top-left corner of each (separate) square
        assert int(corners.sum()) == int(answer)


def test_write_dataset(tmp_path):
    path = write_dataset("quadrant", 12, tmp_path / "a", seed=3)
    assert path == str(tmp_path / "a" / "data.jsonl")
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 12
    assert rows[0] == {"images": ["images/000000.png"], "prompt": PROMPTS["quadrant"], "answer": rows[0]["answer"]}
    assert all(os.path.isfile(tmp_path / "a" / r["images"][0]) for r in rows)
    write_dataset("quadrant", 12, tmp_path / "b", seed=3)
    for name in ["data.jsonl", "images/000000.png", "images/000011.png"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(ValueError, match="task='shape'"):
        write_dataset("shape", 1, tmp_path, seed=0)


def test_make_dataset_cli(tmp_path):
    out = tmp_path / "ds"
    r = subprocess.run([sys.executable, "-m", "launch.make_dataset", "--task=count", "--n=8", f"--out={out}",
                        "--seed=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(out / "data.jsonl") in r.stdout and "answers:" in r.stdout
    assert len((out / "data.jsonl").read_text().splitlines()) == 8
    bad = subprocess.run([sys.executable, "-m", "launch.make_dataset", "--task=shape", "--n=8", f"--out={out}"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "task" in bad.stderr


def test_video_count_clips_hold_the_answer_only_across_frames(tmp_path):
    """Each decoded mp4 shows a square in exactly `answer` temporal steps (both frames of a step), at most one per
    frame; the files are a function of the seed."""
    import av

    from rollplex_jax.data.synthetic_video import write_video_dataset

    path = write_video_dataset(24, tmp_path / "a", seed=3)
    assert write_video_dataset(24, tmp_path / "b", seed=3)
    rows = [json.loads(line) for line in open(path)]
    answers = []
    for i, row in enumerate(rows):
        assert row["prompt"] == "how many squares?" and row["videos"] == [f"videos/{i:06d}.mp4"]
        a, b = (tmp_path / d / row["videos"][0] for d in ("a", "b"))
        assert a.read_bytes() == b.read_bytes()
        with av.open(str(a)) as c:
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
        lit = [bool((f[..., 0] > 140).any()) for f in frames]
        assert len(frames) == 8 and lit[0::2] == lit[1::2]  # a square lasts one temporal step (2 frames)
        assert sum(lit[0::2]) == int(row["answer"])
        answers.append(row["answer"])
    assert set(answers) == {"1", "2", "3", "4"}


def test_synthetic_split_is_keyed_by_its_flags(tmp_path):
    """<workdir>/data is reused only when this run's flags would write the same files: other flags rewrite it, or
    (with checkpoints trained on it) refuse; a split written before its flags were recorded is rewritten, or with
    checkpoints reused as it is."""
    from rollplex_jax.config import Config, ConfigError, DataConfig, ModelConfig, RunConfig
    from rollplex_jax.data.tokenizer import TinyTokenizer
    from rollplex_jax.parallel.multihost import Processes
    from rollplex_jax.run import setup as run_setup

    wd = str(tmp_path / "run")
    model = ModelConfig.from_json_file(os.path.join(REPO, "configs", "models", "demo.json"))

    def load(**data):
        logs = []
        cfg = Config(model=model, run=RunConfig(workdir=wd),
                     data=DataConfig(eval_n=0, min_pixels=3136, max_pixels=3136, max_prompt_len=64, **data))
        ds, rep = run_setup.load_split(cfg, TinyTokenizer(), wd, Processes(), "train", log=logs.append)
        return ds, [m for m in logs if not m.startswith("data: ") or "kept" not in m]

    ds, logs = load(synthetic_n=8)
    assert len(ds) == 8 and logs == []
    ds, logs = load(synthetic_n=12)  # another count: written anew, not the 8 rows of before
    assert len(ds) == 12
    assert logs == [f"data: {wd}/data was written from --synthetic_task=colour, --synthetic_n=8, --seed=0, "
                    "--synthetic_image_size=56; this run's flags give --synthetic_task=colour, --synthetic_n=12, "
                    "--seed=0, --synthetic_image_size=56: writing it anew"]
    written = os.path.getmtime(os.path.join(wd, "data", "data.jsonl"))
    ds, logs = load(synthetic_n=12, synthetic_video_frames=10)  # a flag the colour task does not read
    assert len(ds) == 12 and logs == [] and os.path.getmtime(os.path.join(wd, "data", "data.jsonl")) == written
    ds, _ = load(synthetic_n=12, synthetic_task="count")
    assert {e.answer for e in ds} <= {"1", "2", "3", "4"}

    os.makedirs(os.path.join(wd, "checkpoints", "3"))  # a checkpoint was trained on these prompts
    with pytest.raises(ConfigError, match=r"--synthetic_task=count, --synthetic_n=12.*--synthetic_task=colour, "
                                          r"--synthetic_n=12.*checkpoints"):
        load(synthetic_n=12)

    os.remove(os.path.join(wd, "data", "synthetic.json"))  # as an earlier version left it
    ds, logs = load(synthetic_n=5)
    assert len(ds) == 12 and logs == [f"data: {wd}/data records no flags (written by an earlier version): reused as "
                                      "it is"]
    os.rmdir(os.path.join(wd, "checkpoints", "3"))
    ds, logs = load(synthetic_n=5)
    assert len(ds) == 5 and "unrecorded flags" in logs[0]
