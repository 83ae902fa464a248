"""Rollout engines in PyTorch whose weights are the actor's buffers (DLPack): transformers everywhere, vLLM where
installed. Knows nothing of JAX or of ``rollplex_jax``: it receives its tensor layout (``rollplex_contract``)
and DLPack-capable arrays, and returns ``Rollouts``."""
