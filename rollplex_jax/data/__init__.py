"""Prompts from disk to arrays: image preprocessing (Qwen smart_resize + patches), tokenizers and the chat
rendering, datasets (JSONL rows, validation, collation into ``Prompts``) and the built-in synthetic tasks."""
