"""What a finished run reports: ``run_summary.json``'s fields (ARCHITECTURE.md "Run outputs").

Pure functions of the run's history and figures, so the summary's meaning is readable in one place:
``reward/mean`` is the last step's mean reward (the final one), ``reward/first10_mean`` and
``reward/last20_mean`` the means over the first 10 and the last 20 steps.
"""

from __future__ import annotations

import importlib.metadata as md

import numpy as np

from rollplex_contract.layout import SharingReport


def reward_summary(history: list[dict]) -> dict:
    """Final, first-10 and last-20 mean rewards, and the skipped-update counts, of a run's metrics rows."""
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]  # not a validation-only row (step 0)
    return {
        "reward/mean": float(rewards[-1]) if rewards else None,
        "reward/first10_mean": float(np.mean(rewards[:10])) if rewards else None,
        "reward/last20_mean": float(np.mean(rewards[-20:])) if rewards else None,
        "skipped_steps/no_signal": sum(h.get("skipped_steps/no_signal", 0) for h in history),
        "skipped_steps/nonfinite": sum(h.get("skipped_steps/nonfinite", 0) for h in history),
    }


def compile_summary(cache_dir: str, history: list[dict]) -> dict:
    """Where compiled programs were kept (None: nowhere) and the steps' XLA compilations, seconds and persistent-cache
    loads, summed over the steps' rows (``perf/compiles``, ``timing_s/compile``, ``perf/compile_cache_hits``)."""
    def total(key: str) -> float:
        return float(sum(h.get(key, 0.0) for h in history))

    return {"cache_dir": cache_dir or None, "compiles": int(total("perf/compiles")),
            "compile_s": total("timing_s/compile"), "cache_hits": int(total("perf/compile_cache_hits"))}


def sharing_summary(report: SharingReport, gather=None) -> dict:
    """The engine's sharing report; in a multi-process run (``gather``: the publisher's ``multihost.ReplicatedCopy``)
    the engine views its device's training shards where they hold whole params and an all-gathered copy of the
    rest, whose bytes are rebuilt (engine-only) whatever the per-tensor classification of the arrays it read."""
    out = report.to_dict()
    if gather is not None and hasattr(gather, "copy_bytes"):  # multihost.RolloutTPCopy: a vLLM TP rank's slices
        out["multi_process"] = {"resharded_copy_bytes": gather.copy_bytes, "note": (
            "each process's vLLM TP rank reads the params resharded onto the rollout's TP layout before every rollout "
            "(multihost.RolloutTPCopy, engine-only bytes): its own slices, not the whole model; the counts above "
            "classify the tensors against that copy")}
    elif gather is not None:
        out["multi_process"] = {"gathered_copy_bytes": gather.gathered_bytes,
                                "viewed_training_shard_bytes": gather.viewed_bytes, "note": (
            "each process's engine views the training shards of its own device that hold whole params (a dp-only "
            "mesh: all of them) and reads the rest from a copy all-gathered before every rollout "
            "(multihost.ReplicatedCopy): gathered_copy_bytes are rebuilt; the counts above classify the arrays read")}
    return out


def versions() -> dict:
    """Installed versions of the stack, for the summary."""
    out = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "torch", "transformers", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out
