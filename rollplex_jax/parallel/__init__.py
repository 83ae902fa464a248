"""Where the work runs: devices, processes, memory kinds and threads.

- ``mesh``: the training mesh (fsdp x tp), logical-axis rules, parameter shardings, the start-up check;
- ``distributed``: jax.distributed start (flags or SLURM), gloo on CPU;
- ``multihost``: each process's share of the prompts, all-gathers, the replicated engine copy;
- ``memory_kinds``: pytrees between device and pinned host memory (the offloaded optimizer state);
- ``threads``: torch's thread count for a CPU decode beside XLA's pool.
"""
