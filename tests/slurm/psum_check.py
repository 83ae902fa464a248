"""One process of a multi-process JAX check: start jax.distributed (rollplex_jax.parallel.distributed), build one global
mesh over every process's devices, make a global array from per-process data, reduce it with a jitted sum and a
shard_map psum across processes, print one JSON line.

  python tests/slurm/psum_check.py --coordinator_address=127.0.0.1:PORT --num_processes=2 --process_id=I
  srun -n 2 python tests/slurm/psum_check.py        # settings from SLURM's environment

Run with XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu for 2 fake CPU devices each.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator_address")
    parser.add_argument("--num_processes", type=int)
    parser.add_argument("--process_id", type=int)
    parser.add_argument("--timeout_s", type=int, default=60)
    args = parser.parse_args()

    from rollplex_jax.parallel import distributed

    spec = distributed.detect(args.coordinator_address, args.num_processes, args.process_id)
    index, count = distributed.initialize(spec, timeout_s=args.timeout_s)
    assert distributed.initialize(spec) == (index, count)  # idempotent

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    n_local = jax.local_device_count()
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    # Rows of the global [n_devices * 2, 3] array: this process holds its own contiguous block, row r = r.
    rows_per_process = 2 * n_local
    start = index * rows_per_process
    local = np.arange(start, start + rows_per_process, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    x = jax.make_array_from_process_local_data(sharding, local)

    total = jax.jit(lambda a: jnp.sum(a), out_shardings=NamedSharding(mesh, P()))(x)

    def per_shard(a):
        return jax.lax.psum(jnp.sum(a, keepdims=True), "data")

    psum = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
    n_rows = x.shape[0]
    result = {
        "process_index": index,
        "process_count": count,
        "device_count": jax.device_count(),
        "local_device_count": n_local,
        "global_shape": list(x.shape),
        "sum": float(np.asarray(total.addressable_data(0))),
        "psum": float(np.asarray(psum.addressable_data(0)).reshape(-1)[0]),
        "expected": float(3 * n_rows * (n_rows - 1) / 2),
        "source": spec.source if spec else None,
        "coordinator": spec.coordinator_address if spec else None,
        "hostname": os.uname().nodename,
    }
    print(json.dumps(result), flush=True)
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
