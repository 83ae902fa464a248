"""Models in JAX, as functions of (params, config, inputs): today Qwen2.5-VL (``qwen2_5_vl/``)."""
