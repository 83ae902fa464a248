"""Tokenizers and Qwen2.5-VL's chat layout for one user turn.

What: a ``Tokenizer`` protocol with two implementations, and ``render_prompt``, which
turns (text, vision-token counts) into the prompt ids the model and the rollout engine see.

- ``TinyTokenizer``: a 32-token word-level vocabulary built in code, for the tiny demo
  model. The vocabulary is kept tiny on purpose: GRPO on a random policy only learns if
  sampling the exact answer ``[answer, EOS]`` by chance is common enough (about 1/32**2
  per sample here; see ../shared/LEARNING.md).
- ``HFTokenizer``: a local Hugging Face tokenizer directory (a Qwen2.5-VL checkpoint's),
  with Qwen's special tokens looked up by their strings.

Why ids are built piece by piece: ``render_prompt`` concatenates special-token ids and the
encodings of the text segments between them. Qwen's tokenizer splits its input at special
tokens before running BPE, so this equals tokenizing the whole rendered string (tested),
and it can never merge or split the ``<|image_pad|>`` runs.

Layout (Qwen2-VL / Qwen2.5-VL ``chat_template.json``; it is not shipped inside
transformers but with each checkpoint)::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n      (HFTokenizer only)
    <|im_start|>user\\n
    <|vision_start|><|image_pad|>*n<|vision_end|>   one block per image, then per video
    TEXT<|im_end|>\\n<|im_start|>assistant\\n

The template adds that default system turn when the first message is not a system
message. ``TinyTokenizer.default_system`` is None: its prompts omit the system turn (the
words are not in its vocabulary, and short prompts keep the demo fast). This is the one
deliberate deviation from Qwen's layout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
ENDOFTEXT = "<|endoftext|>"
QWEN_DEFAULT_SYSTEM = "You are a helpful assistant."
IMAGE, VIDEO = object(), object()  # message parts: the next image / video (``rows.IMAGE`` / ``rows.VIDEO``)


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded or lacks a token the chat layout needs."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, rewards and rollouts need from a tokenizer."""

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``; special-token strings map to their ids; no BOS/EOS is added."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def eos_id(self) -> int:
        """``<|im_end|>``: ends an assistant turn (the stop token of rollouts)."""
    @property
    def bos_id(self) -> int: ...
    @property
    def im_start_id(self) -> int: ...
    @property
    def image_pad_id(self) -> int: ...
    @property
    def video_pad_id(self) -> int: ...
    @property
    def vision_start_id(self) -> int: ...
    @property
    def vision_end_id(self) -> int: ...
    @property
    def default_system(self) -> str | None:
        """System message ``render_prompt`` adds by default (None = no system turn)."""


# --- TinyTokenizer ----------------------------------------------------------------------------

