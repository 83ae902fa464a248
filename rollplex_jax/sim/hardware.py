"""Hardware descriptions for the step-time simulator (``rollplex_jax.sim``): presets and a CPU probe.

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

CPU preset ("cpu" = this machine): measured by ``calibrate_cpu()`` (~30 s, cached as JSON under the
workdir, ``cpu_calibration.json``; every timing keeps the FASTEST of its repeats: other processes on a
shared machine only ever slow a run down) with probes:
- ``matmul_flops``: jitted fp32 [512, 512] x [512, 512] matmuls (FLOP/s; 80-100% of it is reached at the
  demo model's own shapes, e.g. [8192, 1176] x [1176, 32], measured 2026-11-30);
- ``bw_curve`` (and ``elementwise_bw`` = ``attention_bw``, ``backward_bw``: its large point): bytes/s,
  in the units the simulator counts (XLA cost_analysis "bytes accessed"), of the demo model's own JAX
  full forward (vision tower + decoder + logits) and of its gradient (backward = gradient - forward),
  time minus FLOPs / matmul_flops, at two reference sizes: 8 rows of 57 tokens with one 12 x 12-patch
  image (~47 MB per forward) and 24 rows of 121 tokens with one 20 x 20-patch image (~380 MB; the L3
  is 32 MiB). Neither is bench_cpu's shape (32 rows of 16 x 16 patches). A program's rate is
  interpolated in log(bytes per call) between the two (clamped): measured 2026-11-30, the same
  forward ran at 10.8 GB/s at 79 MB per call and 5.5-6.6 GB/s at 270-380 MB (cache). Small-array
  softmax / elementwise probes are NOT representative: they ran at 8-50 GB/s;
- ``host_copy_bw``: patch bytes/s of the runtime's host-side input assembly (per-row patches concatenated,
  ``prepare_inputs``, device put) on 32 rows of one 16 x 16-patch image;
- ``op_overhead_s``: a jitted chain of 64 dependent tiny [8, 8] matmuls + tanh: time / 64;
- ``decode_step_s``, ``prefill_s``, ``engine_image_s``: transformers' Qwen2.5-VL (``HFEngine``'s model
  class) of the demo config's size, 32 rows of 38 prompt tokens, ``generate`` of 1 and of 9 forced
  tokens on ``torch_threads`` threads: per step = (t9 - t1) / 8, prefill = t1 - per step; and of 1
  token with one image per row, 10 x 10 patches (38-token prompts) and 20 x 20 (121-token prompts), each
  minus the same prompts without the image: per patch = the slope, per image = the intercept;
- ``corun_interference``, ``corun_decode_util``: the same ``generate`` of 9 tokens with images while ONE
  long XLA computation (the program probe's forward in a loop, dispatched once, as the prefix programs
  are) runs: interference = its time / the quiet one - 1; decode_util = (the XLA loop's time beside the
  decode - alone) / decode time (the share of XLA's speed the decode takes).
Not probed: ``host_step_s`` = CPU_HOST_STEP_S (bind + release + rewards + bookkeeping, from the bench's
own host spans, not from any step time). The MFU factors are 1 on the CPU preset (the probes measure
achieved rates); on CPU the prefix programs are dispatched before ``generate``, so they overlap the
engine's prefill and vision too (``overlap_window='rollout'``). Calibration (a reported benchmark, not a test):
``launch.bench --flagfile=configs/bench_cpu.flags --bench_simulate=cpu`` predicts the bench from these probes
alone (no constant is fitted to the bench) and prints predicted / measured per mode.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

from rollplex_jax.parallel import threads

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
    engine_patch_s: float = 0.0  # measured engine vision cost per patch (replaces the FLOP/byte estimate if > 0)
    op_overhead_s: float = 5e-6  # per kernel / XLA op launch
    elementwise_bw: float = 0.0  # bytes/s achieved by elementwise work (0 = hbm_bw x 0.8)
    attention_bw: float = 0.0  # bytes/s achieved on dense attention scores (softmax-class work; 0 = ew_bw)
    backward_bw: float = 0.0  # bytes/s of backward passes' elementwise + attention bytes (0 = forward's)
    # Measured (CPU): [[fwd bytes per call, fwd bytes/s, bwd bytes per call, bwd bytes/s], ...] at two working
    # sets; a program's rate is interpolated in log(bytes per call) between them (clamped), else the above.
    bw_curve: tuple = ()
    host_copy_bw: float = 0.0  # bytes/s of host-side input assembly on the critical path (0 = not on it)
    decode_util: float = 0.19  # fraction of the compute the decode keeps busy
    interference: float = 0.15  # fractional slowdown of decode while prefix work runs beside it
    host_step_s: float = 0.5  # host-side work per RL step (rewards, scheduling)
    overlap_window: str = "decode"  # what the prefix overlaps: the decode, or the whole rollout (prefill too)
    default_programs: str = "flash"  # flash+layer remat (the defaults) or dense (--attention=dense)
    source: str = ""
    calibration: dict = dataclasses.field(default_factory=dict)

    def flops(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["bfloat16"])

    @property
    def ew_bw(self) -> float:
        return self.elementwise_bw or 0.8 * self.hbm_bw

    @property
    def att_bw(self) -> float:
        return self.attention_bw or self.ew_bw

    def bytes_rate(self, nbytes: float, backward: bool) -> float | None:
        """Bytes/s of a program call moving ``nbytes`` (from ``bw_curve``), or None without a curve."""
        if not self.bw_curve or nbytes <= 0:
            return None
        (b0, f0, c0, g0), (b1, f1, c1, g1) = self.bw_curve[0], self.bw_curve[-1]
        lo, hi, r0, r1 = (c0, c1, g0, g1) if backward else (b0, b1, f0, f1)
        x = min(1.0, max(0.0, math.log(nbytes / lo) / math.log(hi / lo)))
        return r0 * (r1 / r0) ** x

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

# Host work per RL step on this CPU outside the timed programs and the micro-batch assembly (publish/bind
# ~2 ms + release ~2 ms + rewards ~1 ms + Python bookkeeping ~3 ms): the bench's own spans of those host
# phases (bind, release, reward), 2026-11-30; not fitted to any step time.
CPU_HOST_STEP_S = 0.008


def preset(name: str, *, workdir: str | None = None, torch_threads: int = 0, recalibrate: bool = False) -> Hardware:
    """A preset by name (case-insensitive for the GPUs); 'cpu' runs (or reads the cached) calibration."""
    if name.lower() == "cpu":
        return cpu_preset(calibrate_cpu(workdir, torch_threads=torch_threads, recalibrate=recalibrate))
    for k, hw in GPU_PRESETS.items():
        if k.lower() == name.lower():
            return hw
    raise ValueError(f"hardware {name!r}: one of {', '.join(PRESETS)}")


def cpu_preset(cal: dict) -> Hardware:
    if "bw_curve" not in cal:
        raise ValueError("cpu_calibration.json predates the attention / host-copy / co-run probes: rerun with "
                         "--sim_recalibrate")
    return Hardware(
        name="cpu", peak_flops={"float32": cal["matmul_flops"], "bfloat16": cal["matmul_flops"]},
        hbm_bw=cal["elementwise_bw"], intra_bw=cal["elementwise_bw"], inter_bw=cal["elementwise_bw"],
        host_bw=cal["elementwise_bw"], memory_bytes=cal.get("memory_bytes", 0), devices_per_node=1,
        mfu_prefill=1.0, mfu_forward=1.0, mfu_backward=1.0, decode_bw_eff=1.0,
        decode_step_floor_s=cal["decode_step_s"], prefill_fixed_s=cal["prefill_s"],
        engine_image_s=cal["engine_image_s"], engine_patch_s=cal["engine_patch_s"], op_overhead_s=cal["op_overhead_s"],
        elementwise_bw=cal["elementwise_bw"], bw_curve=tuple(tuple(p) for p in cal["bw_curve"]),
        attention_bw=cal["attention_bw"], backward_bw=cal["backward_bw"], host_copy_bw=cal["host_copy_bw"],
        decode_util=cal["corun_decode_util"], interference=cal["corun_interference"], host_step_s=CPU_HOST_STEP_S,
        default_programs="dense", overlap_window="rollout",
        source=f"this CPU, measured {cal['when']} ({cal['probe_s']:.1f} s of probes); host work per step "
               f"{CPU_HOST_STEP_S} s (bench host spans)",
        calibration=dict(cal))


def _median_time(fn, reps: int, stat: str = "median") -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) if stat == "min" else sorted(ts)[len(ts) // 2]


def _min_time(fn, reps: int) -> float:
    """Fastest of ``reps`` runs: the uncontended cost (other processes share this machine's cores)."""
    return _median_time(fn, reps, "min")


def calibrate_cpu(workdir: str | None = None, *, torch_threads: int = 0, recalibrate: bool = False) -> dict:
    """Runs the CPU probes (module doc), or reads ``<workdir>/cpu_calibration.json`` if present. ``torch_threads``
    0: the run's default on this CPU (``threads.default_torch_threads``), the count its decode will use."""
    torch_threads = torch_threads or threads.default_torch_threads(threads.usable_cores())
    path = os.path.join(workdir, "cpu_calibration.json") if workdir else None
    if path and not recalibrate and os.path.exists(path):
        with open(path) as f:
            cal = json.load(f)
        if cal.get("torch_threads") == torch_threads and "bw_curve" in cal:  # else: older probes, rerun
            return cal
    t_start = time.perf_counter()
    import jax
    import jax.numpy as jnp
    import numpy as np

    cpu = jax.devices("cpu")[0]
    n = 512
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32), cpu)
    mm = jax.jit(lambda x: (x @ x) @ x)
    matmul_flops = 2 * 2 * n**3 / _min_time(lambda: mm(a).block_until_ready(), 9)

    # Bytes/s of the forward and the backward (XLA cost_analysis "bytes accessed", the units the simulator
    # counts) achieved by the demo model's own JAX programs at a reference size (_program_probe).
    rng = np.random.default_rng(1)
    curve = []
    for rows, side in ((8, 12), (24, 20)):  # working sets ~40 MB and ~380 MB per forward (L3: 32 MiB)
        mcfg, params, inputs = _demo_inputs(rng, rows=rows, side=side)
        curve.append(_program_probe(mcfg, params, inputs, matmul_flops))
    fwd_bw, bwd_bw = curve[-1][1], curve[-1][3]
    host_copy_bw = _host_prep_probe(rng)

    w = jax.device_put(np.eye(8, dtype=np.float32) * 0.5, cpu)
    chain_n = 64

    def chain(x):
        for _ in range(chain_n):
            x = jnp.tanh(x @ w)
        return x

    ch = jax.jit(chain)
    op_overhead_s = _min_time(lambda: ch(w).block_until_ready(), 9) / chain_n

    xla_work = _long_xla_work(mcfg, params, inputs)
    decode_step_s, prefill_s, image_s, patch_s, corun = _torch_decode_probe(torch_threads, xla_work=xla_work)
    return _save(path, {
        "matmul_flops": matmul_flops, "elementwise_bw": fwd_bw, "attention_bw": fwd_bw, "backward_bw": bwd_bw,
        "bw_curve": curve,
        "host_copy_bw": host_copy_bw, "op_overhead_s": op_overhead_s,
        "decode_step_s": decode_step_s, "prefill_s": prefill_s, "engine_image_s": image_s, "engine_patch_s": patch_s,
        **corun,
        "cores": os.cpu_count() or 1, "torch_threads": torch_threads, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "probe_s": time.perf_counter() - t_start})


