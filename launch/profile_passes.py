"""The serial schedule's reference and actor passes, JAX beside transformers' torch Qwen2.5-VL, in one process.

  python -m launch.profile_passes --flagfile=configs/bench_vlm448_cpu.flags [--profile_repeats=5]
      [--profile_trace_dir=DIR] [--noprofile_torch] [--profile_uncapped]

What is timed, on one batch built like the serial step's (B prompts of the flagfile's data, each repeated for
its G answers; answers of random tokens and lengths, no rollout), with the params of ``--seed``:

- ``jax_inputs``: host-side assembly of the micro-batches (``programs.sequences.micro_batches``: M-RoPE index,
  vision layout, device transfer);
- ``jax_reference``: ``ref_logprobs`` over every micro-batch (what ``SerialOps.ref_logp`` runs);
- ``jax_actor``: ``grad`` (loss, fwd + bwd) over every micro-batch plus the gradient accumulation;
- ``torch_reference``: transformers' forward on the same rows (sdpa attention, ``logits_to_keep`` so only the
  answer positions reach the vocabulary projection, as ours) and the answers' log-probs, under ``no_grad``;
- ``torch_actor``: the same forward with autograd, a loss of the same shape (a weighted sum of the answers'
  log-probs) and its backward.

The torch side gets the M-RoPE positions precomputed (ours, which the parity tests check against
transformers'), so both time the model, not the host. Both use the process's default threads. Passes run
interleaved, ``--profile_repeats`` rounds after one warm-up, min and median per pass printed; the
largest |logp_jax - logp_torch| checks that both computed the same thing. Each JAX phase's FLOPs
(``programs.costs.serial_phase_costs``: XLA's count of the same programs with dense attention, which has no
loops) are printed beside its time as a rate, with XLA's count of the programs as run and their while loops
(counted once each by XLA: a lower bound).
``--profile_uncapped`` adds the JAX passes as they ran before ``attention.cache_block`` (before/after in one
process). ``--profile_trace_dir`` writes a ``jax.profiler`` trace of one more round of the JAX passes.
Prints one JSON line last.
"""

import json
import statistics
import sys
import time

from absl import app, flags, logging

from launch import flags as launch_flags

_REPEATS = flags.DEFINE_integer("profile_repeats", 5, "Timed rounds (each pass once per round).", lower_bound=1)
_TRACE = flags.DEFINE_string("profile_trace_dir", "", "Write a jax.profiler trace of one round of the JAX passes.")
_TORCH = flags.DEFINE_boolean("profile_torch", True, "Also time transformers' torch model on the same batch.")
_UNCAPPED = flags.DEFINE_boolean("profile_uncapped", False, "Also time the JAX passes traced without the CPU "
                                 "block cap (models/attention.cache_block): the programs as they were before it.")


