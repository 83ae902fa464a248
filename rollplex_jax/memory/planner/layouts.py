"""The two layouts: per-device bytes of every buffer class in every phase, and what they assume.

``build_plan(cfg, lengths, mesh, programs, policy)`` predicts the bytes each buffer class of
``classes.CLASSES`` occupies on one device in each phase of ``classes.PHASES`` (rollout,
score, train, update), for two layouts:

- ``naive_colocation``: serial colocation with everything resident all the time: actor compute
  weights, gradients, fp32 master weights and Adam moments, reference weights, a second full copy of
  the weights for the rollout engine (at the rollout TP degree) and the engine's KV cache (its pool
  stays allocated); one prefix per sample (no prefix sharing), no boundary state; scoring and
  training run over full (prompt ++ answer) sequences, one micro-batch at a time.
- ``rollplex``: what our runtime does under the config: the reference and actor prefixes run during
  the rollout and their boundary KV lives until its last consumer (reference part: score; actor part:
  train), one prefix per prompt when ``cfg.run.prefix_sharing`` (else one per sample); the actor
  prefix's vjp residuals live from rollout to train when ``cfg.run.actor_prefix == 'residuals'``
  (with ``'recompute'`` the train program recomputes the prefix forward instead); the optimizer state
  and master weights are resident, or (``policy == 'offload'``) in host memory outside ``update`` and
  streamed through the device one chunk of 1/``cfg.memory.optimizer_chunks`` at a time during
  ``update``; the engine's KV cache exists only during the rollout; the rollout engine reads the
  actor's compute weights (no copy) except for a rebuilt part (rollout weights below).

The mesh, sharding and program model are described in ``types``; the parameters' shards and the
FSDP-gathered weights in ``shards``; the rows each program takes in ``rows``; the per-layer formulas in
``activations``; the sizes both layouts share in ``sizes``; the rollplex layout's phases in ``rollplex``;
choosing the optimizer policy under a budget in ``budget``.

What the plan describes is what the runtime holds on one device, checked class by class against the meter on
fake-device meshes (``tests/test_sharded.py``, ``tests/test_memory.py``: planned within 15% of measured per
phase on fsdp 2 x tp 2 and tp 4, and on one device). A dimension a mesh axis does not divide stays whole:
parameters (``shards``), kv heads and the vocabulary of the boundary state, and a program's rows (``rows``).
Rows that fsdp does not divide are an upper bound: GSPMD may split the model dimension instead and gather
fewer weights (the tiny demo's 2-row prefix calls on fsdp 4: planned 1.16x the measured rollout, 1.23x the
train phase).

Sizes (P params, b = dtype bytes, L decoder layers, K kv heads, d head dim, V vocabulary,
Tp / Tv / Tr prompt / vision / answer tokens per row from ``Lengths``; K_dev(t) = K / t where t divides
K, else K; the engine's K_dev(rollout_tp) = max(1, ceil(K / rollout_tp)), vLLM's replicated kv heads):
- weights, gradients, master weights and Adam moments: each parameter's shard on the fsdp x tp mesh
  (``shards``; the optimizer state has the params' layout), replicated over dp (``--train_dp``), master
  weights and moments / dp with the optimizer state sharded over it (ZeRO-1, ``--optimizer_shard``);
- rollout KV per device = rows x (Tp + Tr) x L x 2 x K_dev(rollout_tp) x d x b (no prompt sharing
  inside the engine: an upper bound for vLLM's prefix caching);
- boundary KV per device = (actor + reference) [L, B', Tp, K_dev(tp), d] x 2 (k, v) x b + the last
  logits [B', V_dev(tp)] fp32, B' = B (prefix sharing) or B * G, the rows of each prefix call
  (``rows.actor_parts``) divided over the D / tp batch shards where they divide them;
- rollout weights: naive = P x b / rollout_tp (a full second copy);
  rollplex: the engine-owned (rebuilt) bytes of the per-tensor classification
  (``sharing.plan_sharing``, the largest of any device); aligned and view tensors alias the actor's
  compute weights; the classification also reports the physical floor of the rebuilt bytes
  (``floor_bytes_per_device``: what a rollout rank reads that its device's training shards cannot hold in
  any layout, ``sharing.floor_bytes``). (Before issue 7 this was assumed to be
  ``max(0, P / rollout_tp - P / (fsdp * tp)) x b``, the part not held locally: ``remote_bytes_per_device``
  of the classification, a lower bound for an engine that takes split pieces.)

Activations (phase-local temporaries of the largest program in a phase), per device:
- rollout: the engine's decode temporaries (rows x V fp32 logits and sampling probs) or one prefill
  chunk (``ProgramModel.prefill_chunk`` tokens through a layer, plus one prompt's vision encoder),
  whichever is larger; rollplex adds the prefix programs' working set running beside it (one layer
  of the prefix forward over the prompt rows, and two residual streams);
- score: the reference forward over one micro-batch: naive over full sequences (vision tower per
  row, fp32 logits [rows, Tp + Tr, V/tp] and their log-softmax), rollplex the suffix only
  (logits over Tr);
- train: forward + backward over one micro-batch of ``--micro_batch`` rows, or what ``--micro_batch_tokens``
  holds at the longest lengths (global, i.e. ceil(micro_batch / (D / tp)) rows per device): saved activations
  (no weight copy inside one program), the backward's layer working set, the fp32 logits, their cotangent and
  log-softmax, and one gradient-sized buffer (the micro-batch's gradient before it is added to the accumulator, or the
  suffix and prefix parts before they are added); rollplex: the suffix over Tr tokens attending
  Tp + Tr keys per micro-batch, then the prefix vjp over the first mini-batch's prompt rows and the
  boundary-KV cotangents accumulated for them (with ``--actor_prefix=recompute``, the recomputed prefix
  of one micro-batch's prompt rows: its saved activations and backward);
- with fsdp > 1 every program also holds FSDP-gathered weights (``shards``): a backward all of them, a
  forward its non-layer weights and one layer's and block's; the prefix vjp
  holds a text layer's and a vision block's working sets together and a per-layer carry
  (``activations.backward_carry``), calibrated against ``launch.plan --compile`` at 3B and scale_cpu;
  rollplex with several mini-batches: the train phase is the fuller of its two moments (``rollplex``);
- update: the fp32 AdamW temporaries (cast gradients and the update) over the optimizer shard: all of it
  at once (naive), one chunk at a time (rollplex); the clipped gradients (a copy) count as gradients.
- other: the prompts' inputs (fp32 patches, ids, masks, positions), whole on the busiest device (the host
  builds them and the programs take them replicated), and the rollouts; rollplex also keeps the inputs of
  every row subset a program took until the step ends (``rows.input_copies``: up to a second copy of the
  step's inputs); naive keeps per-sample inputs (each prompt's patches repeated for its G answers, as the
  serial schedule's micro-batches are built up front).

Naive colocation vs the paper's "about 165 GiB per GPU" (Qwen2.5-VL-32B, 32 x H800): with
``configs/qwen2_5_vl_32b_h800x32.flags`` on its previous mesh (``--train_dp=1 --train_fsdp=4 --max_batch=256``)
this planner's naive layout gives about 91 GiB, 28 of them the 256 answers' inputs held whole on every device
(dense attention with per-layer recompute: about 114 GiB; on the flagfile's tp 8 x dp 4, weights and gradients
over tp only: about 102 GiB). It is our runtime's sharding with everything resident, not the paper's stack:
there weights, bf16 gradients, fp32 master weights and Adam moments all sharded over the 32 GPUs (ZeRO-3 style),
a rollout KV cache of exactly the sequences a replica decodes, one sequence per GPU per micro-batch with a
memory-efficient attention kernel and per-layer recompute, and by definition no boundary KV. The paper's stack is
planned by ``baseline.megatron_vllm`` (``launch.plan --baseline=megatron_vllm``, HYPOTHETICAL): weights over TP 8 only,
Megatron's fp32 main-grad buffers, its distributed optimizer over the data-parallel group, vLLM's pool at
gpu_memory_utilization 0.9 x 80 GiB, per-sample actor and reference boundary KV: about 147 GiB, 18 GiB under
the paper's figure (not tuned to match). vLLM's gpu_memory_utilization moves it most (0.45: -36 GiB); without
a distributed optimizer (master weights and moments over TP only) it is +35 GiB (182 GiB).
"""

