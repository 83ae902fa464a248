"""GRPO math: advantage estimators, PPO/KL losses and loss weights (pure jax.numpy), and host-side rewards."""
