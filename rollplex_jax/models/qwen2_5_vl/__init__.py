"""Qwen2.5-VL: what is its own, the vision tower (windowed attention, gated MLP, RMSNorm blocks); the rest is the
shared vision-language code in ``models/vl/``, as for ``models/qwen3_vl/``."""