TINY_SPECIAL = ("<pad>", "<bos>", IM_END, IM_START, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
TINY_CHAT_WORDS = ("user", "assistant", "\n")
TINY_TASK_WORDS = (
    "what", "colour", "which", "quadrant", "how", "many", "squares", "?",
    "red", "green", "blue", "yellow",
    "top-left", "top-right", "bottom-left", "bottom-right",
    "1", "2", "3", "4",
)
TINY_UNK = "<unk>"
TINY_VOCAB: tuple[str, ...] = TINY_SPECIAL + TINY_CHAT_WORDS + TINY_TASK_WORDS + (TINY_UNK,)
TINY_MAX_VOCAB = 32
assert len(TINY_VOCAB) <= TINY_MAX_VOCAB and len(set(TINY_VOCAB)) == len(TINY_VOCAB)


_TINY_ONLY = ("without --model_dir the run trains the tiny random demo model, whose tokenizer only knows the "
              "synthetic tasks' words; to train on a real dataset pass --model_dir=<a local Hugging Face Qwen2.5-VL "
              "checkpoint directory: config.json, the tokenizer files and *.safetensors weights>")


class TinyTokenizer:
    """Deterministic word-level tokenizer over ``TINY_VOCAB`` (32 tokens, ids = positions).

    Encoding: special tokens (``<...>``) and newlines are matched literally first; the rest
    is split on whitespace and ``?`` is split off words. A word outside the vocabulary
    raises ``ValueError`` naming it (never a silent ``<unk>``). Decoding joins words with
    one space and writes special tokens and newlines as they are, so
    ``encode(decode(ids)) == ids`` for every id sequence.
    """

    _LITERALS = tuple(t for t in TINY_VOCAB if t.startswith("<")) + ("\n",)
    _SPLIT = re.compile("(" + "|".join(re.escape(t) for t in sorted(_LITERALS, key=len, reverse=True)) + ")")

    def __init__(self):
        self._ids = {t: i for i, t in enumerate(TINY_VOCAB)}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self._SPLIT.split(text):
            if piece in self._LITERALS:
                ids.append(self._ids[piece])
                continue
            for word in piece.split():
                for part in re.split(r"(\?)", word):
                    if not part:
                        continue
                    if part not in self._ids:
                        raise ValueError(f"word {part!r} is not in TinyTokenizer's vocabulary "
                                         f"({', '.join(repr(w) for w in TINY_CHAT_WORDS + TINY_TASK_WORDS)}): "
                                         f"{_TINY_ONLY}")
                    ids.append(self._ids[part])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out, prev_word = [], False
        for i in ids:
            i = int(i)
            if i < 0:
                raise ValueError(f"token id {i} is negative")
            # A model's vocabulary may be larger than its tokenizer's (Qwen pads 151,665 tokens to 151,936;
            # configs/models/scale_cpu.json has 32,000): an id past the tokenizer's decodes to a mark naming it,
            # so two answers made of such ids still read (and reward) differently.
            tok = TINY_VOCAB[i] if i < len(TINY_VOCAB) else f"<unk:{i}>"
            if tok.startswith("<") or tok == "\n":
                if not (skip_special_tokens and tok.startswith("<")):
                    out.append(tok)
                prev_word = False
            else:
                out.append(" " + tok if prev_word else tok)
                prev_word = True
        return "".join(out)

    def id_of(self, token: str) -> int:
        """Id of one vocabulary entry (KeyError names it if absent)."""
        return self._ids[token]

    @property
    def vocab(self) -> tuple[str, ...]:
        return TINY_VOCAB

    @property
    def vocab_size(self) -> int:
        return len(TINY_VOCAB)

    pad_id = property(lambda self: self._ids["<pad>"])
    bos_id = property(lambda self: self._ids["<bos>"])
    eos_id = property(lambda self: self._ids[IM_END])
    im_start_id = property(lambda self: self._ids[IM_START])
    vision_start_id = property(lambda self: self._ids[VISION_START])
    vision_end_id = property(lambda self: self._ids[VISION_END])
    image_pad_id = property(lambda self: self._ids[IMAGE_PAD])
    video_pad_id = property(lambda self: self._ids[VIDEO_PAD])
    default_system = property(lambda self: None)

    def model_config_overrides(self) -> dict[str, int]:
        """Special ids and vocabulary size for the demo ``ModelConfig``.

        ``vocab_size`` belongs to ``TextConfig``; the rest are ``ModelConfig`` fields::

            o = TinyTokenizer().model_config_overrides()
            cfg = tiny_model_config(text={"vocab_size": o.pop("vocab_size")}, **o)
        """
        return {"image_token_id": self.image_pad_id, "video_token_id": self.video_pad_id,
                "vision_start_token_id": self.vision_start_id, "vision_end_token_id": self.vision_end_id,
                "bos_token_id": self.bos_id, "eos_token_id": self.eos_id, "pad_token_id": self.pad_id,
                "vocab_size": self.vocab_size}


# --- HFTokenizer ------------------------------------------------------------------------------


class HFTokenizer:
    """A local Hugging Face tokenizer (``AutoTokenizer``, ``local_files_only``) with Qwen's ids.

    ``vocab_size`` is the tokenizer's length (base vocabulary plus added tokens); a Qwen
    checkpoint's embedding has more rows (151936 for 151665 tokens), so compare ids against
    the model config, not this. ``pad_id`` is the tokenizer's pad token (Qwen:
    ``<|endoftext|>``), else ``<|endoftext|>``, else EOS; ``bos_id`` is its BOS token, else
    ``<|endoftext|>`` (Qwen's config uses it as ``bos_token_id``), else ``pad_id``.
    """

    def __init__(self, model_dir: str | os.PathLike):
        d = os.fspath(model_dir)
        if not os.path.isdir(d):
            raise TokenizerError(f"tokenizer directory {d!r} does not exist or is not a directory")
        has_fast = os.path.isfile(os.path.join(d, "tokenizer.json"))
        has_bpe = all(os.path.isfile(os.path.join(d, f)) for f in ("vocab.json", "merges.txt"))
        if not (has_fast or has_bpe):
            raise TokenizerError(
                f"tokenizer directory {d!r} has no tokenizer files: 'tokenizer.json' is missing (and no "
                "'vocab.json' + 'merges.txt' either); copy tokenizer.json and tokenizer_config.json from "
                "the Qwen2.5-VL checkpoint into it")
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(d, local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, ... for broken files
            raise TokenizerError(f"could not load the tokenizer in {d!r}: {type(e).__name__}: {e}") from e
        self.model_dir = d
        self._special = {s: self._lookup(s) for s in (IM_START, IM_END, VISION_START, VISION_END,
                                                      IMAGE_PAD, VIDEO_PAD)}
        eot = self.hf.convert_tokens_to_ids(ENDOFTEXT)
        eot = eot if isinstance(eot, int) and eot != self.hf.unk_token_id else None
        pad = self.hf.pad_token_id
        self._pad = pad if pad is not None else (eot if eot is not None else self._special[IM_END])
        bos = self.hf.bos_token_id
        self._bos = bos if bos is not None else (eot if eot is not None else self._pad)
        # Qwen2.5-VL's chat template adds a default system turn; Qwen3-VL's adds none: follow the checkpoint's
        # template where it ships one (no template: Qwen2.5-VL's layout)
        template = getattr(self.hf, "chat_template", None)
        self._system = QWEN_DEFAULT_SYSTEM if not template or QWEN_DEFAULT_SYSTEM in str(template) else None

    def _lookup(self, token: str) -> int:
        i = self.hf.convert_tokens_to_ids(token)
        if not isinstance(i, int) or (i == self.hf.unk_token_id and token != self.hf.unk_token):
            raise TokenizerError(f"the tokenizer in {self.model_dir!r} has no token {token!r}; "
                                 "is it a Qwen2-VL / Qwen2.5-VL tokenizer?")
        if self.hf.encode(token, add_special_tokens=False) != [i]:
            raise TokenizerError(f"the tokenizer in {self.model_dir!r} does not treat {token!r} as one "
                                 "special token (it splits it); is it a Qwen2-VL / Qwen2.5-VL tokenizer?")
        return i

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    pad_id = property(lambda self: self._pad)
    bos_id = property(lambda self: self._bos)
    eos_id = property(lambda self: self._special[IM_END])
    im_start_id = property(lambda self: self._special[IM_START])
    vision_start_id = property(lambda self: self._special[VISION_START])
    vision_end_id = property(lambda self: self._special[VISION_END])
    image_pad_id = property(lambda self: self._special[IMAGE_PAD])
    video_pad_id = property(lambda self: self._special[VIDEO_PAD])
    default_system = property(lambda self: self._system)


# --- the chat layout --------------------------------------------------------------------------

_DEFAULT = object()


def render_prompt(tok: Tokenizer, text: str, n_image_tokens: Sequence[int],
                  n_video_tokens: Sequence[int] = (), *, system: str | None = _DEFAULT) -> list[int]:  # type: ignore[assignment]
    """Prompt ids for one user turn (vision blocks, images then videos, then ``text``) plus the generation prompt:
    ``render_messages`` of ``[("user", [IMAGE]*n + [VIDEO]*m + [text])]`` (the layout of the module docstring).

    Raises:
        ValueError: a count is < 1, or ``text`` contains chat/vision special tokens.
    """
    parts = [IMAGE] * len(n_image_tokens) + [VIDEO] * len(n_video_tokens) + [text]
    return render_messages(tok, [("user", parts)], n_image_tokens, n_video_tokens, system=system)


def _check_text(tok: Tokenizer, text: str) -> None:
    reserved = {tok.image_pad_id, tok.video_pad_id, tok.vision_start_id, tok.vision_end_id,
                tok.im_start_id, tok.eos_id}
    found = sorted(reserved.intersection(tok.encode(text)))
    if found:
        raise ValueError(f"prompt text {text!r} contains special tokens {tok.decode(found)!r}; remove them "
                         "(image/video placeholders are inserted from the images, not from the text)")


def render_messages(tok: Tokenizer, messages: Sequence[tuple[str, Sequence]], n_image_tokens: Sequence[int],
                    n_video_tokens: Sequence[int] = (), *, system: str | None = _DEFAULT,  # type: ignore[assignment]
                    video_timestamps: Sequence[Sequence[float]] | None = None) -> list[int]:
    """Prompt ids of chat ``messages`` as Qwen2.5-VL's chat template lays them out, plus the generation prompt.
    With ``video_timestamps`` (Qwen3-VL: each video's temporal steps' times, ``video_sampling.step_timestamps``) a
    video is written as its processor writes it: per step ``<{t:.1f} seconds>`` then that step's share of the
    pads between vision start and end.

    Args:
        tok: The tokenizer.
        messages: ``(role, parts)`` in order; a part is text, ``IMAGE`` or ``VIDEO`` (the next image / video, whose
            pad count is the next of ``n_image_tokens`` / ``n_video_tokens``).
        n_image_tokens: Image-pad count of each image, in order (``num_merged_tokens``).
        n_video_tokens: Video-pad count of each video, in order.
        system: System message when the first message is not one; default ``tok.default_system``; None = none.
        video_timestamps: one sequence of step times per video (its pad count divides evenly over them), or None.

    Raises:
        ValueError: a count is < 1, the parts use more or fewer images/videos than counted, or a text contains
            chat/vision special tokens.
    """
    counts = {IMAGE: list(n_image_tokens), VIDEO: list(n_video_tokens)}
    for kind, name in ((IMAGE, "image"), (VIDEO, "video")):
        if any(int(n) < 1 for n in counts[kind]):
            raise ValueError(f"each {name} needs >= 1 {name}-pad token, got counts {counts[kind]}")
        used = sum(p is kind for _, parts in messages for p in parts)
        if used != len(counts[kind]):
            raise ValueError(f"the messages hold {used} {name}(s) but {len(counts[kind])} {name} token counts "
                             "were given")
    if system is _DEFAULT:
        system = tok.default_system
    pieces: list[int | str] = []
    if system is not None and (not messages or messages[0][0] != "system"):
        pieces += [tok.im_start_id, "system\n" + system, tok.eos_id, "\n"]
    left = {kind: iter(c) for kind, c in counts.items()}
    times = iter(video_timestamps if video_timestamps is not None else ())
    for role, parts in messages:
        pieces += [tok.im_start_id, f"{role}\n"]
        for p in parts:
            if p is IMAGE or p is VIDEO:
                pad = tok.image_pad_id if p is IMAGE else tok.video_pad_id
                n = int(next(left[p]))
                steps = next(times) if p is VIDEO and video_timestamps is not None else (None,)
                if n % len(steps):
                    raise ValueError(f"a video of {n} pads cannot be split over its {len(steps)} time steps")
                for t in steps:
                    pieces += ([] if t is None else [f"<{t:.1f} seconds>"])
                    pieces += [tok.vision_start_id, *([pad] * (n // len(steps))), tok.vision_end_id]
            else:
                _check_text(tok, p)
                pieces.append(p)
        pieces += [tok.eos_id, "\n"]
    pieces += [tok.im_start_id, "assistant\n"]
    return _encode_pieces(tok, pieces)


def _encode_pieces(tok: Tokenizer, pieces: list[int | str]) -> list[int]:
    """Concatenates ids and encoded text, joining adjacent strings first (as one BPE segment)."""
    ids: list[int] = []
    buf = ""
    for p in pieces:
        if isinstance(p, str):
            buf += p
            continue
        if buf:
            ids += tok.encode(buf)
            buf = ""
        ids.append(p)
    if buf:
        ids += tok.encode(buf)
    return ids
