#!/bin/bash
# Real SLURM on this machine: installs Debian's SLURM + munge (if missing), configures a one-node cluster on
# loopback (state, logs and config under a temp dir), starts munged, slurmctld and slurmd, runs a 2-task job, and
# tears everything down again (also on failure, printing the daemons' logs).
#
#   tests/slurm/run_slurm_test.sh                      # sbatch --wait: srun -n 2 python tests/slurm/psum_check.py
#   tests/slurm/run_slurm_test.sh CMD [ARGS...]        # sbatch --wait: srun -n 2 CMD ARGS...
#   tests/slurm/run_slurm_test.sh --sbatch FILE [ARGS] # sbatch --wait FILE ARGS (e.g. launch/slurm/rollplex.sbatch)
#
# Environment: PYTHON (default .venv/bin/python), NTASKS (2), DEVICES_PER_TASK (2 fake CPU devices),
# SLURM_TEST_TIMEOUT (job time limit in minutes, 10), SBATCH_OPTS (extra sbatch options), KEEP=1 (keep the temp
# dir), SLURM_TEST_DIR (use this dir instead of a new temp dir). The job's stdout is printed; with the default
# command each task's JSON line is checked (psum across processes equals the expected sum).
# Needs root (apt-get, daemons as root). Exit status: the job's.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "${REPO}"
PYTHON="${PYTHON:-${REPO}/.venv/bin/python}"
NTASKS="${NTASKS:-2}"
DEVICES_PER_TASK="${DEVICES_PER_TASK:-2}"
T0="${EPOCHREALTIME}"
elapsed() { awk -v a="${T0}" -v b="${EPOCHREALTIME}" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "[slurm-test $(elapsed)s] $*" >&2; }

SBATCH_FILE=""
if [[ "${1:-}" == "--sbatch" ]]; then
  SBATCH_FILE="$2"
  shift 2
