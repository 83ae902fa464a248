"""The serial GRPO step: update skipping, exact micro-batch accumulation, determinism, reward failures."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rollplex_jax.config import Config, DataConfig, ModelConfig, OptimConfig, RlConfig, RolloutConfig, RunConfig
from rollplex_jax.models.vl.params import init_params, params_sha256
from rollplex_jax.programs.actor import Answers, make_programs
from rollplex_jax.programs.sequences import micro_batches
from rollplex_jax.rl import losses
from rollplex_jax.rl.rewards import RewardError
from rollplex_jax.run.runner import Runner
from rollplex_jax.step import rl_step
from tests.paths import REPO


def small_config(tmp_path, **rl) -> Config:
    model = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    return Config(
        model=model,
        data=DataConfig(synthetic_n=32, eval_n=8, min_pixels=3136, max_pixels=3136, max_prompt_len=64),
        rollout=RolloutConfig(group_size=4, max_new_tokens=3, max_batch=64),
        rl=RlConfig(batch_prompts=4, micro_batch=16, **rl),
        optim=OptimConfig(lr=1e-3),
        run=RunConfig(workdir=str(tmp_path / "run"), steps=3, progress=False),
    )


def test_should_update():
    adv = jnp.array([[1.0, -1.0], [0.0, 0.0]])
    assert rl_step.should_update(adv, np.array([[2, 3], [1, 1]]))
    assert not rl_step.should_update(jnp.zeros((2, 2)), np.array([[2, 3], [1, 1]]))
    assert not rl_step.should_update(adv, np.array([[0, 0], [1, 1]]))  # the answers with signal are empty


def test_nonfinite_gradient_skips_the_update():
    cfg = ModelConfig.from_json_file(REPO / "configs" / "models" / "demo.json")
    prog = make_programs(cfg, RlConfig(), OptimConfig(), total_steps=10, temperature=1.0)
    params = init_params(cfg, jax.random.key(0))
    before = params_sha256(params)
    state = prog.optimizer.init(params)
    grads = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
    new, new_state, m = prog.update(params, state, grads)
    assert not bool(m["update_ok"]) and not np.isfinite(float(m["grad_norm"]))
    assert params_sha256(new) == before
    ok = jax.tree.map(lambda x: jnp.zeros_like(x), new)
    _, _, m2 = prog.update(new, new_state, ok)
    assert bool(m2["update_ok"])


def test_no_signal_step_leaves_params_unchanged(tmp_path, monkeypatch):
    cfg = dataclasses.replace(small_config(tmp_path), rl=dataclasses.replace(small_config(tmp_path).rl,
                                                                               reward="tests.reward_fns:always_one"))
    r = Runner(cfg)
    before = params_sha256(r.state.params)
    m = r.train_step()
    assert m["reward/mean"] == 1.0 and m["skipped_steps/no_signal"] == 1.0
    assert params_sha256(r.state.params) == before
    r.finish()


def test_micro_batches_accumulate_to_the_full_batch_gradient(tmp_path):
    cfg = small_config(tmp_path)
    r = Runner(cfg)
    prompts = __import__("rollplex_jax.data.dataset", fromlist=["collate"]).collate(r.train_set[:4], 0)
    ro = rl_step.sample(r.ctx, r.state.params, prompts, rl_step.Draw(n=4, seed=0))
    b, g, tr = ro.response_ids.shape
    mask = jnp.asarray(ro.mask.reshape(b * g, tr))
    weights = losses.token_weights(mask, "token-mean")
    adv = jnp.asarray(np.random.default_rng(0).standard_normal(b * g), jnp.float32)

    def total_grad(micro):
        acc = None
        for mb in micro_batches(cfg.model, prompts, ro, micro):
            answers = Answers(ids=mb.response_ids, weights=weights[mb.rows], advantages=adv[mb.rows])
            (_, _), gr = r.programs.grad(r.state.params, mb.inputs, mb.prompt_len, answers)
            acc = gr if acc is None else jax.tree.map(jnp.add, acc, gr)
        return acc

    full, split = total_grad(16), total_grad(3)
    scale = max(float(jnp.abs(v).max()) for v in full.values())
    for k in full:  # equal up to fp32 summation order: 1e-5 relative to the largest gradient entry
        np.testing.assert_allclose(np.asarray(split[k]), np.asarray(full[k]), rtol=0, atol=1e-5 * scale, err_msg=k)
    r.finish()


def test_same_seed_same_params_and_reward_failures_are_counted(tmp_path):
    cfg_a = small_config(tmp_path / "a", reward="tests.reward_fns:flaky")
    cfg_b = dataclasses.replace(cfg_a, run=dataclasses.replace(cfg_a.run, workdir=str(tmp_path / "b" / "run")))
    sums = []
    for cfg in (cfg_a, cfg_b):
        r = Runner(cfg)
        ms = list(r.run())
        assert all("loss" in m or m["skipped_steps/no_signal"] for m in ms)
        assert sum(m["reward/failures"] for m in ms) > 0  # flaky raises on some answers: counted, run goes on
        sums.append(r.finish()["params_sha256"])
    assert sums[0] == sums[1]


def test_reward_failure_raise_stops_the_run(tmp_path):
    cfg = small_config(tmp_path, reward="tests.reward_fns:always_raise", reward_failure="raise")
    r = Runner(cfg)
    with pytest.raises(RewardError, match="sample 0"):
        r.train_step()
    r.close()
