"""TinyTokenizer, HFTokenizer (on a tokenizer built here, no download) and render_prompt."""

import json
import os

import numpy as np
import pytest

from launch.make_tiny_checkpoint import save_bpe_tokenizer  # a byte-level BPE with Qwen's special tokens
from rollplex_jax.config import tiny_model_config
from rollplex_jax.data import synthetic
from rollplex_jax.data.tokenizer import (
    HFTokenizer,
    TinyTokenizer,
    Tokenizer,
    TokenizerError,
    render_prompt,
)

TINY_EXPECTED = [
    "<pad>", "<bos>", "<|im_end|>", "<|im_start|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
    "<|video_pad|>", "user", "assistant", "\n",
    "what", "colour", "which", "quadrant", "how", "many", "squares", "?",
    "red", "green", "blue", "yellow", "top-left", "top-right", "bottom-left", "bottom-right",
    "1", "2", "3", "4", "<unk>",
]

# Qwen2-VL / Qwen2.5-VL chat_template.json (shipped with the checkpoints, not with transformers).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --- TinyTokenizer ----------------------------------------------------------------------------

def test_tiny_vocab_is_small_and_stable():
    tok = TinyTokenizer()
    assert tok.vocab_size <= 32
    assert list(tok.vocab) == TINY_EXPECTED
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.im_start_id) == (0, 1, 2, 3)
    assert (tok.vision_start_id, tok.vision_end_id, tok.image_pad_id, tok.video_pad_id) == (4, 5, 6, 7)
    assert tok.default_system is None
    assert isinstance(tok, Tokenizer)


def test_tiny_covers_every_synthetic_prompt_and_answer():
    tok = TinyTokenizer()
    for task in synthetic.TASKS:
        tok.encode(synthetic.PROMPTS[task])
        for answer in synthetic.ANSWERS[task]:
            assert len(tok.encode(answer)) == 1, answer  # reward needs exactly [answer, EOS]


def test_tiny_encode_decode():
    tok = TinyTokenizer()
    assert tok.encode("what colour?") == [11, 12, 18]
    assert tok.encode("  how many\tsquares ? ") == [15, 16, 17, 18]
    assert tok.encode("<|im_start|>user\nred<|im_end|>") == [3, 8, 10, 19, 2]
    assert tok.decode([11, 12, 18]) == "what colour ?"
    assert tok.decode([3, 8, 10, 19, 2]) == "<|im_start|>user\nred<|im_end|>"
    assert tok.decode([19, 2, 0, 0], skip_special_tokens=True) == "red"
    text = "<|im_start|>assistant\ntop-left 3<|im_end|>"
    assert tok.decode(tok.encode(text)) == text
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(0, 12))).tolist()
        assert tok.encode(tok.decode(ids)) == ids


def test_tiny_unknown_word_raises():
    tok = TinyTokenizer()
    with pytest.raises(ValueError, match="'purple'"):
        tok.encode("what colour purple?")
    assert tok.decode([19, 32, 9058]) == "red<unk:32><unk:9058>"  # ids past the tokenizer (a larger model vocab)
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_tiny_model_config_overrides():
    o = TinyTokenizer().model_config_overrides()
    assert o == {"image_token_id": 6, "video_token_id": 7, "vision_start_token_id": 4, "vision_end_token_id": 5,
                 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "vocab_size": 32}
    cfg = tiny_model_config(text={"vocab_size": o.pop("vocab_size")}, **o)
    assert cfg.text.vocab_size == 32 and cfg.image_token_id == 6


def test_render_prompt_tiny_layout():
    tok = TinyTokenizer()
    ids = render_prompt(tok, "what colour?", [2, 1], [3])
    assert ids == [3, 8, 10,            # <|im_start|> user \n
                   4, 6, 6, 5,          # image 1: 2 pads
                   4, 6, 5,             # image 2: 1 pad
                   4, 7, 7, 7, 5,       # video: 3 pads
                   11, 12, 18,          # what colour ?
                   2, 10, 3, 9, 10]     # <|im_end|> \n <|im_start|> assistant \n
    one = render_prompt(tok, "how many squares?", [4])
    assert one.count(tok.image_pad_id) == 4 and len(one) == 3 + 6 + 4 + 5
    assert render_prompt(tok, "", []) == [3, 8, 10, 2, 10, 3, 9, 10]


