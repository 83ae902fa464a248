"""One dataset row as verl / EasyR1 / TRL / Video-R1 users store it -> (chat messages, media items, answer, extra).

Why: users arrive with their own files and column names. This module reads a row through EasyR1's column flags
and turns it into what the tokenizer and the vision preprocessing need, with the rules stated once:

- Columns (``RowFormat``): ``prompt_key`` (default ``prompt``), ``answer_key`` (``answer``; a dotted path such as
  ``reward_model.ground_truth`` reaches into nested columns), ``image_key`` (``images``), ``video_key``
  (``videos``). A missing prompt or answer column is a ``DataError`` naming the column and listing the columns the
  row has; a missing image or video column means the row has none. An answer may be a string or a number (kept as
  its text); an empty answer skips the row (counted).
- A media column holds one item or a list of items. An image item is a path, raw bytes, or a
  ``{"bytes": ..., "path": ...}`` dict (bytes win when present). A video item is a path string, a verl-style dict
  ``{"video": path or [frame paths], "fps"/"nframes"/...}``, or a list of frame image paths.
  The rule for a list in the video column: a list of strings that all name image files (by extension: .png,
  .jpg, ...) is ONE video given as frames; any other list is a list of videos (each a path, dict or frame list).
- Paths are relative to ``image_dir`` when given, else to the data file's directory (EasyR1 joins image_dir too).
- The prompt is a string with ``<image>`` / ``<video>`` placeholders, or chat messages (verl: a list of
  ``{"role", "content"}``; content a string with placeholders or a list of ``{"type": "text"|"image"|"video"}``
  parts). Placeholders are replaced, in place, by the items in order; their count must equal the items' count
  (else ``DataError`` naming file:row). A prompt with no placeholder at all gets its media before the text of its
  first user turn, images then videos (TRL's rule, and this project's original JSONL format).
- ``format_prompt``: a jinja template (a file path) rendered with the prompt text as ``content`` and every other
  column by its name, or the built-in ``math`` / ``r1v`` (EasyR1's ``examples/format_prompt`` wording); it applies
  to a string prompt, or to the text of the last user turn of chat messages.

Messages come out as ``[(role, [part, ...]), ...]`` where a part is a text string or ``IMAGE`` / ``VIDEO``;
``tokenizer.render_messages`` lays them out with Qwen2.5-VL's chat template.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

from rollplex_jax.data.sources import DataError
from rollplex_jax.data.tokenizer import IMAGE, VIDEO  # message parts: the next image / video

PLACEHOLDERS = {"<image>": IMAGE, "<video>": VIDEO}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_SPLIT = re.compile("(<image>|<video>)")

BUILTIN_FORMATS = {
    "math": ("{{ content | trim }} You FIRST think about the reasoning process as an internal monologue and then "
             "provide the final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final "
             "answer MUST BE put in \\boxed{}."),
    "r1v": ("{{ content | trim }} A conversation between User and Assistant. The user asks a question, and the "
            "Assistant solves it. The assistant first thinks about the reasoning process in the mind and then provides "
            "the user with the answer. The reasoning process and answer are enclosed within <think> </think> and "
            "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think><answer> answer here "
            "</answer>"),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowFormat:
    """Which columns hold what, where relative paths start, and the prompt template (see the module docstring)."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = "videos"
    image_dir: str = ""
    format_prompt: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedRow:
    """A row's messages, media items (as stored), answer text, the prompt text shown in logs, other columns."""

    messages: list[tuple[str, list]]
    images: list[Any]
    videos: list[Any]
    answer: str
    prompt: str
    extra: dict


def column(row: dict, key: str, where: str, flag: str) -> Any:
    """``row[key]`` with ``key`` dotted into nested dicts; ``DataError`` naming the column and the row's columns."""
    value: Any = row
    for i, part in enumerate(key.split(".")):
        if not isinstance(value, dict) or part not in value:
            have = sorted(value) if isinstance(value, dict) else type(value).__name__
            at = "the row" if i == 0 else f"column {'.'.join(key.split('.')[:i])!r}"
            raise DataError(f"{where}: no column {key!r} (--{flag}={key}); {at} has {have}. Set --{flag} to the "
                            "column that holds it (a dotted path reaches into nested columns)")
        value = value[part]
    return value


