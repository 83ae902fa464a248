"""Prompts from disk to arrays: image preprocessing (Qwen smart_resize + patches), tokenizers and the chat
rendering, datasets (JSONL rows checked at load from their lines and image headers, images decoded per batch
through a byte-bounded patch cache, collation into ``Prompts``), the prompt sampler and the synthetic tasks."""
