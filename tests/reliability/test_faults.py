"""Faults and bad inputs: what the user sees, and that the run goes on (or stops cleanly) with nothing lost.

Every test builds its own tiny setting (configs/models/demo.json, B=2, G=4, 3 new tokens, 56 px
images) and runs the real thing: ``python -m launch.main`` as a subprocess (asserting on exit code,
stderr, metrics.jsonl and run_summary.json), or a real ``Runner`` in-process where the fault has to be
planted inside the run (non-finite gradients, answers that are only EOS).
"""

import dataclasses
import io
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from rollplex_contract.batch import Rollouts
from rollplex_jax.config import Config, DataConfig, ModelConfig, OptimConfig, RlConfig, RolloutConfig, RunConfig
from rollplex_jax.data.tokenizer import HFTokenizer, TinyTokenizer, TokenizerError
from rollplex_jax.models.vl.hf_checkpoint import CheckpointError, save_hf_checkpoint
from rollplex_jax.models.vl.params import init_params, params_sha256
from rollplex_jax.rl import advantages as adv_lib
from rollplex_jax.rl.rewards import exact_match
from rollplex_jax.run.runner import Runner
from rollplex_jax.step import rl_step
from tests.paths import REPO

DEMO = REPO / "configs" / "models" / "demo.json"
TINY = ["--flagfile=configs/tiny_cpu.flags", "--steps=2", "--batch_prompts=2", "--group_size=4", "--synthetic_n=8",
        "--eval_n=0", "--noprogress"]


