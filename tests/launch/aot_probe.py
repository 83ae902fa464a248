"""Planned vs compiled bytes of a cut-down Qwen2.5-VL-32B (its widths, fewer layers and 2 vision blocks) on a
chosen mesh: how the planner's tensor-parallel and FSDP terms were checked (a probe, not a test).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m tests.launch.aot_probe --fsdp=1 --tp=8 --layers=16
  (--full: the flagfile's batch and lengths instead of 1 prompt per fsdp group of 2,048 tokens, 1,536 vision)

Prints one JSON line: per program XLA's temp/argument/output GiB, per phase compiled and planned JAX bytes.
"""

import argparse
import dataclasses
import json

from launch.api import config_from_flagfile
from rollplex_jax.memory import aot, planner

GiB = 2**30


def probe_config(fsdp: int, tp: int, layers: int, full: bool):
    cfg = config_from_flagfile("configs/qwen2_5_vl_32b_h800x32.flags")
    m = cfg.model
    model = dataclasses.replace(m, text=dataclasses.replace(m.text, num_hidden_layers=layers),
                                vision=dataclasses.replace(m.vision, depth=2, fullatt_block_indexes=(1,)))
    mesh = dataclasses.replace(cfg.mesh, train_dp=1, train_fsdp=fsdp, train_tp=tp, rollout_tp=min(tp, 4))
    rl = cfg.rl if full else dataclasses.replace(cfg.rl, batch_prompts=fsdp, micro_batch=4 if fsdp > 1 else 1)
    cfg = dataclasses.replace(cfg, model=model, mesh=mesh, rl=rl)
    lengths = planner.Lengths.from_config(cfg) if full else planner.Lengths(2048, 1536, 256, source="probe")
    return cfg, lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fsdp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--full", action="store_true")
    a = ap.parse_args()
    cfg, lengths = probe_config(a.fsdp, a.tp, a.layers, a.full)
    c = aot.compiled_memory(cfg, lengths, policy="offload")
    p = planner.plan(cfg, lengths, None, optimizer_policy="offload")
    print(json.dumps({
        "fsdp": a.fsdp, "tp": a.tp, "layers": a.layers, "full": a.full,
        "programs": {k: {"temp": round(v.temp / GiB, 4), "arg": round(v.argument / GiB, 4),
                         "out": round(v.output / GiB, 4)} for k, v in c.programs.items()},
        "compiled": {ph: round(b / GiB, 3) for ph, b in c.phase_bytes.items()},
        "planned": {ph: round(p.jax_bytes("rollplex", ph) / GiB, 3) for ph in c.phase_bytes}}))


if __name__ == "__main__":
    main()
