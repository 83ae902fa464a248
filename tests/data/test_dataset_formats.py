"""Datasets as verl / EasyR1 / Video-R1 users have them: parquet (files, directories), JSON arrays, column keys,
placeholders, chat messages, --format_prompt, and the clear error or counted skip for each kind of bad row."""

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from rollplex_jax.config import VisionConfig
from rollplex_jax.data.dataset import DataError, LoadOptions, collate, load_dataset
from rollplex_jax.data.image_processing import load_image, preprocess_images
from rollplex_jax.data.rows import BUILTIN_FORMATS, RowFormat
from rollplex_jax.data.tokenizer import IMAGE, TinyTokenizer, render_messages

VISION = VisionConfig()  # patch 14, merge 2: a 56x56 image is 4x4 patches = 4 tokens
LIMITS = dict(min_pixels=56 * 56, max_pixels=56 * 56 * 4, max_prompt_len=64)
TOK = TinyTokenizer()


def _png_bytes(colour=(200, 0, 0), size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _load(path, fmt=RowFormat(), **kw):
    logs = []
    ds, rep = load_dataset(path, TOK, VISION, LoadOptions(fmt=fmt, **{**LIMITS, **kw}), log=logs.append)
    return ds, rep, logs


def _verl_rows(n=3):
    """verl's geo3k parquet layout: chat-message prompts with <image>, images as {bytes, path}, nested answer."""
    colours = ["red", "green", "blue", "yellow"]
    rgb = {"red": (200, 0, 0), "green": (0, 200, 0), "blue": (0, 0, 200), "yellow": (200, 200, 0)}
    return [{"data_source": "synthetic/colour", "ability": "vision",
             "prompt": [{"role": "user", "content": "what <image> colour?"}],
             "images": [{"bytes": _png_bytes(rgb[c]), "path": None}],
             "reward_model": {"style": "rule", "ground_truth": c}, "extra_info": {"index": i}}
            for i, c in enumerate(colours[:n])]


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=2)
    return path


def test_verl_parquet_with_image_bytes_and_a_nested_answer(tmp_path):
    path = _write_parquet(tmp_path / "train.parquet", _verl_rows(3))
    fmt = RowFormat(answer_key="reward_model.ground_truth")
    ds, rep, _ = _load(path, fmt)
    assert (rep.rows, rep.kept) == (3, 3)
    e = ds[2]
    assert e.answer == "blue" and e.source == f"{path}:row 2"
    assert e.extra["data_source"] == "synthetic/colour" and e.extra["extra_info"] == {"index": 2}
    # the image block stands where <image> was: "what" <image> "colour?"
    assert e.prompt_ids.tolist() == render_messages(TOK, [("user", ["what ", IMAGE, " colour?"])], [4])
    want, grid = preprocess_images([load_image(_png_bytes((0, 0, 200)))], VISION, 56 * 56, 56 * 56 * 4)
    np.testing.assert_array_equal(e.pixel_values, want)
    p = collate(ds[:3], TOK.pad_id)
    assert p.image_grid_thw.tolist() == [[1, 4, 4]] * 3 and p.pixel_values.shape == (48, VISION.patch_dim)


def test_a_directory_of_parquet_files_is_one_split_in_name_order(tmp_path):
    rows = _verl_rows(4)
    (tmp_path / "d").mkdir()
    _write_parquet(tmp_path / "d" / "part-1.parquet", rows[2:])
    _write_parquet(tmp_path / "d" / "part-0.parquet", rows[:2])
    ds, rep, _ = _load(tmp_path / "d", RowFormat(answer_key="reward_model.ground_truth"))
    assert rep.kept == 4 and [e.answer for e in ds] == ["red", "green", "blue", "yellow"]
    assert ds[3].source == f"{tmp_path / 'd' / 'part-1.parquet'}:row 1"


