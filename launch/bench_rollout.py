"""The rollout alone, with and without one prefill per prompt, on a flagfile's model and first batch.

  python -m launch.bench_rollout --flagfile=configs/bench_vlm448_cpu.flags [--rollout_repeats=5]

Binds the engine (``--engine=hf``) to the run's initial params, then times ``rl_step.sample`` (bind, generate,
release) on the run's first batch of prompts, G answers each, alternating the two ways: ``shared`` (each prompt
prefilled once for its G answers, the default) and ``per_answer`` (each answer prefills its own copy of the
prompt, as transformers' ``generate`` does). Prints one JSON line: each way's min and median seconds, the ratio
of the minima, the prompt tokens each prefilled, and whether both sampled the same answers (they must: sampling
is per answer; log-probs may differ by float noise, ``max_logprob_diff``).
"""

import json
import statistics
import time

from absl import app, flags, logging

from launch import flags as launch_flags

_REPEATS = flags.DEFINE_integer("rollout_repeats", 5, "Timed rollouts per way (after one warm-up each).",
                                lower_bound=1)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    import numpy as np

    from rollplex_jax.data import dataset as data_lib
    from rollplex_jax.run.runner import Runner
    from rollplex_jax.step import rl_step

    cfg = launch_flags.config_from_flags(flags.FLAGS)
    if cfg.rollout.engine != "hf":
        raise app.UsageError("launch.bench_rollout times the HF engine's two prefill ways: use --engine=hf")
    runner = Runner(cfg)
    batch = [runner.train_set[i] for i in runner.sampler.next_indices()]
    prompts = data_lib.collate(batch, runner.tokenizer.pad_id)
    g, times, outs = cfg.rollout.group_size, {"shared": [], "per_answer": []}, {}
    for k in range(_REPEATS.value + 1):
        for way in times:
            runner.engine.share_prefill = way == "shared"
            t0 = time.perf_counter()
            outs[way] = rl_step.sample(runner.ctx, runner.state.params, prompts, rl_step.Draw(n=g, seed=k))
            if k:  # the first of each way is a warm-up
                times[way].append(time.perf_counter() - t0)
    runner.engine.share_prefill = True
    runner.close()
    a, b = outs["shared"], outs["per_answer"]
    out = {"ways": {w: {"min_s": min(t), "median_s": statistics.median(t), "prefill_tokens": outs[w].prefill_tokens}
                    for w, t in times.items()},
           "speedup": min(times["per_answer"]) / min(times["shared"]),
           "same_answers": bool(np.array_equal(a.response_ids, b.response_ids)),
           "max_logprob_diff": float(np.abs(a.logprobs - b.logprobs).max()),
           "rows": prompts.batch_size * g, "prompt_tokens": int(prompts.attention_mask.sum())}
    print(json.dumps(out))


if __name__ == "__main__":
    launch_flags.define_flags()
    app.run(main)