def _as_list(value: Any) -> list:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def _is_frame_list(value: Any) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(v, str) and v.lower().endswith(IMAGE_EXTENSIONS) for v in value))


def video_items(value: Any) -> list:
    """The videos of a video column's value (the frame-list rule is in the module docstring)."""
    if value is None:
        return []
    if _is_frame_list(value):
        return [list(value)]
    return _as_list(value)


def _split_text(text: str) -> list:
    return [PLACEHOLDERS.get(p, p) for p in _SPLIT.split(text) if p]


def _content_parts(content: Any, where: str) -> list:
    if isinstance(content, str):
        return _split_text(content)
    if not isinstance(content, (list, tuple)):
        raise DataError(f"{where}: a message's content must be a string or a list of parts, got "
                        f"{type(content).__name__}")
    parts = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            parts += _split_text(p["text"])
        elif kind in ("image", "image_url") or (isinstance(p, dict) and "image" in p):
            parts.append(IMAGE)
        elif kind == "video" or (isinstance(p, dict) and "video" in p):
            parts.append(VIDEO)
        else:
            raise DataError(f"{where}: message part {p!r} is not {{'type': 'text', 'text': ...}}, "
                            "{'type': 'image'} or {'type': 'video'}")
    return parts


def _messages(prompt: Any, where: str, key: str) -> list[tuple[str, list]]:
    if isinstance(prompt, str):
        return [("user", _split_text(prompt))]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        out = []
        for m in prompt:
            role = m.get("role")
            if role not in ("system", "user", "assistant") or "content" not in m:
                raise DataError(f"{where}: chat message {m!r} needs a 'role' (system, user or assistant) and a "
                                "'content'")
            out.append((role, _content_parts(m["content"], where)))
        if not any(role == "user" for role, _ in out):
            raise DataError(f"{where}: the chat messages in column {key!r} have no user turn")
        return out
    raise DataError(f"{where}: column {key!r} must be a string or a list of chat messages "
                    f"[{{'role': ..., 'content': ...}}], got {type(prompt).__name__} {str(prompt)[:80]!r}")


def _place_media(messages: list[tuple[str, list]], n_images: int, n_videos: int, where: str) -> None:
    """Checks the placeholder counts against the items, or puts the media first when there is no placeholder."""
    found = {kind: sum(p is kind for _, parts in messages for p in parts) for kind in (IMAGE, VIDEO)}
    if found[IMAGE] == found[VIDEO] == 0:
        for role, parts in messages:
            if role == "user":
                parts[:0] = [IMAGE] * n_images + [VIDEO] * n_videos
                return
    for kind, name, n in ((IMAGE, "image", n_images), (VIDEO, "video", n_videos)):
        if found[kind] != n:
            raise DataError(f"{where}: the prompt has {found[kind]} <{name}> placeholder(s) but the row has {n} "
                            f"{name}(s); each {name} needs one placeholder where it goes (or use none at all: the "
                            "media then go before the text)")


def _template(spec: str):
    """The compiled template of ``--format_prompt`` (a built-in name or a file, re-read when the file changes)."""
    if spec in BUILTIN_FORMATS:
        return _compiled(spec, BUILTIN_FORMATS[spec])
    try:
        st = os.stat(spec)
        return _file_template(spec, st.st_mtime_ns, st.st_size)
    except OSError as e:
        raise DataError(f"--format_prompt={spec!r} is neither a built-in ({', '.join(BUILTIN_FORMATS)}) nor a "
                        f"readable jinja file: {e}") from None


