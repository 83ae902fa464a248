"""The decode shares of a multi-process run with ``--rollout_tp`` (issue 33): a TP group of consecutive processes
decodes one share together, the groups' shares cover the batch once, and the gathered batch takes one rank's rows
per group (``multihost.Processes.decode_share`` / ``keeps_rollouts``, ``multihost.first_rows``)."""

import numpy as np
import pytest

from rollplex_contract.batch import Rollouts
from rollplex_jax.parallel.multihost import Processes, first_rows
from rollplex_jax.rl.rewards import RewardScores


@pytest.mark.parametrize("count, tp, batch", [(2, 2, 4), (4, 2, 5), (8, 4, 8), (8, 1, 9), (4, 4, 1)])
def test_groups_decode_disjoint_shares_that_cover_the_batch(count, tp, batch):
    procs = [Processes(i, count) for i in range(count)]
    shares = [p.decode_share(batch, tp) for p in procs]
    for g in range(count // tp):  # every rank of a group: the same share
        assert len({(s.start, s.stop) for s in shares[g * tp:(g + 1) * tp]}) == 1
    kept = [s for p, s in zip(procs, shares, strict=True) if p.keeps_rollouts(tp)]
    assert len(kept) == count // tp
    assert np.concatenate([np.arange(s.start, s.stop) for s in kept]).tolist() == list(range(batch))


def test_first_rows_of_none_is_an_empty_contribution():
    b, g, t = 3, 2, 4
    ro = Rollouts(response_ids=np.ones((b, g, t), np.int32), lengths=np.full((b, g), t), logprobs=np.zeros((b, g, t)),
                  finish_reasons=[["length"] * g] * b, prefill_tokens=17)
    scores = RewardScores(np.arange(b * g, dtype=np.float32), {"format": np.ones(b * g, np.float32)}, 1)
    ro0, s0 = first_rows(ro, scores, 0)
    assert ro0.response_ids.shape == (0, g, t) and ro0.lengths.shape == (0, g) and ro0.finish_reasons == []
    assert ro0.prefill_tokens == 0 and s0.failures == 0 and s0.overall.shape == (0,) and s0.parts["format"].size == 0
    ro2, s2 = first_rows(ro, scores, 2)
    assert ro2.response_ids.shape == (2, g, t) and s2.overall.tolist() == [0, 1, 2, 3] and ro2.prefill_tokens == 17


@pytest.mark.parametrize("mesh, own", [(dict(train_tp=2, train_dp=2), True), (dict(train_tp=2), True),
                                       (dict(train_tp=2, train_dp=2, dp_placement="within"), False),
                                       (dict(train_fsdp=2), False), (dict(train_tp=4), False)])
def test_a_rank_views_its_own_shards_only_where_its_tp_group_is_a_training_one(mesh, own):
    """vLLM's TP groups are consecutive processes: a rank's own training shards are its tensors only where training
    TP = rollout TP at fsdp 1 and a training tp group is consecutive devices (``--dp_placement=within`` puts dp
    groups there); elsewhere it reads the resharded copy."""
    from rollplex_jax.config import MeshConfig

    assert MeshConfig(rollout_tp=2, **mesh).rollout_ranks_own_shards is own
