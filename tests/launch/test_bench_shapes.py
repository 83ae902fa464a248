"""Issue 30's shape benchmark, without running it: its data loads as the bench's runs read it (mixed sizes, a
fixed-size twin with the same rows), and its summary of three runs' metrics rows says what it should."""

import json
import subprocess
import sys

import numpy as np
import pytest

from launch import flags as launch_flags
from launch.bench_shapes import FLAGFILE, TARGETS, read_rows, summarise
from launch.make_tiny_checkpoint import save_bpe_tokenizer
from rollplex_jax.data import synthetic_mixed
from rollplex_jax.data.dataset import LoadOptions, load_dataset
from rollplex_jax.data.tokenizer import HFTokenizer
from tests.paths import REPO


def _load(path, tok):
    """The rows as a bench run loads them: the flagfile's data options (answer key, pixels, max_prompt_len)."""
    from absl import flags

    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", f"--flagfile={REPO / FLAGFILE}", f"--dataset={path}"])
    cfg = launch_flags.config_from_flags(fv)
    return load_dataset(path, tok, cfg.model.vision, LoadOptions.from_config(cfg.data), log=lambda m: None)


def test_mixed_count_parquet_and_its_fixed_twin_load(tmp_path):
    n = 12
    mixed = synthetic_mixed.write_parquet(tmp_path / "mixed" / "train.parquet", n, seed=3)
    r = subprocess.run([sys.executable, "-m", "launch.make_dataset", "--task=mixed_count", f"--n={n}", "--seed=3",
                        "--fixed_size=250", f"--out={tmp_path / 'fixed'}"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "250-250 px wide" in r.stdout
    save_bpe_tokenizer(tmp_path / "tok", vocab_size=512)
    tok = HFTokenizer(tmp_path / "tok")
    (ds_m, rep_m), (ds_f, rep_f) = _load(mixed, tok), _load(tmp_path / "fixed" / "train.parquet", tok)
    assert rep_m.kept == rep_f.kept == n  # none over max_prompt_len, none resized
    assert rep_m.resized == rep_f.resized == 0
    grids_m = [tuple(ex.image_grid_thw[0]) for ex in ds_m]
    grids_f = {tuple(ex.image_grid_thw[0]) for ex in ds_f}
    assert len(set(grids_m)) >= n - 2 and grids_f == {(1, 18, 18)}  # 250 px -> smart_resize 252 = 18 patches
    assert [ex.answer for ex in ds_m] == [ex.answer for ex in ds_f] and {ex.answer for ex in ds_m} <= {"1", "2", "3",
                                                                                                       "4"}
    assert [ex.prompt for ex in ds_m] == [ex.prompt for ex in ds_f]
    assert len(set(ds_m.prompt_lengths.tolist())) >= n - 2  # image size and question length both vary
    assert ds_m[0].extra["data_source"] == synthetic_mixed.DATA_SOURCE


def _rows(step_s, padding=0.1, compiles=None, first=1):
    rows = []
    for i, s in enumerate(step_s):
        row = {"step": first + i, "timing_s/step": s, "perf/padding_frac": padding}
        if compiles is not None:
            row.update({"perf/compiles": compiles[i], "timing_s/compile": 0.5 * compiles[i]})
        rows.append(row)
    return rows


def test_summarise_reads_metrics_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    mixed_rows = _rows([20.0, 3, 3, 3, 3, 2.0, 2.6, 3.0, 1.0], padding=0.2, compiles=[40, 5, 5, 5, 5, 1, 0, 2, 0])
    path.write_text("\n".join(json.dumps(r) for r in [{"step": 0, "val/reward_score": 0.1}, *mixed_rows]) + "\n")
    mixed = read_rows(str(path))
    assert mixed == mixed_rows  # the validation-only row is not a training row
    out = summarise(mixed, _rows([9.0, 1, 1, 1, 1, 2.0, 2.0, 2.0, 2.0]), _rows([4.0, 3, 3, 3, 3, 2, 2, 2, 2]))
    assert out["steps"] == 9 and out["steady_from_step"] == 6
    assert (out["mixed_s_per_step"], out["fixed_s_per_step"], out["ratio_mixed_fixed"]) == (2.3, 2.0, 1.15)
    assert out["rerun_s_per_step"] == 2
    assert (out["compiles_after_5"], out["compile_s_after_5"], out["padding_frac"]) == (3, 1.5, 0.2)
    assert (out["cold_first_step_s"], out["rerun_first_step_s"], out["rerun_over_cold_first"]) == (20.0, 4.0, 0.2)
    assert out["pass"] == {k: True for k in TARGETS} and set(out["targets"]) == set(TARGETS)
    assert out["missing_keys"] == {"mixed": [], "fixed": ["perf/compiles", "timing_s/compile"],
                                   "rerun": ["perf/compiles", "timing_s/compile"]}


def test_summarise_without_compile_metrics_or_steady_steps():
    """Today's metrics (no perf/compiles): null, not 0, and named; a run shorter than 6 steps has no steady state."""
    out = summarise(_rows([10.0, 3.0, 3.5, 3.0, 2.0, 2.5, 3.5], padding=0.5), _rows([5.0, 1, 1, 1, 1, 1, 1]),
                    _rows([6.0, 3, 3, 3, 3, 3, 3]))
    assert out["ratio_mixed_fixed"] == 3.0 and out["compiles_after_5"] is None
    assert out["pass"] == {"ratio_mixed_fixed": False, "compiles_after_5": None, "padding_frac": False,
                           "rerun_over_cold_first": False}
    assert out["missing_keys"]["mixed"] == ["perf/compiles", "timing_s/compile"]
    short = summarise(_rows([10.0, 3.0]), _rows([5.0, 1.0]), [])
    assert short["mixed_s_per_step"] is None and short["ratio_mixed_fixed"] is None
    assert short["rerun_first_step_s"] is None and short["missing_keys"]["rerun"] == list(
        ("timing_s/step", "perf/padding_frac", "perf/compiles", "timing_s/compile"))
    assert np.isclose(short["cold_first_step_s"], 10.0)


@pytest.mark.parametrize("response,answer,accuracy", [("3", "3", 1.0), ("there are 2 or 4", "4", 1.0),
                                                      ("4 not 3", "4", 0.0), ("", "1", 0.0)])
def test_count_reward(response, answer, accuracy):
    from launch.bench_reward import count_reward

    r = count_reward(response, answer)
    assert r["accuracy"] == accuracy and r["overall"] == accuracy + 0.1 * (len(response) % 2)