@functools.lru_cache(maxsize=16)
def _file_template(path: str, mtime_ns: int, size: int):
    del mtime_ns, size  # the cache key: a changed file is read again
    with open(path, encoding="utf-8") as f:
        return _compiled(path, f.read())


@functools.lru_cache(maxsize=16)
def _compiled(spec: str, text: str):
    import jinja2

    try:
        return jinja2.Environment(keep_trailing_newline=False).from_string(text)
    except jinja2.TemplateError as e:
        raise DataError(f"--format_prompt={spec!r}: not a valid jinja template: {e}") from None


def check_format_prompt(spec: str) -> None:
    """Raises ``DataError`` now (not at the first row) when ``--format_prompt`` cannot be used."""
    if spec:
        _template(spec)


def _format(messages: list[tuple[str, list]], spec: str, row: dict, where: str) -> None:
    """Renders the last user turn's text through the template (placeholders kept where they were)."""
    role_parts = [parts for role, parts in messages if role == "user"][-1]
    text = "".join("<image>" if p is IMAGE else "<video>" if p is VIDEO else p for p in role_parts)
    import jinja2

    try:
        out = _template(spec).render(**{**{k: v for k, v in row.items() if isinstance(k, str)}, "content": text})
    except jinja2.TemplateError as e:
        raise DataError(f"{where}: --format_prompt={spec!r} failed on this row: {e}") from None
    role_parts[:] = _split_text(out)


def _text(messages: list[tuple[str, list]]) -> str:
    return "\n".join("".join("<image>" if p is IMAGE else "<video>" if p is VIDEO else p for p in parts)
                     for role, parts in messages if role == "user")


def _answer(value: Any, where: str, key: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: column {key!r} (the answer) must be a string or a number, got "
                        f"{type(value).__name__} {str(value)[:80]!r}")
    return value if isinstance(value, str) else str(value)


def parse_row(row: dict, fmt: RowFormat, where: str) -> ParsedRow:
    """A row's messages, media items, answer and other columns (the rules are in the module docstring)."""
    prompt = column(row, fmt.prompt_key, where, "prompt_key")
    answer = _answer(column(row, fmt.answer_key, where, "answer_key"), where, fmt.answer_key)
    images = _as_list(row.get(fmt.image_key))
    videos = video_items(row.get(fmt.video_key))
    messages = _messages(prompt, where, fmt.prompt_key)
    if fmt.format_prompt:
        _format(messages, fmt.format_prompt, row, where)
    text = _text(messages)  # the prompt as written (and formatted), before media are placed
    _place_media(messages, len(images), len(videos), where)
    top = {fmt.prompt_key, fmt.image_key, fmt.video_key}
    extra = {k: v for k, v in row.items() if k not in top and not isinstance(v, (bytes, bytearray))}
    return ParsedRow(messages=messages, images=images, videos=videos, answer=answer, prompt=text,
                     extra=extra)


def media_base(data_path: str, fmt: RowFormat) -> str:
    """The directory relative media paths start from."""
    if fmt.image_dir:
        return fmt.image_dir
    path = data_path.rsplit("@", 1)[0] if not os.path.exists(data_path) else data_path
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def local_path(path: str, base: str) -> str:
    """A media path (``file://`` stripped) joined to ``base`` when relative."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    return os.path.normpath(os.path.join(base, os.path.expanduser(path)))


def image_source(item: Any, base: str, where: str, k: int) -> tuple[str, str | bytes]:
    """``(name for messages, path or encoded bytes)`` of image item ``k`` of a row."""
    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
        if data:
            return (path or f"<image {k} bytes of {where}>"), bytes(data)
        item = path
    if isinstance(item, (bytes, bytearray)):
        return f"<image {k} bytes of {where}>", bytes(item)
    if isinstance(item, str) and item:
        path = local_path(item, base)
        return path, path
    raise DataError(f"{where}: image {k} is {type(item).__name__} {str(item)[:80]!r}; an image item is a path, raw "
                    "bytes or a {'bytes': ..., 'path': ...} dict")