def test_json_array_with_easyr1_keys_placeholders_and_format_prompt(tmp_path):
    Image.new("RGB", (56, 56), (0, 200, 0)).save(tmp_path / "g.png")
    rows = [{"problem": "<image>how many squares?", "solution": 3, "images": "g.png", "id": 7},
            {"problem": "what colour?", "solution": "green", "images": ["g.png"], "id": 8}]
    (tmp_path / "d.json").write_text(json.dumps({"train": rows}))
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{{ content | trim }} what colour? {{ id }}")
    with pytest.raises(DataError, match="holds an object.*@KEY"):
        _load(tmp_path / "d.json")
    ds, rep, _ = _load(f"{tmp_path / 'd.json'}@train", RowFormat(prompt_key="problem", answer_key="solution"))
    assert rep.kept == 2 and ds[0].answer == "3" and ds[0].source == f"{tmp_path / 'd.json'}:row 0"
    assert ds[1].prompt_ids.tolist() == render_messages(TOK, [("user", [IMAGE, "what colour?"])], [4])  # media first
    with pytest.raises(DataError, match="'what', 'colour', 'which'"):  # "7" is not a tiny word: a clear error
        _load(f"{tmp_path / 'd.json'}@train", RowFormat(prompt_key="problem", answer_key="solution",
                                                        format_prompt=str(tpl)))
    tpl.write_text("{{ content | trim }} what colour?")
    ds, _, _ = _load(f"{tmp_path / 'd.json'}@train", RowFormat(prompt_key="problem", answer_key="solution",
                                                               format_prompt=str(tpl)))
    assert ds[0].prompt == "<image>how many squares? what colour?"
    assert ds[0].prompt_ids.tolist() == render_messages(TOK, [("user", [IMAGE, "how many squares? what colour?"])],
                                                        [4])


def test_builtin_format_prompts_carry_easyr1s_wording():
    assert BUILTIN_FORMATS["math"].endswith("The final answer MUST BE put in \\boxed{}.")
    assert "<think> </think>" in BUILTIN_FORMATS["math"] and "<answer> </answer>" in BUILTIN_FORMATS["r1v"]
    with pytest.raises(DataError, match="neither a built-in"):
        from rollplex_jax.data.rows import check_format_prompt

        check_format_prompt("no-such-template.jinja")


@pytest.mark.parametrize("row,match", [
    ({"question": "what colour?", "answer": "red"}, r"no column 'prompt' \(--prompt_key=prompt\); the row has "
                                                    r"\['answer', 'question'\]"),
    ({"prompt": "what colour?", "reward_model": {"style": "rule"}}, "no column 'reward_model.ground_truth'.*"
                                                                    "column 'reward_model' has"),
    ({"prompt": "<image> <image> what colour?", "images": ["a.png"], "answer": "red"},
     "has 2 <image> placeholder.*but the row has 1 image"),
    ({"prompt": [{"role": "user", "content": "<image> what colour?"}], "answer": "red", "images": ["a.png"],
      "videos": ["a.mp4"]}, "has 0 <video> placeholder"),
    ({"prompt": [{"role": "narrator", "content": "x"}], "answer": "red"}, "needs a 'role'"),
    ({"prompt": "what colour?", "answer": {"a": 1}}, "must be a string or a number"),
])
def test_bad_rows_are_clear_errors_naming_file_and_row(tmp_path, row, match):
    Image.new("RGB", (56, 56)).save(tmp_path / "a.png")
    good = {"prompt": "what colour?", "images": ["a.png"], "answer": "red",
            "reward_model": {"style": "rule", "ground_truth": "red"}}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
    key = "reward_model.ground_truth" if "reward_model" in row else "answer"
    with pytest.raises(DataError, match=match) as e:
        _load(path, RowFormat(answer_key=key))
    assert f"{path}:2" in str(e.value)