def _main(*args, timeout=300):
    """Runs ``python -m launch.main`` from the repo root; returns (CompletedProcess, wall seconds)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "launch.main", *args], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    return r, time.monotonic() - t0


def _rows(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _small_config(workdir, **rl) -> Config:
    return Config(
        model=ModelConfig.from_json_file(DEMO),
        data=DataConfig(synthetic_n=8, eval_n=0, min_pixels=3136, max_pixels=3136, max_prompt_len=64),
        rollout=RolloutConfig(group_size=4, max_new_tokens=3, max_batch=64),
        rl=RlConfig(batch_prompts=2, micro_batch=8, **rl),
        optim=OptimConfig(lr=1e-3),
        run=RunConfig(workdir=str(workdir), steps=3, progress=False),
    )


def _host(params: dict) -> dict:
    return {k: np.asarray(v).copy() for k, v in params.items()}


def _bit_identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)


# --- 1, 2: bad dataset rows ---------------------------------------------------------------------------

def _png(path, size=(56, 56), colour=(255, 0, 0)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path)


def test_bad_rows_are_skipped_named_and_counted_and_the_run_goes_on(tmp_path):
    ds = tmp_path / "ds"
    for i in range(4):
        _png(ds / "images" / f"good{i}.png", colour=(255, 0, 0) if i % 2 else (0, 0, 255))
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    buf = io.BytesIO()
    noise.save(buf, format="PNG")
    (ds / "images" / "corrupt.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])  # valid header, cut
    (ds / "images" / "empty.png").write_bytes(b"")
    _png(ds / "images" / "huge.png", size=(1200, 1200), colour=(0, 255, 0))
    long_prompt = "what colour " * 40 + "?"  # 81 text tokens > --max_prompt_len=64
    rows = [  # (images, prompt, answer); file line = index + 1
        (["images/good0.png"], "what colour?", "blue"),
        (["images/corrupt.png"], "what colour?", "red"),
        (["images/good1.png"], "what colour?", "red"),
        (["images/empty.png"], "what colour?", "red"),
        (["images/missing.png"], "what colour?", "red"),
        (["images/huge.png"], "what colour?", "green"),
        (["images/good2.png"], long_prompt, "blue"),
        (["images/good2.png"], "what colour?", "blue"),
        (["images/good3.png"], "what colour?", "red"),
    ]
    path = ds / "data.jsonl"
    path.write_text("".join(json.dumps({"images": im, "prompt": p, "answer": a}) + "\n" for im, p, a in rows))
    wd = tmp_path / "run"
    r, _ = _main(*TINY, f"--dataset={path}", f"--workdir={wd}")
    assert r.returncode == 0, r.stderr[-3000:]

    lines = r.stderr.splitlines()

    def warning_for(lineno: int) -> str:
        found = [s for s in lines if f"{path}:{lineno}:" in s]
        assert len(found) == 1, (lineno, found, r.stderr[-3000:])
        assert "row skipped" in found[0], found[0]
        return found[0]

    for lineno, image in ((2, "corrupt.png"), (4, "empty.png"), (5, "missing.png")):
        assert str(ds / "images" / image) in warning_for(lineno)
    assert "truncated or corrupt" in warning_for(2)
    assert "empty (0 bytes)" in warning_for(4)
    assert "does not exist" in warning_for(5)
    assert "over max_prompt_len=64" in warning_for(7)
    assert not [s for s in lines for n in (1, 3, 6, 8, 9) if f"{path}:{n}:" in s]  # good and resized rows: silent
    assert "kept 5 of 9 rows" in r.stderr

    summary = json.loads((wd / "run_summary.json").read_text())
    assert summary["data"]["train"] == {"rows": 9, "kept": 5, "bad_image": 3, "bad_video": 0, "empty_answer": 0,
                                        "resized": 1, "too_long": 1}
    assert summary["steps_done"] == 2
    assert [row["step"] for row in _rows(wd)] == [1, 2]


def test_malformed_jsonl_line_refuses_to_start(tmp_path):
    ds = tmp_path / "ds"
    _png(ds / "images" / "a.png")
    good = json.dumps({"images": ["images/a.png"], "prompt": "what colour?", "answer": "red"})
    path = ds / "data.jsonl"
    # Line 2 is blank (skipped, still counted), line 3 is cut short; line 4 is fine again.
    path.write_text(good + "\n\n" + good[:-1] + "\n" + good + "\n")
    wd = tmp_path / "run"
    r, _ = _main(*TINY, f"--dataset={path}", f"--workdir={wd}")
    assert r.returncode != 0
    assert f"{path}:3: not valid JSON" in r.stderr, r.stderr[-3000:]
    assert not (wd / "metrics.jsonl").exists() or _rows(wd) == []  # no step ran


# --- 3, 4: rewards that hang or raise ---------------------------------------------------------------

@pytest.mark.timing  # a wall-time bound: run alone (make test)
def test_hanging_and_raising_rewards_are_counted_and_the_run_goes_on(tmp_path):
    # tests.reward_fns:hang_raise_or_one: of every 4 calls, one sleeps 120 s, one raises, two return 1.0.
    wd = tmp_path / "run"
    r, wall = _main(*TINY, f"--workdir={wd}", "--reward=tests.reward_fns:hang_raise_or_one",
                    "--reward_timeout_s=0.5", "--reward_workers=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert wall < 60, f"2 steps took {wall:.0f} s: something waited for the 120 s reward call"
    rows = _rows(wd)
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # 8 samples per step: 2 timed out, 2 raised (reward 0, counted), 4 scored 1.0
        assert row["reward/failures"] == 4.0, row
        assert row["reward/mean"] == 0.5, row
    assert json.loads(r.stdout.strip().splitlines()[-1])["steps_done"] == 2


def test_raising_reward_with_failure_raise_stops_naming_the_sample(tmp_path):
    wd = tmp_path / "run"
    r, _ = _main(*TINY, f"--workdir={wd}", "--reward=tests.reward_fns:always_raise", "--reward_failure=raise")
    assert r.returncode != 0
    assert "reward function failed on sample 0" in r.stderr, r.stderr[-3000:]
    assert "RuntimeError: reward service unavailable" in r.stderr
    assert _rows(wd) == []  # the failed step wrote no metrics row


@pytest.mark.timing  # a wall-time bound: run alone (make test)
def test_hanging_reward_with_failure_raise_exits_promptly(tmp_path):
    # The timeout becomes the error; the hung call's thread must not hold the process at exit.
    wd = tmp_path / "run"
    try:
        r, wall = _main(*TINY, f"--workdir={wd}", "--reward=tests.reward_fns:hang", "--reward_timeout_s=0.5",
                        "--reward_failure=raise", timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail("launch.main did not exit within 60 s after a reward timeout with --reward_failure=raise "
                    "(the interpreter joins the hung reward thread at exit; launch.main must os._exit on "
                    f"errors too). stderr tail: {(e.stderr or b'')[-1500:]!r}")
    assert r.returncode != 0
    assert "reward function failed on sample 0" in r.stderr, r.stderr[-3000:]
    assert "TimeoutError: call did not return within timeout_s=0.5" in r.stderr
    assert wall < 60


# --- 4b: a rollout that hangs --------------------------------------------------------------------------

def test_timed_engine_is_the_engine_with_a_deadline():
    """run/watchdog.TimedEngine: the engine's attributes read and written through it, its errors raised in the
    caller (generate runs in a worker thread), a deadline that must be > 0."""
    from rollout_torch.hf_engine import HFEngine
    from rollplex_contract.batch import Prompts, SamplingParams
    from rollplex_jax.run.watchdog import TimedEngine

    inner = HFEngine(ModelConfig.from_json_file(DEMO).to_hf_dict(), max_batch=8)
    engine = TimedEngine(inner, 30, "--engine=hf")
    assert engine.layout == "hf" and not engine.stuck
    engine.share_prefill = False  # launch.bench_rollout sets it on the runner's engine
    assert inner.share_prefill is False
    prompts = Prompts(input_ids=np.ones((1, 3), np.int32), attention_mask=np.ones((1, 3), np.int32))
    with pytest.raises(RuntimeError, match="generate called before bind"):  # the engine's own error
        engine.generate(prompts, 2, SamplingParams())
    assert not engine.stuck
    with pytest.raises(ValueError, match="deadline > 0"):
        TimedEngine(inner, 0, "--engine=hf")


def test_hung_rollout_stops_the_run_with_a_checkpoint_that_resumes(tmp_path):
    """The engine's second generate never returns (tests/reliability/hang_rollout.py): past --rollout_timeout_s the
    step fails naming the step, the engine and the flag, the checkpoint of step 1 is written (no periodic ones:
    --checkpoint_every=0), the process exits 1 without waiting for the hung thread; a resume continues from it."""
    from launch.api import runner_from_flagfile
    from rollplex_jax.run.checkpoint import Checkpointer

    wd = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # 10 s: ~50x what this tiny generate takes (B 2 x G 4 answers of 3 tokens) even on a loaded 2-core machine.
    r = subprocess.run([sys.executable, "-m", "tests.reliability.hang_rollout", "--hang_at_call=2", *TINY,
                        f"--workdir={wd}", "--checkpoint_every=0", "--rollout_timeout_s=10"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr[-3000:]
    assert ("error: step 2: the rollout engine (--engine=hf) did not return from generate within "
            "--rollout_timeout_s=10 s (8 sequences)") in r.stderr, r.stderr[-3000:]
    assert "hang_rollout.py" in r.stderr.split("where the rollout thread is stuck")[1]  # the hung thread's stack
    assert f"checkpoint: step 1 (the last finished step) saved in {wd / 'checkpoints'}" in r.stderr
    for started in ("model: random init (no --model_dir; seed 0): done in ", "engine: building --engine=hf: done in ",
                    "step 1: done in "):  # the long start-up steps say what they do and how long it took
        assert started in r.stderr, started
    assert [row["step"] for row in _rows(wd)] == [1]
    assert sorted(os.listdir(wd / "checkpoints")) == ["1"]
    ck = Checkpointer(str(wd), keep=2)
    assert ck.meta(1)["sampler"]["position"] == 2  # step 1's batch only: the failed step gave its batch back
    ck.close()

    logs = []  # the same flags with --resume, in this process
    resumed = runner_from_flagfile("configs/tiny_cpu.flags", workdir=wd, steps=2, batch_prompts=2, group_size=4,
                                   synthetic_n=8, eval_n=0, progress=False, checkpoint_every=0, resume=True,
                                   log=logs.append)
    assert resumed.step == 1 and any("continuing from the checkpoint of step 1" in m for m in logs)
    list(resumed.run())
    resumed.close()
    assert [row["step"] for row in _rows(wd)] == [1, 2]


# --- 5: a missing or incomplete model directory -----------------------------------------------------

def _qwen_like_tokenizer(path) -> HFTokenizer:
    """A byte-level BPE with Qwen's special tokens, trained here on a few lines (no download)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|image_pad|>", "<|video_pad|>"]
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(["system\nYou are a helpful assistant.", "user\nwhat colour?", "assistant\nred green blue"]
                            * 5, trainer)
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>").save_pretrained(
        path)
    return HFTokenizer(path)


