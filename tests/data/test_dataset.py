"""JSONL validation, load_dataset (bad images, resizing, long prompts), collate and PromptSampler."""

import json

import numpy as np
import pytest
from PIL import Image

from rollplex_jax.config import VisionConfig
from rollplex_jax.data.dataset import DataError, LoadOptions, PromptSampler, collate, load_dataset
from rollplex_jax.data.image_processing import load_image, preprocess_images
from rollplex_jax.data.synthetic import write_dataset
from rollplex_jax.data.tokenizer import TinyTokenizer, render_prompt

VISION = VisionConfig()  # patch 14, merge 2, temporal 2
LIMITS = dict(min_pixels=56 * 56, max_pixels=56 * 56 * 4, max_prompt_len=64)


def _load(path, **kw):
    logs = []
    examples, rep = load_dataset(path, TinyTokenizer(), VISION, LoadOptions(**{**LIMITS, **kw}), log=logs.append)
    return examples, rep, logs


def _png(path, size=(56, 56), colour=(200, 0, 0)):
    Image.new("RGB", size, colour).save(path)
    return path.name


def _write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_synthetic_round_trip(tmp_path):
    path = write_dataset("colour", 6, tmp_path, seed=0)
    rows = [json.loads(line) for line in open(path) if line.strip()]
    examples, rep, logs = _load(path)
    assert rep.to_dict() == {"rows": 6, "kept": 6, "bad_image": 0, "bad_video": 0, "empty_answer": 0,
                               "resized": 0, "too_long": 0}
    assert len(logs) == 1 and "kept 6 of 6 rows" in logs[0]
    tok = TinyTokenizer()
    for i, (e, row) in enumerate(zip(examples, rows, strict=True)):
        assert e.source == f"{path}:{i + 1}" and (e.prompt, e.answer) == (row["prompt"], row["answer"])
        assert e.images == (str(tmp_path / row["images"][0]),)
        assert e.prompt_ids.dtype == np.int32
        assert e.prompt_ids.tolist() == render_prompt(tok, row["prompt"], [4])
        pv, grid = preprocess_images([load_image(e.images[0])], VISION, 56 * 56, 56 * 56 * 4)
        assert e.pixel_values.dtype == np.float32 and e.pixel_values.shape == (16, VISION.patch_dim)
        np.testing.assert_array_equal(e.pixel_values, pv)
        assert e.image_grid_thw.tolist() == [[1, 4, 4]] == grid.tolist()


def test_bad_images_are_skipped_and_huge_ones_resized(tmp_path):
    _png(tmp_path / "ok.png")
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (tmp_path / "empty.png").write_bytes(b"")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (2000, 2000, 3), np.uint8)).save(tmp_path / "huge.png")
    row = lambda *imgs: {"images": list(imgs), "prompt": "what colour?", "answer": "red"}
    path = _write_rows(tmp_path / "d.jsonl", [row("ok.png"), row("ok.png", "corrupt.png"), row("empty.png"),
                                              row("missing.png"), row("huge.png"), row("ok.png", "huge.png")])
    examples, rep, logs = _load(path)
    assert rep.to_dict() == {"rows": 6, "kept": 3, "bad_image": 3, "bad_video": 0, "empty_answer": 0,
                               "resized": 2, "too_long": 0}
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:5", f"{path}:6"]
    warnings = [m for m in logs if m.startswith("warning")]
    assert len(warnings) == 3
    for line, name in [(2, "corrupt.png"), (3, "empty.png"), (4, "missing.png")]:
        assert any(f"{path}:{line}" in m and name in m for m in warnings), (line, logs)
    huge = examples[1]
    assert huge.image_grid_thw.tolist() == [[1, 8, 8]]  # 2000x2000 -> 112x112 under max_pixels = 4 * 56 * 56
    assert huge.prompt_ids.tolist().count(TinyTokenizer().image_pad_id) == 16
    assert examples[2].image_grid_thw.tolist() == [[1, 4, 4], [1, 8, 8]]
    assert examples[2].pixel_values.shape == (16 + 64, VISION.patch_dim)