from __future__ import annotations

import math

from rollplex_jax.config import Config
from rollplex_jax.config.shapes import planned_micro_batch
from rollplex_jax.memory.classes import CLASSES, PHASES
from rollplex_jax.memory.planner.activations import (
    BWD_FACTOR,
    Pass,
    block_temp,
    layer_temp,
    one_layer_saved,
    saved_activations,
)
from rollplex_jax.memory.planner.rollplex import prefix_rows, rollplex
from rollplex_jax.memory.planner.sizes import Sizes, shared_sizes
from rollplex_jax.memory.planner.types import (
    F32,
    Lengths,
    Plan,
    PlanMesh,
    ProgramModel,
    dtype_bytes,
)

WEIGHT_SHARING_RULE = (
    "rollout weights: per-tensor classification (rollplex_jax/weights/classify.py) of the engine's tensors against the "
    "training shards on each device (rank r of rollout replica j on training device j*rollout_tp + r): aligned "
    "and view tensors alias the actor's compute weights, rebuilt ones (fused, resharded, padded) are "
    "engine-owned buffers; rollout_weights = the largest rebuilt bytes of any device, held in every phase by one "
    "process (refilled after each update), during the rollout only with several (--process_devices: all-gathered "
    "before each rollout, the weight sync per rank)")