def _demo_rows(rng, rows: int, side: int = 16):
    """(model config, ids [rows, side^2 / 4 + 21], per-row patches, grids): one side x side-patch image per row."""
    import numpy as np

    from rollplex_jax.config import ModelConfig

    mcfg = ModelConfig.from_hf_dict(_demo_hf_config())
    t = side * side // mcfg.vision.spatial_merge_size**2 + 21
    merged = side * side // mcfg.vision.spatial_merge_size**2
    ids = np.full((rows, t), 9, np.int64)
    ids[:, 4] = mcfg.vision_start_token_id
    ids[:, 5:5 + merged] = mcfg.image_token_id
    ids[:, 5 + merged] = mcfg.vision_end_token_id
    per_row = [rng.standard_normal((side * side, mcfg.vision.patch_dim), np.float32) for _ in range(rows)]
    return mcfg, ids, per_row, np.array([[1, side, side]] * rows)


def _demo_inputs(rng, rows: int, side: int):
    import jax
    import numpy as np

    from rollplex_jax.models.vl.model import prepare_inputs
    from rollplex_jax.models.vl.params import init_params

    mcfg, ids, per_row, grids = _demo_rows(rng, rows, side)
    inputs = prepare_inputs(mcfg, ids, np.ones_like(ids), np.concatenate(per_row), grids)
    return mcfg, init_params(mcfg, jax.random.key(0)), inputs


