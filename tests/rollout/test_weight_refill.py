"""Rebuilt weight buffers refilled right after the update, off the critical path (issue 20, item 3).

``WeightPublisher.refill`` copies the update's output into the engine's engine-owned (rebuilt) buffers on a side
thread; the next ``publish`` of those very arrays then only creates views (``bind(..., refilled=True)``). Oracle:
the engine's tensors equal the actor's checkpoint tensors after every publish, whether the refill ran, was
skipped, or refilled other arrays than those published; and the publish of refilled arrays copies nothing.
Params are fsdp-sharded over 4 fake CPU devices, so the transformers engine (one device) rebuilds the split ones.
"""

import jax
import numpy as np
import pytest

from rollout_torch.hf_engine import HFEngine
from rollout_torch.weights import ShardedBinder
from rollplex_jax.config import MeshConfig, tiny_model_config
from rollplex_jax.models.vl.fused import to_hf
from rollplex_jax.models.vl.names import normalize_name
from rollplex_jax.models.vl.params import init_params
from rollplex_jax.parallel import mesh as M
from rollplex_jax.trace import Tracer
from rollplex_jax.weights.sharing import WeightPublisher

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (fake) devices: XLA_FLAGS as the Makefile")


def _params(cfg, seed: int):
    mesh = M.train_mesh(MeshConfig(train_fsdp=4))
    return M.place(init_params(cfg, jax.random.key(seed), std=0.1), M.param_shardings(cfg, mesh))


def _assert_engine_holds(eng: HFEngine, params, cfg) -> None:
    want = to_hf({k: np.asarray(v) for k, v in params.items()}, cfg)
    for name, t in eng.bound_tensors().items():
        np.testing.assert_array_equal(t.detach().numpy(), want[normalize_name(name)], err_msg=name)


@pytest.fixture
def setup(monkeypatch):
    """An HF engine over fsdp-4 params, published once (allocates the rebuilt buffers), and a fill counter."""
    cfg = tiny_model_config()
    eng = HFEngine(cfg.to_hf_dict())
    pub = WeightPublisher(eng, cfg)
    pub.publish(_params(cfg, 0), version=0)
    pub.release()
    fills = []
    original = ShardedBinder._fill
    monkeypatch.setattr(ShardedBinder, "_fill", lambda self, buf, rt, *a: fills.append(rt.target) or original(
        self, buf, rt, *a))
    yield cfg, eng, pub, fills
    pub.join()
    pub.release()


def test_refilled_arrays_are_bound_without_copies(setup):
    cfg, eng, pub, fills = setup
    tracer = Tracer()
    new = _params(cfg, 1)
    ptrs = {key: buf.data_ptr() for key, buf in eng.binder.rebuilt_buffers().items()}
    pub.refill(new, tracer, step=3)
    pub.publish(new, version=4)  # joins the refill, then binds views only
    assert pub.refilled_bytes == sum(rt.nbytes for rt in eng.tensors if rt.kind == "rebuilt") > 0
    assert len(fills) == len([rt for rt in eng.tensors if rt.kind == "rebuilt"])  # all by the refill thread
    assert {key: buf.data_ptr() for key, buf in eng.binder.rebuilt_buffers().items()} == ptrs  # in place
    _assert_engine_holds(eng, new, cfg)
    (span,) = [s for s in tracer.spans if s.name == "refill"]
    assert span.lane == "weights" and span.step == 4 and span.args["bytes"] == pub.refilled_bytes
    pub.release()
    fills.clear()
    pub.publish(new, version=5)  # the same arrays again (a skipped update, validation): nothing to copy
    assert fills == []
    _assert_engine_holds(eng, new, cfg)


def test_other_arrays_than_refilled_are_filled_at_bind(setup):
    cfg, eng, pub, fills = setup
    pub.refill(_params(cfg, 1), Tracer(), step=0)
    other = _params(cfg, 2)
    pub.publish(other, version=1)
    assert pub.refilled_bytes == 0
    _assert_engine_holds(eng, other, cfg)  # not the refilled values: bind copied again


def test_no_refill_while_bound_and_errors_reach_the_caller(setup, monkeypatch):
    cfg, eng, pub, fills = setup
    new = _params(cfg, 1)
    pub.publish(new, version=1)
    fills.clear()
    pub.refill(_params(cfg, 2), Tracer(), step=1)  # views of `new` are alive: refilling now would be wrong
    assert pub.join() is None and fills == []
    pub.release()

    def broken(shards):
        raise OSError("device lost")

    monkeypatch.setattr(eng, "refill", broken)
    pub.refill(_params(cfg, 3), None, step=2)
    with pytest.raises(RuntimeError, match="refilling") as e:
        pub.join()
    assert isinstance(e.value.__cause__, OSError)


def test_a_sharding_spelled_another_way_is_the_same_layout():
    """A program's output may spell its NamedSharding otherwise than ``mesh.place`` did (P('fsdp') vs P('fsdp',
    None)); the refill must still count (else the first update's refill is skipped and its bind copies)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rollplex_jax.weights.sharing import _layout_equal, _layout_key

    mesh = M.train_mesh(MeshConfig(train_fsdp=4))
    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("fsdp")))
    y = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("fsdp", None)))
    z = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P(None, "fsdp")))
    assert x.sharding != y.sharding and _layout_equal(_layout_key({"w": x}), _layout_key({"w": y}))
    assert not _layout_equal(_layout_key({"w": x}), _layout_key({"w": z}))
