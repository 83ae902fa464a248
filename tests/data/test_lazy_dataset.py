"""The lazy dataset: loading decodes no pixel and keeps metadata only; batches equal the eager path's exactly;
the patch cache stays within its bound; pixels damaged past their header fail at batch time naming file:line."""

import io
import json
import re
import tracemalloc

import numpy as np
import pytest
from PIL import Image, ImageFile

from rollplex_jax.config import VisionConfig
from rollplex_jax.data import dataset as D
from rollplex_jax.data import image_processing
from rollplex_jax.data.image_cache import PatchCache
from rollplex_jax.data.synthetic import write_dataset
from rollplex_jax.data.tokenizer import TinyTokenizer
from rollplex_jax.parallel import multihost
from tests.data.eager_reference import eager_collate, eager_load

VISION = VisionConfig()  # patch 14, merge 2, temporal 2
LIMITS = dict(min_pixels=56 * 56, max_pixels=56 * 56 * 4, max_prompt_len=64)
PATCH_BYTES = VISION.patch_dim * 4  # one fp32 patch row


def _load(path, **kw):
    logs = []
    ds, rep = D.load_dataset(path, TinyTokenizer(), VISION, D.LoadOptions(**{**LIMITS, **kw}), log=logs.append)
    return ds, rep, logs


@pytest.fixture
def decodes(monkeypatch):
    """Counts calls of PIL's pixel decoder (``ImageFile.load``, several per image: PIL calls it again from
    convert/transpose), of the dataset's ``load_image`` (one per image decoded) and of ``_patchify``."""
    calls = {"decode": 0, "load_image": 0, "patchify": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(ImageFile.ImageFile, "load", counted("decode", ImageFile.ImageFile.load))
    monkeypatch.setattr(image_processing, "_patchify", counted("patchify", image_processing._patchify))
    monkeypatch.setattr(D, "load_image", counted("load_image", D.load_image))
    return calls


def test_loading_decodes_no_pixel_and_holds_metadata_only(tmp_path, decodes):
    n = 3000
    path = write_dataset("colour", n, tmp_path, seed=0)
    decodes.update(decode=0, patchify=0)  # writing the PNGs decoded nothing, but start from zero
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ds, rep, _ = _load(path)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert (len(ds), rep.kept) == (n, n)
    assert decodes == {"decode": 0, "load_image": 0, "patchify": 0}
    eager_pixels = n * 16 * PATCH_BYTES  # what the eager load held: 16 patches per 56 px image
    print(f"held after load: {held} B = {held / n:.0f} B/row (eager pixels alone: {eager_pixels / n:.0f} B/row)")
    assert held < 300 * n  # measured 135 B/row: offsets, CRCs, lengths, grids, the index
    assert ds.cache.nbytes == 0

    batch = ds[np.array([5, 17, 5, 2999])]  # one image twice
    p = D.collate(batch, TinyTokenizer().pad_id)
    assert decodes["load_image"] == decodes["patchify"] == 3  # three distinct images, decoded once each
    decoded = dict(decodes)
    assert p.pixel_values.shape == (4 * 16, VISION.patch_dim)
    D.collate(batch, TinyTokenizer().pad_id)
    assert decodes == decoded and ds.cache.hits == 1 + 4  # again: all from the cache


def _rgb(rng, h, w):
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8))


def _mixed_dataset(tmp_path):
    """Rows over many image kinds (modes, EXIF rotation, resizing, several per row, none), plus bad rows."""
    rng = np.random.default_rng(0)
    d = tmp_path
    _rgb(rng, 56, 56).save(d / "a.png")
    _rgb(rng, 70, 120).save(d / "wide.jpg", quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate: a 60x100 (h x w) file is a 100x60 image upright
    _rgb(rng, 60, 100).save(d / "rotated.jpg", exif=exif)
    _rgb(rng, 50, 50).convert("RGBA").save(d / "rgba.png")
    pal = _rgb(rng, 64, 48).convert("P")
    pal.info["transparency"] = 0
    pal.save(d / "palette.png", transparency=0)
    _rgb(rng, 56, 84).convert("L").save(d / "grey.webp")
    _rgb(rng, 600, 400).save(d / "huge.png")
    (d / "empty.png").write_bytes(b"")
    buf = io.BytesIO()
    _rgb(rng, 56, 56).save(buf, format="PNG")
    (d / "cut.png").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    names = ["a.png", "wide.jpg", "rotated.jpg", "rgba.png", "palette.png", "grey.webp", "huge.png"]
    rows = [[n] for n in names] + [[], ["a.png", "rotated.jpg"], ["huge.png", "grey.webp", "a.png"],
                                   ["empty.png"], ["a.png", "cut.png"], ["missing.png"], ["a.png"] * 3]
    prompts = ["what colour?", "how many squares?", "which quadrant?"]
    lines = [json.dumps({"images": r, "prompt": prompts[i % 3], "answer": "red"}) for i, r in enumerate(rows)]
    lines.insert(3, "")  # a blank line: line numbers still count it
    lines.append(json.dumps({"images": ["a.png"] * 4, "prompt": "what colour?", "answer": "red"}))  # 35 tokens
    path = d / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("cache_bytes", [0, 20 * 16 * PATCH_BYTES, 1 << 30])
def test_batches_equal_the_eager_path_exactly(tmp_path, cache_bytes):
    path = _mixed_dataset(tmp_path)
    ds, rep, logs = _load(path, cache_bytes=cache_bytes, max_prompt_len=32)
    eager_logs = []
    eager, eager_rep = eager_load(path, TinyTokenizer(), VISION, **{**LIMITS, "max_prompt_len": 32},
                                  log=eager_logs.append)
    pil_detail = lambda m: re.sub(r"\(truncated or corrupt\): .*", "(truncated or corrupt)", m)  # noqa: E731
    assert rep == eager_rep  # same rows kept, same counts, and the same messages but PIL's own words for a cut
    assert list(map(pil_detail, logs)) == list(map(pil_detail, eager_logs))  # PNG (verify vs decode)
    assert (rep.bad_image, rep.too_long, rep.resized) == (3, 2, 2)
    assert [e.source for e in ds] == [e["source"] for e in eager]
    for e, ref in zip(ds, eager, strict=True):
        assert (e.prompt, e.answer, e.images) == (ref["prompt"], ref["answer"], ref["images"])
        assert e.prompt_ids.tolist() == ref["prompt_ids"].tolist() and e.prompt_ids.dtype == np.int32
        np.testing.assert_array_equal(e.image_grid_thw, ref["image_grid_thw"])
    np.testing.assert_array_equal(ds.prompt_lengths, [len(e["prompt_ids"]) for e in eager])
    np.testing.assert_array_equal(ds.vision_tokens, [int(np.prod(e["image_grid_thw"], -1).sum()) // 4
                                                     for e in eager])
    rng = np.random.default_rng(1)
    for idx in [np.arange(len(ds)), *(rng.integers(0, len(ds), 5) for _ in range(6))]:
        got = D.collate([ds[int(i)] for i in idx], 0)
        want = eager_collate([eager[i] for i in idx], 0)
        for field in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "video_grid_thw"):
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None), field
            if a is not None:
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), field
    assert ds.cache.nbytes <= cache_bytes


