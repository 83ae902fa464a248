"""Models in JAX, as functions of (params, config, inputs): the shared vision-language code (``vl/``), each
family's own vision tower (``qwen2_5_vl/``, ``qwen3_vl/``) and what differs between them (``family.py``)."""