def test_bad_media_and_empty_answers_are_counted_skips(tmp_path):
    rows = _verl_rows(4)
    rows[1]["images"] = [{"bytes": b"\x89PNG\r\n\x1a\n not a png", "path": None}]  # corrupt image in the row
    rows[2]["reward_model"]["ground_truth"] = "  "  # empty answer
    path = _write_parquet(tmp_path / "t.parquet", rows)
    ds, rep, logs = _load(path, RowFormat(answer_key="reward_model.ground_truth"))
    assert (rep.kept, rep.bad_image, rep.empty_answer) == (2, 1, 1)
    assert [e.answer for e in ds] == ["red", "yellow"]
    warnings = [m for m in logs if m.startswith("warning")]
    assert any(f"{path}:row 1" in m and "bad image" in m for m in warnings)
    assert any(f"{path}:row 2" in m and "answer (column 'reward_model.ground_truth') is empty" in m for m in warnings)
    assert "1 with an empty answer" in logs[-1]


def test_unknown_formats_and_unreadable_parquet_are_named(tmp_path):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown format '.csv'"):
        _load(tmp_path / "d.csv")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        _load(tmp_path / "bad.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no .parquet file"):
        _load(tmp_path / "empty")


def test_video_rows_every_item_form_and_bad_videos_are_counted_skips(tmp_path):
    """Video items as a path (Video-R1), a verl dict with its own nframes, and a frame list (the image-extension
    rule); an unreadable file and a 1-frame video skip their rows (bad_video). Grids and second_per_grid_ts are
    hand-computed: 32 frames at 8 fps sampled at 2 fps -> 8 frames, 4 steps, 2 / (8/32 * 8) = 1.0 s per step;
    nframes 4 -> 2 steps at 4/32 * 8 = 1 fps -> 2.0 s; a 3-frame list -> 4 frames (last repeated), 2 fps -> 1.0 s."""
    from rollplex_jax.data.video_sampling import VideoRule
    from tests.video_files import write_frames, write_video

    write_video(tmp_path / "a.mp4", 32)
    write_video(tmp_path / "one.mp4", 1)
    (tmp_path / "bad.mp4").write_bytes(b"not a video at all")
    (tmp_path / "f").mkdir()
    frames = [p.replace(str(tmp_path) + "/", "") for p in write_frames(tmp_path / "f", 3, size=(56, 56))]
    rows = [{"problem": "<video>how many squares?", "solution": "2", "path": "a.mp4"},
            {"problem": "how many squares?", "solution": "3", "path": {"video": "a.mp4", "nframes": 4}},
            {"problem": "how many squares?", "solution": "4", "path": frames},
            {"problem": "how many squares?", "solution": "1", "path": "bad.mp4"},
            {"problem": "how many squares?", "solution": "1", "path": "one.mp4"}]
    (tmp_path / "v.json").write_text(json.dumps(rows))
    fmt = RowFormat(prompt_key="problem", answer_key="solution", video_key="path")
    rule = VideoRule(min_pixels=56 * 56, max_pixels=56 * 56)  # every frame 56x56: 2x2 merged tokens per step
    ds, rep, logs = _load(tmp_path / "v.json", fmt, video_rule=rule)
    assert (rep.kept, rep.bad_video) == (3, 2)
    assert [e.video_grid_thw.tolist() for e in ds] == [[[4, 4, 4]], [[2, 4, 4]], [[2, 4, 4]]]
    assert [e.second_per_grid_ts.tolist() for e in ds] == [[1.0], [2.0], [1.0]]
    assert [int((e.prompt_ids == TOK.video_pad_id).sum()) for e in ds] == [16, 8, 8]
    warnings = [m for m in logs if m.startswith("warning")]
    assert any(f"{tmp_path / 'v.json'}:row 3" in m and "bad.mp4" in m for m in warnings)
    assert any(f"{tmp_path / 'v.json'}:row 4" in m and "one.mp4" in m for m in warnings)
    p = collate(ds, TOK.pad_id)
    assert p.video_grid_thw.tolist() == [[4, 4, 4], [2, 4, 4], [2, 4, 4]] and p.image_grid_thw is None
    assert p.second_per_grid_ts.tolist() == [1.0, 2.0, 1.0] and p.pixel_values.shape == (64 + 32 + 32, 1176)
