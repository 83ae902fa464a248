"""XLA's own bytes for a run's real programs at a config's shapes, compiled ahead of time without allocating.

``compiled_memory(cfg, lengths)`` builds every program one step of ``cfg.run.schedule`` runs (the same
builders the runner uses: ``programs.actor.make_programs``, ``programs.split.make_split_programs``, the
optimizer), lowers each on ``jax.ShapeDtypeStruct`` inputs with the training mesh's shardings and
compiles it on the backend present (CPU works for any size: nothing is allocated), and reads
``compiled.memory_analysis()`` per device: temp, argument, output and alias bytes (total = temp +
arguments + outputs - aliases; on CPU ``peak_memory_in_bytes`` is only arguments + outputs, SCALE.md).

Per phase, what a device holds while the phase's largest program runs: that program's total, plus the
phase's other live state that is not among its arguments (optimizer state during training, the
reference weights, residuals kept for later, ...), computed exactly from the abstract shapes and
shardings. ``launch.plan --compile`` prints both beside the planner's figures (``planned_vs_compiled``).
The torch engine's KV cache and working set are not JAX programs: they stay the planner's.

On CPU, XLA rewrites every 16-bit matmul to float32 (its dot emitter has no bfloat16 kernel: the
``float-normalization-bf16`` and ``change-op-data-type`` passes insert converts), and the converted weights
then live as fp32 temporaries: a bfloat16 Qwen2.5-VL-3B prefix forward compiled as is shows +0.29 GiB of
temp per decoder layer (an fp32 copy of the layer's weights; flat in depth in float32), 56 GiB for the
whole prefix, none of which a GPU allocates (its bf16 GEMMs are native). So on CPU a bfloat16 model is
compiled as float16 (the same two bytes per element in every buffer; the CPU dot emitter takes f16) with
``change-op-data-type`` disabled (``CPU_STANDIN``): the buffers are those of a 16-bit program. It is a
stand-in for memory analysis only: such programs are compiled, never run. On a mesh, XLA's CPU pipeline
also combines the all-reduces of every layer's weight gradient into one (``cpu-all-reduce-combiner``), so
all layers' unreduced gradients are live at once: measured at 3B on 8 fake devices, the prefix vjp's
temp grows 0.26 GiB per decoder layer with it and is flat without it; GPU combiners are bounded by a
byte threshold. CPU compiles run without it. ``Compiled.note`` says what was changed.

Inputs are the worst case the planner assumes (``planner.Lengths``): every row ``prompt_tokens`` long
(no padding), one image of ``vision_tokens`` merged tokens per prompt (or a video), answers of
``response_tokens``; micro-batches of ``--micro_batch`` answers.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from rollplex_jax.config import Config
from rollplex_jax.config.shapes import planned_micro_batch
from rollplex_jax.memory import targets
from rollplex_jax.models.platform import compiling_for, platform
from rollplex_jax.models.vl import rope
from rollplex_jax.models.vl.layers import compiler_options
from rollplex_jax.models.vl.model import ModelInputs
from rollplex_jax.models.vl.params import param_shapes
from rollplex_jax.models.vl.vision_chunks import slot_count
from rollplex_jax.parallel import mesh as mesh_lib
from rollplex_jax.programs import hlo_cost

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ProgramBytes:
    """One compiled program's per-device bytes (``memory_analysis``) and what one run of it costs per device,
    read from its optimized HLO (``programs/hlo_cost.py``: FLOPs, bytes moved, kernels, collective bytes)."""

    temp: int
    argument: int
    output: int
    alias: int
    cost: dict | None = None

    @property
    def total(self) -> int:
        return self.temp + self.argument + self.output - self.alias

    def to_dict(self) -> dict:
        return {"temp_bytes": self.temp, "argument_bytes": self.argument, "output_bytes": self.output,
                "alias_bytes": self.alias, "total_bytes": self.total, "cost": self.cost}


TRITON_TILES = "Couldn't find output tile sizes"  # XLA GPU's error where no Triton GEMM tiling fits (compile_program)
CPU_STANDIN = {"bfloat16": "float16"}  # model dtype -> the dtype its programs compile as on CPU (module doc)
CPU_COMBINER = "cpu-all-reduce-combiner"  # disabled in CPU compiles on a mesh (module doc)


def compile_setup(cfg: Config) -> tuple[Config, dict | None, str]:
    """(the config to compile, extra XLA options, a note): on CPU without the all-reduce combiner, and a
    bfloat16 model as float16 with the pass that upcasts 16-bit dots disabled (module doc); elsewhere the
    config as it is."""
    if platform() != "cpu":
        return cfg, None, f"compiled as {cfg.model.dtype} for {platform()}"
    passes = [(compiler_options(cfg.programs.remat) or {}).get("xla_disable_hlo_passes"), CPU_COMBINER]
    note = ["compiled on cpu without its all-reduce combiner (it merges every layer's gradient all-reduce "
            "into one, keeping all of them live)"]
    if cfg.model.dtype in CPU_STANDIN:
        stand_in = CPU_STANDIN[cfg.model.dtype]
        passes.append("change-op-data-type")
        note.append(f"{cfg.model.dtype} compiled as {stand_in} (same bytes per element; XLA's CPU backend "
                    "otherwise upcasts 16-bit matmuls to fp32, which a GPU does not)")
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=stand_in))
    return cfg, {"xla_disable_hlo_passes": ",".join(filter(None, passes))}, "; ".join(note)


def abstract_shard_bytes(tree) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs (the largest shard of each, by its sharding;
    nothing is allocated: ``meter.live_buffer_bytes`` counts live buffers)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


class Abstract:
    """Abstract (ShapeDtypeStruct) params, optimizer state and inputs on the training mesh: of the visible
    devices, or of ``devices`` (a compile target's fake ones, ``targets.devices``: a mesh even of one, so that
    every program lowers for them)."""

    def __init__(self, cfg: Config, devices: list | None = None):
        self.cfg = cfg
        m = cfg.mesh
        target = devices is not None
        devices = jax.devices() if devices is None else devices
        if len(devices) < m.train_devices and not target:  # e.g. one GPU, an 8-device flagfile: fake CPU devices
            devices = jax.devices("cpu")
        if len(devices) < m.train_devices:
            raise ValueError(f"compiling for {m.train_devices} devices needs as many visible ones (on CPU: XLA_FLAGS="
                             f"--xla_force_host_platform_device_count={m.train_devices} before JAX starts)")
        many = m.train_devices > 1 or target
        self.mesh = mesh_lib.train_mesh(m, devices[:m.train_devices]) if many else None
        self.replicated = NamedSharding(self.mesh, PartitionSpec()) if self.mesh is not None else None
        shapes = param_shapes(cfg.model)
        shard = mesh_lib.param_shardings(cfg.model, self.mesh) if self.mesh is not None else {}
        self.params = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard.get(k)) for k, s in shapes.items()}
        self.shardings = shard

    def like_params(self, tree):
        """``tree`` (from ``jax.eval_shape``) with each leaf sharded as the parameter in its path."""
        def leaf(path, x):
            names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key in self.params]
            s = self.params[names[-1]].sharding if names and x.shape == self.params[names[-1]].shape \
                else self.replicated
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        return jax.tree_util.tree_map_with_path(leaf, tree)

    def array(self, shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=self.replicated)

    def buffer(self, spec, width: int, dtype) -> jax.ShapeDtypeStruct:
        """A vision chunks' embeddings buffer of ``spec`` (``config.shapes.ChunkSpec``) [slots, groups x units,
        width], split over the batch shards as the runtime's (``vision_chunks.constrain_buffer``)."""
        axes = mesh_lib.batch_axes(self.mesh.shape) if self.mesh is not None else ()
        s = None if not axes else NamedSharding(self.mesh, PartitionSpec(None, axes[0] if len(axes) == 1 else axes))
        shape = (spec.buffer // spec.chunk_units, spec.chunk_units, width)
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=s or self.replicated)

    def inputs(self, rows: int, prompt_tokens: int, vision_tokens: int, response_tokens: int = 0,
               frames: int = 0, slots: int = 0) -> ModelInputs:
        """``rows`` unpadded rows of ``prompt_tokens`` (one image or video of ``vision_tokens`` merged tokens
        each) followed by ``response_tokens`` answer tokens, as abstract ``ModelInputs``; ``slots``: the rows of
        a chunked vision embeddings buffer (``ModelInputs.vision_slots``, no pixels: the buffer has them)."""
        ids, grids, kind = host_rows(self.cfg, rows, prompt_tokens, vision_tokens, response_tokens, frames)
        chunked = bool(slots and len(grids))
        region = np.zeros_like(ids, bool)
        region[:, :prompt_tokens] = True
        types = rope.token_types(ids, self.cfg.model, region)
        mask = np.ones_like(ids)
        img, vid = (grids, None) if kind == "image" else (None, grids)
        positions, next_pos = rope.get_rope_index(ids, mask, self.cfg.model, img, vid, None, types)
        layout = rope.vision_layout(grids, self.cfg.model.vision).arrays(self.cfg.mesh.batch_shards) \
            if len(grids) and not chunked else None
        a = self.array
        patches = int(np.prod(grids, -1).sum()) if len(grids) else 0
        i32 = a(ids.shape, jnp.int32)
        return ModelInputs(
            input_ids=i32, attention_mask=i32, token_types=i32,
            positions=a(positions.shape, positions.dtype), next_position=a(next_pos.shape, next_pos.dtype),
            pixel_values=None if layout is None else a((patches, self.cfg.model.vision.patch_dim), jnp.float32),
            layout=None if layout is None else {k: a(np.shape(v), np.asarray(v).dtype) for k, v in layout.items()},
            vision_slots=a((slot_count(slots, rows, ids.shape[1]),), jnp.int32) if chunked else None)

    def chunk(self, spec, prompt_tokens: int, vision_tokens: int, frames: int = 0):
        """One vision chunk of ``spec`` (``config.shapes.ChunkSpec``) as abstract ``vision_chunks.VisionInputs``:
        every chunk of a run has its shape (a row's image or video of ``vision_tokens`` fits a full-attention row)."""
        from rollplex_jax.models.vl.vision_chunks import VisionInputs, plan_chunks

        _, grids, _ = host_rows(self.cfg, 1, prompt_tokens, vision_tokens, 0, frames)
        v = self.cfg.model.vision
        pixels = np.zeros((int(np.prod(grids, -1).sum()), v.patch_dim), np.float32)
        c = plan_chunks(grids, pixels, spec, v).inputs[0]
        return VisionInputs(self.array(c["pixel_values"].shape, jnp.float32),
                            {k: self.array(np.shape(x), np.asarray(x).dtype) for k, x in c["layout"].items()})


