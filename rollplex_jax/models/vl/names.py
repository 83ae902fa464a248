"""Parameter naming of checkpoints and of transformers' in-memory model (pure strings, no JAX import).

Our parameter names are a Qwen2.5-VL checkpoint's on-disk names (``model.layers.N...``,
``visual.blocks.N...``, ``lm_head.weight``). transformers 5 keeps the modules under other
names in memory (``model.language_model.*``, ``model.visual.*``).
"""

from __future__ import annotations

_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def normalize_name(name: str) -> str:
    """Maps a tensor name in either transformers spelling to our parameter name.

    Args:
        name: e.g. ``model.language_model.layers.0.mlp.up_proj.weight`` or ``model.layers.0.mlp.up_proj.weight``.

    Returns:
        The on-disk name (``model.layers.0.mlp.up_proj.weight``, ``visual.blocks.0...``).
    """
    for src, dst in _PREFIXES:
        if name.startswith(src):
            return dst + name[len(src):]
    return name


def transformers_name(name: str) -> str:
    """Our (on-disk) parameter name -> transformers 5's in-memory name (what the transformers engine binds).

    ``model.layers.0.mlp.up_proj.weight`` -> ``model.language_model.layers.0.mlp.up_proj.weight``;
    ``visual.blocks.0...`` -> ``model.visual.blocks.0...``; ``lm_head.weight`` unchanged (a name already in
    transformers' spelling maps to itself).
    """
    name = normalize_name(name)
    for mem, disk in _PREFIXES:
        if name.startswith(disk):
            return mem + name[len(disk):]
    return name