def test_model_dir_problems_name_what_is_missing(tmp_path):
    # A path that does not exist: refused at flag parsing, naming the path.
    r, _ = _main(*TINY, f"--workdir={tmp_path / 'r0'}", "--model_dir=/nonexistent/qwen")
    assert r.returncode != 0
    assert "/nonexistent/qwen/config.json" in r.stderr and "does not exist" in r.stderr, r.stderr[-2000:]

    # config.json only: the first thing missing is the tokenizer.
    d = tmp_path / "ckpt"
    d.mkdir()
    demo = ModelConfig.from_json_file(DEMO)
    (d / "config.json").write_text(json.dumps(demo.to_hf_dict()))
    cfg = _small_config(tmp_path / "r1")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_len=512),
                              run=dataclasses.replace(cfg.run, model_dir=str(d)))
    with pytest.raises(TokenizerError) as e:
        Runner(cfg, log=lambda m: None)
    assert str(d) in str(e.value) and "tokenizer.json" in str(e.value)

    # config.json + tokenizer, no weights: the user is told which weight files are missing.
    tok = _qwen_like_tokenizer(d)
    model = dataclasses.replace(
        demo, text=dataclasses.replace(demo.text, vocab_size=320), image_token_id=tok.image_pad_id,
        video_token_id=tok.video_pad_id, vision_start_token_id=tok.vision_start_id,
        vision_end_token_id=tok.vision_end_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id)
    assert tok.vocab_size <= 320
    (d / "config.json").write_text(json.dumps(model.to_hf_dict()))
    r, _ = _main(*TINY, f"--workdir={tmp_path / 'r2'}", f"--model_dir={d}", "--max_prompt_len=512")
    assert r.returncode != 0
    assert f"checkpoint {str(d)!r} has neither model.safetensors nor model.safetensors.index.json" in r.stderr, \
        r.stderr[-3000:]

    # Complete: a Runner loads exactly the saved weights. Then one tensor goes missing: named.
    params = init_params(model, jax.random.key(3))
    save_hf_checkpoint(d, model, params)
    cfg = dataclasses.replace(cfg, model=model, run=dataclasses.replace(cfg.run, workdir=str(tmp_path / "r3")))
    logs = []
    runner = Runner(cfg, log=logs.append)
    assert params_sha256(runner.state.params) == params_sha256(params)
    assert any(m.startswith(f"model: loading the checkpoint {d}: done in ") for m in logs), logs
    runner.close()
    from safetensors.numpy import load_file, save_file

    tensors = load_file(d / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, workdir=str(tmp_path / "r4")))
    with pytest.raises(CheckpointError) as e:
        Runner(cfg, log=lambda m: None)
    assert "missing tensors (1): lm_head.weight" in str(e.value) and str(d) in str(e.value)


