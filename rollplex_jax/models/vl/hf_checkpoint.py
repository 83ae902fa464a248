"""Read and write Qwen2.5-VL checkpoints in the Hugging Face safetensors layout.

A checkpoint directory holds ``config.json`` and either one ``model.safetensors``
or shards ``model-0000i-of-0000N.safetensors`` listed by
``model.safetensors.index.json`` (its ``weight_map`` maps tensor name -> shard).

A checkpoint's tensors are keyed by the names transformers 5 writes to disk
(``model.embed_tokens.weight``, ``model.layers.N.*``, ``visual.*``, ``lm_head.weight``); the
actor's parameters (``params.Params``) are in the engine's layout (fused q/k/v and gate/up,
padded vocabulary: ``fused.py``), converted exactly at load and save. Files may also use transformers'
in-memory spelling
(``model.language_model.*``, ``model.visual.*``); the loader accepts both. A Qwen3-VL checkpoint is written
in that spelling (``family.Family.transformers_names_on_disk``: transformers 5.25 has no name conversion for it).

Loading checks every tensor against ``checkpoint_specs(cfg)`` before reading any data
and raises one ``CheckpointError`` naming every missing, unexpected or misshapen
tensor. bfloat16 tensors are read as ``ml_dtypes.bfloat16`` numpy arrays (numpy
has no bf16 of its own). Saving keeps each parameter's dtype, so a checkpoint
loaded in its own dtype (in any layout) and saved again has byte-identical tensors.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" dtype, which safetensors' numpy reader needs)
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from rollplex_jax.config import ModelConfig
from rollplex_jax.models.family import family_of
from rollplex_jax.models.vl.fused import to_actor, to_hf
from rollplex_jax.models.vl.names import (
    normalize_name,  # noqa: F401  (re-exported)
    transformers_name,
)
from rollplex_jax.models.vl.params import Params, checkpoint_specs, param_specs

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_EMBED = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"



class CheckpointError(ValueError):
    """A checkpoint directory is incomplete or does not match its config; the message names what."""


def read_config(model_dir: str | os.PathLike, dtype: str | None = None) -> ModelConfig:
    """Reads ``config.json`` of a checkpoint directory.

    Args:
        model_dir: the checkpoint directory.
        dtype: overrides the dtype the config names ("float32" or "bfloat16").

    Returns:
        The ``ModelConfig``.

    Raises:
        CheckpointError: ``config.json`` is absent.
    """
    path = os.path.join(os.fspath(model_dir), CONFIG_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint config {path!r} does not exist")
    return ModelConfig.from_json_file(path, dtype=dtype)


def tensor_files(model_dir: str | os.PathLike) -> dict[str, str]:
    """Finds which file holds each tensor, from the files' own headers.

    Args:
        model_dir: the checkpoint directory.

    Returns:
        ``{tensor name as spelled in the file: path of the safetensors file}``.

    Raises:
        CheckpointError: no weights file; the index is malformed, names a shard that is not on
            disk, or lists a tensor its shard does not hold.
    """
    model_dir = os.fspath(model_dir)
    single = os.path.join(model_dir, SINGLE_FILE)
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(single):  # transformers prefers the single file too
        with safe_open(single, framework="np") as f:
            return {k: single for k in f.keys()}
    if not os.path.isfile(index):
        raise CheckpointError(f"checkpoint {model_dir!r} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint index {index!r} is not valid (needs a 'weight_map'): {e!r}") from None
    shards = sorted(set(weight_map.values()))
    absent = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
    if absent:
        raise CheckpointError(f"checkpoint {model_dir!r}: shard files listed in {INDEX_FILE} are missing: "
                              + ", ".join(absent))
    out: dict[str, str] = {}
    for shard in shards:
        path = os.path.join(model_dir, shard)
        with safe_open(path, framework="np") as f:
            out.update({k: path for k in f.keys()})
    unheld = sorted(f"{k} (in {s})" for k, s in weight_map.items() if k not in out)
    if unheld:
        raise CheckpointError(f"checkpoint {model_dir!r}: tensors listed in {INDEX_FILE} are missing from "
                              "their shard: " + ", ".join(unheld))
    return out


def check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], where: str, *, actor: bool = False) -> None:
    """Checks tensor names and shapes against ``checkpoint_specs(cfg)`` (``actor``: the actor's
    ``param_specs(cfg)``), reporting every problem at once.

    Args:
        cfg: the model config.
        shapes: ``{tensor name: shape}`` of what was found.
        where: what is being checked (a path), for the message.

    Raises:
        CheckpointError: naming every missing tensor, unexpected tensor and shape mismatch.
    """
    specs = param_specs(cfg) if actor else checkpoint_specs(cfg)
    missing = [k for k in specs if k not in shapes]
    extra = sorted(k for k in shapes if k not in specs)
    wrong = [f"{k} (expected {tuple(specs[k][0])}, found {tuple(shapes[k])})"
             for k in specs if k in shapes and tuple(shapes[k]) != tuple(specs[k][0])]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): " + ", ".join(missing))
    if wrong:
        problems.append(f"shape mismatches ({len(wrong)}): " + ", ".join(wrong))
    if extra:
        problems.append(f"unexpected tensors ({len(extra)}): " + ", ".join(extra))
    if problems:
        raise CheckpointError(f"{where} does not match its config: " + "; ".join(problems))


def _read(path: str, name: str) -> np.ndarray:
    with safe_open(path, framework="np") as f:
        return f.get_tensor(name)


def load_hf_checkpoint(model_dir: str | os.PathLike, dtype: str | None = None, *, fuse_groups: int = 1,
                       vocab_multiple: int = 1) -> tuple[ModelConfig, Params]:
    """Loads a Qwen2.5-VL Hugging Face checkpoint directory.

    Args:
        model_dir: a directory with ``config.json`` and ``model.safetensors`` or a sharded set
            indexed by ``model.safetensors.index.json``; tensor names in either transformers spelling.
        dtype: "float32" or "bfloat16" for the returned params (and config); default: the
            config's ``dtype`` / ``torch_dtype``.

    Returns:
        ``(cfg, params)``: params is ``{name: jax.Array}`` on the default device in the actor's layout,
        with exactly the names and shapes of ``param_specs(cfg)`` (``cfg`` carries ``fuse_groups`` and
        ``vocab_multiple``: ``fused.py``). A tied ``lm_head.weight`` found in the files is dropped (it must
        equal the embedding).

    Raises:
        CheckpointError: naming the missing config, missing shard, missing/unexpected/misshapen
            tensor, a tensor spelled twice, or a tied ``lm_head.weight`` differing from the embedding.
    """
    model_dir = os.fspath(model_dir)
    cfg = read_config(model_dir, dtype=dtype).with_param_layout(fuse_groups, vocab_multiple)
    located: dict[str, tuple[str, str]] = {}  # our name -> (file path, name in file)
    for raw, path in tensor_files(model_dir).items():
        name = normalize_name(raw)
        if name in located:
            raise CheckpointError(f"checkpoint {model_dir!r}: tensor {name!r} appears twice "
                                  f"(as {located[name][1]!r} and {raw!r})")
        located[name] = (path, raw)

    if cfg.tie_word_embeddings and _LM_HEAD in located and _EMBED in located:
        head, embed = _read(*located[_LM_HEAD]), _read(*located[_EMBED])
        if head.shape != embed.shape or head.dtype != embed.dtype or not np.array_equal(head, embed):
            raise CheckpointError(f"checkpoint {model_dir!r}: config ties word embeddings but {_LM_HEAD!r} "
                                  f"differs from {_EMBED!r}; untie the config or drop {_LM_HEAD!r}")
        del located[_LM_HEAD]

    by_file: dict[str, list[tuple[str, str]]] = {}  # file -> [(our name, name in file)], to open each once
    for name, (path, raw) in located.items():
        by_file.setdefault(path, []).append((name, raw))
    shapes = {}
    for path, names in by_file.items():
        with safe_open(path, framework="np") as f:
            shapes.update({name: tuple(f.get_slice(raw).get_shape()) for name, raw in names})
    check_shapes(cfg, shapes, f"checkpoint {model_dir!r}")

    dt = np.dtype(jnp.dtype(cfg.dtype))
    loaded: dict[str, np.ndarray] = {}
    for path, names in by_file.items():
        with safe_open(path, framework="np") as f:
            for name, raw in names:
                a = f.get_tensor(raw)
                loaded[name] = a if a.dtype == dt else a.astype(dt)
    actor = to_actor(loaded, cfg)
    return cfg, {name: jnp.asarray(actor.pop(name)) for name in param_specs(cfg)}


def _hf_config_dict(cfg: ModelConfig) -> dict:
    d = cfg.to_hf_dict()
    # transformers 5 types vision_config.tokens_per_second as int and rejects 2.0.
    tps = d["vision_config"].get("tokens_per_second")
    if isinstance(tps, float) and tps.is_integer():
        d["vision_config"]["tokens_per_second"] = int(tps)
    return d


def shard_names(names: list[str], nbytes: dict[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    """Splits tensors, in order, into shards of at most ``max_shard_bytes`` each.

    Args:
        names: tensor names in writing order.
        nbytes: byte size of each tensor.
        max_shard_bytes: the shard limit; None for one shard. A tensor larger than the
            limit gets a shard of its own.

    Returns:
        The list of shards, each a list of names.
    """
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        if max_shard_bytes is not None and shards[-1] and size + nbytes[name] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes[name]
    return shards


def _write_atomic(path: str, write) -> None:
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)


def save_hf_checkpoint(model_dir: str | os.PathLike, cfg: ModelConfig, params: Params,
                       max_shard_bytes: int | None = None) -> list[str]:
    """Writes a checkpoint directory that transformers' ``from_pretrained`` and ``load_hf_checkpoint`` read.

    Writes ``config.json`` and ``model.safetensors`` (metadata ``{"format": "pt"}``), or, when
    ``max_shard_bytes`` is given and the tensors exceed it, ``model-0000i-of-0000N.safetensors``
    plus ``model.safetensors.index.json``. Each tensor keeps its dtype (bf16 is written as BF16).
    Weight files of an earlier save in ``model_dir`` that this save does not rewrite are removed.

    Args:
        model_dir: the directory (created if absent).
        cfg: the model config, written as ``cfg.to_hf_dict()``.
        params: ``{name: array}`` with exactly the names and shapes of ``param_specs(cfg)`` (the actor's
            layout; written in the checkpoint's, ``fused.to_hf``).
        max_shard_bytes: the largest shard size in bytes; None for a single file.

    Returns:
        The names of the weight files written.

    Raises:
        CheckpointError: params do not match ``param_specs(cfg)`` (every problem named).
    """
    model_dir = os.fspath(model_dir)
    check_shapes(cfg, {k: tuple(v.shape) for k, v in params.items()}, "params to save", actor=True)
    os.makedirs(model_dir, exist_ok=True)
    hf = to_hf({k: np.asarray(jax.device_get(v)) for k, v in params.items()}, cfg)
    on_disk = transformers_name if family_of(cfg).transformers_names_on_disk else str  # Qwen3-VL: transformers'
    arrays = {on_disk(k): np.ascontiguousarray(hf[k]) for k in checkpoint_specs(cfg)}
    nbytes = {k: a.nbytes for k, a in arrays.items()}
    shards = shard_names(list(arrays), nbytes, max_shard_bytes)
    metadata = {"format": "pt"}

    written: list[str] = []
    if len(shards) == 1:
        _write_atomic(os.path.join(model_dir, SINGLE_FILE), lambda p: save_file(arrays, p, metadata=metadata))
        written.append(SINGLE_FILE)
    else:
        n = len(shards)
        weight_map = {}
        for i, names in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            part = {k: arrays[k] for k in names}
            _write_atomic(os.path.join(model_dir, fname), lambda p, part=part: save_file(part, p, metadata=metadata))
            weight_map.update({k: fname for k in names})
            written.append(fname)
        index = {"metadata": {"total_size": sum(nbytes.values()),
                              "total_parameters": sum(math.prod(a.shape) for a in arrays.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        _write_atomic(os.path.join(model_dir, INDEX_FILE), lambda p: _write_json(p, index))
    _write_atomic(os.path.join(model_dir, CONFIG_FILE), lambda p: _write_json(p, _hf_config_dict(cfg)))

    keep = set(written) | ({INDEX_FILE} if len(shards) > 1 else set())
    for fname in os.listdir(model_dir):
        if fname not in keep and (fname in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(fname)):
            os.remove(os.path.join(model_dir, fname))
    return written


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