def serial_batch(cfg):
    """(prompts, rollouts): the first B prompts of the run's data and G random answers each (seeded)."""
    import numpy as np

    from rollplex_contract.batch import Rollouts
    from rollplex_jax.data import dataset as data_lib
    from rollplex_jax.parallel import multihost
    from rollplex_jax.run import setup as run_setup

    tok = run_setup.tokenizer(cfg)
    ds, _ = run_setup.load_split(cfg, tok, cfg.run.workdir, multihost.Processes(), "train", log=lambda *a, **k: None)
    prompts = data_lib.collate([ds[i] for i in range(cfg.rl.batch_prompts)], tok.pad_id)
    b, g, t = cfg.rl.batch_prompts, cfg.rollout.group_size, cfg.rollout.max_new_tokens
    rng = np.random.default_rng(cfg.run.seed)
    lengths = rng.integers(max(1, t // 2), t + 1, size=(b, g))
    ids = rng.integers(10, cfg.model.text.vocab_size, size=(b, g, t)).astype(np.int32)
    ids[np.arange(t)[None, None] >= lengths[..., None]] = cfg.model.pad_token_id
    rollouts = Rollouts(response_ids=ids, lengths=lengths, finish_reasons=[["length"] * g] * b,
                        logprobs=np.zeros((b, g, t), np.float32))
    return prompts, rollouts


def jax_passes(cfg, params, prompts, rollouts):
    """name -> zero-argument callable running that JAX pass to completion; and the extras for the report."""
    import jax
    import jax.numpy as jnp

    from rollplex_jax.models.vl.model import InputOptions
    from rollplex_jax.programs.actor import Answers, make_programs
    from rollplex_jax.programs.sequences import micro_batches
    from rollplex_jax.rl import losses

    programs = make_programs(cfg.model, cfg.rl, cfg.optim, 1, prog=cfg.programs, temperature=cfg.rollout.temperature)
    mbs = micro_batches(cfg.model, prompts, rollouts, cfg.rl.micro_batch, opts=InputOptions(pack=cfg.programs.packing))
    mask = jnp.asarray(rollouts.mask.reshape(-1, rollouts.mask.shape[-1]))
    weights = losses.token_weights(mask, cfg.rl.loss_agg)
    adv = jax.random.normal(jax.random.key(1), (weights.shape[0],))  # any advantages: timing, not learning
    ref = jnp.concatenate([programs.ref_logprobs(params, mb.inputs, mb.prompt_len, mb.response_ids,
                                                 mb.response_mask) for mb in mbs])

    def reference():
        return jax.block_until_ready(jnp.concatenate(
            [programs.ref_logprobs(params, mb.inputs, mb.prompt_len, mb.response_ids, mb.response_mask)
             for mb in mbs]))

    def grad_args(mb):
        r = mb.rows
        return (params, mb.inputs, mb.prompt_len, Answers(ids=mb.response_ids, weights=weights[r], advantages=adv[r],
                                                          ref=ref[r]))

    def actor():
        acc = None
        for mb in mbs:
            (_, _), g = programs.grad(*grad_args(mb))
            acc = g if acc is None else programs.accumulate(acc, g)
        return jax.block_until_ready(acc)

    def inputs():
        return jax.block_until_ready([mb.inputs for mb in micro_batches(cfg.model, prompts, rollouts,
                                                                         cfg.rl.micro_batch,
                                                                         opts=InputOptions(pack=cfg.programs.packing))])

    calls = {"jax_reference": [(programs.ref_logprobs, (params, mb.inputs, mb.prompt_len, mb.response_ids,
                                                        mb.response_mask)) for mb in mbs],
             "jax_actor": [(programs.grad, grad_args(mb)) for mb in mbs]}
    extras = dict(mbs=mbs, weights=weights, adv=adv, ref=ref, calls=calls)
    return {"jax_inputs": inputs, "jax_reference": reference, "jax_actor": actor}, extras


def torch_model(cfg, params):
    """transformers' Qwen2.5-VL (sdpa attention, fp32) holding copies of ``params``."""
    import numpy as np
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from rollplex_jax.models.vl.fused import to_hf
    from rollplex_jax.models.vl.hf_checkpoint import normalize_name

    hf_cfg = Qwen2_5_VLConfig(**cfg.model.to_hf_dict())
    hf_cfg._attn_implementation = "sdpa"
    model = Qwen2_5_VLForConditionalGeneration(hf_cfg).float()
    state = {}
    params = to_hf(params, cfg.model)  # the checkpoint's tensors (separate q/k/v, gate/up; the vocabulary)
    for name, t in model.state_dict().items():
        key = normalize_name(name)
        if key == "lm_head.weight" and cfg.model.tie_word_embeddings:
            key = "model.embed_tokens.weight"
        state[name] = torch.from_numpy(np.array(params[key], np.float32)).reshape(t.shape)
    model.load_state_dict(state)
    return model.train(False)


def torch_passes(cfg, model, mbs, weights, adv):
    """name -> zero-argument callable for the torch passes (same rows, micro-batches and weights)."""
    import numpy as np
    import torch

    feeds = []
    for mb in mbs:
        inp = mb.inputs
        grid = np.asarray(_grids(cfg, mb), np.int64)
        feeds.append(dict(
            kw=dict(input_ids=torch.from_numpy(np.asarray(inp.input_ids, np.int64)),
                    attention_mask=torch.from_numpy(np.asarray(inp.attention_mask, np.int64)),
                    mm_token_type_ids=torch.from_numpy(np.asarray(inp.token_types)),
                    position_ids=torch.from_numpy(np.asarray(inp.positions, np.int64)),
                    pixel_values=torch.from_numpy(np.asarray(inp.pixel_values)),
                    image_grid_thw=torch.from_numpy(grid),
                    logits_to_keep=mb.response_ids.shape[1] + 1),
            ids=torch.from_numpy(np.asarray(mb.response_ids, np.int64)),
            mask=torch.from_numpy(np.asarray(mb.response_mask) > 0),
            w=torch.from_numpy(np.asarray(weights[mb.rows])), adv=torch.from_numpy(np.asarray(adv[mb.rows]))))

    def logp(f):
        logits = model(**f["kw"]).logits[:, :-1].float()
        picked = torch.log_softmax(logits, -1).gather(-1, f["ids"][..., None])[..., 0]
        return torch.where(f["mask"], picked, 0.0)

    def reference():
        with torch.no_grad():
            return torch.cat([logp(f) for f in feeds])

    def actor():
        model.zero_grad(set_to_none=True)
        for f in feeds:
            loss = -(f["adv"][:, None] * logp(f) * f["w"]).sum()
            loss.backward()
        return loss

    return {"torch_reference": reference, "torch_actor": actor}


def _grids(cfg, mb):
    """The image grids of a micro-batch's rows (recovered from its vision layout's patch count: one image a
    row, all of one size, which ``serial_batch`` gives for the synthetic data)."""
    import numpy as np

    rows = mb.inputs.input_ids.shape[0]
    n = mb.inputs.pixel_values.shape[0] // rows
    merge = cfg.model.vision.spatial_merge_size
    side = int(round(np.sqrt(n)))
    if side * side != n or side % merge:
        raise ValueError(f"profile_passes expects square images, one a row; got {n} patches a row")
    return [[1, side, side]] * rows


def uncapped_passes(cfg, params, prompts, rollouts) -> dict:
    """The JAX reference and actor passes traced (and compiled) with ``attention.CPU_BLOCK_BYTES`` unbounded,
    i.e. with ``--attention_block`` as given (the blockwise kernel before ``cache_block``), as
    ``jax_*_uncapped``."""
    from rollplex_jax.models import attention

    saved, attention.CPU_BLOCK_BYTES = attention.CPU_BLOCK_BYTES, float("inf")
    try:
        passes, _ = jax_passes(cfg, params, prompts, rollouts)
        for name in ("jax_reference", "jax_actor"):
            passes[name]()  # traced now, under the unbounded rule
    finally:
        attention.CPU_BLOCK_BYTES = saved
    return {f"{name}_uncapped": passes[name] for name in ("jax_reference", "jax_actor")}


def time_interleaved(passes: dict, repeats: int) -> dict:
    """Runs every pass once (warm-up), then ``repeats`` rounds of all of them in turn: name -> seconds."""
    for fn in passes.values():
        fn()
    times = {name: [] for name in passes}
    for _ in range(repeats):
        for name, fn in passes.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: {"min_s": min(t), "median_s": statistics.median(t)} for name, t in times.items()}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    import jax
    import numpy as np

    from rollplex_jax.models.vl.params import init_params
    from rollplex_jax.programs.costs import ZERO, PhasePrograms, program_costs, serial_phase_costs

    cfg = launch_flags.config_from_flags(flags.FLAGS)
    params = init_params(cfg.model, jax.random.key(cfg.run.seed))
    prompts, rollouts = serial_batch(cfg)
    passes, extra = jax_passes(cfg, params, prompts, rollouts)
    out = {"rows": int(rollouts.response_ids.size // rollouts.response_ids.shape[-1]),
           "prompt_len": int(prompts.input_ids.shape[1]), "micro_batches": len(extra["mbs"])}
    if _UNCAPPED.value:
        passes.update(uncapped_passes(cfg, params, prompts, rollouts))
    if _TORCH.value:
        model = torch_model(cfg, params)
        passes.update(torch_passes(cfg, model, extra["mbs"], extra["weights"], extra["adv"]))
        diff = np.abs(np.asarray(extra["ref"]) - passes["torch_reference"]().numpy()).max()
        out["max_abs_logp_diff_jax_torch"] = float(diff)
    out["passes"] = time_interleaved(passes, _REPEATS.value)
    phases = serial_phase_costs(PhasePrograms.of(cfg), params, params, extra["mbs"],
                                extra["weights"], extra["adv"], None, extra["ref"])
    for name, phase in (("jax_reference", "reference"), ("jax_actor", "actor")):
        timed = sum((program_costs(fn, *args) for fn, args in extra["calls"][name]), ZERO)
        r = out["passes"][name]
        r.update(flops=phases[phase].flops, bytes_accessed=phases[phase].bytes_accessed,
                 gflops_per_s=phases[phase].flops / r["min_s"] / 1e9,
                 xla_flops_as_run=timed.flops, while_loops_as_run=timed.while_loops)
    if _TRACE.value:
        with jax.profiler.trace(_TRACE.value):
            passes["jax_reference"]()
            passes["jax_actor"]()
    for name, r in out["passes"].items():
        print(f"{name:16s} min {r['min_s']:.3f} s  median {r['median_s']:.3f} s"
              + (f"  {r['flops'] / 1e9:.2f} GFLOP  {r['gflops_per_s']:.1f} GFLOP/s" if "flops" in r else ""),
              file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    launch_flags.define_flags()
    app.run(main)