def test_too_long_prompts_are_filtered_not_truncated(tmp_path):
    _png(tmp_path / "a.png")
    path = _write_rows(tmp_path / "d.jsonl", [
        {"images": ["a.png"], "prompt": "what colour?", "answer": "red"},  # 17 tokens
        {"images": ["a.png", "a.png"], "prompt": "what colour?", "answer": "red"},  # 23 tokens
    ])
    examples, rep, logs = _load(path, max_prompt_len=20)
    assert (rep.kept, rep.too_long) == (1, 1) and len(examples[0].prompt_ids) == 17
    (w,) = [m for m in logs if m.startswith("warning")]
    assert f"{path}:2" in w and "23 tokens" in w and "max_prompt_len=20" in w
    with pytest.raises(DataError, match="no usable rows") as e:
        _load(path, max_prompt_len=10)
    assert "2 over max_prompt_len=10" in str(e.value)


# load_dataset reads every format (rows.py): a row without images is a text prompt, a single image needs no list
# and a numeric answer is its text (loaded None: the row loads).
@pytest.mark.parametrize("line,loaded", [
    ('{"images": [], "prompt": "what colour?"', "not valid JSON"),
    ('["a.png"]', "must be a JSON object"),
    ('{"images": ["a.png"], "prompt": "what colour?"}', "no column 'answer'"),
    ('{"images": ["a.png"], "answer": "red"}', "no column 'prompt'"),
    ('{"prompt": "what colour?", "answer": "red"}', None),
    ('{"images": "a.png", "prompt": "what colour?", "answer": "red"}', None),
    ('{"images": ["a.png"], "prompt": "what colour?", "answer": 3}', None),
    ('{"images": ["a.png"], "prompt": "what colour?", "answer": [3]}', "string or a num"),
])
def test_malformed_lines_name_file_and_line(tmp_path, line, loaded):
    good = '{"images": ["a.png"], "prompt": "what colour?", "answer": "red"}'
    path = _write_rows(tmp_path / "d.jsonl", [good, "", good, line])
    _png(tmp_path / "a.png")
    if loaded is None:
        examples, rep, _ = _load(path)
        assert rep.kept == 3
        return
    with pytest.raises(DataError, match=loaded) as e:
        _load(path)
    assert f"{path}:4" in str(e.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        _load(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="has no rows"):
        _load(_write_rows(tmp_path / "blank.jsonl", ["", "  "]))
    _png(tmp_path / "a.png")
    path = _write_rows(tmp_path / "d.jsonl", [{"images": ["a.png"], "prompt": "what shape?", "answer": "red"}])
    with pytest.raises(DataError, match=f"{path}:1.*'shape'"):
        _load(path)
    path = _write_rows(tmp_path / "d.jsonl", [{"images": ["missing.png"], "prompt": "what colour?", "answer": "red"}])
    with pytest.raises(DataError, match="1 with bad images"):
        _load(path)


def test_unknown_word_without_model_dir_says_to_pass_it(tmp_path):
    """A real dataset's words are not the tiny demo tokenizer's: the error says which flag loads a real model."""
    path = _write_rows(tmp_path / "d.jsonl", [{"prompt": "What is the area of the triangle?", "answer": "12"}])
    with pytest.raises(DataError) as e:
        _load(path)
    msg = str(e.value)
    assert f"{path}:1" in msg and "'What'" in msg
    assert "--model_dir=<a local Hugging Face Qwen2.5-VL checkpoint directory" in msg
    assert "config.json" in msg and "safetensors" in msg


def test_skipped_rows_log_the_first_ten_then_counts_per_cause(tmp_path):
    """15 bad rows (9 with a missing image, 6 over max_prompt_len, interleaved): one warning each for the first 10
    rows in file order, one line counting the other 5 per cause, and the summary counting all 15."""
    _png(tmp_path / "a.png")
    missing = {"images": ["missing.png"], "prompt": "what colour?", "answer": "red"}
    long = {"images": ["a.png", "a.png"], "prompt": "what colour?", "answer": "red"}  # 23 tokens > 20
    good = {"images": ["a.png"], "prompt": "what colour?", "answer": "red"}  # 17 tokens
    bad = [missing, long, missing] * 5  # rows 2..16: 10 missing images, 5 too long
    path = _write_rows(tmp_path / "d.jsonl", [good, *bad, good])
    examples, rep, logs = _load(path, max_prompt_len=20)
    assert (rep.kept, rep.bad_image, rep.too_long) == (2, 10, 5)
    warned = [m for m in logs if "row skipped" in m]
    assert [m.split(": row skipped")[0] for m in warned] == [f"warning: {path}:{i}" for i in range(2, 12)]
    rest = [m for m in logs if "more rows skipped" in m]  # rows 12..16: missing, long, missing, missing, long
    assert rest == ["warning: 5 more rows skipped without a line each (3 with bad images, 2 over max_prompt_len=20); "
                    "the first 10 are above, the summary below counts every cause"]
    assert "skipped 10 with bad images, 5 over max_prompt_len=20" in logs[-1]
    assert len(logs) == 12


def test_collate_left_pads_and_keeps_pixel_order(tmp_path):
    names = [_png(tmp_path / f"{c}.png", colour=rgb) for c, rgb in
             [("r", (255, 0, 0)), ("g", (0, 255, 0)), ("b", (0, 0, 255))]]
    path = _write_rows(tmp_path / "d.jsonl", [
        {"images": [names[0], names[1]], "prompt": "what colour?", "answer": "red"},
        {"images": [], "prompt": "what colour?", "answer": "green"},
        {"images": [names[2]], "prompt": "how many squares?", "answer": "1"},
    ])
    examples, _, _ = _load(path)
    p = collate(examples, pad_id=0)
    lengths = [len(e.prompt_ids) for e in examples]
    assert p.input_ids.shape == (3, max(lengths)) and p.input_ids.dtype == np.int32
    for i, e in enumerate(examples):
        pad = max(lengths) - lengths[i]
        assert (p.input_ids[i, :pad] == 0).all() and p.input_ids[i, pad:].tolist() == e.prompt_ids.tolist()
        assert p.attention_mask[i].tolist() == [0] * pad + [1] * lengths[i]
    np.testing.assert_array_equal(p.pixel_values, np.concatenate([examples[0].pixel_values,
                                                                  examples[2].pixel_values]))
    assert p.pixel_values.shape == (48, VISION.patch_dim)
    assert p.image_grid_thw.tolist() == [[1, 4, 4]] * 3
    assert p.video_grid_thw is None
    # the first patch of each image is its flat colour: red, green, blue in batch order
    first = p.pixel_values[[0, 16, 32]].reshape(3, 3, -1)[:, :, 0]
    assert first.argmax(axis=1).tolist() == [0, 1, 2]
    text_only = collate([examples[1]], pad_id=0)
    assert text_only.pixel_values is None and text_only.image_grid_thw is None


def test_prompt_sampler_is_deterministic_and_covers_epochs():
    a, b = PromptSampler(10, 4, seed=3), PromptSampler(10, 4, seed=3)
    seq_a = np.concatenate([a.next_indices() for _ in range(5)])
    seq_b = np.concatenate([b.next_indices() for _ in range(5)])
    np.testing.assert_array_equal(seq_a, seq_b)
    assert sorted(seq_a[:10].tolist()) == list(range(10)) and sorted(seq_a[10:20].tolist()) == list(range(10))
    assert seq_a[:10].tolist() != seq_a[10:20].tolist()  # a new permutation each epoch
    c = np.concatenate([PromptSampler(10, 4, seed=4).next_indices() for _ in range(3)])
    assert c.tolist() != seq_a[:12].tolist()
    big = PromptSampler(3, 7, seed=0).next_indices()
    assert len(big) == 7 and sorted(big[:3].tolist()) == [0, 1, 2]


def test_prompt_sampler_state_round_trip():
    ref = PromptSampler(10, 4, seed=1)
    expected = [ref.next_indices().tolist() for _ in range(8)]
    s = PromptSampler(10, 4, seed=1)
    got = [s.next_indices().tolist() for _ in range(3)]
    state = json.loads(json.dumps(s.state()))
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = PromptSampler.from_state(state, n_examples=10)
    got += [resumed.next_indices().tolist() for _ in range(5)]
    assert got == expected
    with pytest.raises(ValueError, match="same dataset"):
        PromptSampler.from_state(state, n_examples=11)