def _program_probe(mcfg, params, inputs, matmul_flops: float) -> list[float]:
    """[forward bytes, forward bytes/s, backward bytes, backward bytes/s] of the demo model's full forward
    (vision tower + decoder + logits) and of its gradient: bytes from XLA's cost_analysis, time minus the
    FLOPs at ``matmul_flops``; the backward = gradient program - forward."""
    import jax

    from rollplex_jax.models.vl.model import full_forward

    def loss(p, i):
        return full_forward(p, mcfg, i).sum()

    fwd, grad = jax.jit(loss), jax.jit(jax.grad(loss))
    cf, cg = _xla_cost(fwd, params, inputs), _xla_cost(grad, params, inputs)
    tf = _min_time(lambda: fwd(params, inputs).block_until_ready(), 5)
    tg = _min_time(lambda: jax.block_until_ready(grad(params, inputs)), 5)
    f_bw = cf["bytes accessed"] / max(tf - cf["flops"] / matmul_flops, 0.2 * tf)
    tb = tg - tf
    b_bytes = cg["bytes accessed"] - cf["bytes accessed"]
    b_bw = b_bytes / max(tb - (cg["flops"] - cf["flops"]) / matmul_flops, 0.2 * tb)
    return [cf["bytes accessed"], f_bw, b_bytes, b_bw]