def test_the_cache_stays_within_its_bound(tmp_path):
    path = write_dataset("quadrant", 40, tmp_path, seed=1)
    image = 16 * PATCH_BYTES
    ds, _, _ = _load(path, cache_bytes=int(3.5 * image))
    seen = []
    for start in range(0, 40, 4):
        D.collate(ds[start:start + 4], 0)
        seen.append(ds.cache.nbytes)
    assert max(seen) <= 3.5 * image and len(ds.cache) == 3
    assert ds.cache.stats()["misses"] == 40 and ds.cache.evictions == 37
    D.collate(ds[37:40], 0)
    assert ds.cache.hits == 3  # the three most recent images are the ones kept
    small = PatchCache(image - 1)
    assert small.get("k", lambda: np.zeros(16 * VISION.patch_dim, np.float32)).nbytes == image
    assert len(small) == 0 and small.nbytes == 0  # larger than the bound: returned, not kept
    with pytest.raises(ValueError):
        ds[0].pixel_values[0, 0] = 1.0  # cached patches are shared: read-only


def test_pixels_damaged_past_their_header_fail_at_batch_time_naming_file_line(tmp_path):
    rng = np.random.default_rng(2)
    _rgb(rng, 56, 56).save(tmp_path / "ok.jpg")
    buf = io.BytesIO()
    _rgb(rng, 56, 56).save(buf, format="JPEG")
    (tmp_path / "cut.jpg").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])  # header intact
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"images": [n], "prompt": "what colour?", "answer": "red"}) + "\n"
                            for n in ("ok.jpg", "cut.jpg")))
    ds, rep, logs = _load(path)
    assert rep.kept == 2 and not [m for m in logs if m.startswith("warning")]  # the header cannot tell
    D.collate(ds[:1], 0)
    with pytest.raises(D.DataError, match=rf"{path}:2: image file '{tmp_path / 'cut.jpg'}' could not be decoded "
                                          r"\(truncated or corrupt\).*replace the file"):
        D.collate(ds, 0)


def test_a_file_changed_since_loading_is_named(tmp_path):
    path = write_dataset("colour", 4, tmp_path, seed=3)
    ds, _, _ = _load(path)
    Image.new("RGB", (112, 56)).save(tmp_path / "images" / "000001.png")  # another size than at load time
    with pytest.raises(D.DataError, match=rf"{path}:2: image .*000001.png' decodes to a 4x8-patch grid but its "
                                          "header gave 4x4"):
        D.collate(ds[1:2], 0)
    lines = open(path).read().splitlines()
    lines[2] = lines[2].replace("what colour?", "what  colour?")
    open(path, "w").write("\n".join(lines) + "\n")
    with pytest.raises(D.DataError, match=rf"{path}:3: the dataset file changed since it was loaded"):
        ds[2]


def test_indexing_slicing_and_shares(tmp_path):
    path = write_dataset("count", 10, tmp_path, seed=4)
    ds, _, _ = _load(path)
    assert len(ds) == 10 and ds[-1].source == f"{path}:10" and ds[np.int64(3)].source == f"{path}:4"
    part = ds[2:8]
    assert isinstance(part, D.Dataset) and len(part) == 6 and part[0].source == f"{path}:3"
    assert [e.source for e in part[1::2]] == [f"{path}:{i}" for i in (4, 6, 8)]
    picked = ds[np.array([9, 0, 9])]
    assert [e.source for e in picked] == [f"{path}:{i}" for i in (10, 1, 10)]
    shares = [ds[multihost.share(len(ds), i, 3)] for i in range(3)]
    assert [e.source for s in shares for e in s] == [e.source for e in ds]
    assert part.prompt_lengths.tolist() == [len(e.prompt_ids) for e in part] and part.cache is ds.cache
    with pytest.raises(IndexError):
        ds[10]
    with pytest.raises(TypeError):
        ds["a"]
    assert not ds[5:5] and repr(ds) == f"Dataset({str(path)!r}, 10 examples)"
