"""One process per device on one machine, without SLURM: what ``torchrun --nproc-per-node`` is to torch.

  python -m launch.local [--nproc=N] [--cpu] -- --flagfile=configs/my_run.flags [--more launch.main flags]

Why: a process runs one rollout engine, on its first device (issue 33). One process driving a box's 8 GPUs
decodes every prompt on one of them while seven wait; 8 processes of one device each decode an eighth each, and
form one jax.distributed job over one mesh (the training is the same: tested, ``tests/test_multiprocess.py``).
The SLURM script starts that layout on clusters; this starts it on one machine.

What it does: starts N ``python -m launch.main`` processes with ``--coordinator_address`` (a free local port),
``--num_processes=N`` and ``--process_id=i``; process i sees only GPU i (``CUDA_VISIBLE_DEVICES``, out of the
GPUs visible to this launcher), or with ``--cpu`` one fake CPU device (``XLA_FLAGS``), so ``--train_dp x
--train_fsdp x --train_tp`` must be N. SIGTERM / SIGINT are forwarded to every process (``launch.main`` then
checkpoints and stops); when one process fails, the others are stopped (``--heartbeat_timeout_s`` would end them
too, later). Exits with the first failing process's code, else 0. ``N`` defaults to the visible GPUs
(``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

_NPROC = flags.DEFINE_integer("nproc", 0, "Processes to start, one per device (0: the visible GPUs).", lower_bound=0)
_CPU = flags.DEFINE_bool("cpu", False, "One fake CPU device per process (JAX_PLATFORMS=cpu), e.g. to try the layout "
                         "on a laptop or in tests.")


def visible_gpus(environ=os.environ) -> list[str]:
    """The GPUs this launcher may hand out: CUDA_VISIBLE_DEVICES's entries, else one per ``nvidia-smi -L`` line."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def with_device_count(xla_flags: str, devices: int) -> str:
    """``xla_flags`` (an XLA_FLAGS value) with its fake CPU device count replaced by ``devices``, the rest kept."""
    keep = [f for f in xla_flags.split() if "xla_force_host_platform_device_count" not in f]
    return " ".join([*keep, f"--xla_force_host_platform_device_count={devices}"])


def child_env(i: int, gpus: list[str], cpu: bool, environ=os.environ) -> dict:
    """Process i's environment: GPU i alone, or one fake CPU device."""
    env = dict(environ)
    if cpu:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=with_device_count(env.get("XLA_FLAGS", ""), 1))
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpus[i]
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(procs: list[subprocess.Popen]) -> int:
    """Waits for every process; when one fails, stops the rest; the first failure's code, else 0."""
    code = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and not code:
            code = failed[0]
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.2)
    return code or next((p.returncode for p in procs if p.returncode), 0)


def main(argv):
    args = argv[1:]
    gpus = [] if _CPU.value else visible_gpus()
    n = _NPROC.value or len(gpus)
    if not n:
        raise app.UsageError("no GPU visible (CUDA_VISIBLE_DEVICES, nvidia-smi): give --nproc=N with --cpu")
    if not _CPU.value and n > len(gpus):
        raise app.UsageError(f"--nproc={n} but {len(gpus)} GPUs are visible: one process per GPU")
    port = _free_port()
    cmd = [sys.executable, "-m", "launch.main", *args, f"--coordinator_address=127.0.0.1:{port}",
           f"--num_processes={n}"]
    procs = [subprocess.Popen([*cmd, f"--process_id={i}"], env=child_env(i, gpus, _CPU.value)) for i in range(n)]

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    sys.exit(_wait(procs))


if __name__ == "__main__":
    app.run(main)
