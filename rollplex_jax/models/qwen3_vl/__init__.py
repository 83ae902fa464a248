"""Qwen3-VL (dense): what differs from Qwen2.5-VL (``docs/qwen3_vl_survey.md``); the rest is shared."""
