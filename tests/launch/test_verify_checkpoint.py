"""launch.verify_checkpoint on a tiny HF checkpoint made with transformers: ok, above tolerance, malformed."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from safetensors.numpy import load_file, save_file

from rollplex_jax.config import tiny_model_config
from tests.hf_reference import hf_model

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "launch.verify_checkpoint", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    return r.returncode, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_hf")
    hf_model(tiny_model_config(), seed=5).save_pretrained(d)
    return d


def test_tiny_checkpoint_matches_transformers(tiny_dir):
    rc, out, err = _run(f"--hf_dir={tiny_dir}")
    assert rc == 0, err
    assert out["ok"] is True
    assert out["max_abs_logit_diff"] <= 1e-4
    assert out["n_params"] == 190688
    assert "video_grid=[[2," in err  # the video has 2 temporal patches


def test_tiny_qwen3_vl_checkpoint_matches_transformers(tmp_path):
    """A Qwen3-VL checkpoint written by transformers (its names: model.language_model.*) verifies as Qwen2.5-VL's."""
    from rollplex_jax.config.model import tiny_qwen3_vl_config

    hf_model(tiny_qwen3_vl_config(), seed=5).save_pretrained(tmp_path)
    rc, out, err = _run(f"--hf_dir={tmp_path}")
    assert rc == 0, err
    assert out["ok"] is True and out["max_abs_logit_diff"] <= 1e-4
    assert "video_grid=[[2," in err


def test_above_tolerance_exits_1(tiny_dir):
    rc, out, _ = _run(f"--hf_dir={tiny_dir}", "--atol=0")
    assert rc == 1 and out["ok"] is False and out["max_abs_logit_diff"] > 0


def test_malformed_checkpoint_names_the_tensor(tiny_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_dir / "config.json").read_text())
    tensors = load_file(tiny_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    rc, out, err = _run(f"--hf_dir={bad}")
    assert rc == 2 and out["ok"] is False
    assert "model.layers.1.mlp.up_proj.weight" in err


def test_missing_directory_is_a_clear_error(tmp_path):
    rc, out, err = _run(f"--hf_dir={tmp_path / 'nope'}")
    assert rc == 2 and "config.json" in err