def _zeros() -> dict:
    return {p: {c: 0.0 for c in CLASSES} for p in PHASES}


def naive_colocation(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes) -> dict:
    """{phase: {class: bytes}} of serial colocation with everything resident (module doc)."""
    grads = s.compute
    act = naive_activations(cfg, lengths, mesh, pm, s)
    naive = _zeros()
    for p in PHASES:
        naive[p].update(compute_weights=s.compute, master_weights=s.master, optimizer_state=s.moments,
                        ref_weights=s.ref, rollout_weights=s.rollout_copy, rollout_kv=s.rollout_kv,
                        gradients=grads, other=s.other_naive, activations=act[p])
    # the micro-batch's gradient before it is added to the accumulator, and the FSDP-gathered weights (``shards``)
    naive["train"]["activations"] += grads + s.gathered.all
    if cfg.rl.uses_reference:
        naive["score"]["activations"] += s.gathered.forward
    naive["update"]["gradients"] += grads  # the clipped gradients (a copy: the clip program's output)
    return naive


def naive_activations(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes) -> dict:
    """{phase: bytes} of the serial schedule's phase-local temporaries over full sequences, one micro-batch per
    program, without a gradient-sized buffer (module doc; ``baseline`` reuses them)."""
    m = cfg.model
    x, v, b = m.text, m.vision, dtype_bytes(m)
    Tr, tp, r_mb = lengths.response_tokens, mesh.tp, s.r_mb
    patches = lengths.vision_tokens * v.spatial_merge_size**2
    t_full = lengths.prompt_tokens + Tr
    n_mb = r_mb * patches
    score = (2 * r_mb * t_full * x.hidden_size * b
             + max(layer_temp(m, r_mb, t_full, t_full, pm, tp),
                   block_temp(m, n_mb, pm, patches, tp) + 2 * n_mb * v.hidden_size * b)
             ) + r_mb * s.logits_row * (t_full * (F32 + b) + Tr * 2 * F32)
    train = (saved_activations(m, Pass(r_mb, t_full, t_full, n_mb, patches), pm, tp)
             + BWD_FACTOR * max(layer_temp(m, r_mb, t_full, t_full, pm, tp), block_temp(m, n_mb, pm, patches, tp))
             + one_layer_saved(m, r_mb, t_full, t_full, n_mb, pm, tp)) \
        + r_mb * s.logits_row * (t_full * (2 * F32 + b) + Tr * 2 * F32)
    return {"rollout": s.engine_tmp, "score": score if cfg.rl.uses_reference else 0.0, "train": train,
            "update": 2 * s.opt_elems * F32}  # the fp32 AdamW temporaries over the optimizer's shard


