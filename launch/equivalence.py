"""How far apart two trainings from the same start are, in units of the update (tests and ``launch.bench``).

Two correct programs that sum partial products in another order (a sharded mesh, the prefix/suffix split,
another CPU's vector width) give gradients that differ by fp32 rounding. AdamW divides each gradient
component by its own RMS + eps, so where a component is ~0 that noise is amplified up to lr / eps times and
can move a parameter by a sizeable part of an update, on one CPU and not on another. A tolerance on the
parameter values either hides real errors or fails on noise. Measured instead: |a - b| per element as a
fraction of the update scale lr x updates (each AdamW step moves an element by about lr). Reduction-order
noise stays a small fraction of it (rare elements excepted where eps is small, hence a high percentile
beside the maximum); a real error (a wrong sign, a missing micro-batch, a stale prefix, a wrong mask)
changes updates by O(lr) on many elements.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

#: Tensors whose exact gradient is identically zero: adding q . b_k to every score of a query leaves the
#: softmax unchanged, so what any program computes for the decoder's k bias is rounding noise, which AdamW
#: turns into steps of up to lr; its value never changes an output. Left out of update comparisons, which run
#: in the checkpoint's layout (``checkpoint_layout``), where the k bias is a tensor of its own: in the actor's
#: it is rows of the fused ``qkv_proj.bias`` (``fused.py``) beside the q and v biases, which do learn.
ZERO_GRADIENT = ("self_attn.k_proj.bias",)

#: Name parts of the actor's fused tensors (``fused.py``), which a comparison refuses: ``checkpoint_layout``.
FUSED = ("qkv_proj.", "gate_up_proj.")


def checkpoint_layout(params: Mapping, model) -> dict[str, np.ndarray]:
    """The actor's params (``model``: their ``ModelConfig``) as the checkpoint's tensors, host numpy: q, k, v and
    gate, up apart (``fused.to_hf``), so that ``ZERO_GRADIENT`` names the k bias alone."""
    from rollplex_jax.models.vl.fused import to_hf

    return to_hf({k: np.asarray(v) for k, v in params.items()}, model)


def require_checkpoint_layout(params: Mapping) -> None:
    """Raises if ``params`` holds an actor's fused tensor (``FUSED``) instead of the checkpoint's tensors."""
    fused = sorted(k for k in params if any(part in k for part in FUSED))
    if fused:
        raise ValueError(f"params are compared in the checkpoint's layout but hold the actor's fused {fused[0]} "
                         f"(+{len(fused) - 1} more): convert both with launch.equivalence.checkpoint_layout")


def update_distance(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray], *, lr: float, updates: int,
                    exclude: tuple[str, ...] = ZERO_GRADIENT) -> dict[str, float]:
    """Per-element |got - ref| / (lr x updates), fp32 rounding of the values (4 ulp) forgiven: per tensor the
    maximum, and over all elements the maximum (``max``), the 99.9th percentile (``p999``) and the tensor
    holding the maximum (``worst``). Both in the checkpoint's layout (``checkpoint_layout``): a fused actor
    tensor raises, since excluding the k bias would then exclude the q and v biases with it."""
    require_checkpoint_layout(ref)
    scale = lr * max(updates, 1)
    per_tensor, flat = {}, []
    for name, b in ref.items():
        if name.endswith(exclude):
            continue
        a, b = np.asarray(got[name], np.float64), np.asarray(b, np.float64)
        ulp = 4 * np.spacing(np.abs(b).astype(np.float32)).astype(np.float64)
        d = np.maximum(np.abs(a - b) - ulp, 0.0).ravel() / scale
        per_tensor[name] = float(d.max()) if d.size else 0.0
        flat.append(d)
    allv = np.concatenate(flat) if flat else np.zeros(1)
    worst = max(per_tensor, key=per_tensor.get) if per_tensor else ""
    return {"max": float(allv.max()), "p999": float(np.quantile(allv, 0.999)), "worst": worst,
            "per_tensor": per_tensor}