def test_render_prompt_rejects_bad_input():
    tok = TinyTokenizer()
    with pytest.raises(ValueError, match="special tokens"):
        render_prompt(tok, "what <|image_pad|> colour?", [1])
    with pytest.raises(ValueError, match="special tokens"):
        render_prompt(tok, "red<|im_end|>", [1])
    with pytest.raises(ValueError, match=">= 1 image-pad"):
        render_prompt(tok, "what colour?", [0])


# --- HFTokenizer ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen_like_tokenizer")
    save_bpe_tokenizer(d)
    return d


def test_hf_tokenizer_special_ids(hf_dir):
    tok = HFTokenizer(hf_dir)
    assert isinstance(tok, Tokenizer)
    hf = tok.hf
    for name, s in [("eos_id", "<|im_end|>"), ("im_start_id", "<|im_start|>"), ("image_pad_id", "<|image_pad|>"),
                    ("video_pad_id", "<|video_pad|>"), ("vision_start_id", "<|vision_start|>"),
                    ("vision_end_id", "<|vision_end|>"), ("pad_id", "<|endoftext|>"), ("bos_id", "<|endoftext|>")]:
        assert getattr(tok, name) == hf.convert_tokens_to_ids(s), name
    assert tok.vocab_size == len(hf)
    assert tok.default_system == "You are a helpful assistant."
    text = "what colour is the square?"
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("n_images,n_videos,text", [([4], [], "what colour is the square?"),
                                                     ([3, 1], [2], "how many squares?"),
                                                     ([], [], "red green")])
def test_render_prompt_hf_matches_qwen_chat_template(hf_dir, n_images, n_videos, text):
    """render_prompt == tokenizing Qwen's chat template output with the pads expanded, as the processor does."""
    tok = HFTokenizer(hf_dir)
    content = [{"type": "image"}] * len(n_images) + [{"type": "video"}] * len(n_videos) + [{"type": "text",
                                                                                          "text": text}]
    rendered = tok.hf.apply_chat_template([{"role": "user", "content": content}], chat_template=QWEN_CHAT_TEMPLATE,
                                          tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    for pad, counts in (("<|image_pad|>", n_images), ("<|video_pad|>", n_videos)):
        parts = rendered.split(pad)
        assert len(parts) == len(counts) + 1
        rendered = parts[0] + "".join(pad * n + rest for n, rest in zip(counts, parts[1:], strict=True))
    expected = tok.hf.encode(rendered, add_special_tokens=False)
    ids = render_prompt(tok, text, n_images, n_videos)
    assert ids == expected
    assert ids.count(tok.image_pad_id) == sum(n_images) and ids.count(tok.video_pad_id) == sum(n_videos)
    no_system = render_prompt(tok, text, n_images, n_videos, system=None)
    assert no_system == ids[ids.index(tok.im_start_id, 1):]


def test_hf_tokenizer_missing_files(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        HFTokenizer(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    with pytest.raises(TokenizerError) as e:
        HFTokenizer(tmp_path)
    assert str(tmp_path) in str(e.value) and "tokenizer.json" in str(e.value)


def test_hf_tokenizer_without_qwen_tokens(tmp_path):
    save_bpe_tokenizer(tmp_path, specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert os.path.isfile(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="vision_start"):
        HFTokenizer(tmp_path)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "text", "text": "what colour "}, {"type": "image"},
                                  {"type": "text", "text": " is the square?"}, {"type": "video"}]}],
    [{"role": "system", "content": "red green"},
     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many squares?"}]},
     {"role": "assistant", "content": "blue"},
     {"role": "user", "content": [{"type": "text", "text": "what colour?"}, {"type": "image"}]}],
])
def test_render_messages_hf_matches_qwen_chat_template(hf_dir, messages):
    """render_messages == Qwen's chat template on the same messages (system turn given or defaulted, media in
    place, several turns), pads expanded as the processor does."""
    from rollplex_jax.data.tokenizer import IMAGE, VIDEO, render_messages

    tok = HFTokenizer(hf_dir)
    rendered = tok.hf.apply_chat_template(messages, chat_template=QWEN_CHAT_TEMPLATE, tokenize=False,
                                          add_generation_prompt=True)
    n_images = [2 + i for i in range(rendered.count("<|image_pad|>"))]
    n_videos = [3] * rendered.count("<|video_pad|>")
    for pad, counts in (("<|image_pad|>", n_images), ("<|video_pad|>", n_videos)):
        parts = rendered.split(pad)
        rendered = parts[0] + "".join(pad * n + rest for n, rest in zip(counts, parts[1:], strict=True))
    as_parts = lambda c: [c] if isinstance(c, str) else [
        IMAGE if p["type"] == "image" else VIDEO if p["type"] == "video" else p["text"] for p in c]
    ours = render_messages(tok, [(m["role"], as_parts(m["content"])) for m in messages], n_images, n_videos)
    assert ours == tok.hf.encode(rendered, add_special_tokens=False)
    with pytest.raises(ValueError, match="hold 1 image"):
        render_messages(tok, [("user", [IMAGE, "x"])], [2, 2])