def _assumptions(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, s: Sizes,
                 policy: str) -> list[str]:
    Tp, Tv, Tr = lengths.prompt_tokens, lengths.vision_tokens, lengths.response_tokens
    patches = Tv * cfg.model.vision.spatial_merge_size**2
    actor_how = ("keeps its vjp residuals (no weights: the params are passed to the prefix vjp again) for the "
                 "first mini-batch's prefix rows" if cfg.run.actor_prefix == "residuals"
                 else "is recomputed in the update, micro-batch by micro-batch (only its boundary KV is kept)")
    offload, chunks, c = policy == "offload", cfg.memory.optimizer_chunks, s.classification
    return [
        pm.describe(),
        f"lengths per row: prompt {Tp} tokens ({Tv} of them vision, {patches} patches), answer {Tr} tokens; "
        + lengths.source,
        f"devices {mesh.devices}: training fsdp {mesh.fsdp} x tp {mesh.tp} x dp {mesh.dp} (batch over "
        f"{mesh.batch_shards} shards; tp splits attention heads and MLP widths, the residual stream is whole on "
        f"every device of a tp group); rollout {mesh.rollout_replicas} replicas at tp {mesh.rollout_tp}, "
        f"{s.rows_roll} sequences each"
        + (f"; dp {mesh.dp} (--train_dp): weights and reference replicated over it, the optimizer state "
           + ("sharded over it (ZeRO-1, --optimizer_shard=dp)" if mesh.zero_dp else "replicated")
           if mesh.dp > 1 else ""),
        "compute weights, gradients, reference weights, fp32 master weights and Adam moments: each parameter's "
        "shard on the fsdp x tp mesh (a dimension a mesh axis does not divide stays whole)"
        + (f", master weights and moments / {mesh.optimizer_shards} (ZeRO-1 over dp)"
           if mesh.optimizer_shards > 1 else "")
        + ("; with fsdp > 1 a backward holds every weight FSDP-gathered, a forward its non-layer weights and one "
           "layer's" if mesh.fsdp > 1 else ""),
        f"micro-batch: {planned_micro_batch(cfg)} rows globally -> {s.r_mb} per device (scoring and training run one "
        "micro-batch per program, in both schedules)",
        f"rollout KV cache: {s.rows_roll} sequences x {Tp + Tr} tokens per engine replica, no prompt sharing "
        "inside the engine (an upper bound for vLLM's prefix caching); naive colocation keeps it allocated in "
        "every phase, rollplex only during the rollout",
        f"rollplex: {'one prefix per prompt' if cfg.run.prefix_sharing else 'one prefix per answer'} "
        f"({prefix_rows(cfg, mesh)} prefix rows per device); actor prefix {actor_how}; reference boundary KV "
        "freed after scoring, actor boundary KV after training"
        + ("; reference off (no KL in the objective and no --log_kl)" if not cfg.rl.uses_reference else ""),
        f"rollplex optimizer state: {policy}" + (f" (host memory outside update; one chunk of 1/{chunks} on "
                                                  "the device during update)" if offload else ""),
        WEIGHT_SHARING_RULE + f" ({c['layout']} layout: "
        f"{', '.join(f'{k} {v:.1%}' for k, v in c['fractions'].items())} of the engine's bytes)",
        "naive colocation: per-sample inputs and prefixes (each prompt's patches repeated for its G answers), "
        "no boundary state, full-sequence scoring and training, a full rollout copy of the weights",
    ]


def _details(cfg: Config, lengths: Lengths, mesh: PlanMesh, s: Sizes) -> dict:
    return {
        "prefix_rows_per_device": prefix_rows(cfg, mesh),
        "answers_per_prefix": cfg.rollout.group_size if cfg.run.prefix_sharing else 1,
        "micro_rows_per_device": s.r_mb, "rollout_rows_per_replica": s.rows_roll,
        "batch_shards": mesh.batch_shards, "data_parallel": mesh.dp, "optimizer_chunks": cfg.memory.optimizer_chunks,
        # torch-side figures (the rollout engine's working set), not visible to JAX's live-array count:
        "engine_activation_bytes": int(s.engine_tmp), "rollout_kv_bytes": int(s.rollout_kv),
    }


def build_plan(cfg: Config, lengths: Lengths, mesh: PlanMesh, pm: ProgramModel, policy: str) -> Plan:
    """Both layouts under an explicit optimizer ``policy`` ('resident' or 'offload') for rollplex."""
    s = shared_sizes(cfg, lengths, mesh, pm)
    weight_sharing = {
        "status": "classified",
        "rule": WEIGHT_SHARING_RULE,
        "train_shards": mesh.weight_shards,
        "rollout_tp": mesh.rollout_tp,
        "rebuilt_bytes_per_device": int(s.rebuilt),
        "rebuilt_fraction_of_rollout_shard": round(s.rebuilt / s.rollout_copy, 4) if s.rollout_copy else 0.0,
        "naive_copy_bytes_per_device": int(s.rollout_copy),
        "floor_bytes_per_device": s.classification["floor_bytes_per_device"],
        "data_parallel": mesh.dp,
        "classification": s.classification,
    }
    phases = {"naive_colocation": naive_colocation(cfg, lengths, mesh, pm, s),
              "rollplex": rollplex(cfg, lengths, mesh, pm, s, policy)}
    layouts = {name: {p: {c: int(math.ceil(v)) for c, v in ph[p].items()} for p in PHASES}
               for name, ph in phases.items()}
    return Plan(layouts=layouts, devices=mesh.devices, lengths=lengths, programs=pm,
                optimizer_policy=policy, budget_bytes=cfg.memory.budget_bytes, params=s.counts,
                weight_sharing=weight_sharing, assumptions=tuple(_assumptions(cfg, lengths, mesh, pm, s, policy)),
                details=_details(cfg, lengths, mesh, s))
