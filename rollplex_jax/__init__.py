"""Rollplex-JAX: the trainer. Actor and reference programs in JAX, the RL step per schedule, the run loop.

Parts, top to bottom (each imports only the parts below it: ``tests/test_layout_rules.py``):

- ``run/``: the loop shared by ``launch.main`` and notebooks (set-up, validation, checkpoints, outputs);
- ``step/``: one RL step per schedule (rollout through ``rollout_torch`` over views of the actor's weights,
  rewards, reference, advantages, updates), its ops and metrics;
- ``sim/``: the step-time simulator and hardware presets;
- ``memory/``: buffer classes, the live meter, the planner, the memory policy, ahead-of-time compiles;
- ``weights/``: the engines' layouts and the weight publisher (views, rebuilt buffers, refill);
- ``programs/``: the jit programs (serial actor/reference, prefix/suffix split, chunked optimizer);
- ``parallel/``: meshes, jax.distributed, the multi-process step, memory kinds, threads;
- ``models/``: Qwen2.5-VL in JAX and the shared attention kernels;
- ``rl/``: advantages, losses, rewards, graders (pure math, no model);
- ``data/``: sources, rows, images, videos, tokenizer, synthetic tasks;
- ``config/``: the frozen config tree;
- ``trace.py``: phase spans on lanes (the step writes them, the run draws them).

Flag parsing lives in ``launch/``.
"""
