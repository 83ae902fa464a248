#!/bin/bash
# `make test-slurm`: the tiny CPU config trained for real through SLURM (launch/slurm/rollplex.sbatch: srun with
# 2 tasks x 2 fake CPU devices = one jax.distributed job on a one-node cluster on loopback, run_slurm_test.sh), and
# the same flags in one process with 4 devices; the two runs must end with the same params_sha256.
# Needs root (apt-get installs SLURM + munge when missing; the daemons run as root).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${REPO}"
PYTHON="${PYTHON:-${REPO}/.venv/bin/python}"
D="$(mktemp -d /tmp/rollplex-slurm-train.XXXXXX)"
trap 'rm -rf "${D}"' EXIT
FLAGS=(--steps=3 --train_fsdp=2 --train_tp=2 --batch_prompts=4 --group_size=4 --micro_batch=8 --synthetic_n=64
       --eval_n=16 --checkpoint_every=1 --noprogress --reward=launch.bench_reward:varied_reward)

echo "[check_training] one process, 4 devices" >&2
XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu "${PYTHON}" -m launch.main \
  --flagfile=configs/tiny_cpu.flags --workdir="${D}/one" "${FLAGS[@]}" > "${D}/one.json"

echo "[check_training] sbatch launch/slurm/rollplex.sbatch: srun 2 tasks x 2 devices" >&2
JAX_PLATFORMS=cpu WORKDIR="${D}/two" FLAGFILE=configs/tiny_cpu.flags NTASKS=2 DEVICES_PER_TASK=2 PYTHON="${PYTHON}" \
  tests/slurm/run_slurm_test.sh --sbatch launch/slurm/rollplex.sbatch "${FLAGS[@]}"

"${PYTHON}" - "${D}" <<'PY'
import json, sys
d = sys.argv[1]
one = json.loads(open(f"{d}/one.json").read().strip().splitlines()[-1])
two = json.load(open(f"{d}/two/run_summary.json"))
print(json.dumps({"one_process": {k: one[k] for k in ("steps_done", "params_sha256")},
                  "slurm_2_tasks": {k: two.get(k) for k in ("steps_done", "params_sha256", "processes")}}))
assert two["processes"] == 2, two.get("processes")
assert two["steps_done"] == one["steps_done"] == 3
assert two["params_sha256"] == one["params_sha256"], "SLURM 2-task run differs from the 1-process run"
print("[check_training] OK: the SLURM run equals the single-process run", file=sys.stderr)
PY
