"""One process of ``test_vllm_tp.py``: a vLLM tensor-parallel rank bound to its device's training shard.

Run as ``python tests_vllm/tp_worker.py OUT.json`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torch's, for
vLLM's external launcher) and ROLLPLEX_JAX_COORDINATOR (jax.distributed's), one fake CPU device per process. The
actor's text params are sharded over a training mesh of tp = WORLD_SIZE (one device per process, as issue 33's one
process per device); the engine is vLLM with ``tensor_parallel_size=WORLD_SIZE`` over the same processes; rank r is
bound to the shards of device r as ``weights.classify`` classifies them. WORLD_SIZE 1 is the TP-1 reference (one
process, no mesh). Writes the greedy tokens, their log-probs and the bind's sharing counts and pointers.
"""

from __future__ import annotations

import json
import os
import sys

import jax

RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
if WORLD > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["ROLLPLEX_JAX_COORDINATOR"], WORLD, RANK)

import numpy as np  # noqa: E402

from rollout_torch.vllm_engine import VLLMEngine, write_text_only_checkpoint  # noqa: E402
from rollplex_contract.batch import SamplingParams  # noqa: E402
from rollplex_jax.config import MeshConfig, tiny_model_config  # noqa: E402
from rollplex_jax.models.vl.fused import param_layout  # noqa: E402
from rollplex_jax.models.vl.params import init_params  # noqa: E402
from rollplex_jax.parallel import mesh as mesh_lib  # noqa: E402
from rollplex_jax.weights.classify import device_order, device_shards, plan_for_params  # noqa: E402
from tests_vllm.test_vllm_engine import TEXT, make_prompts  # noqa: E402

TP = 2  # the layout's fuse groups: the rollout TP of the run this reproduces (the reference reads the same params)


def main(out: str, model_dir: str) -> None:
    cfg = tiny_model_config(text=TEXT, vision=dict(out_hidden_size=256)).with_param_layout(
        **param_layout(TP, TP, "vllm"))
    params = {k: v for k, v in init_params(cfg, jax.random.PRNGKey(0), std=0.1).items()
              if not k.startswith("visual.")}
    if WORLD > 1:
        mesh = mesh_lib.train_mesh(MeshConfig(train_tp=WORLD))
        shardings = mesh_lib.param_shardings(cfg, mesh)
        params = mesh_lib.place(params, {k: shardings[k] for k in params})
    if RANK == 0:
        write_text_only_checkpoint(model_dir, cfg.to_hf_dict())
    if WORLD > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoint written")
    kw = dict(tensor_parallel_size=WORLD, distributed_executor_backend="external_launcher") if WORLD > 1 else {}
    engine = VLLMEngine(model_dir, max_model_len=256, max_num_seqs=8, **kw)
    position = device_order(params).index(jax.local_devices()[0]) if WORLD > 1 else 0
    plan = plan_for_params(params, engine.layout, WORLD, cfg=cfg, positions=[position],
                           layout_name=engine.layout)
    engine.bind(plan.ranks[position], device_shards(params), position=position)
    rng = np.random.default_rng(7)
    prompts = make_prompts([[1, *rng.integers(3, 240, 21).tolist()], [1, *rng.integers(3, 240, 7).tolist()]])
    r = engine.generate(prompts, n=1, sampling=SamplingParams(temperature=0.0, max_new_tokens=8))
    own = {int(s.data.unsafe_buffer_pointer()) for a in params.values() for s in a.addressable_shards}
    bound = {name: int(p.data_ptr()) for name, p in engine.params.items()}
    with open(out, "w") as f:
        json.dump({"tokens": np.asarray(r.response_ids).tolist(), "logprobs": np.asarray(r.logprobs).tolist(),
                   "mask": np.asarray(r.mask).tolist(), "counts": dict(engine.sharing_report().counts),
                   "views_of_own_shards": sorted(n for n, p in bound.items() if p in own),
                   "params": sorted(engine.params), "kinds": {rt.target: rt.kind for rt in plan.ranks[position]}},
                  f)
    engine.release()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
