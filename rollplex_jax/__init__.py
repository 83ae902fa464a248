"""Rollplex-JAX: the trainer. Actor and reference programs in JAX, the RL step per schedule, the run loop.

Data flows: ``data/`` (prompts) -> ``scheduler`` (one RL step: rollout through ``rollout_torch`` over
views of the actor's weights, rewards, reference, advantages, updates; ``step_ops`` per schedule) with
``programs/`` (jit programs) over ``models/`` (Qwen2.5-VL) and ``rl/`` (pure math); ``runner`` runs the
loop (``run_setup``, ``run_memory``, ``run_summary``); ``sharing`` + ``engine_layouts`` bind the engine;
``mesh``, ``multihost``, ``distributed`` place it on devices and processes; ``memory``, ``planner``,
``simulator``, ``hardware`` measure and predict; ``trace``, ``outputs``, ``checkpoint`` write what a run
leaves behind. Flag parsing lives in ``launch/``.
"""