def _host_prep_probe(rng) -> float:
    """Patch bytes per second of the runtime's host-side input assembly (sequences.micro_batches' work: per-row
    patches concatenated, then ``prepare_inputs``: token types, M-RoPE positions, vision layout, device put)
    at a reference size: 32 rows of 85 tokens, one 16 x 16-patch image each (demo model)."""
    import numpy as np

    from rollplex_jax.models.vl.model import prepare_inputs

    mcfg, ids, per_row, grids = _demo_rows(rng, 32)

    def prep():
        inputs = prepare_inputs(mcfg, ids, np.ones_like(ids), np.concatenate(per_row), grids)
        inputs.pixel_values.block_until_ready()

    return sum(p.nbytes for p in per_row) / _min_time(prep, 5)


def _xla_cost(fn, *args) -> dict:
    c = fn.lower(*args).compile().cost_analysis()
    return c[0] if isinstance(c, list) else c


def _long_xla_work(mcfg, params, inputs):
    """A function that dispatches ONE long XLA computation (the probe's forward in a loop, ~0.3 s) and returns
    its result unwaited: the prefix programs run like this beside the decode (dispatched once, no Python)."""
    import jax

    from rollplex_jax.models.vl.model import full_forward

    f = jax.jit(lambda p, i: full_forward(p, mcfg, i).sum())
    one = _min_time(lambda: f(params, inputs).block_until_ready(), 2)
    n = max(2, int(0.25 / max(one, 1e-4)))

    def body(_, c):  # each pass depends on the last (no hoisting), the dependency itself is ~free
        i = inputs._replace(pixel_values=inputs.pixel_values + c * 1e-30) if hasattr(inputs, "_replace") \
            else dataclasses.replace(inputs, pixel_values=inputs.pixel_values + c * 1e-30)
        return full_forward(params, mcfg, i).sum() * 1e-30

    loop = jax.jit(lambda c: jax.lax.fori_loop(0, n, body, c))
    loop(0.0).block_until_ready()
    return lambda: loop(0.0)


def _corun(gen, xla_work) -> dict:
    """The decode beside one long XLA computation: interference = the decode's slowdown; decode_util = the
    share of XLA's speed the decode takes while both run ((T_busy - T_alone) / decode time)."""
    import jax

    alone = _min_time(lambda: jax.block_until_ready(xla_work()), 2)
    quiet = _min_time(gen, 3)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = xla_work()  # dispatched, runs on XLA's threads
        g0 = time.perf_counter()
        gen()
        g = time.perf_counter() - g0
        jax.block_until_ready(out)
        busy = time.perf_counter() - t0
        runs.append((g, busy))
    g, busy = min(runs)  # the least disturbed run (by other processes), as the quiet one is the fastest
    return {"corun_interference": max(0.0, g / quiet - 1.0),
            "corun_decode_util": min(0.95, max(0.0, (busy - alone) / g))}


def _save(path, cal: dict) -> dict:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal


def _torch_decode_probe(torch_threads: int, rows: int = 32, prompt: int = 38, xla_work=None):
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
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2

        def batch(side, length):  # rows of ``length`` tokens, with and without one side x side-patch image
            merged = side * side // vc.spatial_merge_size**2
            text = torch.randint(8, vocab, (rows, length))
            img = text.clone()
            img[:, 4:4 + merged] = hf["image_token_id"]
            return text, img, torch.randn(rows * side * side, patch_dim), torch.tensor([[1, side, side]] * rows)

        # 10 x 10 patches (140 px, 25 merged tokens) in 38-token prompts; 20 x 20 (280 px) in 121-token ones
        small, large = batch(10, prompt), batch(20, 121)

        def gen(k, image, b=small):
            text, img, pix, grid = b
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

        t1 = _min_time(lambda: gen(1, False), 5)
        t9 = _min_time(lambda: gen(9, False), 5)
        t1i = _min_time(lambda: gen(1, True), 5)
        t1_l = _min_time(lambda: gen(1, False, large), 5)
        t1i_l = _min_time(lambda: gen(1, True, large), 5)
        corun = _corun(lambda: gen(9, True), xla_work) if xla_work is not None else {}
    finally:
        torch.set_num_threads(old)
    step = max(1e-5, (t9 - t1) / 8)
    per_image_small, per_image_large = max(0.0, (t1i - t1) / rows), max(0.0, (t1i_l - t1_l) / rows)
    per_patch = max(0.0, (per_image_large - per_image_small) / (400 - 100))
    image = max(0.0, per_image_small - 100 * per_patch)
    return step, max(0.0, t1 - step), image, per_patch, corun


def _demo_hf_config() -> dict:
    path = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "models", "demo.json")
    with open(path) as f:
        return json.load(f)
