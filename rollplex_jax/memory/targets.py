"""GPU targets for ahead-of-time compiles without a GPU: XLA's GPU compiler on fake devices of a named card.

``launch.plan --compile --target=h100`` compiles the run's programs with XLA's GPU compiler, so the memory
figures are those of the program a GPU runs (not the CPU's, whose attention blocks, compiler options and dtype
handling differ: ``models/platform.py``). The recipe (issue 31; jax-ml/jax#28376, openxla/xla#16913 and #25919):
the CUDA PJRT plugin of the same version as jax with ``ptxas`` from ``nvidia-cuda-nvcc-cu12`` (the ``gpu-aot``
extra; ``make gpu-aot`` installs them into ``<venv>/gpu-aot``, off the path, so that other commands on a machine
without CUDA do not meet the plugin's failed driver check at every start: ``use_plugin`` puts it on the path),
JAX's platforms limited to the CPU (the plugin then skips its driver check), and
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<GpuTargetConfig text proto>,
topology="1 x hosts x devices per host")``, whose devices take ``jax.jit(...).lower(...).compile()`` and answer
``memory_analysis()`` with XLA GPU's own buffer assignment.

The device descriptions are the cards' published figures (SM count, clocks, memory, caches; the H100's proto as
in jax-ml/jax#28376), ``device_memory_size`` the card's usable memory (XLA's scheduler reads it). Without a device
there is no autotuning (default GEMM tiles) and runtime-side allocations (NCCL buffers, cuBLAS / cuDNN
workspaces and handles, allocator slack) are outside ``memory_analysis``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import sys

PLUGIN = "jax-cuda12-plugin"
DNN_VERSION = (9, 7)  # the cuDNN the target config declares (dnn_version_info) and cuDNN attention lowers for
SIDE_DIR = os.path.join(sys.prefix, "gpu-aot")  # where ``make gpu-aot`` installs the plugin (off the path)
INSTALL_HINT = ("compiling for a GPU target needs the CUDA PJRT plugin of this jax version and ptxas: "
                f"`make gpu-aot` (into {SIDE_DIR}), or pip install -e '.[gpu-aot]'")


@dataclasses.dataclass(frozen=True)
class Target:
    """A card XLA's GPU compiler can compile for without one: its name, compute capability, memory and the
    figures of its ``gpu_device_info``."""

    key: str
    name: str
    capability: tuple[int, int]
    memory_bytes: int
    cores: int
    clock_ghz: float
    bandwidth: int  # bytes/s
    l2_bytes: int
    smem_per_core: int
    smem_optin: int

    def config_proto(self) -> str:
        """The ``GpuTargetConfig`` text proto ``topologies.get_topology_desc`` takes."""
        major, minor = self.capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.smem_per_core}
  threads_per_core_limit: 2048
  core_count: {self.cores}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {self.bandwidth}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.smem_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {DNN_VERSION[0]} minor: {DNN_VERSION[1]} }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{self.name}"
"""

    def to_dict(self) -> dict:
        return {"target": self.key, "device": self.name, "compute_capability": ".".join(map(str, self.capability)),
                "device_memory_bytes": self.memory_bytes}


_HOPPER = dict(capability=(9, 0), cores=132, clock_ghz=1.98, l2_bytes=52428800, smem_per_core=233472,
               smem_optin=232448)
TARGETS = {
    "h100": Target("h100", "NVIDIA H100 80GB HBM3", memory_bytes=84929347584, bandwidth=3352320000000, **_HOPPER),
    "h800": Target("h800", "NVIDIA H800", memory_bytes=84929347584, bandwidth=3352320000000, **_HOPPER),
    "h200": Target("h200", "NVIDIA H200", memory_bytes=150011707392, bandwidth=4800000000000, **_HOPPER),
    "a100": Target("a100", "NVIDIA A100-SXM4-80GB", capability=(8, 0), memory_bytes=85198045184, cores=108,
                   clock_ghz=1.41, bandwidth=2039000000000, l2_bytes=41943040, smem_per_core=167936,
                   smem_optin=166912),
}


