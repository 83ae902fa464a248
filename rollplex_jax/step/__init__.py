"""One RL step per schedule: rollout, rewards, reference, advantages, updates.

- ``rl_step``: ``serial_step`` and ``rollplex_step`` (the shared order of a step), ``sample`` (publish ->
  generate -> release), the mini-batch update loop;
- ``ops``: the ``Ops`` protocol each schedule implements, and ``SerialOps`` (full sequences);
- ``rollplex_ops``: ``RollplexOps`` (prefix programs during the decode, suffix scoring and gradients);
- ``metrics``: verl / EasyR1 per-step metric names computed from a step's data.
"""