def host_rows(cfg: Config, rows: int, prompt_tokens: int, vision_tokens: int, response_tokens: int,
              frames: int) -> tuple[np.ndarray, np.ndarray, str]:
    """Token ids [rows, prompt + response] with one vision block of ``vision_tokens`` per row, its grids
    [rows, 3], and ``image`` or ``video``: a grid whose merged h x w (x t) holds ``vision_tokens``."""
    m, v = cfg.model, cfg.model.vision
    merge = v.spatial_merge_size
    t = max(1, math.ceil(frames / v.temporal_patch_size)) if frames else 1
    per_frame = max(1, vision_tokens // t) if vision_tokens else 0
    a = max((d for d in range(1, int(math.isqrt(per_frame)) + 1) if per_frame % d == 0), default=1)
    grid = np.array([t, a * merge, (per_frame // a) * merge], np.int64) if per_frame else None
    n_vis = t * per_frame if per_frame else 0
    if n_vis + 2 > prompt_tokens and n_vis:
        raise ValueError(f"{n_vis} vision tokens + 2 markers do not fit a prompt of {prompt_tokens} tokens")
    kind = "video" if frames else "image"
    pad = m.video_token_id if frames else m.image_token_id
    row = [m.vision_start_token_id, *([pad] * n_vis), m.vision_end_token_id] if n_vis else []
    text = [m.bos_token_id] * (prompt_tokens - len(row))
    ids = np.array([text[:1] + row + text[1:] + [m.eos_token_id] * response_tokens] * rows, np.int64)
    grids = np.repeat(grid[None], rows, 0) if grid is not None else np.zeros((0, 3), np.int64)
    return ids, grids, kind


@dataclasses.dataclass(frozen=True)
class Compiled:
    """Per-device bytes per program and per phase (``phase_bytes[phase]``: the largest of its programs, each
    with the phase's live state not among its arguments or outputs added)."""

    programs: dict[str, ProgramBytes]
    phase_bytes: dict[str, int]
    phase_program: dict[str, str]
    live_bytes: dict[str, dict[str, int]]
    note: str = ""
    runs: dict[str, tuple[str, int, dict]] = dataclasses.field(default_factory=dict)

    def step_costs(self) -> dict[str, dict]:
        """Per device, one step's costs per simulator phase (``sim/phases.py``: vision, actor_prefix, ref_prefix,
        reference, actor, update): each program's HLO cost (``programs/hlo_cost.py``) times its runs per step,
        with the programs and runs that make it up."""
        out: dict[str, dict] = {}
        for name, (phase, runs, cost) in self.runs.items():
            o = out.setdefault(phase, {"flops": 0.0, "bytes": 0.0, "kernels": 0.0, "comm_bytes": 0.0,
                                       "unknown_loops": 0, "programs": {}, "bytes_by_kind": {}})
            for k in ("flops", "bytes", "kernels", "comm_bytes"):
                o[k] += runs * cost[k]
            for kind, b in cost.get("bytes_by_kind", {}).items():
                o["bytes_by_kind"][kind] = o["bytes_by_kind"].get(kind, 0.0) + runs * b
            o["unknown_loops"] += cost["unknown_loops"]
            o["programs"][name] = runs
        return out

    def to_dict(self) -> dict:
        return {"programs": {k: v.to_dict() for k, v in self.programs.items()},
                "phases": {p: {"bytes": b, "program": self.phase_program[p], "live_bytes": self.live_bytes[p]}
                           for p, b in self.phase_bytes.items()}, "note": self.note, "step_costs": self.step_costs()}


class _Phases:
    """Collects programs per phase with the classes each takes or produces."""

    def __init__(self, options: dict | None = None, note: str = ""):
        self.options, self.note = options, note
        self.programs: dict[str, ProgramBytes] = {}
        self.entries: dict[str, list[tuple[str, set[str], int]]] = {}
        self.live: dict[str, dict[str, int]] = {}
        self.runs: dict[str, tuple[str, int, dict]] = {}

    def add(self, phase: str, name: str, pb: ProgramBytes, uses: set[str], partial: int = 0, *, sim: str = "",
            runs: int = 1) -> None:
        """``uses``: live classes among the program's arguments/outputs; ``partial``: bytes of other live
        classes it takes only in part (an optimizer chunk); ``sim``, ``runs``: ``count``'s."""
        self.programs[name] = pb
        self.entries.setdefault(phase, []).append((name, uses, partial))
        self.count(name, pb, sim, runs)

    def count(self, name: str, pb: ProgramBytes, sim: str, runs: int) -> None:
        """Counts ``runs`` runs of the program per step in the simulator's phase ``sim`` (``Compiled.step_costs``);
        a program that holds no memory of its own worth planning (a second run at other shapes) is counted only."""
        if sim and runs and pb.cost is not None:
            self.runs[name] = (sim, runs, pb.cost)

    def compile(self, fn, *args):
        return compile_program(fn, *args, options=self.options)

    def result(self) -> Compiled:
        phase_bytes, phase_program = {}, {}
        for phase, live in self.live.items():
            best = (sum(live.values()), "(no program)")
            for name, uses, partial in self.entries.get(phase, []):
                extra = sum(v for k, v in live.items() if k not in uses) - partial
                best = max(best, (self.programs[name].total + extra, name))
            phase_bytes[phase], phase_program[phase] = int(best[0]), best[1]
        return Compiled(self.programs, phase_bytes, phase_program, self.live, self.note, dict(self.runs))


def compile_program(fn, *args, options: dict | None = None):
    """(per-device bytes, abstract outputs with the compiled program's output shardings); ``options``: XLA
    options added to the program's own (a later ``xla_disable_hlo_passes`` replaces an earlier one)."""
    lowered = fn.lower(*args)
    try:
        compiled = lowered.compile(compiler_options=options)
    except jax.errors.JaxRuntimeError as e:  # XLA GPU without a device: no tiling for some small GEMMs
        if TRITON_TILES not in str(e):
            raise
        log.warning("%s: XLA GPU found no Triton tiling for a GEMM without autotuning (%s); compiling its GEMMs "
                    "for cuBLAS instead (--xla_gpu_enable_triton_gemm=false)", fn, str(e).splitlines()[0][:200])
        compiled = lowered.compile(compiler_options={**(options or {}), "xla_gpu_enable_triton_gemm": False})
    a = compiled.memory_analysis()
    pb = ProgramBytes(int(a.temp_size_in_bytes), int(a.argument_size_in_bytes), int(a.output_size_in_bytes),
                      int(a.alias_size_in_bytes), hlo_cost.program_cost(compiled.as_text()).to_dict())
    outs = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), lowered.out_info,
                        compiled.output_shardings)
    return pb, outs


def optimizer_state(optimizer, params: dict, A: Abstract):
    """The abstract optimizer state of ``optimizer`` for ``params`` (as ``ChunkedOptimizer.init``, unplaced)."""
    import optax

    from rollplex_jax.programs.optimizer import OptState, chunk_names

    names = chunk_names(params, optimizer.n_chunks)
    optimizer.names = names
    chunks, masters = [], []
    for group in names:
        p = {k: params[k] for k in group}
        fp32 = all(jnp.dtype(v.dtype) == jnp.float32 for v in p.values())
        master = optax.EmptyState() if fp32 else {k: jax.ShapeDtypeStruct(v.shape, jnp.float32, sharding=v.sharding)
                                                   for k, v in p.items()}
        chunks.append(A.like_params(jax.eval_shape(optimizer.tx.init, p if fp32 else master)))
        masters.append(master)
    state = OptState(tuple(chunks), tuple(masters))
    if not optimizer.zero:
        return state
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(  # ZeRO-1: as ChunkedOptimizer.shard_state lays it out
        x.shape, x.dtype, sharding=mesh_lib.zero_sharding(x.sharding, x.shape)) if x.ndim else x, state)


def _update_phase(ph: _Phases, optimizer, params, opt, grads, live: dict, offload: bool) -> None:
    """The optimizer's programs: global-norm clip (its output is the clipped gradients), then one chunk's AdamW
    (the largest chunk). Offloaded, the optimizer state is on the device only as the chunk that program
    takes; resident, all of it is live and the chunk is part of it."""
    pb, (clipped, _, ok) = ph.compile(optimizer._clip, grads)
    ph.add("update", "clip", pb, {"gradients", "clipped"}, sim="update")
    sizes = [abstract_shard_bytes({k: params[k] for k in g}) for g in optimizer.names]
    i = int(np.argmax(sizes))
    group = optimizer.names[i]
    args = ({k: params[k] for k in group}, opt.chunks[i], opt.master[i], {k: clipped[k] for k in group}, ok)
    pb, _ = ph.compile(optimizer.program(i, *args[:3]), *args)
    live = dict(live, clipped=abstract_shard_bytes(clipped))
    ph.live["update"] = live
    ph.add("update", "update_chunk", pb, set(),  # runs: every chunk at the largest's cost (an upper bound)
           partial=abstract_shard_bytes((args[0], args[3]) if offload else args[:4]), sim="update",
           runs=len(optimizer.names))


def compiled_memory(cfg: Config, lengths, policy: str = "resident", frames: int = 0,
                    target: targets.Target | None = None) -> Compiled:
    """Compiles the programs of one step of ``cfg.run.schedule`` at ``lengths`` (``planner.Lengths``) on the
    training mesh (which needs ``mesh.train_devices`` visible devices: on CPU, fake ones) and returns their
    per-device bytes, per program and per phase. ``policy``: where the optimizer state lives (resident on
    the device in every phase, or offloaded: on it only during the update). ``target``: a GPU to compile for
    instead (``targets.py``: XLA's GPU compiler on fake devices of that card; the programs built as for a GPU)."""
    if target is None:
        return _compiled_memory(cfg, lengths, policy, frames, None, "")
    devices = targets.devices(target, cfg.mesh.train_devices)
    note = (f"compiled for {target.name} (sm_{''.join(map(str, target.capability))}) by XLA's GPU compiler without a "
            "device: default GEMM tiles (no autotuning); NCCL buffers, cuBLAS/cuDNN workspaces and allocator slack "
            "are not in these bytes")
    with compiling_for("gpu"), targets.cudnn_checks(target):
        return _compiled_memory(cfg, lengths, policy, frames, devices, note)


def _compiled_memory(cfg: Config, lengths, policy: str, frames: int, devices: list | None, target_note: str):
    import contextlib

    from rollplex_jax.programs.actor import make_programs

    cfg, options, note = compile_setup(cfg)
    note = "; ".join(filter(None, [target_note, note]))
    A = Abstract(cfg, devices)
    offload = policy == "offload"
    progs = make_programs(cfg.model, cfg.rl, cfg.optim, max(cfg.run.steps, 1), offload_optimizer=offload,
                          optimizer_chunks=cfg.memory.optimizer_chunks if offload else 1, prog=cfg.programs,
                          temperature=cfg.rollout.temperature)
    progs.optimizer.zero = cfg.mesh.zero_dp
    with jax.set_mesh(A.mesh) if A.mesh is not None else contextlib.nullcontext():
        opt = optimizer_state(progs.optimizer, A.params, A)
        base = {"compute_weights": abstract_shard_bytes(A.params),
                "ref_weights": abstract_shard_bytes(A.params) if cfg.rl.uses_reference else 0}
        resident = {"optimizer_state": abstract_shard_bytes(opt)}
        ph = _Phases(options, note)
        if cfg.run.schedule == "rollplex":
            from rollplex_jax.memory.aot_split import rollplex_programs

            rollplex_programs(ph, cfg, A, progs, lengths, frames, base, {} if offload else resident)
        else:
            _serial(ph, cfg, A, progs, lengths, frames, base, {} if offload else resident)
        grads = A.params
        # the step's inputs, vision chunks and embeddings buffer live until the step ends (after its update)
        kept = {k: v for k, v in ph.live["train"].items() if k in ("other", "emb", "chunks")}
        _update_phase(ph, progs.optimizer, A.params, opt, grads,
                      dict(base, **({} if offload else resident), **kept,
                           gradients=abstract_shard_bytes(grads)), offload)
    return ph.result()


def _answers(cfg: Config, A: Abstract, ids, f32, adv):
    """A gradient program's ``actor.Answers`` as one step passes them: old log-probs with several mini-batches,
    reference log-probs when the reference is used, the engine's (the mismatch metric) with one mini-batch."""
    from rollplex_jax.programs.actor import Answers

    one = cfg.rl.mini_batches == 1
    return Answers(ids=ids, weights=f32, advantages=adv, old=None if one else f32,
                   ref=f32 if cfg.rl.uses_reference else None, engine=f32 if one else None)


def _serial(ph: _Phases, cfg: Config, A: Abstract, progs, lengths, frames: int, base: dict, resident: dict) -> None:
    """The serial schedule: full (prompt ++ answer) rows, one micro-batch per program call."""
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    rows = cfg.rl.batch_prompts * cfg.rollout.group_size
    mb = min(planned_micro_batch(cfg), rows)
    inputs = A.inputs(mb, Tp, Tv, Tr, frames)
    n_mb = math.ceil(rows / mb)
    other = abstract_shard_bytes(inputs) * n_mb  # the step's micro-batches are built up front (SerialOps)
    ids, f32 = A.array((mb, Tr), jnp.int32), A.array((mb, Tr), jnp.float32)
    ph.live["rollout"] = dict(base, **resident)
    if cfg.rl.uses_reference:
        pb, _ = ph.compile(progs.ref_logprobs, A.params, inputs, Tp, ids, A.array((mb, Tr), jnp.int32))
        ph.add("score", "ref_logprobs", pb, {"ref_weights"}, partial=abstract_shard_bytes(inputs), sim="reference",
               runs=n_mb)
    ph.live["score"] = dict(base, **resident, other=other)
    pb, _ = ph.compile(progs.grad, A.params, inputs, Tp, _answers(cfg, A, ids, f32, A.array((mb,), jnp.float32)))
    ph.add("train", "grad", pb, {"compute_weights"}, partial=abstract_shard_bytes(inputs), sim="actor", runs=n_mb)
    ph.live["train"] = dict(base, **resident, other=other, gradients=abstract_shard_bytes(A.params))