# --- 6: empty answers --------------------------------------------------------------------------------

def test_empty_answers_decode_to_nothing_score_zero_and_do_not_update(tmp_path):
    tok = TinyTokenizer()
    eos, pad, red = tok.eos_id, tok.pad_id, tok.id_of("red")
    ro = Rollouts(response_ids=np.array([[[eos, pad], [pad, pad], [red, eos], [red, pad]]]),
                  lengths=np.array([[1, 0, 2, 1]]), finish_reasons=[["stop", "length", "stop", "length"]],
                  logprobs=np.zeros((1, 4, 2), np.float32))
    texts = rl_step.response_texts(ro, tok.decode, (eos,))
    assert texts == [["", "", "red", "red"]]
    assert [exact_match(t, "red") for t in texts[0]] == [0.0, 0.0, 1.0, 1.0]
    # Rewards that differ but only on answers without tokens: nothing to learn from.
    assert not rl_step.should_update(jnp.array([[1.0, -1.0]]), np.array([[0, 0]]))
    assert rl_step.should_update(jnp.array([[1.0, -1.0]]), np.array([[0, 1]]))

    # A real rollout where every answer is only EOS: plant a huge constant feature in the embedding
    # (so the final hidden state always points along it) and have EOS's output row read it.
    r = Runner(_small_config(tmp_path / "run"), log=lambda m: None)
    p = r.state.params
    r.state = dataclasses.replace(r.state, params={
        **p, "model.embed_tokens.weight": p["model.embed_tokens.weight"].at[:, 0].set(1e3),
        "lm_head.weight": p["lm_head.weight"].at[eos, 0].set(100.0)})
    before = _host(r.state.params)
    m = r.train_step()
    got = r.last.rollouts
    assert (got.lengths == 1).all() and (got.response_ids[..., 0] == eos).all()
    assert r.last.texts == [[""] * 4] * 2
    assert m["reward/mean"] == 0.0 and m["reward/failures"] == 0.0
    assert m["response_length/mean"] == 1.0 and m["response/stop_frac"] == 1.0
    assert not rl_step.should_update(adv_lib.compute_advantages(jnp.asarray(r.last.rewards), "grpo"), got.lengths)
    assert m["skipped_steps/no_signal"] == 1.0
    assert _bit_identical(before, r.state.params)
    r.close()
    assert _rows(tmp_path / "run")[0]["skipped_steps/no_signal"] == 1.0


