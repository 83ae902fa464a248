"""Hardware descriptions for the step-time simulator (``rollplex_jax.simulator``): presets and a CPU probe.

GPU presets: public datasheet numbers (NVIDIA H100 / H800 / H200 SXM, dense, no sparsity):
- H100 SXM: 989 TFLOP/s bf16 (tensor cores), 67 TFLOP/s fp32 (non-tensor), HBM3 3.35 TB/s, 80 GB,
  NVLink 900 GB/s bidirectional (450 GB/s per direction);
- H800 SXM: the H100's compute and HBM (989 TFLOP/s bf16, 3.35 TB/s, 80 GB), NVLink cut to 400 GB/s
  bidirectional (200 GB/s per direction);
- H200 SXM: 989 TFLOP/s bf16, HBM3e 4.8 TB/s, 141 GB, NVLink 900 GB/s.
Inter-node: one 400 Gb/s NIC per GPU (50 GB/s; typical of H800/H100 clusters, not a datasheet
number); host link PCIe 5.0 x16 (~55 GB/s usable).

Efficiency factors ASSUMED for the GPU presets (not measured here; the sweep in the simulator shows
what they move): MFU 0.50 prefill (rollout engine), 0.45 forward, 0.40 backward (Megatron-class
training of 7-32B models reports 35-55%); decode is memory-bound: each step reads the engine shard's
weights and the active rows' KV at 60% of HBM bandwidth, with a per-step floor of 4 ms (CUDA-graph
launch, sampling, TP all-reduce latency of ~64 layers) ; decode keeps 19% of the SMs busy (the
paper, 2nd-hand): the idle 81% is what the prefix programs can use; interference: the decode is
slowed by 15% while prefix kernels run beside it (ASSUMPTION; the paper reports MPS dynamic sharing
beats static partitioning but gives no factor); 5 us per kernel launch; 0.5 s of host work per step
(rewards, Python scheduling, barriers).

CPU preset ("cpu" = this machine): measured by ``calibrate_cpu()`` (< 30 s, cached as JSON under the
workdir, ``cpu_calibration.json``) with probes:
- ``matmul_flops``: jitted fp32 [512, 512] x [512, 512] matmuls (FLOP/s);
- ``elementwise_bw``: a jitted softmax over an fp32 [2, 2048, 2048] array: 8 nominal bytes per element
  (one read, one write) / time (bytes/s), the kind of traffic dense attention generates;
- ``op_overhead_s``: a jitted chain of 64 dependent tiny [8, 8] matmuls + tanh: time / 64;
- ``decode_step_s``, ``prefill_s``, ``engine_image_s``: transformers' Qwen2.5-VL (``HFEngine``'s model
  class) of the demo config's size, 32 rows of 38 prompt tokens, ``generate`` of 1 and of 9 forced
  tokens on ``torch_threads`` threads: per step = (t9 - t1) / 8, prefill = t1 - per step; and of 1
  token with one 10 x 10-patch image per row: per image = (t1_image - t1) / 32.
STALE (issue 11 open): these constants were fitted before the vision tower's attention became per
window and before bench_cpu moved to 224 px images (both 2026-11-30); the calibration test is skipped
until the phase model is refitted (measured then: serial 0.409 s, rollplex 0.125 s; the model predicts
rollplex/serial 2.4-2.6x against 3.3x whatever MFU / bandwidth / engine / interference constants).
Constants of the CPU preset FITTED ONCE on this 2-core machine (bench_cpu, 2026-08 run: serial step
0.521 s = rollout 0.051 + reference 0.085 + actor 0.349 + update 0.014 + 0.02 unaccounted; rollplex
0.110 s = rollout 0.055 + reference 0.002 + actor 0.013 + update 0.007 + 0.03 unaccounted;
overlap_only 0.609 s, sharing_only 0.118 s): ``host_step_s`` = 0.03 s (bind/release, rewards,
advantages, memory marks, input preparation, the optimizer's per-program dispatch: the part no
phase model covers), ``interference`` = 1.0 on CPU
(the decode ran ~2-4x slower beside the prefix in overlap_only: both sides compete for 2 cores and
the memory bus; on CPU the prefix programs are dispatched before ``generate``, so they overlap the
engine's prefill and vision too: ``overlap_window='rollout'``),
decode_util = torch threads / cores (the share of cores the decode holds). The MFU
factors are 1 on the CPU preset: the probes already measure achieved rates.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

TFLOP, GB = 1e12, 1e9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One device's rates and the efficiency factors the simulator applies to them."""

    name: str
    peak_flops: dict  # {dtype: FLOP/s} dense
    hbm_bw: float  # bytes/s (device memory)
    intra_bw: float  # bytes/s per device per direction (NVLink within a node)
    inter_bw: float  # bytes/s per device (network between nodes)
    host_bw: float  # bytes/s (device <-> host memory: optimizer offload)
    memory_bytes: float
    devices_per_node: int = 8
    mfu_prefill: float = 0.5
    mfu_forward: float = 0.45
    mfu_backward: float = 0.40
    decode_bw_eff: float = 0.6
    decode_step_floor_s: float = 4e-3
    prefill_fixed_s: float = 0.0  # fixed cost of one engine prefill call
    engine_image_s: float = 0.0  # fixed cost per image in the engine's vision encoder (besides FLOPs)
    op_overhead_s: float = 5e-6  # per kernel / XLA op launch
    elementwise_bw: float = 0.0  # bytes/s achieved by elementwise work (0 = hbm_bw x 0.8)
    decode_util: float = 0.19  # fraction of the compute the decode keeps busy
    interference: float = 0.15  # fractional slowdown of decode while prefix work runs beside it
    host_step_s: float = 0.5  # host-side work per RL step (rewards, scheduling)
    overlap_window: str = "decode"  # what the prefix overlaps: the decode, or the whole rollout (prefill too)
    default_programs: str = "flash"  # flash+layer remat (GPU at scale) or dense (today's JAX programs)
    source: str = ""
    calibration: dict = dataclasses.field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    @property
    def ew_bw(self) -> float:
        return self.elementwise_bw or 0.8 * self.hbm_bw

    def replace(self, **kw) -> Hardware:
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_NIC = 50 * GB  # 400 Gb/s per GPU
_PCIE = 55 * GB
H100 = Hardware("H100", {"bfloat16": 989 * TFLOP, "float32": 67 * TFLOP}, 3.35e12, 450 * GB, _NIC, _PCIE, 80 * GB,
                source="NVIDIA H100 SXM datasheet (dense bf16 989 TFLOP/s, fp32 67 TFLOP/s, 3.35 TB/s, 80 GB, "
                       "NVLink 900 GB/s bidirectional)")
