"""launch.flags: every flagfile parses into a valid Config; bad values fail naming the flag."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from absl import app, flags

from launch import flags as launch_flags
from rollplex_jax.config import Config, ConfigError, ModelConfig, tiny_model_config
from rollplex_jax.data.tokenizer import TinyTokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
FLAGFILES = sorted((REPO / "configs").glob("*.flags"))


def _parse(*args: str) -> flags.FlagValues:
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    fv(["prog", *args])
    return fv


def _show_config(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.show_config", *args], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=60)


def test_there_are_flagfiles():
    assert REPO / "configs" / "tiny_cpu.flags" in FLAGFILES


@pytest.mark.parametrize("path", FLAGFILES, ids=lambda p: p.name)
def test_every_flagfile_builds_a_config(path):
    cfg = launch_flags.config_from_flags(_parse(f"--flagfile={path}"))
    assert isinstance(cfg, Config)
    json.dumps(cfg.to_dict())


def test_tiny_cpu_values():
    cfg = launch_flags.config_from_flags(_parse(f"--flagfile={REPO / 'configs' / 'tiny_cpu.flags'}"))
    assert cfg.model == ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    assert cfg.model.text.vocab_size == TinyTokenizer().vocab_size
    assert (cfg.data.min_pixels, cfg.data.max_pixels, cfg.data.max_prompt_len) == (56 * 56, 56 * 56, 64)
    assert (cfg.run.workdir, cfg.run.seed, cfg.run.steps, cfg.run.model_dir) == ("runs/tiny_cpu", 0, 300, "")
    assert (cfg.rl.batch_prompts, cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (16, 8, 3)


def test_command_line_overrides_flagfile():
    cfg = launch_flags.config_from_flags(
        _parse(f"--flagfile={REPO / 'configs' / 'tiny_cpu.flags'}", "--steps=3", "--dtype=bfloat16"))
    assert cfg.run.steps == 3 and cfg.model.dtype == "bfloat16"


def test_tiny_json_equals_tiny_model_config():
    text = (REPO / "configs" / "models" / "tiny.json").read_text()
    assert text.rstrip() == json.dumps(tiny_model_config().to_hf_dict(), indent=2)
    assert ModelConfig.from_json_file(REPO / "configs" / "models" / "tiny.json") == tiny_model_config()


def test_define_flags_twice_is_a_noop():
    fv = flags.FlagValues()
    launch_flags.define_flags(fv)
    launch_flags.define_flags(fv)
    fv(["prog", "--steps=2"])
    assert fv.steps == 2


BAD_FLAGS = [
    (["--dtype=float16"], ["--dtype=float16", "float32|bfloat16"]),
    (["--steps=-1"], ["--steps=-1", "non-negative integer"]),
    (["--max_prompt_len=0"], ["--max_prompt_len=0", "positive integer"]),
    (["--max_pixels=10", "--min_pixels=100"], ["--max_pixels=10", ">= --min_pixels=100"]),
    (["--model_config=/nonexistent.json"], ["--model_config", "/nonexistent.json", "not found"]),
    (["--model_dir=/nonexistent_dir"], ["--model_dir", "/nonexistent_dir/config.json", "does not exist"]),
    (["--workdir="], ["--workdir", "non-empty"]),
    (["--max_pixel=5"], ["max_pixel", "Did you mean: max_pixels"]),
    (["--no_such_flag=1"], ["Unknown command line flag", "no_such_flag"]),
]


@pytest.mark.parametrize("args, expected", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_values_fail_at_parse_naming_the_flag(args, expected):
    with pytest.raises(flags.Error) as e:
        _parse(*args)
    for s in expected:
        assert s in str(e.value)


def test_relative_model_config_prefers_cwd_then_repo_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    demo = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")  # the default --model_config
    assert launch_flags.config_from_flags(_parse()).model == demo  # from the repo root
    local = tmp_path / "configs" / "models" / "demo.json"
    local.parent.mkdir(parents=True)
    local.write_text(json.dumps(tiny_model_config(text=dict(num_hidden_layers=3)).to_hf_dict()))
    assert launch_flags.config_from_flags(_parse()).model.text.num_hidden_layers == 3


def test_model_dir_overrides_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_model_config(text=dict(num_hidden_layers=1)).to_hf_dict()))
    cfg = launch_flags.config_from_flags(_parse(f"--model_dir={tmp_path}", "--model_config=/nonexistent.json"))
    assert cfg.model.text.num_hidden_layers == 1 and cfg.run.model_dir == str(tmp_path)


@pytest.mark.parametrize("content, expected", [
    ("{not json", "not valid JSON"),
    (json.dumps({**tiny_model_config().to_hf_dict(), "model_type": "llama"}), "model_type='llama'"),
    (json.dumps({**tiny_model_config().to_hf_dict(), "image_token_id": 999}), "model.image_token_id=999"),
])
def test_bad_model_file_names_flag_and_file(tmp_path, content, expected):
    path = tmp_path / "bad.json"
    path.write_text(content)
    fv = _parse(f"--model_config={path}")
    with pytest.raises(app.UsageError) as e:
        launch_flags.config_from_flags(fv)
    msg = str(e.value)
    assert "--model_config" in msg and str(path) in msg and expected in msg


def test_config_error_fields_map_to_flags():
    fv = _parse("--max_pixels=5000")
    err = launch_flags._usage_error(ConfigError("data.max_pixels=5000 is invalid: must be >= min_pixels"), fv)
    assert str(err).startswith("--max_pixels=5000: data.max_pixels")


def test_show_config_prints_json():
    r = _show_config("--flagfile=configs/tiny_cpu.flags", "--steps=7")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["run"]["steps"] == 7 and d["data"]["max_pixels"] == 56 * 56
    assert d["model"]["text"]["vocab_size"] == TinyTokenizer().vocab_size


@pytest.mark.parametrize("args, expected", [BAD_FLAGS[0], BAD_FLAGS[4]], ids=["dtype", "model_config"])
def test_show_config_rejects_bad_flags(args, expected):
    r = _show_config("--flagfile=configs/tiny_cpu.flags", *args)
    assert r.returncode != 0 and r.stdout == ""
    for s in expected:
        assert s in r.stderr
