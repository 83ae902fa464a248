"""--schedule=rollplex computes the same update as --schedule=serial.

Same seed, 3 RL steps: per-step loss and KL within 1e-5, final params within 2% of the update scale
(lr x updates) per element (tests/equivalence.py: robust to reduction order, and why), for every
combination of --prefix_sharing and --overlap, with --freeze_vision off and on, with
--actor_prefix=recompute, and with 2 mini-batches (the second recomputes the prefix); micro-batch cases at
--temperature=0.7 too; and prompts with decoded
videos (a mp4 and a frame list, with their second_per_grid_ts), 2 steps. Also: the split
gradient equals the full-sequence gradient on random inputs (per parameter, fp32, rtol 1e-5), and a
stale boundary state raises.

Params are compared in the checkpoint's layout (``launch.equivalence.checkpoint_layout``), without the decoder's
k biases, whose exact gradient is identically zero (``launch.equivalence.ZERO_GRADIENT``).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from launch.equivalence import checkpoint_layout
from rollplex_contract.batch import Prompts
from rollplex_jax.config import (
    Config,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ProgramConfig,
    RlConfig,
    RolloutConfig,
    RunConfig,
)
from rollplex_jax.data.dataset import collate
from rollplex_jax.data.video_io import load_video, probe_video, video_spec
from rollplex_jax.data.video_sampling import VideoRule
from rollplex_jax.models.vl import model as M
from rollplex_jax.programs.actor import Answers
from rollplex_jax.programs.sequences import micro_batches
from rollplex_jax.rl import losses
from rollplex_jax.run.runner import Runner
from rollplex_jax.step import rl_step, rollplex_ops
from rollplex_jax.step.ops import Targets
from tests.equivalence import assert_same_updates
from tests.hf_reference import mm_inputs
from tests.paths import REPO
from tests.video_files import write_frames, write_video

TOL = 1e-5
LR = 3e-3


def _config(tmp_path, name, freeze=False, mini=1, micro=4, temperature=1.0, model="demo.json", **run) -> Config:
    model = ModelConfig.from_json_file(REPO / "configs" / "models" / model)
    pixels = (model.vision.patch_size * model.vision.spatial_merge_size * 2) ** 2  # 2x2 merged tokens
    return Config(
        model=model,
        data=DataConfig(synthetic_n=16, eval_n=0, min_pixels=pixels, max_pixels=pixels, max_prompt_len=64),
        rollout=RolloutConfig(group_size=4, max_new_tokens=3, max_batch=64, temperature=temperature),
        rl=RlConfig(batch_prompts=2, micro_batch=micro, kl_mode="loss", kl_coef=0.1,
                    reward="tests.reward_fns:length_parity",
                    mini_batches=mini),
        # eps 1e-6 (AdamW's default 1e-8 turns gradient components of ~1e-7, pure fp32 rounding noise here,
        # into lr-sized steps: the final-params comparison would test that amplification, not the schedule).
        optim=OptimConfig(lr=LR, eps=1e-6, freeze_vision=freeze),
        run=RunConfig(workdir=str(tmp_path / name), steps=3, progress=False, **run),
    )


def _run(cfg):
    r = Runner(cfg)
    metrics = list(r.run())
    params = checkpoint_layout(r.state.params, r.cfg.model)
    r.close()
    return metrics, params


def _compare(a, b, mini=1):
    (ma, pa), (mb, pb) = a, b
    assert len(ma) == len(mb) == 3
    assert any(m["skipped_steps/no_signal"] == 0 for m in ma)  # at least one real update happened
    for x, y in zip(ma, mb, strict=True):
        assert x["reward/mean"] == y["reward/mean"]
        for key in ("loss", "kl"):
            if key in x or key in y:
                assert abs(x[key] - y[key]) <= TOL, (key, x[key], y[key])
    worst = assert_same_updates(pa, pb, lr=LR, updates=3 * mini)
    print(f"worst param difference {worst:.3g} of the tolerance")


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    root = tmp_path_factory.mktemp("serial")
    return {freeze: _run(_config(root, f"s{freeze}", freeze=freeze)) for freeze in (False, True)}


# every combination of the switches with the tower trained, the defaults and none of them with it frozen
@pytest.mark.parametrize("sharing,overlap,freeze", [(True, True, False), (True, False, False), (False, True, False),
                                                    (False, False, False), (True, True, True), (False, False, True)])
def test_rollplex_equals_serial(serial, tmp_path, sharing, overlap, freeze):
    cfg = _config(tmp_path, "r", freeze=freeze, schedule="rollplex", prefix_sharing=sharing, overlap=overlap)
    _compare(_run(cfg), serial[freeze])


def test_rollplex_recompute_equals_serial(serial, tmp_path):
    cfg = _config(tmp_path, "r", schedule="rollplex", actor_prefix="recompute")
    _compare(_run(cfg), serial[False])


def test_qwen3_vl_rollplex_equals_serial(tmp_path):
    """The tiny Qwen3-VL demo model (DeepStack into decoder layer 0: its boundary KV depends on the vision
    features, q/k norms, interleaved M-RoPE) trains the same updates in both schedules."""
    a = _run(_config(tmp_path, "s", model="demo_qwen3_vl.json"))
    b = _run(_config(tmp_path, "r", model="demo_qwen3_vl.json", schedule="rollplex"))
    _compare(b, a)


def test_two_mini_batches_equal_serial(tmp_path):
    """Only the first mini-batch may use the precomputed prefix; the second recomputes it (params moved).
    Two AdamW updates per step (6 in all)."""
    a = _run(_config(tmp_path, "s", mini=2))
    b = _run(_config(tmp_path, "r", mini=2, schedule="rollplex"))
    _compare(b, a, mini=2)


@pytest.mark.parametrize("micro,mini,sharing,temperature", [(2, 2, True, 0.7), (8, 1, True, 1.0),
                                                             (3, 1, False, 0.7)])
def test_micro_batches_equal_serial(tmp_path, micro, mini, sharing, temperature):
    """The rollplex gradient programs in micro-batches of --micro_batch answers: half a prompt's answers per
    micro-batch (2 < G = 4), two whole prompts (8), or 3 answer rows without prefix sharing; with two
    mini-batches the second recomputes its prefix micro-batch by micro-batch. Two cases at --temperature=0.7
    (every log-prob of softmax(logits / T): the ratio's old log-probs with two mini-batches, the KL, the
    prefix's last logits)."""
    a = _run(_config(tmp_path, "s", mini=mini, micro=micro, temperature=temperature))
    b = _run(_config(tmp_path, "r", mini=mini, micro=micro, temperature=temperature, schedule="rollplex",
                     prefix_sharing=sharing))
    _compare(b, a, mini=mini)


def _video_prompts(cfg: ModelConfig, tmp_path) -> Prompts:
    """Two prompts built by hand: a 32-frame mp4 at 2 fps (t 4, 1 s per step) after an image, and a 5-frame list at
    4 fps (t 3, 0.5 s per step); every frame 2 x 2 merged tokens (56x56 for Qwen2.5-VL, 64x64 for Qwen3-VL)."""
    (tmp_path / "frames").mkdir()
    specs = [video_spec(write_video(tmp_path / "a.mp4", 32, noise=True)),
             video_spec({"video": write_frames(tmp_path / "frames", 5), "fps": 4.0})]
    v = cfg.vision
    side = v.patch_size * v.spatial_merge_size
    plans = [probe_video(s, VideoRule(min_pixels=side * side, max_pixels=4 * side * side), side,
                         patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size) for s in specs]
    rows = [[1, 9, ("image", (1, 4, 4)), 10, ("video", plans[0].grid_thw), 11, 12],
            [1, 13, ("video", plans[1].grid_thw), 14, 15, 16, 17]]
    inp = mm_inputs(cfg, rows, np.random.default_rng(0))
    videos = [load_video(s, p, cfg.vision) for s, p in zip(specs, plans, strict=True)]
    inp["pixel_values"] = np.concatenate([inp["pixel_values"][:16], *videos])
    return Prompts(**inp, second_per_grid_ts=np.asarray([p.second_per_grid_t for p in plans], np.float32))


def _steps(cfg, prompts, n=2):
    """``n`` steps of ``cfg``'s schedule on the same prompts; (metrics, final params)."""
    r = Runner(cfg)
    step_fn = rl_step.rollplex_step if cfg.run.schedule == "rollplex" else rl_step.serial_step
    metrics = []
    for step in range(n):
        with r.mesh_scope():
            out = step_fn(r.ctx, r.state, prompts, [""] * prompts.batch_size, seed=r._seed(step), step=step,
                          tracer=r.tracer)
        r.state = out.state
        metrics.append(out.metrics)
    params = checkpoint_layout(r.state.params, r.cfg.model)
    r.close()
    return metrics, params


@pytest.mark.parametrize("model", ["demo.json", "demo_qwen3_vl.json"])
def test_video_prompts_rollplex_equals_serial(tmp_path, model):
    """The rollplex prefix (vision tower over the videos' frames, their M-RoPE positions: time-scaled for
    Qwen2.5-VL, one block per frame for Qwen3-VL, with its DeepStack taps) shared by G answers gives the serial
    step's update on prompts with videos."""
    serial = _config(tmp_path, "s", model=model)
    prompts = _video_prompts(serial.model, tmp_path)
    (ma, pa), (mb, pb) = (_steps(serial, prompts),
                          _steps(_config(tmp_path, "r", model=model, schedule="rollplex"), prompts))
    assert any(m["skipped_steps/no_signal"] == 0 for m in ma)
    for x, y in zip(ma, mb, strict=True):
        assert x["reward/mean"] == y["reward/mean"]
        for key in ("loss", "kl"):
            if key in x or key in y:
                assert abs(x[key] - y[key]) <= TOL, (key, x[key], y[key])
    worst = assert_same_updates(pb, pa, lr=LR, updates=2)
    print(f"video prompts: worst param difference {worst:.3g} of the tolerance")


def _mixed_prompts(cfg: ModelConfig) -> Prompts:
    """Three prompts of 18, 3 and 8 tokens (two with an image): the short ones pack into one prefix row, and the
    3-token prompt's prompt ++ answer rows (<= 6 tokens of 21) three to a row."""
    rows = [[1, 9, ("image", (1, 4, 4)), 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [1, 13, 14],
            [1, ("image", (1, 4, 4)), 15]]
    return Prompts(**mm_inputs(cfg, rows, np.random.default_rng(0)))


def test_packed_steps_equal_padded(tmp_path):
    """--packing (the default: padding-free rows with segment ids) gives the left-padded computation's update in
    both schedules, on prompts of different lengths where both pack (the prefix rows and the serial rows)."""
    padded = dataclasses.replace(_config(tmp_path, "p"), programs=ProgramConfig(packing=False))
    prompts = _mixed_prompts(padded.model)
    assert M.prepare_inputs(padded.model, prompts.input_ids, prompts.attention_mask, prompts.pixel_values,
                            prompts.image_grid_thw, opts=M.InputOptions(pack=True)).packing.input_ids.shape[0] == 2
    oracle = _steps(padded, prompts)
    assert any(m["skipped_steps/no_signal"] == 0 for m in oracle[0])
    for schedule in ("serial", "rollplex"):
        cfg = _config(tmp_path, schedule, schedule=schedule)
        assert cfg.programs.packing
        ma, pa = _steps(cfg, prompts)
        for x, y in zip(ma, oracle[0], strict=True):
            assert x["reward/mean"] == y["reward/mean"]
            for key in ("loss", "kl"):
                assert abs(x[key] - y[key]) <= TOL, (schedule, key, x[key], y[key])
        worst = assert_same_updates(pa, oracle[1], lr=LR, updates=2)
        print(f"packed {schedule}: worst param difference {worst:.3g} of the tolerance")


def test_serial_rows_of_a_short_prompt_pack(tmp_path):
    """The serial micro-batches of the mixed prompts really run packed where rows fit: the 3-token prompt's four
    rows in two packed rows; the 8-token prompt's rows (<= 11 of 21 tokens) stay one per row, so unpacked."""
    cfg = _config(tmp_path, "s")
    prompts = _mixed_prompts(cfg.model)
    r = Runner(cfg)
    ro = rl_step.sample(r.ctx, r.state.params, prompts, rl_step.Draw(n=4, seed=1))
    r.close()
    mbs = micro_batches(cfg.model, prompts, ro, 4, opts=M.InputOptions(pack=True))
    assert [mb.inputs.packing is not None for mb in mbs] == [False, True, False]
    assert mbs[1].inputs.packing.input_ids.shape == (2, 21)


def test_stale_boundary_raises():
    b = rollplex_ops.Boundary(version=3, arrays=None)
    b.check(3, "ok")
    with pytest.raises(rollplex_ops.StaleBoundaryError, match="version 3.*version 4"):
        b.check(4, "actor update")


@pytest.mark.parametrize("micro", [8, 4, 3])
def test_split_gradient_equals_full_gradient(tmp_path, micro):
    """Random answers and advantages: residual and recompute gradients = full-sequence gradient, per param,
    in micro-batches of 8 (both prompts), 4 (one prompt) and 3 answers (a prompt's answers in chunks)."""
    cfg = _config(tmp_path, "g", schedule="rollplex", micro=micro)
    r = Runner(cfg)
    prompts = collate(r.train_set[:2], 0)
    ro = rl_step.sample(r.ctx, r.state.params, prompts, rl_step.Draw(n=4, seed=1))
    rng = np.random.default_rng(0)
    b, g, tr = ro.response_ids.shape
    ids = rng.integers(8, 31, size=(b, g, tr))
    ro = dataclasses.replace(ro, response_ids=ids, lengths=np.full((b, g), tr, np.int32))
    mask = jnp.asarray(ro.mask.reshape(b * g, tr))
    w = losses.token_weights(mask, "token-mean")
    adv = jnp.asarray(rng.standard_normal(b * g), jnp.float32)

    full = None
    for mb in micro_batches(cfg.model, prompts, ro, 8):
        (_, _), gr = r.programs.grad(r.state.params, mb.inputs, mb.prompt_len,
                                     Answers(ids=mb.response_ids, weights=w[mb.rows], advantages=adv[mb.rows]))
        full = gr if full is None else jax.tree.map(jnp.add, full, gr)

    ops = rollplex_ops.RollplexOps(r.cfg, r.ctx.split, r.programs.accumulate, r.state, prompts, r.tracer,
                                   step=0).dispatch()
    ops.set_rollouts(ro)
    targets = Targets(weights=w, advantages=adv)
    split_res, _ = ops.grads(r.state.params, slice(0, b * g), targets, version=0)
    split_rec, _ = ops.grads(r.state.params, slice(0, b * g), targets, version=1)  # -> recompute
    for name in full:
        ref = np.asarray(full[name])
        for got in (split_res, split_rec):
            np.testing.assert_allclose(np.asarray(got[name]), ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max() + 1e-12,
                                       err_msg=name)
    assert any(np.abs(np.asarray(full[k])).max() > 0 for k in full if k.startswith("visual."))  # reaches vision
    r.close()
