"""Write a random-init Qwen2.5-VL or Qwen3-VL checkpoint (HF layout, with its ``preprocessor_config.json``) from a
model config, e.g. the tiny one, optionally with a small Qwen-like Hugging Face tokenizer beside it.

  python -m launch.make_tiny_checkpoint --out=DIR [--model_config=configs/models/tiny.json] [--seed=0]
  python -m launch.make_tiny_checkpoint --out=DIR --with_tokenizer

The directory loads in transformers (`Qwen2_5_VLForConditionalGeneration.from_pretrained`) and
with `--model_dir=DIR` in our launchers. `--with_tokenizer` also writes a byte-level BPE with Qwen's special
tokens (`save_bpe_tokenizer`, trained here on a few lines: nothing downloaded) and sets the config's special ids
and vocabulary to it, so `--model_dir=DIR` runs the HFTokenizer path (Qwen's chat layout, system prompt, real BPE
lengths) on a tiny model: what issue 30's shape benchmark trains (launch/bench_shapes.py), and what
`tests_vllm/test_vllm_runtime.py` trains with `--engine=vllm` (vLLM's processor reads the preprocessor config). Tests
reuse `save_bpe_tokenizer` (tests/data/test_tokenizer.py).
"""

import dataclasses
import os

from absl import app, flags

from launch.flags import resolve_path
from rollplex_jax.config import ModelConfig
from rollplex_jax.data.synthetic_mixed import QUESTIONS

QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>")
# What the BPE learns its merges from: the chat layout's words, the demo tasks' words and the counting questions
# of synthetic_mixed (so they take a few tokens each, as English does under Qwen's 151k vocabulary).
CORPUS = ("system\nYou are a helpful assistant.", "user\nwhat colour is the square?",
          "assistant\nred green blue yellow", "how many squares? 1 2 3 4", *QUESTIONS)



def define_flags() -> None:
    """This entry point's flags, defined when it runs (not at import: tests and launch.bench_shapes import the
    functions below next to other entry points' flags)."""
    flags.DEFINE_string("out", None, "Output directory.", required=True)
    flags.DEFINE_string("model_config", "configs/models/tiny.json", "HF-style config.json.")
    flags.DEFINE_integer("seed", 0, "Init seed.", lower_bound=0)
    flags.DEFINE_float("init_std", 0.02, "Std of the normal init of weight matrices.", lower_bound=0.0)
    flags.DEFINE_bool("with_tokenizer", False, "Also write a small Qwen-like BPE tokenizer and fit the config's "
                      "special ids and vocabulary to it.")


def save_bpe_tokenizer(path, specials=QWEN_SPECIALS, pad="<|endoftext|>", vocab_size=320, corpus=CORPUS):
    """Trains a byte-level BPE (as Qwen's) on ``corpus`` with ``specials`` first (ids 0, 1, ...) and saves it as a
    ``PreTrainedTokenizerFast`` in ``path`` (EOS ``<|im_end|>``, PAD ``pad``); returns that tokenizer."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator(list(corpus) * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token=pad)
    fast.save_pretrained(path)
    return fast


def fit_to_tokenizer(cfg: ModelConfig, tok, multiple: int = 64) -> ModelConfig:
    """``cfg`` with the special ids of ``tok`` (an ``HFTokenizer``) and its vocabulary rounded up to ``multiple``."""
    vocab = -(-tok.vocab_size // multiple) * multiple
    return dataclasses.replace(
        cfg, text=dataclasses.replace(cfg.text, vocab_size=vocab), image_token_id=tok.image_pad_id,
        video_token_id=tok.video_pad_id, vision_start_token_id=tok.vision_start_id,
        vision_end_token_id=tok.vision_end_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id)


def write_model_dir(out, cfg: ModelConfig, *, seed: int = 0, std: float = 0.02, with_tokenizer: bool = False,
                    vocab_size: int = 512) -> tuple[ModelConfig, int, int]:
    """Writes a random-init checkpoint of ``cfg`` (fitted to a ``vocab_size`` BPE tokenizer written beside it when
    ``with_tokenizer``) into ``out``; returns (the config written, parameters, files). The weights go last, so a
    directory with ``model.safetensors`` is complete."""
    import jax

    from rollplex_jax.data.tokenizer import HFTokenizer
    from rollplex_jax.models.vl.hf_checkpoint import save_hf_checkpoint
    from rollplex_jax.models.vl.params import count_params, init_params

    out = os.fspath(out)
    if with_tokenizer:
        save_bpe_tokenizer(out, vocab_size=vocab_size)
        cfg = fit_to_tokenizer(cfg, HFTokenizer(out))
    params = init_params(cfg, jax.random.key(seed), std=std)
    write_preprocessor_config(out, cfg)
    files = save_hf_checkpoint(out, cfg, params)
    return cfg, count_params(params), len(files)


def write_preprocessor_config(out, cfg: ModelConfig, max_merged_tokens: int = 256) -> None:
    """``preprocessor_config.json`` as a checkpoint of ``cfg``'s family has one (what vLLM's processor reads): the
    PIL image processor (no torchvision), patch / merge / temporal sizes and normalization from ``cfg.vision``,
    images of 4 to ``max_merged_tokens`` merged tokens."""
    import json

    v = cfg.vision
    unit = (v.patch_size * v.spatial_merge_size) ** 2
    processor = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}[cfg.family]
    pre = {"image_processor_type": "Qwen2VLImageProcessorPil", "processor_class": processor,
           "patch_size": v.patch_size, "merge_size": v.spatial_merge_size, "temporal_patch_size": v.temporal_patch_size,
           "size": {"shortest_edge": 4 * unit, "longest_edge": max_merged_tokens * unit},
           "image_mean": list(v.image_mean), "image_std": list(v.image_std)}
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    f = flags.FLAGS
    path = resolve_path(f.model_config)
    if path is None:
        raise app.UsageError(f"--model_config={f.model_config!r}: file not found")
    cfg, n, files = write_model_dir(f.out, ModelConfig.from_json_file(path), seed=f.seed, std=f.init_std,
                                    with_tokenizer=f.with_tokenizer)
    tok = f", a {cfg.text.vocab_size}-row vocabulary fitted to its BPE tokenizer" if f.with_tokenizer else ""
    print(f"wrote {f.out}: {n:,} parameters in {files} file(s){tok}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