H800 = H100.replace(name="H800", intra_bw=200 * GB,
                    source="NVIDIA H800 SXM (H100 compute and HBM: 989 TFLOP/s bf16, 3.35 TB/s, 80 GB; NVLink "
                           "400 GB/s bidirectional)")
H200 = H100.replace(name="H200", hbm_bw=4.8e12, memory_bytes=141 * GB,
                    source="NVIDIA H200 SXM datasheet (989 TFLOP/s bf16, 4.8 TB/s HBM3e, 141 GB, NVLink 900 GB/s)")
GPU_PRESETS = {"H100": H100, "H800": H800, "H200": H200}
PRESETS = (*GPU_PRESETS, "cpu")

# CPU constants fitted once on this machine (module doc).
CPU_FITTED = {"host_step_s": 0.03, "interference": 1.0}


def preset(name: str, *, workdir: str | None = None, torch_threads: int = 0, recalibrate: bool = False) -> Hardware:
    """A preset by name (case-insensitive for the GPUs); 'cpu' runs (or reads the cached) calibration."""
    if name.lower() == "cpu":
        return cpu_preset(calibrate_cpu(workdir, torch_threads=torch_threads, recalibrate=recalibrate))
    for k, hw in GPU_PRESETS.items():
        if k.lower() == name.lower():
            return hw
    raise ValueError(f"hardware {name!r}: one of {', '.join(PRESETS)}")


