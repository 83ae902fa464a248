"""Per-step metrics of tiny runs: the engine-vs-trainer log-prob mismatch and the throughput per training device.

``rollout/logprob_abs_diff_{mean,max}``: |engine log-prob - trainer log-prob under theta_k| over the answer tokens,
every step, both schedules: measured inside the first mini-batch's gradient programs (one mini-batch), by the old
log-prob pass (two mini-batches), or by one log-prob pass on a step that skips its update (no signal). Checked
against the same quantity recomputed here from the step's rollouts and theta_k with the serial scoring program
(another program: fp32 reduction-order noise apart, ~1e-7 per token here), and at --temperature=0.7 on the fp32 demo
model the mean must be <= 1e-4 (measured ~1e-6). The bound is tight enough to catch a trainer left at T = 1: the
same recomputation at T = 1 is > 1e-2 off (asserted).

``perf/throughput``: tokens per second per *training* device (fsdp x tp = 1 here) while the test environment shows
4 fake devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.api import runner_from_flagfile
from rollplex_jax.data.dataset import collate
from rollplex_jax.programs.actor import make_programs
from rollplex_jax.programs.sequences import micro_batches
from tests.test_runner_api import TINY

T = 0.7


def _quiet(msg):
    pass


def _trainer_logp(r, programs, params, prompts, ro) -> np.ndarray:
    """The answers' log-probs [B*G, Tr] under ``params`` by ``programs``' serial scoring program."""
    with r.mesh_scope():
        return np.concatenate([np.asarray(programs.old_logprobs(params, mb.inputs, mb.prompt_len, mb.response_ids,
                                                                mb.response_mask))
                               for mb in micro_batches(r.cfg.model, prompts, ro, 64)])


@pytest.mark.parametrize("schedule,mini,reward", [("serial", 1, "tests.reward_fns:length_parity"),
                                                  ("rollplex", 1, "tests.reward_fns:length_parity"),
                                                  ("serial", 2, "tests.reward_fns:length_parity"),
                                                  ("rollplex", 1, "tests.reward_fns:always_one")])
def test_logprob_mismatch_every_step(tmp_path, schedule, mini, reward):
    r = runner_from_flagfile("configs/tiny_cpu.flags", workdir=tmp_path, schedule=schedule, log=_quiet,
                             **{**TINY, "temperature": T, "mini_batches": mini, "micro_batch": 4, "reward": reward})
    programs = {t: make_programs(r.cfg.model, r.cfg.rl, r.cfg.optim, 1, temperature=t, prog=r.cfg.programs)
                for t in (T, 1.0)}
    theta_k = jax.tree.map(jnp.copy, r.state.params)  # the update donates theta_k
    (m,) = r.run(1)
    ro, prompts = r.last.rollouts, collate(r.last_prompts, r.tokenizer.pad_id)
    real = ro.mask.reshape(-1, ro.mask.shape[-1]) > 0
    engine = ro.logprobs.reshape(real.shape)
    d = np.abs(engine - _trainer_logp(r, programs[T], theta_k, prompts, ro))[real]
    mean, top = m["rollout/logprob_abs_diff_mean"], m["rollout/logprob_abs_diff_max"]
    print(f"{schedule} mini {mini} {reward}: mean {mean:.3g} max {top:.3g} (recomputed {d.mean():.3g}, "
          f"{d.max():.3g}); skipped {m['skipped_steps/no_signal']}")
    assert mean <= 1e-4 and top <= 1e-3
    assert abs(mean - d.mean()) <= 1e-6 and abs(top - d.max()) <= 1e-5
    assert np.abs(engine - _trainer_logp(r, programs[1.0], theta_k, prompts, ro))[real].mean() > 1e-2
    # always_one: no signal, no update (the metric from one log-prob pass); length_parity: an update's programs
    assert m["skipped_steps/no_signal"] == float(reward.endswith("always_one"))
    assert m["perf/throughput"] == pytest.approx(m["perf/total_num_tokens"] / m["time/step_s"])
    assert r.cfg.mesh.train_devices == 1 and jax.device_count() == 4
    r.close()
