"""The code both model families share (``models/family.py`` says what differs): parameters in the HF layout, the
M-RoPE decoder, inputs, packing, vision chunks, full / prefix / suffix forwards, checkpoints. Each family's vision
tower lives in its own package (``models/qwen2_5_vl/``, ``models/qwen3_vl/``)."""
