"""The default torch thread count of a CPU rollout (rollplex_jax/parallel/threads.py, run_setup.make_engine)."""

import dataclasses

import pytest
import torch

from rollplex_jax.config import Config
from rollplex_jax.parallel import threads
from rollplex_jax.run import setup as run_setup


def test_default_rule_is_half_the_cores_at_least_one():
    assert [threads.default_torch_threads(c) for c in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    with pytest.raises(ValueError):
        threads.default_torch_threads(0)


@pytest.fixture
def restore_threads():
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("given, cores, engine, on_cpu, expected", [
    (0, 2, "hf", True, 1),  # default on a CPU decode: the rule
    (0, 8, "hf", True, 4),
    (3, 8, "hf", True, 3),  # --torch_threads=3 is kept
    (0, 8, "hf", False, 7),  # a GPU decode: torch as it was (7, set below)
])
def test_make_engine_sets_torch_threads(monkeypatch, restore_threads, given, cores, engine, on_cpu, expected):
    torch.set_num_threads(7)
    built = object()
    monkeypatch.setattr(run_setup, "_build_engine", lambda cfg, plan=None: built)
    monkeypatch.setattr(run_setup, "decodes_on_cpu", lambda cfg: on_cpu)
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    cfg = Config()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, torch_threads=given, engine=engine))
    engine = run_setup.make_engine(cfg)
    assert engine.inner is built  # behind the rollout deadline (--rollout_timeout_s, on by default)
    assert torch.get_num_threads() == expected


def test_decodes_on_cpu():
    cfg = Config()
    assert run_setup.decodes_on_cpu(cfg)  # tests run on CPU: the transformers engine views CPU buffers
    assert not run_setup.decodes_on_cpu(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout,
                                                                                              engine="vllm")))