def test_qwen3_vl_video_steps_with_timestamps_match_its_processor(hf_dir):
    """A Qwen3-VL video as transformers' Qwen3VLProcessor writes it (``replace_video_token``): the template's
    vision block collapsed to the pad, then per temporal step ``<{t:.1f} seconds>`` and that step's pads between
    vision start and end; the times from transformers' own ``_calculate_timestamps``."""
    from transformers import Qwen3VLProcessor

    from rollplex_jax.data.tokenizer import IMAGE, VIDEO, render_messages
    from rollplex_jax.data.video_sampling import step_timestamps

    indices, fps = [0, 12, 24, 36, 48], 24.0
    times = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
    assert step_timestamps(indices, fps, 2) == tuple(times)
    assert [f"{t:.1f}" for t in times] == ["0.2", "1.2", "2.0"]
    tok = HFTokenizer(hf_dir)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "how many squares?"}]
    rendered = tok.hf.apply_chat_template([{"role": "user", "content": content}], chat_template=QWEN_CHAT_TEMPLATE,
                                          tokenize=False, add_generation_prompt=True)
    steps = "".join(f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * 2 + "<|vision_end|>" for t in times)
    rendered = rendered.replace("<|vision_start|><|video_pad|><|vision_end|>", steps).replace(
        "<|image_pad|>", "<|image_pad|>" * 3)
    ours = render_messages(tok, [("user", [IMAGE, VIDEO, "how many squares?"])], [3], [6],
                           video_timestamps=[tuple(times)])
    assert ours == tok.hf.encode(rendered, add_special_tokens=False)
    with pytest.raises(ValueError, match="cannot be split"):
        render_messages(tok, [("user", [VIDEO, "x"])], [], [5], video_timestamps=[tuple(times)])


def test_a_chat_template_without_a_default_system_turn_renders_none(hf_dir, tmp_path):
    """Qwen3-VL's chat template adds no default system turn (Qwen2.5-VL's adds "You are a helpful assistant."):
    the tokenizer follows the template its checkpoint ships; without one, Qwen2.5-VL's layout."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf.save_pretrained(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.default_system is None
    ids = render_prompt(tok, "how many squares?", [2])
    assert tok.decode(ids).startswith("<|im_start|>user\n") and "system" not in tok.decode(ids)
    assert HFTokenizer(hf_dir).default_system == "You are a helpful assistant."
