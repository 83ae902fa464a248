"""The run loop and what a run leaves behind.

- ``runner``: ``Runner``, the loop shared by ``launch.main`` and notebooks (build, resume, step, validate,
  checkpoint, finish);
- ``setup``: building a run (tokenizer, datasets, initial params and their placement, the engine);
- ``validation``: greedy/sampled validation during training; ``checkpoint``: orbax save/restore;
- ``summary``: the fields of ``run_summary.json``; ``outputs``: metrics.jsonl, TensorBoard, plots;
- ``compiles``: XLA compilations per step and why a late step compiled; ``compile_cache``: the persistent
  compilation cache (``--compilation_cache_dir``).
"""