def cpu_preset(cal: dict) -> Hardware:
    cores = max(1, cal["cores"])
    threads = cal["torch_threads"] or cores
    return Hardware(
        name="cpu", peak_flops={"float32": cal["matmul_flops"], "bfloat16": cal["matmul_flops"]},
        hbm_bw=cal["elementwise_bw"], intra_bw=cal["elementwise_bw"], inter_bw=cal["elementwise_bw"],
        host_bw=cal["elementwise_bw"], memory_bytes=cal.get("memory_bytes", 0), devices_per_node=1,
        mfu_prefill=1.0, mfu_forward=1.0, mfu_backward=1.0, decode_bw_eff=1.0,
        decode_step_floor_s=cal["decode_step_s"], prefill_fixed_s=cal["prefill_s"],
        engine_image_s=cal["engine_image_s"], op_overhead_s=cal["op_overhead_s"], elementwise_bw=cal["elementwise_bw"],
        decode_util=min(1.0, threads / cores), default_programs="dense", overlap_window="rollout",
        source=f"this CPU, measured {cal['when']} ({cal['probe_s']:.1f} s of probes); fitted once: {CPU_FITTED}",
        calibration=dict(cal), **CPU_FITTED)


def _median_time(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def calibrate_cpu(workdir: str | None = None, *, torch_threads: int = 0, recalibrate: bool = False) -> dict:
    """Runs the CPU probes (module doc), or reads ``<workdir>/cpu_calibration.json`` if present."""
    path = os.path.join(workdir, "cpu_calibration.json") if workdir else None
    if path and not recalibrate and os.path.exists(path):
        with open(path) as f:
            cal = json.load(f)
        if cal.get("torch_threads") == torch_threads:
            return cal
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.devices("cpu")[0]
    n = 512
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32), cpu)
    mm = jax.jit(lambda x: (x @ x) @ x)
    matmul_flops = 2 * 2 * n**3 / _median_time(lambda: mm(a).block_until_ready(), 7)

    big = jax.device_put(np.random.default_rng(1).standard_normal((2, 2048, 2048), np.float32), cpu)
    sm = jax.jit(lambda x: jax.nn.softmax(x, axis=-1))
    elementwise_bw = big.size * 8 / _median_time(lambda: sm(big).block_until_ready(), 5)

    w = jax.device_put(np.eye(8, dtype=np.float32) * 0.5, cpu)
    chain_n = 64

    def chain(x):
        for _ in range(chain_n):
            x = jnp.tanh(x @ w)
        return x

    ch = jax.jit(chain)
    op_overhead_s = _median_time(lambda: ch(w).block_until_ready(), 9) / chain_n

    decode_step_s, prefill_s, image_s = _torch_decode_probe(torch_threads)
    return _save(path, {
        "matmul_flops": matmul_flops, "elementwise_bw": elementwise_bw, "op_overhead_s": op_overhead_s,
        "decode_step_s": decode_step_s, "prefill_s": prefill_s, "engine_image_s": image_s, "cores": os.cpu_count() or 1,
        "torch_threads": torch_threads, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "probe_s": time.perf_counter() - t_start})


def _save(path, cal: dict) -> dict:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal


def _torch_decode_probe(torch_threads: int, rows: int = 32, prompt: int = 38) -> tuple[float, float, float]:
    """Per-step and prefill time of transformers' Qwen2.5-VL ``generate`` at the demo model's size."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    old = torch.get_num_threads()
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        hf = _demo_hf_config()
        cfg = Qwen2_5_VLConfig(**hf)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
        vocab = cfg.text_config.vocab_size
        vc = cfg.vision_config
        side = 10  # a 140 x 140 px image: 10 x 10 patches -> 25 merged tokens
        merged = side * side // vc.spatial_merge_size**2
        text = torch.randint(8, vocab, (rows, prompt))
        img = text.clone()
        img[:, 4:4 + merged] = hf["image_token_id"]
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        pix = torch.randn(rows * side * side, patch_dim)
        grid = torch.tensor([[1, side, side]] * rows)

        def gen(k, image):
            ids = img if image else text
            kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                      mm_token_type_ids=(ids == hf["image_token_id"]).int())
            if image:
                kw.update(pixel_values=pix, image_grid_thw=grid)
            g = GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=k, min_new_tokens=k,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            with torch.no_grad():
                model.generate(**kw, generation_config=g)

        t1 = _median_time(lambda: gen(1, False), 5)
        t9 = _median_time(lambda: gen(9, False), 5)
        t1i = _median_time(lambda: gen(1, True), 5)
    finally:
        torch.set_num_threads(old)
    step = max(1e-5, (t9 - t1) / 8)
    return step, max(0.0, t1 - step), max(0.0, (t1i - t1) / rows)


def _demo_hf_config() -> dict:
    path = os.path.join(os.path.dirname(__file__), "..", "configs", "models", "demo.json")
    with open(path) as f:
        return json.load(f)
