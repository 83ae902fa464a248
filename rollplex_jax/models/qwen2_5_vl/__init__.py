"""Qwen2.5-VL in JAX: parameters in HF layout, vision tower, M-RoPE decoder, prefix/suffix split."""