def target(key: str) -> Target:
    """The target named ``key`` (``TARGETS``), or a ValueError naming the choices."""
    if key not in TARGETS:
        raise ValueError(f"--target={key}: unknown; choose cpu or one of {', '.join(TARGETS)}")
    return TARGETS[key]


def use_plugin() -> None:
    """Makes the plugin visible to JAX before its backends start: ``SIDE_DIR`` on the path (unless the plugin is
    installed already) and JAX's platforms limited to the CPU (unless the backends started, or a platform was
    asked for), so the plugin registers without looking for a driver. Call before any JAX operation."""
    import jax

    if plugin_version() is None and os.path.isdir(SIDE_DIR) and SIDE_DIR not in sys.path:
        sys.path.append(SIDE_DIR)
        importlib.invalidate_caches()
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")


def plugin_version() -> str | None:
    """The installed CUDA PJRT plugin's version, or None."""
    try:
        return importlib.metadata.version(PLUGIN)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict:
    """jax, jaxlib and the CUDA plugin versions (None where absent), for a compile's JSON."""
    import jax
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, PLUGIN: plugin_version()}


def devices(t: Target, n: int, per_host: int = 8) -> list:
    """``n`` fake devices of ``t`` (a topology of ceil(n / per_host) hosts; one host when n <= per_host), for
    lowering and compiling only. Raises RuntimeError naming the install when the plugin is absent or its version
    is not jax's."""
    import jax
    from jax.experimental import topologies

    have = plugin_version()
    if have is None:
        raise RuntimeError(f"{INSTALL_HINT}: {PLUGIN} is not installed")
    if have != jax.__version__:
        raise RuntimeError(f"{INSTALL_HINT}: {PLUGIN} {have} does not match jax {jax.__version__}")
    hosts, local = (1, n) if n <= per_host or n % per_host else (n // per_host, per_host)
    topo = topologies.get_topology_desc(platform="cuda", target_config=t.config_proto(),
                                        topology=f"1x{hosts}x{local}")
    return list(topo.devices)[:n]


@contextlib.contextmanager
def cudnn_checks(t: Target):
    """Inside the block, jax's cuDNN attention (``jax.nn.dot_product_attention(implementation="cudnn")``) checks
    the target ``t`` instead of a local GPU, so it lowers for that card without one.

    jax 0.10.2 decides at trace time from the machine: ``fused_attention_stablehlo.check_compute_capability`` and
    ``is_cuda_compute_capability_equal`` read ``xla_bridge.local_devices("gpu")`` (none here: "Unknown backend
    gpu", and the call falls back to blockwise), ``check_cudnn_version`` the loaded libcudnn. Within the block
    they answer for ``t``'s compute capability and ``DNN_VERSION`` (the version the target config declares); XLA's
    GPU compiler then compiles the cuDNN fused-attention custom calls for ``t`` (checked 2026-12-06: a bf16
    [4, 1024, 16, 128] attention and its gradient compile deviceless to one and two ``__cudnn$fmha`` calls).
    Without a device the cuDNN graph is not built or autotuned, so the workspace XLA reserves is its default.
    Restores the three functions on exit; not thread-safe (a compile runs them on the calling thread)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    have = tuple(t.capability)
    version = DNN_VERSION[0] * 10000 + DNN_VERSION[1] * 100

    def at_least(capability: str) -> bool:
        return have >= tuple(int(x) for x in capability.split("."))

    def equal(capability: str) -> bool:
        return have == tuple(int(x) for x in capability.split("."))

    names = ("check_compute_capability", "is_cuda_compute_capability_equal", "check_cudnn_version")
    saved = {n: getattr(fa, n) for n in names}
    for n, f in zip(names, (at_least, equal, lambda: version), strict=True):
        setattr(fa, n, f)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(fa, n, f)
