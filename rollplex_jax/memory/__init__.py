"""Device memory: measured, planned and compiled.

- ``classes``: buffer classes x phases x policies (one vocabulary for the meter and the planner);
- ``meter``: live device bytes per phase and class at run time (``MemoryMeter``);
- ``planner``: per-device bytes per phase and class predicted from a config (naive vs rollplex);
- ``policy``: the optimizer policy under ``--hbm_budget`` and the run's memory report;
- ``aot``: the real programs compiled ahead of time on abstract inputs (XLA's memory analysis).
"""