# --- 7: non-finite gradients -------------------------------------------------------------------------

def test_nonfinite_gradient_skips_the_update_and_the_run_goes_on(tmp_path):
    # Why not a NaN parameter: the engine samples from zero-copy views of the actor's params, so a NaN in
    # any of them reaches torch, whose multinomial raises ("probability tensor contains either inf, nan or
    # element < 0") before any gradient exists. Instead scale the final norm up by 2**80 and lm_head down
    # by 2**80: the logits are exactly unchanged (powers of two), so the rollout is normal, but
    # d loss / d lm_head = (onehot - p) h^T is ~1e22 per element and the gradient norm overflows to inf.
    wd = tmp_path / "run"
    r = Runner(_small_config(wd, reward="tests.reward_fns:length_parity"), log=lambda m: None)
    p = r.state.params
    norm, head = np.asarray(p["model.norm.weight"]).copy(), np.asarray(p["lm_head.weight"]).copy()
    s = 2.0**80
    r.state = dataclasses.replace(r.state, params={**p, "model.norm.weight": p["model.norm.weight"] * s,
                                                    "lm_head.weight": p["lm_head.weight"] / s})
    params_before, opt_before = _host(r.state.params), _host(dict(enumerate(jax.tree.leaves(r.state.opt_state))))
    m = r.train_step()
    assert m["skipped_steps/no_signal"] == 0.0, "the batch must carry signal, or the update is skipped earlier"
    assert m["skipped_steps/nonfinite"] == 1.0 and not np.isfinite(m["grad_norm"])
    assert _bit_identical(params_before, r.state.params)
    assert _bit_identical(opt_before, dict(enumerate(jax.tree.leaves(r.state.opt_state))))

    # Undo the scaling: the next step updates normally, and the skip stays counted.
    r.state = dataclasses.replace(r.state, params={**r.state.params, "model.norm.weight": jnp.asarray(norm),
                                                    "lm_head.weight": jnp.asarray(head)})
    restored = params_sha256(r.state.params)
    m2 = r.train_step()
    assert m2["skipped_steps/nonfinite"] == 0.0 and np.isfinite(m2["grad_norm"])
    assert m2["skipped_steps/nonfinite_total"] == 1.0
    assert params_sha256(r.state.params) != restored
    summary = r.finish()
    assert summary["skipped_steps/nonfinite"] == 1
    rows = _rows(wd)
    assert [(row["step"], row["skipped_steps/nonfinite"]) for row in rows] == [(1, 1.0), (2, 0.0)]
    assert rows[0]["grad_norm"] == "inf"


# --- 8: bad flag values ------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,hint", [("--group_size=1", "must be >= 2"),
                                       ("--kl_mode=bogus", "loss|reward|off"),
                                       ("--lr=-1", "must be > 0")])
def test_bad_flag_value_fails_at_start_naming_the_flag(tmp_path, flag, hint):
    wd = tmp_path / "run"
    r, _ = _main("--flagfile=configs/tiny_cpu.flags", f"--workdir={wd}", flag)
    assert r.returncode != 0
    name = flag.split("=")[0]
    assert f"{name}=" in r.stderr and hint in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not wd.exists()  # refused before building anything