fi
DEFAULT_CMD=0
if [[ -z "${SBATCH_FILE}" && $# -eq 0 ]]; then
  DEFAULT_CMD=1
  set -- "${PYTHON}" "${REPO}/tests/slurm/psum_check.py"
fi

# --- install ---------------------------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v srun >/dev/null \
   || ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  PKGS=(slurmctld slurmd slurm-client munge)
  if ! apt-get install -y -q --no-install-recommends "${PKGS[@]}" >/tmp/slurm-test-apt.log 2>&1; then
    apt-get update -q >>/tmp/slurm-test-apt.log 2>&1 || true
    apt-get install -y -q --no-install-recommends "${PKGS[@]}" >>/tmp/slurm-test-apt.log 2>&1 \
      || { tail -30 /tmp/slurm-test-apt.log >&2; log "FAILED: apt-get install"; exit 1; }
  fi
  log "installed: $(slurmctld -V)"
fi

# --- config ----------------------------------------------------------------------------------------------------
D="${SLURM_TEST_DIR:-$(mktemp -d /tmp/rollplex-slurm.XXXXXX)}"
mkdir -p "${D}/state" "${D}/spool" "${D}/munge" "${D}/out"
HOST="$(hostname -s)"
NCPU="$(nproc)"
(( NCPU < NTASKS )) && NCPU="${NTASKS}"  # CPUs= in slurm.conf may exceed the real count (a warning only)
free_port() { "${PYTHON}" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CTLD_PORT="$(free_port)"
SLURMD_PORT="$(free_port)"
export SLURM_CONF="${D}/slurm.conf"
cat >"${SLURM_CONF}" <<EOF
ClusterName=rollplex-test
SlurmctldHost=${HOST}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
MailProg=/bin/true
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${D}/munge/munge.socket
StateSaveLocation=${D}/state
SlurmdSpoolDir=${D}/spool
SlurmctldPidFile=${D}/slurmctld.pid
SlurmdPidFile=${D}/slurmd.pid
SlurmctldLogFile=${D}/slurmctld.log
SlurmdLogFile=${D}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=60
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${NCPU} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
# No cgroups anywhere (proctrack/linuxproc, task/none); an explicit cgroup.conf keeps slurmd from probing them.
# (no cgroup.conf: slurm 22.05 has no CgroupPlugin=disabled; see below)

PIDS=()
STATUS=1
dump_logs() {
  for f in "${D}/munged.log" "${D}/slurmctld.log" "${D}/slurmd.log" "${D}/slurmctld.stderr" "${D}/slurmd.stderr"; do
    [[ -s "${f}" ]] && { echo "----- ${f} (last 40 lines)" >&2; tail -40 "${f}" >&2; }
  done
  return 0
}
teardown() {
  local rc=$?
  [[ "${STATUS}" -ne 0 ]] && { log "FAILED (rc ${rc}); daemon logs:"; dump_logs; }
  if [[ -n "${CTLD_STARTED:-}" ]]; then scancel --full --quiet -u root 2>/dev/null || true; fi
  local i
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do kill "${PIDS[i]}" 2>/dev/null || true; done
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    for _ in $(seq 50); do kill -0 "${PIDS[i]}" 2>/dev/null || break; sleep 0.1; done
    kill -9 "${PIDS[i]}" 2>/dev/null || true
  done
  if [[ "${KEEP:-0}" == 1 || -n "${SLURM_TEST_DIR:-}" ]]; then log "kept ${D}"; else rm -rf "${D}"; fi
  log "daemons stopped; total $(elapsed)s"
}
trap teardown EXIT
trap 'exit 130' INT TERM

# --- daemons ---------------------------------------------------------------------------------------------------
# munged: own key and socket under ${D}; run as root (--force: it refuses root and foreign-owned dirs otherwise).
dd if=/dev/urandom of="${D}/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "${D}/munge"
chmod 400 "${D}/munge/munge.key"
munged --foreground --force --key-file="${D}/munge/munge.key" --socket="${D}/munge/munge.socket" \
  --pid-file="${D}/munge/munged.pid" --log-file="${D}/munged.log" --seed-file="${D}/munge/munged.seed" \
  >"${D}/munged.stderr" 2>&1 &
PIDS+=($!)
for _ in $(seq 50); do [[ -S "${D}/munge/munge.socket" ]] && break; sleep 0.1; done
munge --socket="${D}/munge/munge.socket" -n </dev/null | unmunge --socket="${D}/munge/munge.socket" >/dev/null \
  || { log "munge round trip failed"; cat "${D}/munged.stderr" >&2; exit 1; }
log "munged up"

slurmctld -D -i -f "${SLURM_CONF}" >"${D}/slurmctld.stderr" 2>&1 &
PIDS+=($!)
CTLD_STARTED=1
slurmd -D -f "${SLURM_CONF}" -N "${HOST}" >"${D}/slurmd.stderr" 2>&1 &
PIDS+=($!)

for _ in $(seq 300); do
  STATE="$(sinfo -h -N -n "${HOST}" -o '%T' 2>/dev/null || true)"
  [[ "${STATE}" == "idle" ]] && break
  for p in "${PIDS[@]}"; do kill -0 "${p}" 2>/dev/null || { log "a daemon exited (pid ${p})"; exit 1; }; done
  sleep 0.2
done
[[ "${STATE:-}" == "idle" ]] || { log "node ${HOST} not idle after 60 s (state '${STATE:-}')"; sinfo -N -l >&2 || true; exit 1; }
log "cluster up: node ${HOST} idle (${NCPU} CPUs)"

# --- job -------------------------------------------------------------------------------------------------------
export JAX_PLATFORMS=cpu
export XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_TASK}"
export TOKENIZERS_PARALLELISM=false
export PYTHON
OUT="${D}/out/job-%j.out"
# shellcheck disable=SC2086  # SBATCH_OPTS is a list of options
COMMON=(--parsable --nodes=1 --ntasks="${NTASKS}" --ntasks-per-node="${NTASKS}" --cpus-per-task=1
        --time="${SLURM_TEST_TIMEOUT:-10}" --output="${OUT}" --chdir="${REPO}" ${SBATCH_OPTS:-})
if [[ -n "${SBATCH_FILE}" ]]; then
  log "sbatch ${SBATCH_FILE} $*"
  # no GPUs on this test node: override the script's --gpus-per-node
  JOB="$(sbatch --gpus-per-node=0 "${COMMON[@]}" "${SBATCH_FILE}" "$@")"
else
  printf -v QUOTED ' %q' "$@"
  log "sbatch: srun -n ${NTASKS}${QUOTED}"
  JOB="$(sbatch "${COMMON[@]}" --wrap="srun --kill-on-bad-exit=1 --ntasks=${NTASKS}${QUOTED}")"
fi
JOB="${JOB%%;*}"
# Poll (sbatch --wait polls every 10 s); a requeued job (preemption) goes back to PENDING and runs again.
# SLURM_TEST_ON_RUNNING, if set, is evaluated once when the job first runs for >= SLURM_TEST_ON_RUNNING_AFTER s
# (e.g. to simulate the time-limit signal: 'scancel --batch --signal=USR1 $JOB').
RUNNING_SINCE=""
while true; do
  INFO="$(scontrol -o show job "${JOB}" 2>/dev/null || true)"
  STATE="$(sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p' <<<"${INFO}")"
  case "${STATE}" in
    COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) break ;;
    "") log "job ${JOB} vanished from slurmctld"; exit 1 ;;
    RUNNING)
      if [[ -n "${SLURM_TEST_ON_RUNNING:-}" ]]; then
        RUNNING_SINCE="${RUNNING_SINCE:-${SECONDS}}"
        if (( SECONDS - RUNNING_SINCE >= ${SLURM_TEST_ON_RUNNING_AFTER:-0} )); then
          log "job ${JOB} running: ${SLURM_TEST_ON_RUNNING}"
          eval "${SLURM_TEST_ON_RUNNING}"
          SLURM_TEST_ON_RUNNING=""
        fi
      fi ;;
  esac
  sleep 0.5
