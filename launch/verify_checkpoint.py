"""Load an HF Qwen2.5-VL checkpoint with our loader and compare our logits with transformers'.

  python -m launch.verify_checkpoint --hf_dir=DIR [--dtype=float32] [--atol=...]

Prints one JSON line last: {"max_abs_logit_diff": ..., "n_params": ..., "ok": true|false}.
Exit status: 0 ok, 1 above tolerance, 2 malformed checkpoint (the message names the tensor or file).
"""

import json
import sys

from absl import app, flags

_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face Qwen2.5-VL checkpoint directory.", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Compute dtype on both sides.")
_ATOL = flags.DEFINE_float("atol", None, "Max abs logit difference allowed (default: 1e-4 x max|logit| in "
                           "float32, 5e-2 x max|logit| in bfloat16).", lower_bound=0.0)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    import jax
    import numpy as np

    from rollplex_jax.models.vl import model as M
    from rollplex_jax.models.vl import verify
    from rollplex_jax.models.vl.hf_checkpoint import CheckpointError, load_hf_checkpoint
    from rollplex_jax.models.vl.params import count_params

    try:
        cfg, params = load_hf_checkpoint(_HF_DIR.value, dtype=_DTYPE.value)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        print(json.dumps({"max_abs_logit_diff": None, "n_params": None, "ok": False, "error": str(e)}))
        sys.exit(2)
    inp = verify.verification_inputs(cfg)
    ours = np.asarray(jax.jit(M.full_forward, static_argnums=1)(params, cfg, M.prepare_inputs(cfg, **inp)))
    ref = verify.transformers_logits(_HF_DIR.value, cfg, inp)
    diff = float(np.abs(ours - ref).max())
    tol = _ATOL.value if _ATOL.value is not None else verify.default_tolerance(cfg.dtype, ref)
    ok = bool(diff <= tol)
    print(f"tokens={inp['input_ids'].shape[1]} image_grids={inp['image_grid_thw'].tolist()} "
          f"video_grid={inp['video_grid_thw'].tolist()} tolerance={tol:.3g}", file=sys.stderr)
    print(json.dumps({"max_abs_logit_diff": diff, "n_params": count_params(params), "ok": ok}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    app.run(main)
