"""Sharing the actor's weights with the rollout engine.

- ``engine_layouts``: each engine's tensors (transformers, vLLM, vLLM text, TP) in our parameter names;
- ``sharing``: ``WeightPublisher`` (classify the engine's layout against the params' shardings, bind views,
  release before donation, refill rebuilt buffers after the update) and the per-device classification.
"""