done
EXIT_CODE="$(sed -n 's/.* ExitCode=\([0-9]*\):\([0-9]*\).*/\1 \2/p' <<<"${INFO}")"
read -r RC SIG <<<"${EXIT_CODE:-1 0}"
(( SIG != 0 && RC == 0 )) && RC=$((128 + SIG))
[[ "${STATE}" == COMPLETED ]] || (( RC != 0 )) || RC=1
JOB_OUT="${D}/out/job-${JOB}.out"
log "job ${JOB} ${STATE}: rc ${RC}, restarts $(sed -n 's/.* Restarts=\([0-9]*\).*/\1/p' <<<"${INFO}")"
if [[ -f "${JOB_OUT}" ]]; then
  echo "----- job ${JOB} output" >&2
  cat "${JOB_OUT}"
fi
[[ "${RC}" -eq 0 ]] || exit "${RC}"

if [[ "${DEFAULT_CMD}" -eq 1 ]]; then
  grep '^{' "${JOB_OUT}" | "${PYTHON}" -c '
import json, sys
rows = [json.loads(line) for line in sys.stdin]
n, d = int(sys.argv[1]), int(sys.argv[2])
assert len(rows) == n, f"expected {n} JSON lines, got {len(rows)}"
assert sorted(r["process_index"] for r in rows) == list(range(n)), rows
for r in rows:
    assert r["process_count"] == n and r["device_count"] == n * d and r["source"] == "slurm", r
    assert r["sum"] == r["psum"] == r["expected"], r
print("OK: %d SLURM tasks x %d CPU devices, one jax.distributed job: psum %s, coordinator %s"
      % (n, d, rows[0]["psum"], rows[0]["coordinator"]))
' "${NTASKS}" "${DEVICES_PER_TASK}"
fi
STATUS=0
