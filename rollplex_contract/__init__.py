"""What the trainer (``rollplex_jax``) and the rollout engines (``rollout_torch``) exchange, and nothing else.

Both packages import this one; it imports neither (nor JAX, nor torch: numpy and the standard library only),
so the dependency arrows point one way: ``launch -> rollplex_jax -> rollout_torch -> rollplex_contract`` and
``rollplex_jax -> rollplex_contract``.

- ``batch``: a step's prompts, how to sample, the rollouts that come back, and the ``Engine`` protocol;
- ``layout``: how an engine's weight tensors are made of the actor's training shards (boxes, the
  aligned / view / rebuilt classes, one engine rank's ``RankTensor`` list, ``Shard``, ``SharingReport``).
"""
